"""calibrate(): the copy engine's measured bandwidth and latency, the only machine numbers the planner uses.

File store (CPU): pwrite/pread through the store's own I/O threads, timed from submission to landing, so
the thread hand-off is part of the latency. Pinned store (GPU): D2H/H2D into pinned buffers on the side
streams, timed by CUDA events. Each direction is fitted as t(n) = latency + n / bandwidth by least squares
over the medians of a few sizes. Results are cached per (store, device, path).
"""
import dataclasses
import statistics
import time

import torch

from fastdist.memory.store import FileStore, PinnedStore

_CACHE = {}
DEFAULT_SIZES = (1 << 20, 4 << 20, 16 << 20)


@dataclasses.dataclass(frozen=True)
class CopyModel:
    """t(n) = latency + n / bandwidth for writes (out of device memory) and reads (back in); seconds, bytes/s."""

    kind: str
    write_bandwidth: float
    write_latency: float
    read_bandwidth: float
    read_latency: float
    samples: tuple = ()  # (direction, bytes, [seconds...]) as measured

    def write_seconds(self, nbytes: float, count: int = 1) -> float:
        """Seconds to copy ``nbytes`` out in ``count`` copies."""
        return count * self.write_latency + nbytes / self.write_bandwidth

    def read_seconds(self, nbytes: float, count: int = 1) -> float:
        """Seconds to copy ``nbytes`` back in ``count`` copies."""
        return count * self.read_latency + nbytes / self.read_bandwidth

    def to_dict(self) -> dict:
        """The model as plain data (JSON-able)."""
        d = dataclasses.asdict(self)
        d["samples"] = [[direction, nbytes, list(times)] for direction, nbytes, times in self.samples]  # as JSON
        return d


def _fit(points):
    """Least-squares latency and bandwidth from [(bytes, seconds)]; latency >= 0."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my / mx
    if slope <= 0:  # noise on a tiny range: fall back to the largest size's throughput
        slope = ys[-1] / xs[-1]
    latency = max(0.0, my - slope * mx)
    return 1.0 / slope, latency


def _time_file(store, nbytes, repeats):
    # Not fastdist.distributed.timing.time_fn: each read needs the slot its write just made (and frees it), and the
    # clock stops when the store's I/O thread has landed the copy, so write and read alternate in one loop.
    writes, reads = [], []
    src = torch.randn(nbytes // 4).untyped_storage()
    for _ in range(repeats):
        start = time.perf_counter()
        slot, copy = store.write(src, lambda c: None)
        copy.wait()
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        _, copy = store.read(slot)
        copy.wait()
        reads.append(time.perf_counter() - start)
        store.free(slot)
    return writes, reads


def _time_pinned(store, nbytes, repeats):
    writes, reads = [], []
    src = torch.empty(nbytes, dtype=torch.uint8, device=store.device).untyped_storage()
    for _ in range(repeats):
        slot, copy = store.write(src)
        writes.append(copy.seconds)
        _, copy = store.read(slot)
        reads.append(copy.seconds)
        store.free(slot)
    return writes, reads


def calibrate(store: str = "auto", path: str | None = None, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
              refresh: bool = False) -> CopyModel:
    """Measures (once per store/path, then cached) and returns the CopyModel of this machine's swap path.

    Args:
        store: ``"file"``, ``"pinned"`` or ``"auto"`` (pinned when CUDA is available).
        path: the file store's directory (default: the temp directory).
        sizes: the copy sizes timed, in bytes.
        repeats: timed copies per size and direction.
        refresh: measure again even if a model is cached.

    Raises:
        ValueError: an unknown store, or no size or repetition.
    """
    kind = ("pinned" if torch.cuda.is_available() else "file") if store == "auto" else store
    if kind not in ("pinned", "file"):
        raise ValueError(f"calibrate: store must be 'auto', 'pinned' or 'file', got {store!r}")
    if repeats < 1 or not sizes:
        raise ValueError("calibrate: needs at least one size and one repetition")
    key = (kind, torch.cuda.current_device() if kind == "pinned" else None, path)
    if key in _CACHE and not refresh:
        return _CACHE[key]
    engine = FileStore(path) if kind == "file" else PinnedStore()
    try:
        timer = _time_file if kind == "file" else _time_pinned
        timer(engine, min(sizes), 1)  # warm-up: first-touch of the file extent / pinned pool
        samples, write_points, read_points = [], [], []
        for nbytes in sorted(sizes):
            writes, reads = timer(engine, nbytes, repeats)
            samples += [("write", nbytes, tuple(writes)), ("read", nbytes, tuple(reads))]
            write_points.append((nbytes, statistics.median(writes)))
            read_points.append((nbytes, statistics.median(reads)))
    finally:
        engine.close()
    write_bw, write_lat = _fit(write_points)
    read_bw, read_lat = _fit(read_points)
    model = CopyModel(kind, write_bw, write_lat, read_bw, read_lat, tuple(samples))
    _CACHE[key] = model
    return model
