"""Where swapped-out saved tensors live: a file (CPU machines) or pinned host memory (GPUs).

A store moves the bytes of one storage out and back asynchronously and says when each copy has landed.
Both stores hand out `Copy` objects: `done()` polls, `wait()` blocks and returns the seconds spent blocked,
`seconds` is the copy's own duration once it has finished. A file that cannot be grown or written raises
:class:`StoreIOError` naming the file, the bytes and the cause.
"""
import bisect
import errno
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

PAGE = 4096

__all__ = ["FileStore", "PinnedStore", "StoreIOError", "preallocate"]


class StoreIOError(OSError):
    """A store's file could not be grown, written or read: a full disk, a file size limit, an I/O error. ``errno``
    is the cause's; the message names the file and the bytes."""


# The file system cannot reserve space ahead (writes still report a full disk, only later).
_NO_PREALLOCATION = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def preallocate(fd: int, offset: int, nbytes: int, what: str) -> None:
    """Reserves bytes ``[offset, offset + nbytes)`` of the file ``fd`` on its disk, so that a full disk is reported
    now rather than by a later write into them (or by SIGBUS through a memory mapping of a sparse file).

    Args:
        fd: an open file descriptor.
        offset: the first byte to reserve.
        nbytes: how many bytes.
        what: the file as the message should name it.

    Raises:
        StoreIOError: the file system refused (ENOSPC, EFBIG, EIO, ...).
    """
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        if e.errno in _NO_PREALLOCATION:
            return
        raise StoreIOError(e.errno, f"{what}: cannot reserve {nbytes} bytes at offset {offset}: "
                                    f"{e.strerror or e}") from e


def _byte_view(storage):
    """A flat uint8 tensor over all bytes of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class _Extents:
    """First-fit allocator of page-aligned byte ranges in a growing file; freed neighbours coalesce."""

    def __init__(self):
        self.size = 0
        self._free = []  # sorted [(offset, length)]

    def alloc(self, nbytes):
        need = max(PAGE, -(-nbytes // PAGE) * PAGE)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                return off
        if self._free and self._free[-1][0] + self._free[-1][1] == self.size:  # grow the trailing hole
            off, _ = self._free.pop()
        else:
            off = self.size
        self.size = off + need
        return off

    def free(self, offset, nbytes):
        length = max(PAGE, -(-nbytes // PAGE) * PAGE)
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == offset + length:  # merge with the next hole
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge with the previous hole
            offset, prev = self._free.pop(i - 1)
            length += prev
            i -= 1
        self._free.insert(i, (offset, length))

    def in_use(self):
        return self.size - sum(length for _, length in self._free)


class _FutureCopy:
    """A copy run by an I/O thread; `future` is set right after submission."""

    def __init__(self):
        self.future = None
        self.seconds = 0.0
        self.stall_seconds = 0.0  # the host measures its own waits: wait() returns them

    def done(self):
        return self.future.done()

    def wait(self):
        """Blocks until the copy has landed (re-raising its I/O error); returns the seconds blocked."""
        start = time.perf_counter()
        self.future.result()
        return time.perf_counter() - start


class FileStore:
    """Swaps CPU storages to one file with pwrite/pread on background I/O threads.

    The file is unlinked as soon as it is opened, so it disappears with its descriptor whatever happens to the
    process; `close()` closes the descriptor and stops the threads. Writes and reads have separate threads so
    that a backward-pass prefetch never queues behind the forward pass's last writes. The copy lands in the
    kernel's page cache, which the OS may write back to disk under pressure: the process's own memory drops.

    Args:
        path: the directory of the file (default: the temp directory).
        io_threads: I/O threads per direction.
    """

    kind = "file"
    device = torch.device("cpu")

    def __init__(self, path: str | None = None, io_threads: int = 1):
        directory = path if path is not None else tempfile.gettempdir()
        os.makedirs(directory, exist_ok=True)
        fd, self.filename = tempfile.mkstemp(prefix="fastdist-swap-", suffix=".bin", dir=directory)
        os.unlink(self.filename)
        self._fd = fd
        self._extents = _Extents()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="fastdist-swap-write")
        self._reader = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="fastdist-swap-read")
        self.closed = False

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether the store can take ``tensor``'s storage: CPU tensors."""
        return tensor.device.type == "cpu"

    def file_bytes(self) -> int:
        """The file's size: the most bytes it has held at once, rounded to pages."""
        with self._lock:
            return self._extents.size

    def _reserve(self, nbytes):
        """An extent of ``nbytes``; the file grows (on disk, now) when no freed extent fits."""
        with self._lock:
            size, free = self._extents.size, list(self._extents._free)
            offset = self._extents.alloc(nbytes)
            if self._extents.size > size:
                try:
                    preallocate(self._fd, size, self._extents.size - size,
                                f"fastdist swap file {self.filename} (unlinked)")
                except StoreIOError:
                    self._extents.size, self._extents._free = size, free  # as before: nothing was reserved
                    raise
        return offset

    def write(self, storage: torch.UntypedStorage,
              on_done: Callable[[_FutureCopy], None]) -> tuple[tuple[int, int], _FutureCopy]:
        """Starts copying ``storage`` out.

        Args:
            storage: the CPU storage; it must stay alive until the copy has landed.
            on_done: called with the copy on the I/O thread once it has landed.

        Returns:
            (slot, copy): where the bytes go, and the copy in flight.

        Raises:
            StoreIOError: the file cannot grow by the storage's bytes (the copy's own I/O errors are raised by
                its ``wait()``, as StoreIOError too).
        """
        nbytes = storage.nbytes()
        offset = self._reserve(nbytes)
        src = _byte_view(storage).numpy()
        copy = _FutureCopy()

        def work():
            start = time.perf_counter()
            written = 0
            while written < nbytes:  # pwrite may write less than asked
                try:
                    written += os.pwrite(self._fd, src[written:], offset + written)
                except OSError as e:
                    raise StoreIOError(e.errno, f"fastdist swap file {self.filename} (unlinked): writing {nbytes} "
                                                f"bytes at offset {offset} failed: {e.strerror or e}") from e
            copy.seconds = time.perf_counter() - start
            on_done(copy)

        copy.future = self._writer.submit(work)
        return (offset, nbytes), copy

    def read(self, slot: tuple[int, int]) -> tuple[torch.UntypedStorage, _FutureCopy]:
        """Starts copying ``slot`` back into a new CPU storage; returns (the storage, the copy in flight)."""
        offset, nbytes = slot
        storage = torch.UntypedStorage(nbytes)
        dst = _byte_view(storage).numpy()
        copy = _FutureCopy()

        def work():
            start = time.perf_counter()
            got = 0
            while got < nbytes:
                n = os.preadv(self._fd, [dst[got:]], offset + got)
                if n == 0:
                    raise OSError(f"fastdist swap file ended at byte {offset + got}, expected {offset + nbytes}")
                got += n
            copy.seconds = time.perf_counter() - start

        copy.future = self._reader.submit(work)
        return storage, copy

    def free(self, slot: tuple[int, int]) -> None:
        """Gives ``slot``'s bytes of the file back for later writes."""
        with self._lock:
            if not self.closed:
                self._extents.free(*slot)

    def close(self) -> None:
        """Stops the I/O threads and closes the file (which disappears with its descriptor). Idempotent."""
        if self.closed:
            return
        # A garbage-collection finalizer may run on one of the I/O threads themselves: never join oneself.
        on_io_thread = threading.current_thread().name.startswith("fastdist-swap-")
        self._writer.shutdown(wait=not on_io_thread)
        self._reader.shutdown(wait=not on_io_thread)
        with self._lock:
            self.closed = True
            os.close(self._fd)


class _EventCopy:
    """A copy issued on a side stream, bracketed by two timing events.

    `wait()` does not block the host: it makes the current (compute) stream wait for the copy, and brackets
    that wait with two more events so that the compute stream's stall can be read later (`stall_seconds`).
    """

    def __init__(self, stream):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.stream = stream
        self._stall = None

    def done(self):
        return self.end.query()

    @property
    def seconds(self):
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3

    @property
    def stall_seconds(self):
        if self._stall is None:
            return 0.0
        before, after = self._stall
        after.synchronize()
        return before.elapsed_time(after) / 1e3

    def wait(self):
        compute = torch.cuda.current_stream(self.stream.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(self.end)
        after.record(compute)
        self._stall = (before, after)
        return 0.0


class PinnedStore:
    """Swaps CUDA storages to pinned host buffers over a D2H and an H2D side stream.

    Pinned buffers are pooled by size class (powers of two from 1 MiB) because pinning is slow. A device storage
    stays referenced until its D2H event has completed, then the prefetcher drops it; the caching allocator
    may hand its block out again only after that, so no `record_stream` is needed. Reads allocate their
    destination on the compute stream (the stream that will use it) and the H2D stream first waits for
    the compute stream, so the block is not written while earlier compute work may still touch it.

    Args:
        device: the CUDA device index (default: the current device).
    """

    kind = "pinned"

    def __init__(self, device: int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)
        self._pool = {}
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        self.closed = False

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether the store can take ``tensor``'s storage: tensors on its device."""
        return tensor.device == self.device

    @staticmethod
    def _size_class(nbytes):
        return max(1 << 20, 1 << (nbytes - 1).bit_length())

    def _host_buffer(self, nbytes):
        size = self._size_class(nbytes)
        with self._lock:
            free = self._pool.get(size)
            if free:
                return free.pop()
            self.pinned_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def write(self, storage: torch.UntypedStorage,
              on_done: None = None) -> tuple[tuple[torch.Tensor, int], _EventCopy]:
        """Starts copying ``storage`` to a pinned host buffer on the D2H stream; returns (slot, copy). The copy's
        events say when it has landed (``on_done`` is the file store's; unused here)."""
        nbytes = storage.nbytes()
        host = self._host_buffer(nbytes)
        src = _byte_view(storage)
        copy = _EventCopy(self._d2h)
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))  # the producer's kernels come first
        with torch.cuda.stream(self._d2h):
            copy.start.record(self._d2h)
            host[:nbytes].copy_(src, non_blocking=True)
            copy.end.record(self._d2h)
        return (host, nbytes), copy

    def read(self, slot: tuple[torch.Tensor, int]) -> tuple[torch.UntypedStorage, _EventCopy]:
        """Starts copying ``slot`` back into a new device storage on the H2D stream; returns (storage, copy)."""
        host, nbytes = slot
        compute = torch.cuda.current_stream(self.device)
        storage = torch.UntypedStorage(nbytes, device=self.device)  # allocated on the compute stream
        dst = _byte_view(storage)
        copy = _EventCopy(self._h2d)
        self._h2d.wait_stream(compute)
        with torch.cuda.stream(self._h2d):
            copy.start.record(self._h2d)
            dst.copy_(host[:nbytes], non_blocking=True)
            copy.end.record(self._h2d)
        return storage, copy

    def free(self, slot: tuple[torch.Tensor, int], pending: _EventCopy | None = None) -> None:
        """Returns the host buffer to the pool once no copy still reads or writes it."""
        host, _ = slot
        if pending is not None:
            pending.end.synchronize()
        with self._lock:
            self._pool.setdefault(host.numel(), []).append(host)

    def close(self) -> None:
        """Drops the pooled pinned buffers."""
        with self._lock:
            self._pool.clear()
            self.closed = True
