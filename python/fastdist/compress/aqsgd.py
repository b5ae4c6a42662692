"""AQ-SGD (Wang et al., NeurIPS 2022): compress the change of a sample's activation since its last visit.

Both ends keep m(xi) per training sample xi. A sample's first visit, and every visit during the first
``warmup_epochs`` epochs, is sent uncompressed and stored: m(xi) <- a(xi). Later visits send c = C(a(xi) - m(xi)) and
both ends update m(xi) <- m(xi) + D(c), with the same float operations, so their m stay equal bit for bit and the
receiver's output is its m(xi).

The store of m is samples x activation size, so it is pluggable: :class:`MemoryStore` (a tensor in memory) or
:class:`MmapStore` (a memory-mapped file). Both key entries by non-negative integer sample ids, refuse new ids once
full, and read the next batch's entries in a background thread when told its ids (``prefetch``).
"""
import concurrent.futures
import os
import struct

import numpy as np
import torch

from fastdist.compress.compressors import Compressor, Packet, as_rows, check_compressible, check_compressor

__all__ = ["AQSGD", "MemoryStore", "MmapStore", "StoreCorruptedError", "StoreFullError"]


class StoreFullError(RuntimeError):
    """A store has no slot left for a new sample id."""


class StoreCorruptedError(RuntimeError):
    """A store's file does not hold a valid store."""


def _check_ids(ids, who):
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


class _Store:
    """Slots for up to `capacity` sample ids; entries of one shape and dtype; prefetch in a background thread."""

    def __init__(self, capacity, dtype):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"fastdist.compress.{type(self).__name__}: 'capacity' must be an int >= 1, got "
                             f"{capacity!r}")
        self.capacity, self.dtype = capacity, dtype
        self.slot_of = {}  # sample id -> slot
        self.entry_shape = None
        self._executor = None
        self._pending = None  # (ids, future)

    # -- storage, by the subclasses
    def _allocate(self, entry_shape):
        raise NotImplementedError

    def _read_slots(self, slots):
        raise NotImplementedError

    def _write_slots(self, slots, rows):
        raise NotImplementedError

    def _record_slot(self, sample_id, slot):
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
        ids = _check_ids(ids, type(self).__name__)
        known = ids[self.contains(ids)]
        if known.numel() == 0 or self.entry_shape is None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aqsgd-prefetch")
        if self._pending is not None:
            self._pending[1].result()
        slots = self._slots(known)
        self._pending = (known, self._executor.submit(self._read_slots, slots))

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores ``rows`` (``[len(ids), *entry_shape]``) under the sample ``ids``; new ids take free slots.

        Raises:
            StoreFullError: the new ids do not fit.
            ValueError: the rows' shape differs from the entries'.
        """
        if self.entry_shape is None:
            self.entry_shape = tuple(rows.shape[1:])
            self._allocate(self.entry_shape)
        if tuple(rows.shape[1:]) != self.entry_shape:
            raise ValueError(f"fastdist.compress.{type(self).__name__}: entries have shape {self.entry_shape}, got "
                             f"rows of shape {tuple(rows.shape[1:])}")
        new = [int(i) for i in ids.tolist() if int(i) not in self.slot_of]
        if len(self.slot_of) + len(new) > self.capacity:
            raise StoreFullError(f"fastdist.compress.{type(self).__name__}: full: {len(self.slot_of)} of "
                                 f"{self.capacity} slots used, {len(new)} new sample id(s) do not fit; give it a "
                                 "capacity of at least the number of training samples")
        for i in new:
            slot = len(self.slot_of)
            self.slot_of[i] = slot
            self._record_slot(i, slot)
        self._pending = None  # a prefetch read before this write would be stale
        self._write_slots(self._slots(ids), rows.detach().to("cpu", self.dtype))

    def __len__(self) -> int:
        return len(self.slot_of)


class MemoryStore(_Store):
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
        """Restores what :meth:`state_dict` returned (of a store of the same capacity)."""
        if state["capacity"] != self.capacity:
            raise ValueError(f"fastdist.compress.MemoryStore: state has capacity {state['capacity']}, this store "
                             f"{self.capacity}")
        self.slot_of = {int(i): s for s, i in enumerate(state["ids"].tolist())}
        self.entry_shape = None if state["data"] is None else tuple(state["data"].shape[1:])
        self.data = None
        if self.entry_shape is not None:
            self._allocate(self.entry_shape)
            self.data[:len(self.slot_of)] = state["data"]
        self._pending = None


_MAGIC = b"FDAQSGD1"
_HEADER = struct.Struct("<8sIIQI8Q")  # magic, version, dtype code, capacity, ndim, shape[8]
_HEADER_BYTES = 4096
_DTYPES = {1: (torch.float32, np.float32), 2: (torch.float16, np.float16)}


class MmapStore(_Store):
    """Entries in a memory-mapped file at `path`: a 4 KiB header (magic, version, dtype, capacity, entry shape), the
    sample id of each slot (int64, -1 when free), then the entries. An existing file is opened and checked (a
    corrupted or mismatched one raises StoreCorruptedError); a new one is created at the first put.

    Args:
        path: the file.
        capacity: the most sample ids it holds.
        dtype: ``torch.float32`` or ``torch.float16``.
    """

    def __init__(self, path: str | os.PathLike, capacity: int, dtype: torch.dtype = torch.float32):
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"fastdist.compress.MmapStore: 'dtype' must be torch.float32 or torch.float16, got "
                             f"{dtype}")
        super().__init__(capacity, dtype)
        self.path = os.fspath(path)
        self._ids = self._data = None
        if os.path.exists(self.path):
            self._open()

    def _code(self):
        return next(c for c, (t, _) in _DTYPES.items() if t == self.dtype)

    def _layout(self, entry_shape):
        numel = int(np.prod(entry_shape)) if entry_shape else 1
        ids_offset = _HEADER_BYTES
        data_offset = ids_offset + 8 * self.capacity
        data_offset += (-data_offset) % 64
        itemsize = np.dtype(_DTYPES[self._code()][1]).itemsize
        return ids_offset, data_offset, data_offset + self.capacity * numel * itemsize

    def _map(self, entry_shape, mode):
        ids_offset, data_offset, _ = self._layout(entry_shape)
        np_dtype = _DTYPES[self._code()][1]
        self._ids = np.memmap(self.path, dtype=np.int64, mode=mode, offset=ids_offset, shape=(self.capacity,))
        self._data = np.memmap(self.path, dtype=np_dtype, mode="r+", offset=data_offset,
                               shape=(self.capacity, *entry_shape))

    def _allocate(self, entry_shape):
        if len(entry_shape) > 8:
            raise ValueError(f"fastdist.compress.MmapStore: entries of at most 8 dimensions, got {entry_shape}")
        _, _, total = self._layout(entry_shape)
        with open(self.path, "wb") as f:
            shape8 = list(entry_shape) + [0] * (8 - len(entry_shape))
            f.write(_HEADER.pack(_MAGIC, 1, self._code(), self.capacity, len(entry_shape), *shape8))
            f.truncate(total)
        self._map(entry_shape, "r+")
        self._ids[:] = -1

    def _corrupt(self, what):
        return StoreCorruptedError(f"fastdist.compress.MmapStore: {self.path} is not a valid store: {what}")

    def _open(self):
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(_HEADER.size)
        if len(raw) < _HEADER.size:
            raise self._corrupt(f"{size} bytes, shorter than its header")
        magic, version, code, capacity, ndim, *shape8 = _HEADER.unpack(raw)
        if magic != _MAGIC or version != 1:
            raise self._corrupt(f"bad magic/version {magic!r}/{version}")
        if code not in _DTYPES or ndim > 8:
            raise self._corrupt(f"bad dtype code {code} or ndim {ndim}")
        if capacity != self.capacity or _DTYPES[code][0] != self.dtype:
            raise self._corrupt(f"it holds capacity {capacity}, {_DTYPES[code][0]}; this store was opened with "
                                f"capacity {self.capacity}, {self.dtype}")
        entry_shape = tuple(shape8[:ndim])
        _, _, total = self._layout(entry_shape)
        if size != total:
            raise self._corrupt(f"{size} bytes, expected {total} for its header (truncated or overwritten)")
        self._map(entry_shape, "r+")
        ids = np.asarray(self._ids)
        used = ids[ids >= 0]
        if (ids < -1).any() or len(np.unique(used)) != len(used):
            raise self._corrupt("its slot table has invalid or repeated sample ids")
        free = np.flatnonzero(ids < 0)
        if len(free) and free[0] != len(used):
            raise self._corrupt("its used slots are not contiguous")
        self.entry_shape = entry_shape
        self.slot_of = {int(i): s for s, i in enumerate(used.tolist())}

    def _record_slot(self, sample_id, slot):
        self._ids[slot] = sample_id

    def _read_slots(self, slots):
        return torch.from_numpy(np.ascontiguousarray(self._data[slots.numpy()]))

    def _write_slots(self, slots, rows):
        self._data[slots.numpy()] = rows.numpy()

    def flush(self) -> None:
        """Writes the mapped entries and slot table back to the file."""
        if self._data is not None:
            self._data.flush()
            self._ids.flush()

    def state_dict(self) -> dict:
        """The data stays in the file; the state names it (flushed first) and how many entries it holds."""
        self.flush()
        return {"path": self.path, "capacity": self.capacity, "entries": len(self.slot_of)}

    def load_state_dict(self, state: dict) -> None:
        """Opens the file the state names and checks that it holds as many entries as the state says."""
        if state["capacity"] != self.capacity:
            raise ValueError(f"fastdist.compress.MmapStore: state has capacity {state['capacity']}, this store "
                             f"{self.capacity}")
        self.path = state["path"]
        self._pending = None
        self._open()
        if len(self.slot_of) != state["entries"]:
            raise self._corrupt(f"it holds {len(self.slot_of)} entries, the state says {state['entries']}")


class AQSGD(Compressor):
    """AQ-SGD over compressor `c` (e.g. Quantize(4)); `store` holds m per sample. compress/roundtrip need the batch's
    sample ids (one per row of x viewed [B, D]); the packet carries them (8 bytes per sample) so that the receiver
    updates the same entries.

    Args:
        c: the compressor of the changes.
        store: a :class:`MemoryStore` or :class:`MmapStore`, one per end.
        warmup_epochs: epochs whose visits are all sent uncompressed.
    """

    name = "aqsgd"

    def __init__(self, c: Compressor, store: _Store, warmup_epochs: int = 1):
        check_compressor(c, "AQSGD")
        if not isinstance(store, _Store):
            raise TypeError(f"fastdist.compress.AQSGD: 'store' must be a MemoryStore or MmapStore, got "
                            f"{type(store).__name__}")
        if not isinstance(warmup_epochs, int) or warmup_epochs < 0:
            raise ValueError(f"fastdist.compress.AQSGD: 'warmup_epochs' must be an int >= 0, got {warmup_epochs!r}")
        self.c, self.store, self.warmup_epochs = c, store, warmup_epochs
        self.epoch = 0

    def config(self) -> dict:
        return {"name": self.name, "c": self.c.config(), "warmup_epochs": self.warmup_epochs}

    def __repr__(self) -> str:
        return f"AQSGD({self.c!r}, store={type(self.store).__name__}(capacity={self.store.capacity}), " \
               f"warmup_epochs={self.warmup_epochs})"

    def set_epoch(self, epoch: int) -> None:
        """Tells both ends the epoch (the first ``warmup_epochs`` send everything uncompressed)."""
        self.epoch = int(epoch)

    def prefetch(self, sample_ids: torch.Tensor) -> None:
        """Starts reading the stored activations of the next batch's ``sample_ids`` in the background."""
        self.store.prefetch(sample_ids)

    def _ids(self, x, sample_ids):
        if sample_ids is None:
            raise ValueError("fastdist.compress.AQSGD: sample ids are required (one per sample of the batch): pass "
                             "sample_ids=, or use fastdist.compress.batch(sample_ids=...) around the forward pass")
        ids = _check_ids(sample_ids, "AQSGD")
        if ids.numel() != as_rows(x).shape[0]:
            raise ValueError(f"fastdist.compress.AQSGD: got {ids.numel()} sample ids for a batch of "
                             f"{as_rows(x).shape[0]} samples (x of shape {tuple(x.shape)})")
        return ids

    def _combine(self, packet, rows_dtype, device, m_old):
        """The rows the receiver outputs (and both ends store): fresh rows as sent, the others m + D(delta)."""
        t, meta = packet.tensors, packet.meta
        fresh = t["fresh"].bool().to(device)
        d = meta["d"]
        delta = None
        if meta["stale"]:
            inner = Packet(meta["inner_kind"], (meta["stale"], d), rows_dtype,
                           {name[2:]: v for name, v in t.items() if name.startswith("d_")},
                           {name[2:]: v for name, v in meta.items() if name.startswith("d_")})
            delta = self.c.decompress(inner).to(torch.float32)
        if meta["stale"] == fresh.numel():  # the steady state: every sample seen before
            return m_old.to(device, torch.float32) + delta
        out = torch.empty(fresh.numel(), d, dtype=torch.float32, device=device)
        out[fresh] = t["full"].to(torch.float32)
        if delta is not None:
            out[~fresh] = m_old.to(device, torch.float32) + delta
        return out

    def compress(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> Packet:
        check_compressible(x, "AQSGD")
        x = x.detach()
        ids = self._ids(x, sample_ids)
        rows = as_rows(x)
        if self.epoch < self.warmup_epochs:
            fresh = torch.ones(ids.numel(), dtype=torch.bool)
        else:
            fresh = ~self.store.contains(ids)
        tensors = {"ids": ids, "fresh": fresh.to(torch.uint8), "full": rows[fresh.to(rows.device)].contiguous()}
        meta = {"d": rows.shape[1], "stale": int((~fresh).sum())}
        m_old = None
        if meta["stale"]:
            m_old = self.store.get(ids[~fresh])
            delta = rows[~fresh.to(rows.device)].to(torch.float32) - m_old.to(rows.device, torch.float32)
            inner = self.c.compress(delta.to(rows.dtype))
            tensors.update({f"d_{name}": v for name, v in inner.tensors.items()})
            meta.update({f"d_{name}": v for name, v in inner.meta.items()})
            meta["inner_kind"] = inner.kind
        packet = Packet("aqsgd", tuple(x.shape), x.dtype, tensors, meta)
        self._sent = (packet, self._combine(packet, rows.dtype, rows.device, m_old))
        self.store.put(ids, self._sent[1])
        return packet

    def roundtrip(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, Packet]:
        packet = self.compress(x, sample_ids)
        return self._sent[1].reshape(x.shape).to(x.dtype), packet

    def decompress(self, packet: Packet) -> torch.Tensor:
        ids = packet.tensors["ids"]
        fresh = packet.tensors["fresh"].bool()
        m_old = self.store.get(ids[~fresh]) if packet.meta["stale"] else None
        out = self._combine(packet, packet.dtype, packet.tensors["full"].device, m_old)
        self.store.put(ids, out)
        return out.reshape(packet.shape).to(packet.dtype)

    def stateless(self) -> Compressor:
        return self.c.stateless()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "store": self.store.state_dict(), "c": self.c.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.store.load_state_dict(state["store"])
        self.c.load_state_dict(state["c"])
