"""DDP communication hooks built on sketch_allreduce.

    state = SketchState(ratio=0.05)
    ddp.register_comm_hook(state, sketch_hook)

Each bucket is reduced with sketch_allreduce(mode=state.mode), averaged: per row when the bucket holds a
single 2-D parameter (an embedding in its own bucket), per element otherwise. Whether a
bucket goes dense, exact or sketched is decided after the bitmap exchange, from the union's size, so every
rank takes the same path. The hash seed changes per (bucket, step), identically on every rank, so the same
coordinates do not collide step after step.

A bucket whose last call summed exactly by gathering each rank's own rows sends its next call's header in that
gather (sketch_allreduce's Channel, one per bucket index): one collective per call instead of two.

With dense_hook set, buckets that hold neither a sparse gradient nor one 2-D parameter alone (those the hook would
reduce per element: biases, norms, a bucket of several layers) go to that hook instead (e.g. torch's allreduce_hook,
fp16_compress_hook or powerSGD_hook), without the bitmap exchange; it is called on the backward thread in both
modes, over the group its own state names, and the other buckets are then reduced over a group of the state's own
(see SketchState.sketch_group), beside the dense hook's collectives instead of behind them.

With background=True the hook returns at once and the bucket's whole reduction (header, union, payload,
write-back) runs on a thread of the state's own, one bucket at a time in bucket order, over a process group of its
own: the header's collective no longer holds up backward.
"""
import dataclasses
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fastdist.comm.sketch import Channel, ExactTimings, sketch_allreduce, sketch_width
from fastdist.comm.wire import ring_allreduce_bytes
from fastdist.distributed.fingerprint import CallCounter, check_same, fingerprint


@dataclasses.dataclass
class BucketState:
    """What the hook counts per bucket index; re-created when DDP rebuilds its buckets (the size changes)."""
    numel: int
    dtype: str
    calls: int = 0
    last_method: str = ""   # "dense", "exact", "sketch", or "sketch+ef" when error feedback was applied
    ef_calls: int = 0       # calls that applied error feedback (a sketch narrower than the union skips it)
    wire_bytes: int = 0
    dense_wire_bytes: int = 0
    folded_calls: int = 0   # calls whose header rode in the gather of own rows (see sketch_allreduce's Channel)
    parameters: tuple = ()  # the bucket's parameters, by their numbers (see SketchState.parameter_key)


class _ParameterNumbers:
    """Numbers parameters in the order the hook first meets them. That is DDP's first layout of its buckets, made
    from the model's registration order alike in every process and again in a resumed run (DDP rebuilds the buckets
    only after its first backward), so a parameter has the same number on every rank and after a restart, whatever
    DDP's later layouts."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple] = {}  # id(parameter) -> (weak reference, number)
        self._next = 0

    def number(self, p: torch.Tensor) -> int:
        entry = self._by_id.get(id(p))
        if entry is None or entry[0]() is not p:  # new, or another tensor at a freed one's address
            entry = self._by_id[id(p)] = (weakref.ref(p), self._next)
            self._next += 1
        return entry[1]


class SketchState:
    """Configuration and per-bucket state of sketch_hook. Pickles without its process group.

    Error-feedback residuals belong to the bucket's parameters, not to its index: DDP rebuilds its buckets after
    the first backward (and in every resumed run), reordering parameters within a bucket and buckets among
    themselves. A residual is keyed by the bucket's parameter numbers (see `parameter_key`) and lives in the sketch
    of the bucket's gradient laid out in that key's order, so it always meets the elements it was made from.

    Besides the buckets it holds `exact_timings`, the ExactTimings its sketch_allreduce calls decide the exact
    collective with: measurements of this process, so neither saved nor pickled (a restored state measures afresh).

    The ranks' configurations, steps and call counts are checked against each other at the first hook call (and
    again after load_state_dict), before any collective that depends on them; every later call checks its settings
    and its bucket's parameters in sketch_allreduce's header. A mismatch raises MismatchError on every rank, naming
    the field, also with background=True (raised from backward once the step's reductions are done).

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
        lossless_slack: mode "auto": see sketch_allreduce.
        max_sketch_load: mode "auto": see sketch_allreduce.
        dense_hook: a DDP comm hook, called as dense_hook(dense_state, bucket), for the buckets the hook would
            reduce per element (see the module docstring); None: those go through sketch_allreduce too. Checked
            across ranks by its qualified name.
        dense_state: the state dense_hook is called with (e.g. torch's PowerSGDState); pickled with this state.
    """

    _CONFIG = ("ratio", "rows", "seed", "mode", "density_threshold", "start_iter", "error_feedback",
               "exact_collective", "background", "lossless_slack", "max_sketch_load", "dense_hook")
    _DEFAULTS = {"background": False, "lossless_slack": 2.0, "max_sketch_load": 1.0,  # states saved before them
                 "dense_hook": None}
    _RESIDUAL_SPACE = ("ratio", "rows", "seed", "error_feedback")  # what a saved residual is only valid under

    def __init__(self, process_group: dist.ProcessGroup | None = None, ratio: float = 0.05, rows: int = 3,
                 seed: int = 0, mode: str = "auto", density_threshold: float = 0.5, start_iter: int = 0,
                 error_feedback: bool = False, exact_collective: str = "auto", background: bool = False,
                 lossless_slack: float = 2.0, max_sketch_load: float = 1.0,
                 dense_hook: Callable[[Any, dist.GradBucket], torch.futures.Future] | None = None,
                 dense_state: Any = None) -> None:
        self.process_group = process_group
        self.ratio, self.rows, self.seed, self.mode = float(ratio), int(rows), int(seed), mode
        self.density_threshold, self.start_iter = float(density_threshold), int(start_iter)
        self.error_feedback = bool(error_feedback)
        self.exact_collective = exact_collective
        self.background = bool(background)
        self.lossless_slack, self.max_sketch_load = float(lossless_slack), float(max_sketch_load)
        if dense_hook is not None and not callable(dense_hook):
            raise TypeError(f"SketchState: dense_hook must be a DDP comm hook (a callable), got {dense_hook!r}")
        self.dense_hook, self.dense_state = dense_hook, dense_state
        self._reset()

    def _reset(self):
        self.iter = 0
        self.calls = CallCounter()  # sketched hook calls: the step number each one's header carries
        self.buckets = {}
        self.residuals = {}  # parameter key -> residual sketch
        self.exact_timings = ExactTimings()
        self.channels = {}  # bucket index -> Channel: what the bucket's last call agreed for its next
        self._numbers = _ParameterNumbers()
        self._worker = None
        self._own_group = None  # with dense_hook on the backward thread: see sketch_group()
        self._checked = False  # whether the ranks' configurations have been checked since construction or restore

    def config(self) -> dict:
        """The settings every rank must share: {name: value} of the constructor's arguments but the group and
        dense_state (dense_hook by its qualified name)."""
        return {k: _hook_name(self.dense_hook) if k == "dense_hook" else getattr(self, k) for k in self._CONFIG}

    def bucket_state(self, index: int, buffer: torch.Tensor) -> BucketState:
        """The state of bucket `index`, new when the bucket is new or DDP rebuilt it with another size or dtype."""
        state = self.buckets.get(index)
        if state is None or state.numel != buffer.numel() or state.dtype != str(buffer.dtype):
            state = self.buckets[index] = BucketState(buffer.numel(), str(buffer.dtype))
        return state

    def parameter_key(self, params: list) -> tuple:
        """The bucket's parameters as their numbers (see _ParameterNumbers), in increasing order: the key of its
        residual and its hash seed, the same whatever DDP's layout of the bucket."""
        return tuple(sorted(self._numbers.number(p) for p in params))

    def seed_for(self, key: tuple, step: int) -> int:
        """The hash seed of the bucket whose parameter key is `key` at a step, the same on every rank, in
        [0, 2^62): fixed per bucket with error feedback (the residual lives in one hash space), else new every
        step."""
        return fingerprint((self.seed, key, 0 if self.error_feedback else step)) & ((1 << 62) - 1)

    def residual_for(self, key: tuple, numel: int, device: torch.device) -> torch.Tensor | None:
        """The error-feedback residual of the bucket with parameter key `key` ([rows, sketch width], zeros at
        first), or None without feedback."""
        if not self.error_feedback:
            return None
        if key not in self.residuals:
            cols = sketch_width(numel, self.ratio)
            self.residuals[key] = torch.zeros(self.rows, cols, dtype=torch.float32, device=device)
        return self.residuals[key]

    def stats(self) -> dict[int, dict]:
        """Per-bucket totals: calls, last method, wire bytes vs a dense all-reduce, the bucket's parameters."""
        return {i: dataclasses.asdict(s) for i, s in sorted(self.buckets.items())}

    def state_dict(self) -> dict:
        """The configuration, the step and call counts, every bucket's totals and every residual."""
        return {**self.config(), "iter": self.iter, "calls": self.calls.state_dict(), "buckets": self.stats(),
                "residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        """Restores the step and call counts, the totals and the residuals of what state_dict() returned.

        The configuration stays this state's: a saved one that differs is named in a warning, and the residuals
        are then restored only if it agrees on what they depend on (ratio, rows, seed, error_feedback). The ranks
        check each other again at the next hook call.
        """
        saved, mine = {k: state.get(k, self._DEFAULTS.get(k)) for k in self._CONFIG}, self.config()
        differing = [k for k in self._CONFIG if saved[k] != mine[k]]
        residuals = {tuple(k): v for k, v in state.get("residuals", {}).items()}
        if any(k in differing for k in self._RESIDUAL_SPACE):
            residuals = {}
        if differing:
            warnings.warn(f"SketchState.load_state_dict keeps this state's configuration; the saved one differs in "
                          f"{', '.join(f'{k}={saved[k]!r}' for k in differing)}"
                          + ("; its residuals are not restored" if not residuals and state.get("residuals") else ""),
                          stacklevel=2)
        self.iter = int(state["iter"])
        self.calls.load_state_dict(state.get("calls", {"calls": 0}))
        # a state saved before residuals were keyed by parameters held them per bucket index: not restorable
        self.buckets = {int(i): BucketState(**{k: v for k, v in b.items() if k != "residual"})
                        for i, b in state["buckets"].items()}
        self.residuals = residuals
        self.channels = {}
        self._checked = False

    def __getstate__(self):
        return {**self.state_dict(), "dense_hook": self.dense_hook, "dense_state": self.dense_state}

    def __setstate__(self, state):
        self.process_group = None
        for k in self._CONFIG:
            setattr(self, k, state.get(k, self._DEFAULTS.get(k)))
        self.dense_state = state.get("dense_state")
        self._reset()
        self.load_state_dict({**state, "dense_hook": _hook_name(self.dense_hook)})

    def sketch_group(self) -> dist.ProcessGroup | None:
        """The group the backward-thread hook reduces sketch buckets over: with dense_hook, a group of the state's
        own over every rank (created at the first hook call, like the background reducer's), so that a bucket's
        collectives do not queue behind the dense hook's on the same group; else (or when process_group does not
        span every rank) process_group."""
        if self.dense_hook is None or self.background:
            return self.process_group
        if self._own_group is None:
            world = dist.get_world_size()
            if self.process_group is not None and dist.get_world_size(self.process_group) != world:
                return self.process_group
            self._own_group = dist.new_group(ranks=list(range(world)))
        return self._own_group

    def worker(self) -> "_BackgroundReducer":
        """The background reducer, created at first use (see `background`)."""
        if self._worker is None:
            self._worker = _BackgroundReducer(self.process_group)
        return self._worker

    def _check_ranks(self):
        """At the first hook call since construction or restore: every rank has the same settings, step and call
        count, before anything that depends on them (the warm-up's all-reduce, the background group) runs."""
        if not self._checked:
            check_same("SketchState", {**self.config(), "iter": self.iter, "calls": self.calls.calls},
                       self.process_group)
            self._checked = True
            self.sketch_group()  # every rank at the same point: its first hook call


def _hook_name(hook) -> str | None:
    """A comm hook as the ranks compare it: its qualified name (functools.partial: its function's)."""
    if hook is None:
        return None
    fn = getattr(hook, "func", hook)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


class _BackgroundReducer:
    """Runs submitted reductions one at a time, in submission order, on its own daemon thread, over its own process
    group. DDP hands buckets over in the same order on every rank, so every rank issues the same collectives in
    the same order on that group, and none of them interleaves with collectives issued elsewhere.

    A reduction that raises (a MismatchError: on every rank at the same bucket) resolves its future to the
    unreduced bucket, since DDP cannot take an exception through a future, and the rest of the step's reductions
    are skipped alike on every rank; the exception itself is raised from backward, at its end (see `watch`)."""

    def __init__(self, process_group):
        world = dist.get_world_size()
        if process_group is not None and dist.get_world_size(process_group) != world:
            raise ValueError("SketchState(background=True) needs process_group to span every rank "
                             f"({dist.get_world_size(process_group)} of {world})")
        self.group = dist.new_group(ranks=list(range(world)))
        self._tasks = queue.SimpleQueue()
        self._error = None
        self._watching = False
        threading.Thread(target=self._run, name="fastdist-sketch-hook", daemon=True).start()

    def submit(self, fn, fallback):
        """A torch Future of fn(), run after every earlier submission; of `fallback` once a reduction failed."""
        fut = torch.futures.Future()
        self._tasks.put((fn, fallback, fut))
        return fut

    def watch(self):
        """Once per backward pass: raise a failed reduction's exception, with its own type and message, from the
        end of backward (an autograd final callback, which runs after DDP has waited for every bucket)."""
        if not self._watching:
            self._watching = True
            torch.autograd.Variable._execution_engine.queue_callback(self._raise_error)

    def _raise_error(self):
        self._watching = False
        self.submit(lambda: None, None).wait()  # the step's reductions are done
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self):
        while True:
            fn, fallback, fut = self._tasks.get()
            if self._error is not None:
                fut.set_result(fallback)
                continue
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - raised from backward by _raise_error
                self._error = e
                fut.set_result(fallback)


def _canonical_layout(params, buffer, key_order):
    """(view, write_back) of a dense bucket laid out in its parameter key's order: the buffer itself when DDP's
    layout already is, else a reordered copy and the function that writes it back into the buffer."""
    if key_order == sorted(key_order) or buffer.is_sparse:
        return buffer, None
    sizes = [p.numel() for p in params]
    if sum(sizes) != buffer.numel():
        raise RuntimeError(f"sketch_hook: a bucket of {buffer.numel()} values holds parameters of {sum(sizes)}")
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    order = sorted(range(len(params)), key=lambda i: key_order[i])
    view = torch.cat([buffer[offsets[i]:offsets[i + 1]] for i in order])

    def write_back():
        for i, chunk in zip(order, view.split([sizes[i] for i in order])):
            buffer[offsets[i]:offsets[i + 1]].copy_(chunk)

    return view, write_back


def _dense_hook_call(state, bucket, bucket_state):
    """A bucket handed to state.dense_hook: counted in the bucket's totals (method "hook", ring model bytes of a
    dense all-reduce for both, since the hook's own bytes are not known here)."""
    buffer = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    nbytes = ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world)
    bucket_state.calls += 1
    bucket_state.last_method = "hook"
    bucket_state.wire_bytes += nbytes
    bucket_state.dense_wire_bytes += nbytes
    return state.dense_hook(state.dense_state, bucket)


def sketch_hook(state: SketchState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: averages the bucket with sketch_allreduce; returns a future of the buffer (of the reduced
    sparse gradient for a sparse bucket, e.g. nn.Embedding(sparse=True), which is never densified)."""
    state._check_ranks()
    buffer, index, step = bucket.buffer(), bucket.index(), state.iter
    if bucket.is_last():
        state.iter += 1
    if step < state.start_iter:
        world = dist.get_world_size(state.process_group)
        work = dist.all_reduce(buffer.div_(world), group=state.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    bucket_state = state.bucket_state(index, buffer)
    params = bucket.parameters()
    key = state.parameter_key(params)
    bucket_state.parameters = key
    by_row = buffer.is_sparse or (len(params) == 1 and params[0].dim() == 2)
    if state.dense_hook is not None and not by_row:
        return _dense_hook_call(state, bucket, bucket_state)
    write_back = None
    if buffer.is_sparse:  # nn.Embedding(sparse=True): DDP hands over the row-sparse gradient itself
        view, granularity = buffer, "row"
    elif len(params) == 1 and params[0].dim() == 2:  # e.g. an embedding alone in its bucket: support per row
        view, granularity = buffer.view(params[0].shape), "row"
    elif state.error_feedback:  # the residual's coordinates are those of the key's layout, not DDP's current one
        view, write_back = _canonical_layout(params, buffer, [state._numbers.number(p) for p in params])
        granularity = "element"
    else:
        view, granularity = buffer, "element"
    kwargs = dict(ratio=state.ratio, rows=state.rows, seed=state.seed_for(key, step), granularity=granularity,
                  mode=state.mode, op="avg", dense_fraction=state.density_threshold,
                  lossless_slack=state.lossless_slack, max_sketch_load=state.max_sketch_load,
                  residual=state.residual_for(key, buffer.numel(), buffer.device),
                  exact_collective=state.exact_collective, timings=state.exact_timings, step=state.calls.take(),
                  channel=state.channels.setdefault(index, Channel()),
                  agreed={"iter": step, "bucket parameters": key,
                          **{k: getattr(state, k) for k in ("density_threshold", "start_iter", "error_feedback",
                                                            "background")}})

    def record(stats, result):
        if write_back is not None:
            write_back()
        bucket_state.calls += 1
        bucket_state.last_method = stats.method + ("+ef" if stats.error_feedback else "")
        bucket_state.ef_calls += int(stats.error_feedback)
        bucket_state.folded_calls += int(stats.union_method == "folded")
        bucket_state.wire_bytes += stats.wire_bytes
        bucket_state.dense_wire_bytes += stats.dense_wire_bytes
        return result if buffer.is_sparse else buffer  # sparse: a new tensor holding U's rows

    if state.background:
        worker = state.worker()
        worker.watch()

        def reduce():
            handle = sketch_allreduce(view, group=worker.group, async_op=True, **kwargs)
            result = handle.result()
            return record(handle.stats, result)

        return worker.submit(reduce, buffer)
    handle = sketch_allreduce(view, group=state.sketch_group(), async_op=True, **kwargs)
    return handle.get_future().then(lambda fut: record(handle.stats, fut.value()))
