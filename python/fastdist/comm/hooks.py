"""DDP communication hooks built on sketch_allreduce.

    state = SketchState(ratio=0.05)
    ddp.register_comm_hook(state, sketch_hook)

Each bucket is reduced with sketch_allreduce(mode=state.mode), averaged: per row when the bucket holds a
single 2-D parameter (an embedding in its own bucket), per element otherwise. Whether a
bucket goes dense, exact or sketched is decided after the bitmap exchange, from the union's size, so every
rank takes the same path. The hash seed changes per (bucket, step), identically on every rank, so the same
coordinates do not collide step after step.

With background=True the hook returns at once and the bucket's whole reduction (header, union, payload,
write-back) runs on a thread of the state's own, one bucket at a time in bucket order, over a process group of its
own: the header's collective no longer holds up backward.
"""
import dataclasses
import queue
import threading

import torch
import torch.distributed as dist

from fastdist.comm.sketch import ExactTimings, sketch_allreduce, sketch_width
from fastdist.distributed.fingerprint import fingerprint


@dataclasses.dataclass
class BucketState:
    """What the hook keeps per bucket; re-created when DDP rebuilds its buckets (the size changes)."""
    numel: int
    dtype: str
    calls: int = 0
    last_method: str = ""   # "dense", "exact", "sketch", or "sketch+ef" when error feedback was applied
    ef_calls: int = 0       # calls that applied error feedback (a sketch narrower than the union skips it)
    wire_bytes: int = 0
    dense_wire_bytes: int = 0
    residual: torch.Tensor = None  # the error-feedback sketch (error_feedback=True only)


class SketchState:
    """Configuration and per-bucket state of sketch_hook. Pickles without its process group.

    Besides the buckets it holds `exact_timings`, the ExactTimings its sketch_allreduce calls decide the exact
    collective with: measurements of this process, so neither saved nor pickled (a restored state measures afresh).

    Args:
        process_group: the group to reduce over (None: the default group).
        ratio: sketch width as a fraction of the bucket's elements.
        rows: sketch rows.
        seed: base hash seed.
        mode: "auto" (default), "sketch" or "exact" (see sketch_allreduce).
        density_threshold: a bucket whose union covers at least this fraction of its units is all-reduced densely.
        start_iter: plain all-reduce for the first start_iter steps (dense warm-up, as PowerSGD does).
        error_feedback: keep a residual sketch per bucket (FetchSGD-style, see sketch_allreduce); the hash seed then
            stays fixed per bucket instead of changing every step.
        exact_collective: how the lossless path sums the union (see sketch_allreduce).
        background: reduce buckets on a thread and a process group of the state's own (see the module docstring);
            the group is created at the first hook call, a collective of every rank of the default group, so
            process_group must be the default group or span every rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, ratio: float = 0.05, rows: int = 3,
                 seed: int = 0, mode: str = "auto", density_threshold: float = 0.5, start_iter: int = 0,
                 error_feedback: bool = False, exact_collective: str = "auto", background: bool = False) -> None:
        self.process_group = process_group
        self.ratio, self.rows, self.seed, self.mode = float(ratio), int(rows), int(seed), mode
        self.density_threshold, self.start_iter = float(density_threshold), int(start_iter)
        self.error_feedback = bool(error_feedback)
        self.exact_collective = exact_collective
        self.background = bool(background)
        self.iter = 0
        self.buckets = {}
        self.exact_timings = ExactTimings()
        self._worker = None

    def bucket_state(self, index: int, buffer: torch.Tensor) -> BucketState:
        """The state of bucket `index`, new when the bucket is new or DDP rebuilt it with another size or dtype."""
        state = self.buckets.get(index)
        if state is None or state.numel != buffer.numel() or state.dtype != str(buffer.dtype):
            state = self.buckets[index] = BucketState(buffer.numel(), str(buffer.dtype))
        return state

    def seed_for(self, index: int, step: int) -> int:
        """The hash seed of a bucket at a step, the same on every rank, in [0, 2^62): fixed per bucket with
        error feedback (the residual lives in one hash space), else new every step."""
        return fingerprint((self.seed, index, 0 if self.error_feedback else step)) & ((1 << 62) - 1)

    def residual_for(self, bucket_state: BucketState, buffer: torch.Tensor) -> torch.Tensor | None:
        """The bucket's error-feedback residual ([rows, sketch width], zeros at first), or None without feedback."""
        if not self.error_feedback:
            return None
        if bucket_state.residual is None:
            cols = sketch_width(buffer.numel(), self.ratio)
            bucket_state.residual = torch.zeros(self.rows, cols, dtype=torch.float32, device=buffer.device)
        return bucket_state.residual

    def stats(self) -> dict[int, dict]:
        """Per-bucket totals: calls, last method, wire bytes vs a dense all-reduce."""
        return {i: {k: v for k, v in dataclasses.asdict(s).items() if k != "residual"}
                for i, s in sorted(self.buckets.items())}

    _CONFIG = ("ratio", "rows", "seed", "mode", "density_threshold", "start_iter", "error_feedback",
               "exact_collective", "background", "iter")

    def state_dict(self) -> dict:
        """The configuration, the step count and every bucket's totals and residual."""
        buckets = {i: dict(s, residual=self.buckets[i].residual) for i, s in self.stats().items()}
        return {**{k: getattr(self, k) for k in self._CONFIG}, "buckets": buckets}

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict() returned (a state saved before `background` existed loads as False)."""
        for key in self._CONFIG:
            setattr(self, key, state.get(key, False) if key == "background" else state[key])
        self.buckets = {int(i): BucketState(**b) for i, b in state["buckets"].items()}

    def __getstate__(self):
        return self.state_dict()

    def __setstate__(self, state):
        self.process_group = None
        self.buckets = {}
        self.exact_timings = ExactTimings()
        self._worker = None
        self.load_state_dict(state)

    def worker(self) -> "_BackgroundReducer":
        """The background reducer, created at first use (see `background`)."""
        if self._worker is None:
            self._worker = _BackgroundReducer(self.process_group)
        return self._worker


class _BackgroundReducer:
    """Runs submitted reductions one at a time, in submission order, on its own daemon thread, over its own process
    group. DDP hands buckets over in the same order on every rank, so every rank issues the same collectives in
    the same order on that group, and none of them interleaves with collectives issued elsewhere."""

    def __init__(self, process_group):
        world = dist.get_world_size()
        if process_group is not None and dist.get_world_size(process_group) != world:
            raise ValueError("SketchState(background=True) needs process_group to span every rank "
                             f"({dist.get_world_size(process_group)} of {world})")
        self.group = dist.new_group(ranks=list(range(world)))
        self._tasks = queue.SimpleQueue()
        threading.Thread(target=self._run, name="fastdist-sketch-hook", daemon=True).start()

    def submit(self, fn):
        """A torch Future of fn(), run after every earlier submission."""
        fut = torch.futures.Future()
        self._tasks.put((fn, fut))
        return fut

    def _run(self):
        while True:
            fn, fut = self._tasks.get()
            try:
                fut.set_result(fn())
            except Exception as e:  # reaches the caller through the future (DDP re-raises it)
                fut.set_exception(e)


def sketch_hook(state: SketchState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: averages the bucket with sketch_allreduce; returns a future of the buffer (of the reduced
    sparse gradient for a sparse bucket, e.g. nn.Embedding(sparse=True), which is never densified)."""
    buffer, index, step = bucket.buffer(), bucket.index(), state.iter
    if bucket.is_last():
        state.iter += 1
    if step < state.start_iter:
        world = dist.get_world_size(state.process_group)
        work = dist.all_reduce(buffer.div_(world), group=state.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    bucket_state = state.bucket_state(index, buffer)
    params = bucket.parameters()
    if buffer.is_sparse:  # nn.Embedding(sparse=True): DDP hands over the row-sparse gradient itself
        view, granularity = buffer, "row"
    elif len(params) == 1 and params[0].dim() == 2:  # e.g. an embedding alone in its bucket: support per row
        view, granularity = buffer.view(params[0].shape), "row"
    else:
        view, granularity = buffer, "element"
    kwargs = dict(ratio=state.ratio, rows=state.rows, seed=state.seed_for(index, step), granularity=granularity,
                  mode=state.mode, op="avg", dense_fraction=state.density_threshold,
                  residual=state.residual_for(bucket_state, buffer), exact_collective=state.exact_collective,
                  timings=state.exact_timings)

    def record(stats, result):
        bucket_state.calls += 1
        bucket_state.last_method = stats.method + ("+ef" if stats.error_feedback else "")
        bucket_state.ef_calls += int(stats.error_feedback)
        bucket_state.wire_bytes += stats.wire_bytes
        bucket_state.dense_wire_bytes += stats.dense_wire_bytes
        return result if buffer.is_sparse else buffer  # sparse: a new tensor holding U's rows

    if state.background:
        worker = state.worker()

        def reduce():
            handle = sketch_allreduce(view, group=worker.group, async_op=True, **kwargs)
            result = handle.result()
            return record(handle.stats, result)

        return worker.submit(reduce)
    handle = sketch_allreduce(view, group=state.process_group, async_op=True, **kwargs)
    return handle.get_future().then(lambda fut: record(handle.stats, fut.value()))
