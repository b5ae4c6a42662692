"""SwapPrefetcher: saved-tensor hooks that swap activations out in forward and prefetch them back in backward.

Pack (forward): a saved tensor whose storage is large enough, is not a parameter and lives where the store
can take it is copied out asynchronously; the prefetcher holds the storage only until that copy has landed,
then drops it, so the memory is freed while forward goes on. Views of one storage share one copy.
Unpack (backward): the tensor comes back from the store (waiting only if its read has not landed yet,
which is the exposed time), and reads start for the next `prefetch_depth` swapped storages in reverse pack
order, which is the order backward needs them. A storage is dropped again as soon as every saved view of it
has been unpacked, and read again if a retained graph is run a second time.
"""
import collections
import itertools
import threading
import time
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fastdist.memory.store import FileStore, PinnedStore

WRITING, STORED, READING, LOADED = "writing", "stored", "reading", "loaded"


class _Entry:
    """One swapped storage: where its bytes are and whether they are in memory now."""

    __slots__ = (
        "consumed_round",
        "dead",
        "handles",
        "nbytes",
        "read_copy",
        "seq",
        "slot",
        "state",
        "storage",
        "store",
        "unconsumed",
        "version",
        "want",
        "weak",
    )

    def __init__(self, storage, store, version, seq):
        self.nbytes = storage.nbytes()
        self.storage = storage  # held while the data is in memory (writing, loaded)
        self.store = store
        self.state = WRITING
        self.slot = None
        self.want = False  # prefetch asked for it while it was still being written: keep it
        self.handles = set()  # ids of live saved views
        self.unconsumed = set()  # ids of views not unpacked since the storage was last brought in
        self.seq = seq
        self.consumed_round = -1
        self.version = version
        self.weak = StorageWeakRef(storage)
        self.dead = False
        self.read_copy = None


class _Saved:
    """What autograd holds instead of a swapped tensor: a view (offset, size, stride, dtype) of an entry."""

    __slots__ = ("dead_queue", "dtype", "entry", "key", "offset", "size", "stride")

    _keys = itertools.count()  # not id(): an address is reused as soon as an object dies

    def __init__(self, entry, tensor, dead_queue):
        self.entry = entry
        self.key = next(self._keys)
        self.offset = tensor.storage_offset()
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.dtype = tensor.dtype
        self.dead_queue = dead_queue

    def __del__(self):
        # Runs wherever the graph is freed (possibly inside the prefetcher): only queue, never lock.
        try:
            self.dead_queue.append((self.entry, self.key))
        except (AttributeError, TypeError):  # interpreter shutdown: module globals already torn down
            return


def is_parameter_or_view(t: torch.Tensor) -> bool:
    """True when ``t`` is a parameter, a leaf that requires grad, or a view of one: saved tensors that are in
    memory for the whole step anyway, so swapping or counting them would save nothing.

    Args:
        t: a tensor autograd saves.
    """
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


class SwapPrefetcher:
    """Context manager: saved tensors packed inside it are swapped out and prefetched back for backward.

        prefetcher = SwapPrefetcher(min_bytes=1 << 20, prefetch_depth=2)
        with prefetcher:
            loss = model(x).sum()
        loss.backward()
        print(prefetcher.stats())

    Tensors the store cannot take, parameters (and views of them) and storages smaller than ``min_bytes`` stay
    where they are. The store lives until ``close()`` (or until an exception leaves the ``with`` block, or the
    prefetcher is garbage collected); the next ``with`` opens a new one.

    Args:
        min_bytes: the smallest storage swapped.
        prefetch_depth: storages read ahead of the one backward unpacks.
        store: ``"pinned"`` (CUDA tensors to pinned host memory over side streams), ``"file"`` (CPU tensors to a
            file with background I/O threads), or ``"auto"`` (pinned when CUDA is available, else file).
        path: the file store's directory (default: the temp directory).
        io_threads: the file store's I/O threads per direction.
        max_inflight_bytes: with it, forward waits whenever more than this many bytes are still being copied out
            (back-pressure: the copy engine bounds the memory forward can pile up; the wait is
            ``forward_wait_seconds``); None: no bound.
    """

    def __init__(self, min_bytes: int = 1 << 20, prefetch_depth: int = 2, store: str = "auto", path: str | None = None,
                 io_threads: int = 1, max_inflight_bytes: int | None = None):
        if store not in ("auto", "pinned", "file"):
            raise ValueError(f"SwapPrefetcher: store must be 'auto', 'pinned' or 'file', got {store!r}")
        if store == "pinned" and not torch.cuda.is_available():
            raise RuntimeError("SwapPrefetcher: store='pinned' needs a CUDA device; use store='file' on CPU")
        if int(prefetch_depth) < 0:
            raise ValueError(f"SwapPrefetcher: prefetch_depth must be >= 0, got {prefetch_depth}")
        if int(min_bytes) < 0:
            raise ValueError(f"SwapPrefetcher: min_bytes must be >= 0, got {min_bytes}")
        if int(io_threads) < 1:
            raise ValueError(f"SwapPrefetcher: io_threads must be >= 1, got {io_threads}")
        if max_inflight_bytes is not None and int(max_inflight_bytes) < 0:
            raise ValueError(f"SwapPrefetcher: max_inflight_bytes must be >= 0 or None, got {max_inflight_bytes}")
        self.max_inflight_bytes = None if max_inflight_bytes is None else int(max_inflight_bytes)
        self.store_kind = ("pinned" if torch.cuda.is_available() else "file") if store == "auto" else store
        self.min_bytes = int(min_bytes)
        self.prefetch_depth = int(prefetch_depth)
        self.path = path
        self.io_threads = int(io_threads)
        self._store = None
        self._lock = threading.RLock()
        self._hooks = []
        self._dead = collections.deque()
        self._order = []  # live entries in (latest) pack order
        self._by_storage = {}  # storage cdata -> entry, for packing views of one storage once
        self._pending = []  # copies whose time is not yet accounted
        self._gpu_writing = []  # pinned store: entries whose D2H copy is polled
        self._file_writing = []  # file store: writes that may still be in flight
        self._next_seq = 0
        self._round = 0
        self._finalizer = None
        self._resident = 0  # bytes of swappable storages the prefetcher holds in memory now
        self._writing_bytes = 0  # of those, the ones whose copy out has not landed yet
        self.reset_stats()

    # ---- context manager ----

    def __enter__(self) -> "SwapPrefetcher":
        with self._lock:
            if self._store is None:
                self._open()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        self._hooks.pop().__exit__(exc_type, exc, tb)
        if exc_type is not None and not self._hooks:
            self.close()
        return False

    def _open(self):
        if self.store_kind == "file":
            self._store = FileStore(self.path, io_threads=self.io_threads)
        else:
            self._store = PinnedStore()
        self._finalizer = weakref.finalize(self, self._store.close)

    def close(self) -> None:
        """Waits for copies in flight, frees every swapped copy and closes the store (its file, its threads)."""
        with self._lock:
            store, self._store = self._store, None
            if store is None:
                return
            self._reap_dead()
            self._account(block=True)
            for _, copy in self._gpu_writing:  # D2H copies still read device storages we are about to drop
                copy.end.synchronize()
            for entry in self._order:
                entry.dead = True
                entry.storage = None
            self._order.clear()
            self._by_storage.clear()
            self._gpu_writing.clear()
            self._file_writing.clear()
            self._resident = 0
            self._writing_bytes = 0
        store.close()
        if self._finalizer is not None:
            self._finalizer.detach()

    @property
    def store(self) -> FileStore | PinnedStore | None:
        """The open store (None between a close and the next ``with``)."""
        return self._store

    def synchronize(self) -> None:
        """Blocks until every copy in flight has landed (and the memory of written storages is freed)."""
        with self._lock:
            writes, self._file_writing = self._file_writing, []
            gpu = list(self._gpu_writing)
            reads = [copy for _, copy in self._pending]
        for copy in writes:
            copy.wait()
        for _, copy in gpu:
            copy.end.synchronize()
        for copy in reads:
            if self.store_kind == "file":
                copy.wait()
            else:
                copy.end.synchronize()
        with self._lock:
            self._poll_gpu_writes()

    # ---- look-ahead triggered from outside ----

    def _take_seq(self):
        self._next_seq += 1
        return self._next_seq - 1

    def mark(self) -> int:
        """A position in pack order: everything packed so far is before it."""
        return self._next_seq

    def prefetch_on_grad(self, tensor: torch.Tensor, upto: int | None = None) -> None:
        """When backward computes ``tensor``'s gradient, start reading the ``prefetch_depth`` most recently packed
        storages packed before ``upto``. Unpacks alone cannot prefetch the first storage backward needs after a
        stretch of unswapped work; a hook on a later activation can.

        Args:
            tensor: an activation computed after the swapped ones (nothing happens unless it requires grad).
            upto: a :meth:`mark` (default: now).
        """
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad or self.prefetch_depth == 0:
            return
        upto = self.mark() if upto is None else upto
        ref = weakref.ref(self)

        def hook(grad):
            prefetcher = ref()
            if prefetcher is not None:
                prefetcher._prefetch_upto(upto)

        tensor.register_hook(hook)

    def _prefetch_upto(self, upto):
        with self._lock:
            if self._store is None:
                return
            self._reap_dead()
            started = 0
            for entry in reversed(self._order):
                if entry.seq >= upto or entry.consumed_round == self._round:
                    continue
                if entry.state == STORED:
                    self._start_read(entry)
                elif entry.state == WRITING:
                    entry.want = True
                started += 1
                if started == self.prefetch_depth:
                    return

    # ---- statistics ----

    def reset_stats(self) -> None:
        """Zeroes what :meth:`stats` counts."""
        self._stats = dict(bytes_swapped=0, bytes_read=0, bytes_kept=0, tensors_swapped=0, views_deduplicated=0,
                           write_seconds=0.0, read_seconds=0.0, exposed_wait_seconds=0.0, forward_wait_seconds=0.0,
                           peak_resident_bytes=0,
                           peak_store_bytes=0)

    def stats(self) -> dict:
        """Bytes swapped/read/kept, peak bytes of swappable storages held in memory, copy and exposed wait time.

        Copies still in flight are not waited for (call ``synchronize()`` first for a settled picture)."""
        with self._lock:
            self._reap_dead()
            self._account(block=True)
            s = dict(self._stats)
            s["copy_seconds"] = s["write_seconds"] + s["read_seconds"]
            s["hidden_fraction"] = (1.0 - s["exposed_wait_seconds"] / s["copy_seconds"]) if s["copy_seconds"] else 1.0
            s["resident_bytes"] = self._resident
            s["live_swapped_storages"] = len(self._order)
            s["store"] = self.store_kind
            return s

    def _add_resident(self, nbytes):
        self._resident += nbytes
        self._stats["peak_resident_bytes"] = max(self._stats["peak_resident_bytes"], self._resident)

    def _account(self, block=False, oldest=None):
        """Adds the copy and stall times of finished copies (GPU copies are timed by events); with `oldest`,
        settles (blocking) only that many of the oldest pending copies, which finished long ago."""
        if oldest is not None:
            head, self._pending = self._pending[:oldest], self._pending[oldest:]
            for kind, copy in head:
                self._stats[kind] += copy.seconds
                if kind == "read_seconds":
                    self._stats["exposed_wait_seconds"] += copy.stall_seconds
            return
        still = []
        for kind, copy in self._pending:
            if block or copy.done():
                self._stats[kind] += copy.seconds
                if kind == "read_seconds":  # a GPU compute stream's wait, read from events (0 for files)
                    self._stats["exposed_wait_seconds"] += copy.stall_seconds
            else:
                still.append((kind, copy))
        self._pending = still

    # ---- pack ----

    def _keeps(self, t):
        return (t.layout != torch.strided or not self._store.accepts(t) or is_parameter_or_view(t)
                or t.untyped_storage().nbytes() < self.min_bytes)

    def _pack(self, t):
        with self._lock:
            if self._store is None:
                raise RuntimeError("SwapPrefetcher: the prefetcher was closed inside its own `with` block")
            self._reap_dead()
            self._poll_gpu_writes()
            if len(self._pending) > 1024:  # a long run without stats(): fold old copy timings into the totals
                self._account(oldest=512)
            if self._keeps(t):
                self._stats["bytes_kept"] += t.nbytes
                return t
            storage = t.untyped_storage()
            key = StorageWeakRef(storage).cdata
            entry = self._by_storage.get(key)
            if (entry is not None and not entry.dead and not entry.weak.expired() and entry.weak.cdata == key
                    and entry.version == t._version and entry.store is self._store):
                self._stats["views_deduplicated"] += 1
                self._order.remove(entry)
                entry.seq = self._take_seq()
            else:
                entry = _Entry(storage, self._store, t._version, self._take_seq())
                self._by_storage[key] = entry
                self._add_resident(entry.nbytes)
                self._stats["bytes_swapped"] += entry.nbytes
                self._stats["tensors_swapped"] += 1
                self._start_write(entry)
            self._order.append(entry)
            saved = _Saved(entry, t, self._dead)
            entry.handles.add(saved.key)
            entry.unconsumed.add(saved.key)
        if self.max_inflight_bytes is not None:
            self._throttle()
        return saved

    def _throttle(self):
        """Waits (outside the lock: the I/O thread needs it to land a write) for the oldest writes until no
        more than `max_inflight_bytes` are still being copied out."""
        while True:
            with self._lock:
                if self._writing_bytes <= self.max_inflight_bytes:
                    return
                if self.store_kind == "file":
                    self._file_writing = [w for w in self._file_writing if not w.done()]
                    oldest = self._file_writing[0] if self._file_writing else None
                else:
                    oldest = self._gpu_writing[0][1] if self._gpu_writing else None
            if oldest is None:
                return
            start = time.perf_counter()
            if self.store_kind == "file":
                oldest.wait()
            else:
                oldest.end.synchronize()
            with self._lock:
                self._stats["forward_wait_seconds"] += time.perf_counter() - start
                self._poll_gpu_writes()

    def _start_write(self, entry):
        self._writing_bytes += entry.nbytes
        if self.store_kind == "file":
            landed = weakref.WeakMethod(self._write_landed)  # the I/O thread must not keep the prefetcher alive

            def on_done(copy, entry=entry):
                method = landed()
                if method is not None:
                    method(entry, copy)

            entry.slot, copy = self._store.write(entry.storage, on_done)
            self._file_writing = [w for w in self._file_writing if not w.done()] + [copy]
        else:
            entry.slot, copy = self._store.write(entry.storage)
            self._gpu_writing.append((entry, copy))
        self._stats["peak_store_bytes"] = max(self._stats["peak_store_bytes"], self._store_bytes())
        return copy

    def _store_bytes(self):
        return self._store.file_bytes() if self.store_kind == "file" else self._store.pinned_bytes

    def _poll_gpu_writes(self):
        still = []
        for entry, copy in self._gpu_writing:
            if copy.done():
                self._write_landed(entry, copy)
            else:
                still.append((entry, copy))
        self._gpu_writing = still

    def _release(self, entry):
        """Drops the prefetcher's reference to an entry's storage (freeing it unless autograd still uses it)."""
        if entry.storage is not None:
            entry.storage = None
            if entry.store is self._store:
                self._resident -= entry.nbytes

    def _write_landed(self, entry, copy):
        with self._lock:
            self._stats["write_seconds"] += copy.seconds
            if entry.store is self._store:
                self._writing_bytes -= entry.nbytes
            if entry.dead:
                self._release(entry)
                if entry.store is self._store:
                    entry.store.free(entry.slot)
                return
            if entry.state != WRITING:
                return
            if entry.want:
                entry.state, entry.want = LOADED, False
            else:
                entry.state = STORED
                self._release(entry)  # the copy has landed: free the memory

    # ---- unpack ----

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        entry = saved.entry
        with self._lock:
            if entry.dead or entry.store is not self._store:
                raise RuntimeError("SwapPrefetcher: a saved tensor was swapped by a prefetcher that has since been "
                                   "closed; run backward before close() (or before leaving `with` on an error)")
            self._poll_gpu_writes()
            if entry.consumed_round == self._round:  # unpacked again after it was used up: a new backward pass
                self._round += 1
            copy = None
            if entry.state == WRITING:
                entry.want = True
            elif entry.state == STORED:
                self._start_read(entry)
            if entry.state == READING:
                copy = entry.read_copy
            storage = entry.storage
            self._prefetch_before(entry)
        if copy is not None:
            waited = copy.wait()
            with self._lock:
                self._stats["exposed_wait_seconds"] += waited
                if entry.state == READING and entry.read_copy is copy:
                    entry.state = LOADED
        out = torch.empty(0, dtype=saved.dtype, device=storage.device).set_(
            storage, saved.offset, saved.size, saved.stride)
        with self._lock:
            self._consume(entry, saved.key)
        return out

    def _start_read(self, entry):
        entry.storage, entry.read_copy = self._store.read(entry.slot)
        entry.state = READING
        self._stats["bytes_read"] += entry.nbytes
        self._pending.append(("read_seconds", entry.read_copy))
        self._add_resident(entry.nbytes)

    def _prefetch_before(self, entry):
        """Starts bringing in the next `prefetch_depth` storages that backward will need after this one."""
        if self.prefetch_depth == 0:
            return
        started = 0
        for i in range(self._order.index(entry) - 1, -1, -1):
            other = self._order[i]
            if other.consumed_round == self._round:
                continue
            if other.state == STORED:
                self._start_read(other)
            elif other.state == WRITING:
                other.want = True
            started += 1
            if started == self.prefetch_depth:
                return

    def _consume(self, entry, handle_id):
        entry.unconsumed.discard(handle_id)
        if entry.unconsumed:
            return
        entry.consumed_round = self._round
        entry.unconsumed = set(entry.handles)  # a retained graph may unpack them all again
        self._drop(entry)

    def _drop(self, entry):
        if entry.state == WRITING:
            entry.want = False  # released when its copy lands
        elif entry.state in (LOADED, READING) and entry.storage is not None:
            if entry.state == READING and self.store_kind == "file":
                entry.read_copy.wait()  # the I/O thread still writes into it
            entry.state = STORED
            entry.read_copy = None
            self._release(entry)

    def _reap_dead(self):
        """Frees the entries whose saved views autograd has let go of."""
        while self._dead:
            entry, handle_id = self._dead.popleft()
            entry.handles.discard(handle_id)
            entry.unconsumed.discard(handle_id)
            if entry.handles or entry.dead:
                if entry.handles and not entry.unconsumed:
                    entry.unconsumed = set(entry.handles)
                continue
            entry.dead = True
            if entry in self._order:
                self._order.remove(entry)
            if self._by_storage.get(entry.weak.cdata) is entry:
                del self._by_storage[entry.weak.cdata]
            if entry.store is not self._store:
                continue
            if entry.state == WRITING:
                continue  # released, and the slot freed, when the write lands (_write_landed sees `dead`)
            if self.store_kind == "pinned":
                entry.store.free(entry.slot, pending=entry.read_copy)
            else:
                if entry.read_copy is not None:
                    entry.read_copy.wait()
                entry.store.free(entry.slot)
            self._release(entry)
