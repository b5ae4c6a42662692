"""Where AQ-SGD keeps m(xi), one entry per training sample: :class:`MemoryStore` (a tensor in memory) or
:class:`MmapStore` (a file). Both key entries by non-negative integer sample ids, refuse new ids once full, and read
the next batch's entries in a background thread when told its ids (``prefetch``).

The file store is read and written with pread/pwrite on space reserved when the file is made, never through a memory
mapping: a page fault on a mapping of a file that a full disk could not back, or that another process truncated,
kills the process with SIGBUS, while pread/pwrite report both as errors. Each entry carries a CRC-32 of its sample
id and bytes, checked on every read, so flipped bytes and entries read back under another id are caught.
``state_dict()`` snapshots the file (later writes do not change a checkpoint).
"""
import concurrent.futures
import contextlib
import errno
import os
import struct
import tempfile
import zlib

import numpy as np
import torch

from fastdist.memory.store import StoreIOError, preallocate

__all__ = ["MemoryStore", "MmapStore", "SampleStore", "StoreCorruptedError", "StoreFullError", "StoreIOError",
           "check_sample_ids"]


class StoreFullError(RuntimeError):
    """A store has no slot left for a new sample id."""


class StoreCorruptedError(RuntimeError):
    """A store's file does not hold a valid store, or no longer holds what was written to it."""


def check_sample_ids(ids: torch.Tensor, who: str) -> torch.Tensor:
    """The sample ids as a CPU int64 tensor, after checking them.

    Args:
        ids: a 1-D int32/int64 tensor of distinct non-negative ids.
        who: the caller's name, for the messages.

    Raises:
        TypeError: not a 1-D integer tensor.
        ValueError: a negative or repeated id.
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise TypeError(f"fastdist.compress.{who}: sample ids must be a 1-D int32/int64 tensor, got "
                        f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"
                        f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else ''}")
    ids = ids.detach().to("cpu", torch.int64)
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"fastdist.compress.{who}: sample ids must be >= 0, got {int(ids.min())}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"fastdist.compress.{who}: sample ids of one batch must be distinct")
    return ids


class SampleStore:
    """Slots for up to ``capacity`` sample ids; entries of one shape and dtype; prefetch in a background thread.

    Subclasses hold the entries (``_allocate``, ``_read_slots``, ``_write_slots``, ``_record_slots``). A store
    pickles without its prefetch thread and the read in flight.

    Args:
        capacity: the most sample ids it holds (at least the training samples).
        dtype: the entries' dtype.
    """

    def __init__(self, capacity: int, dtype: torch.dtype):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"fastdist.compress.{type(self).__name__}: 'capacity' must be an int >= 1, got "
                             f"{capacity!r}")
        self.capacity, self.dtype = capacity, dtype
        self.slot_of = {}  # sample id -> slot
        self.entry_shape = None
        self._executor = None
        self._pending = None  # (ids, future)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_executor"] = state["_pending"] = None
        return state

    # -- storage, by the subclasses
    def _allocate(self, entry_shape):
        raise NotImplementedError

    def _read_slots(self, slots):
        raise NotImplementedError

    def _write_slots(self, slots, rows):
        raise NotImplementedError

    def _record_slots(self, ids, slots):
        pass

    # -- the interface AQSGD uses
    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """bool ``[len(ids)]``: which of the sample ``ids`` have an entry."""
        return torch.tensor([int(i) in self.slot_of for i in ids.tolist()], dtype=torch.bool)

    def _slots(self, ids):
        try:
            return torch.tensor([self.slot_of[int(i)] for i in ids.tolist()], dtype=torch.int64)
        except KeyError as e:
            raise KeyError(f"fastdist.compress.{type(self).__name__}: sample id {e.args[0]} is not stored") from None

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """The entries of the sample ``ids``, rows ``[len(ids), *entry_shape]``.

        Raises:
            KeyError: an id is not stored.
        """
        if self._pending is not None:
            pending_ids, future = self._pending
            self._pending = None
            rows = future.result()
            if torch.equal(pending_ids, ids):
                return rows
        return self._read_slots(self._slots(ids))

    def prefetch(self, ids: torch.Tensor) -> None:
        """Starts reading the stored entries among the sample ``ids`` in the background; ``get(ids)`` then returns
        them."""
        ids = check_sample_ids(ids, type(self).__name__)
        known = ids[self.contains(ids)]
        if known.numel() == 0 or self.entry_shape is None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aqsgd-prefetch")
        if self._pending is not None:
            self._pending[1].result()
        slots = self._slots(known)
        self._pending = (known, self._executor.submit(self._read_slots, slots))

    def _drop_prefetch(self):
        """Forgets the read in flight after waiting for it (its rows may predate a write; its error is moot)."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending[1].result()
            self._pending = None

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores ``rows`` (``[len(ids), *entry_shape]``) under the sample ``ids``; new ids take free slots.

        Raises:
            StoreFullError: the new ids do not fit.
            ValueError: the rows' shape differs from the entries'.
        """
        if self.entry_shape is None:
            self._allocate(tuple(rows.shape[1:]))
            self.entry_shape = tuple(rows.shape[1:])
        if tuple(rows.shape[1:]) != self.entry_shape:
            raise ValueError(f"fastdist.compress.{type(self).__name__}: entries have shape {self.entry_shape}, got "
                             f"rows of shape {tuple(rows.shape[1:])}")
        new = [int(i) for i in ids.tolist() if int(i) not in self.slot_of]
        if len(self.slot_of) + len(new) > self.capacity:
            raise StoreFullError(f"fastdist.compress.{type(self).__name__}: full: {len(self.slot_of)} of "
                                 f"{self.capacity} slots used, {len(new)} new sample id(s) do not fit; give it a "
                                 "capacity of at least the number of training samples")
        self._drop_prefetch()  # a prefetch read before this write would be stale
        if new:
            first = len(self.slot_of)
            self.slot_of.update({i: first + n for n, i in enumerate(new)})
            self._record_slots(new, range(first, first + len(new)))
        self._write_slots(self._slots(ids), rows.detach().to("cpu", self.dtype))

    def __len__(self) -> int:
        return len(self.slot_of)


class MemoryStore(SampleStore):
    """Entries in a CPU tensor [capacity, *entry_shape], allocated at the first put.

    Args:
        capacity: the most sample ids it holds (at least the training samples).
        dtype: the entries' dtype.
    """

    def __init__(self, capacity: int, dtype: torch.dtype = torch.float32):
        super().__init__(capacity, dtype)
        self.data = None

    def _allocate(self, entry_shape):
        self.data = torch.zeros((self.capacity, *entry_shape), dtype=self.dtype)

    def _read_slots(self, slots):
        return self.data.index_select(0, slots)

    def _write_slots(self, slots, rows):
        self.data.index_copy_(0, slots, rows)

    def state_dict(self) -> dict:
        """The ids and entries held (a copy)."""
        used = len(self.slot_of)
        ids = torch.tensor(sorted(self.slot_of, key=self.slot_of.get), dtype=torch.int64)
        return {"capacity": self.capacity, "ids": ids,
                "data": self.data[:used].clone() if self.data is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state``, what :meth:`state_dict` returned (of a store of the same capacity)."""
        if state["capacity"] != self.capacity:
            raise ValueError(f"fastdist.compress.MemoryStore: state has capacity {state['capacity']}, this store "
                             f"{self.capacity}")
        self._drop_prefetch()
        self.slot_of = {int(i): s for s, i in enumerate(state["ids"].tolist())}
        self.entry_shape = None if state["data"] is None else tuple(state["data"].shape[1:])
        self.data = None
        if self.entry_shape is not None:
            self._allocate(self.entry_shape)
            self.data[:len(self.slot_of)] = state["data"]


_MAGIC = b"FDAQSGD1"
_VERSION = 2  # 1: no checksums, a memory-mapped file
_HEADER = struct.Struct("<8sIIQI8Q")  # magic, version, dtype code, capacity, ndim, shape[8]
_HEADER_BYTES = 4096
_DTYPES = {1: (torch.float32, np.float32), 2: (torch.float16, np.float16)}
_NO_CHECKSUM = -1


def _runs(slots):
    """(first index, end index, first slot) of each run of consecutive slots in the int64 array ``slots``."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(slots)]))
    return [(int(a), int(b), int(slots[a])) for a, b in zip(starts, ends)]


def _entry_checksum(sample_id, row):
    """CRC-32 of a sample id and its entry's bytes: a byte flipped in either, or an entry under another id, fails."""
    return zlib.crc32(row, zlib.crc32(int(sample_id).to_bytes(8, "little", signed=True)))


def _copy_file(src_fd, dst_path):
    """Copies the whole file ``src_fd`` to a new file ``dst_path``: in the kernel (a reflink where the file system
    shares blocks), else through a buffer."""
    size = os.fstat(src_fd).st_size
    in_kernel = hasattr(os, "copy_file_range")
    with open(dst_path, "wb") as dst:
        done = 0
        while done < size:
            if in_kernel:
                try:
                    n = os.copy_file_range(src_fd, dst.fileno(), size - done, done, done)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    in_kernel = False
                    continue
            else:
                dst.seek(done)
                n = dst.write(os.pread(src_fd, min(size - done, 1 << 24), done))
            if n == 0:
                raise OSError(errno.EIO, f"the file ended at byte {done} of {size}")
            done += n


class MmapStore(SampleStore):
    """Entries in a file at `path`: a 4 KiB header (magic, version, dtype, capacity, entry shape), the sample id of
    each slot (int64, -1 when free), each slot's checksum (int64, -1 when none), then the entries. An existing file
    is opened and checked (a corrupted or mismatched one raises StoreCorruptedError); a new one is made, with all of
    its space reserved, at the first put. (The name is historical: it reads and writes with pread/pwrite; see the
    module docstring.)

    ``state_dict()`` copies the file to a snapshot beside it (``<path>.snapshot-*``, in the kernel; a reflink where
    the file system allows) and names it; ``load_state_dict`` copies a snapshot back. A state_dict with no put since
    the last one names the same snapshot. Snapshots are the caller's to delete once no checkpoint needs them.
    A pickled store names its file: the copy reads and writes the same entries (``state_dict`` is the snapshot).

    Args:
        path: the file.
        capacity: the most sample ids it holds.
        dtype: ``torch.float32`` or ``torch.float16``.
        checksums: keep a CRC-32 per entry and check it on every read (reads cost about twice a plain pread).

    Raises:
        StoreIOError: the file cannot be made, reserved, read or written (at the put or get that needed it).
        StoreCorruptedError: the file is not a store, was truncated, or an entry fails its checksum.
    """

    def __init__(self, path: str | os.PathLike, capacity: int, dtype: torch.dtype = torch.float32,
                 checksums: bool = True):
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"fastdist.compress.MmapStore: 'dtype' must be torch.float32 or torch.float16, got "
                             f"{dtype}")
        super().__init__(capacity, dtype)
        self.path = os.fspath(path)
        self.checksums = bool(checksums)
        self._fd = None
        self._id_of_slot = self._crc = None  # in memory, as in the file
        self._snapshot = None  # the snapshot that holds exactly what the file holds, if any
        if os.path.exists(self.path):
            self._open()

    def __getstate__(self) -> dict:
        return {"path": self.path, "capacity": self.capacity, "dtype": self.dtype, "checksums": self.checksums}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["capacity"], state["dtype"], state["checksums"])

    def __del__(self):
        self._close()

    def _close(self):
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    # -- layout and raw I/O
    def _code(self):
        return next(c for c, (t, _) in _DTYPES.items() if t == self.dtype)

    def _np_dtype(self):
        return _DTYPES[self._code()][1]

    def _row_bytes(self, entry_shape):
        return (int(np.prod(entry_shape)) if entry_shape else 1) * np.dtype(self._np_dtype()).itemsize

    def _layout(self, entry_shape):
        """(ids offset, checksums offset, data offset, file bytes)."""
        ids_offset = _HEADER_BYTES
        crc_offset = ids_offset + 8 * self.capacity
        data_offset = crc_offset + 8 * self.capacity
        data_offset += (-data_offset) % 64
        return ids_offset, crc_offset, data_offset, data_offset + self.capacity * self._row_bytes(entry_shape)

    def _corrupt(self, what):
        return StoreCorruptedError(f"fastdist.compress.MmapStore: {self.path} is not a valid store: {what}")

    def _io_error(self, e, doing, nbytes, offset):
        return StoreIOError(e.errno, f"fastdist.compress.MmapStore: {self.path}: {doing} {nbytes} bytes at offset "
                                     f"{offset} failed: {e.strerror or e}")

    def _pread(self, buf, offset):
        """Fills the uint8 array ``buf`` from ``offset``; a file that ends first was truncated."""
        got = 0
        while got < len(buf):
            try:
                n = os.preadv(self._fd, [buf[got:]], offset + got)
            except OSError as e:
                raise self._io_error(e, "reading", len(buf), offset) from e
            if n == 0:
                size = os.fstat(self._fd).st_size
                raise self._corrupt(f"truncated to {size} bytes while open (reading bytes {offset}..{offset + len(buf)}"
                                    f" of {self._total})")
            got += n

    def _pwrite(self, buf, offset):
        """Writes the uint8 array ``buf`` at ``offset`` (pwrite may write less than asked)."""
        done = 0
        while done < len(buf):
            try:
                done += os.pwrite(self._fd, buf[done:], offset + done)
            except OSError as e:
                raise self._io_error(e, "writing", len(buf), offset) from e

    def _check_size(self):
        """A write past the end of a truncated file would quietly grow it with holes where entries were."""
        size = os.fstat(self._fd).st_size
        if size < self._total:
            raise self._corrupt(f"truncated to {size} bytes while open (expected {self._total})")

    def _write_table(self, offset, values, slots):
        """Writes ``values`` (int64) of consecutive ``slots`` into the table at ``offset``."""
        self._pwrite(np.ascontiguousarray(values, dtype="<i8").view(np.uint8), offset + 8 * slots[0])

    # -- making and opening the file
    def _allocate(self, entry_shape):
        if len(entry_shape) > 8:
            raise ValueError(f"fastdist.compress.MmapStore: entries of at most 8 dimensions, got {entry_shape}")
        ids_offset, crc_offset, _, total = self._layout(entry_shape)
        self._close()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            preallocate(self._fd, 0, total, f"fastdist.compress.MmapStore: {self.path}")
            shape8 = list(entry_shape) + [0] * (8 - len(entry_shape))
            header = _HEADER.pack(_MAGIC, _VERSION, self._code(), self.capacity, len(entry_shape), *shape8)
            self._total = total
            self._pwrite(np.frombuffer(header, dtype=np.uint8), 0)
            empty = np.full(self.capacity, -1, dtype="<i8")
            self._pwrite(empty.view(np.uint8), ids_offset)
            self._pwrite(empty.view(np.uint8), crc_offset)
            if os.fstat(self._fd).st_size < total:  # no preallocation on this file system
                os.ftruncate(self._fd, total)
        except BaseException:
            self._close()
            os.unlink(self.path)  # a retry starts afresh
            raise
        self._id_of_slot = np.full(self.capacity, -1, dtype=np.int64)
        self._crc = np.full(self.capacity, _NO_CHECKSUM, dtype=np.int64)
        self._snapshot = None

    def _open(self):
        self._close()
        try:
            self._fd = os.open(self.path, os.O_RDWR)
        except OSError as e:
            raise StoreIOError(e.errno, f"fastdist.compress.MmapStore: cannot open {self.path}: "
                                        f"{e.strerror or e}") from e
        size = os.fstat(self._fd).st_size
        raw = os.pread(self._fd, _HEADER.size, 0)
        if len(raw) < _HEADER.size:
            raise self._corrupt(f"{size} bytes, shorter than its header")
        magic, version, code, capacity, ndim, *shape8 = _HEADER.unpack(raw)
        if magic != _MAGIC:
            raise self._corrupt(f"bad magic {magic!r}")
        if version != _VERSION:
            raise self._corrupt(f"bad version {version} (this fastdist writes version {_VERSION}; a version 1 file, "
                                "without checksums, was written by an older fastdist: delete it to start anew)")
        if code not in _DTYPES or ndim > 8:
            raise self._corrupt(f"bad dtype code {code} or ndim {ndim}")
        if capacity != self.capacity or _DTYPES[code][0] != self.dtype:
            raise self._corrupt(f"it holds capacity {capacity}, {_DTYPES[code][0]}; this store was opened with "
                                f"capacity {self.capacity}, {self.dtype}")
        entry_shape = tuple(shape8[:ndim])
        ids_offset, crc_offset, _, total = self._layout(entry_shape)
        if size != total:
            raise self._corrupt(f"{size} bytes, expected {total} for its header (truncated or overwritten)")
        self._total = total
        tables = np.empty(2 * self.capacity, dtype="<i8")
        self._pread(tables.view(np.uint8), ids_offset)
        ids, crc = tables[:self.capacity].astype(np.int64), tables[self.capacity:].astype(np.int64)
        used = ids[ids >= 0]
        if (ids < -1).any() or len(np.unique(used)) != len(used):
            raise self._corrupt("its slot table has invalid or repeated sample ids")
        free = np.flatnonzero(ids < 0)
        if len(free) and free[0] != len(used):
            raise self._corrupt("its used slots are not contiguous")
        self.entry_shape = entry_shape
        self.slot_of = {int(i): s for s, i in enumerate(used.tolist())}
        self._id_of_slot, self._crc = ids, crc

    # -- entries
    def _record_slots(self, ids, slots):
        self._id_of_slot[slots.start:slots.stop] = ids
        self._write_table(_HEADER_BYTES, ids, slots)

    def _read_slots(self, slots):
        s = slots.numpy()
        row_bytes = self._row_bytes(self.entry_shape)
        rows = np.empty((len(s), *self.entry_shape), dtype=self._np_dtype())
        raw = rows.reshape(len(s), -1).view(np.uint8)
        data_offset = self._layout(self.entry_shape)[2]
        for a, b, first in _runs(s):
            self._pread(raw[a:b].reshape(-1), data_offset + first * row_bytes)
        if self.checksums:
            for n, slot in enumerate(s.tolist()):
                want = int(self._crc[slot])
                if want != _NO_CHECKSUM and _entry_checksum(self._id_of_slot[slot], raw[n]) != want:
                    raise StoreCorruptedError(
                        f"fastdist.compress.MmapStore: {self.path}: the entry of sample {int(self._id_of_slot[slot])} "
                        f"(slot {slot}) fails its checksum: the file was changed outside the store")
        return torch.from_numpy(rows)

    def _write_slots(self, slots, rows):
        self._check_size()
        s = slots.numpy()
        row_bytes = self._row_bytes(self.entry_shape)
        raw = rows.contiguous().numpy().reshape(len(s), -1).view(np.uint8)
        _, crc_offset, data_offset, _ = self._layout(self.entry_shape)
        self._snapshot = None
        for a, b, first in _runs(s):
            self._pwrite(raw[a:b].reshape(-1), data_offset + first * row_bytes)
            if self.checksums:
                crc = [_entry_checksum(self._id_of_slot[first + n], raw[a + n]) for n in range(b - a)]
            else:
                crc = [_NO_CHECKSUM] * (b - a)
            self._crc[first:first + b - a] = crc
            self._write_table(crc_offset, crc, range(first, first + b - a))

    def flush(self) -> None:
        """Makes the entries and tables durable on disk (fsync)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def verify(self) -> None:
        """Reads every entry and checks its checksum.

        Raises:
            StoreCorruptedError: an entry fails its checksum, or the file was truncated.
        """
        if self.entry_shape is None:
            return
        chunk = max(1, (64 << 20) // self._row_bytes(self.entry_shape))
        for first in range(0, len(self.slot_of), chunk):
            self._read_slots(torch.arange(first, min(first + chunk, len(self.slot_of))))

    # -- snapshots
    def state_dict(self) -> dict:
        """A snapshot of the entries: the file copied beside itself (or the last copy, when nothing was put since).

        Returns:
            {"path", "snapshot" (None while empty), "capacity", "entries"}.

        Raises:
            StoreIOError: the copy failed (e.g. the disk is full).
        """
        self._drop_prefetch()
        if self._fd is not None and self._snapshot is None:
            directory, name = os.path.split(os.path.abspath(self.path))
            fd, snapshot = tempfile.mkstemp(prefix=f"{name}.snapshot-", dir=directory)
            os.close(fd)
            try:
                _copy_file(self._fd, snapshot)
            except OSError as e:
                os.unlink(snapshot)
                raise StoreIOError(e.errno, f"fastdist.compress.MmapStore: copying {self.path} "
                                            f"({self._total} bytes) to the snapshot {snapshot} failed: "
                                            f"{e.strerror or e}") from e
            self._snapshot = snapshot
        return {"path": self.path, "snapshot": self._snapshot, "capacity": self.capacity,
                "entries": len(self.slot_of)}

    def load_state_dict(self, state: dict) -> None:
        """Makes this store's file a copy of the state's snapshot, checks it and its entries' checksums.

        Raises:
            ValueError: the state is of a store of another capacity.
            StoreCorruptedError: the snapshot is missing, not a valid store, or holds other entries than the state
                says.
        """
        if state["capacity"] != self.capacity:
            raise ValueError(f"fastdist.compress.MmapStore: state has capacity {state['capacity']}, this store "
                             f"{self.capacity}")
        self._drop_prefetch()
        snapshot = state["snapshot"]
        self._close()
        self.slot_of, self.entry_shape, self._snapshot = {}, None, None
        if snapshot is None:  # a state of an empty store
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        if not os.path.exists(snapshot):
            raise StoreCorruptedError(f"fastdist.compress.MmapStore: the state's snapshot {snapshot} does not exist")
        directory, name = os.path.split(os.path.abspath(self.path))
        fd, staged = tempfile.mkstemp(prefix=f"{name}.loading-", dir=directory)
        try:
            src = os.open(snapshot, os.O_RDONLY)
            try:
                _copy_file(src, staged)
            finally:
                os.close(src)
            os.replace(staged, self.path)  # whole: never a half-copied store under `path`
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
            raise StoreIOError(e.errno, f"fastdist.compress.MmapStore: copying the snapshot {snapshot} to "
                                        f"{self.path} failed: {e.strerror or e}") from e
        finally:
            os.close(fd)
        self._open()
        if len(self.slot_of) != state["entries"]:
            raise self._corrupt(f"it holds {len(self.slot_of)} entries, the state says {state['entries']}")
        if self.checksums:
            self.verify()
        self._snapshot = snapshot
