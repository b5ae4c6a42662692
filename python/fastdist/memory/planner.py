"""plan / apply / optimize: keep, swap or recompute each named segment of a model, under a memory budget.

A segment is a child module the user can name ("blocks.3"); recompute granularity is the segment because a
saved-tensor hook cannot recompute one tensor. `profile` runs one training step and records, per segment,
the bytes of the tensors autograd saves (each storage counted once), how many of those the prefetcher would
swap, the bytes of its inputs (what checkpointing keeps) and its forward time.

The planner predicts the peak of saved activation bytes (what autograd holds for backward) as

    residual: A (keep), A - W (swap), I (recompute)
    peak = max(end of forward: other + sum of residuals + one swapped storage in flight,
               backward at s: other + residuals before s + s's working set)
    working set of s: A (keep), A - W + prefetch window (swap), I + A (recompute)

(A: a segment's saved bytes, W: the part the prefetcher swaps, I: its input bytes; the prefetch window is the
(depth + 1) largest swapped storages of s and the segments before it) and the overhead as
sum_swap E + sum_recompute R, where R is the segment's forward time (one more forward in backward) and E the
exposed swap time of DELTA's director:

    E = max(0, write(W) - forward work after the segment) + max(0, read(W) - backward work of the next segment)

with write/read from the calibrated CopyModel. Policies:
  delta  filter: largest, stalest segments first (A x staleness); director: swap iff E < R, else recompute.
  dtr    filter: smallest R / (A x staleness) first; director: always recompute (DTR cannot swap).
  msps   filter: most bytes saved per second of overhead first (Capuchin); director: the cheaper action.
Segments are taken in filter order until the predicted peak fits the budget, once for every cap on the number
of swapped segments (a swap's prefetch window can make a budget unreachable that fewer swaps would meet); the
fitting candidate with the least predicted overhead wins. Feasibility: all swapped bytes
must be written within the forward pass and read within the backward pass at the calibrated bandwidth;
otherwise the swapped segments with the least advantage over recomputation are recomputed instead.
"""
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from fastdist.distributed.timing import sync
from fastdist.memory.calibrate import CopyModel, calibrate
from fastdist.memory.prefetcher import SwapPrefetcher, is_parameter_or_view

POLICIES = ("delta", "dtr", "msps")
ACTIONS = ("keep", "swap", "recompute")


@dataclasses.dataclass
class Segment:
    """What :func:`profile` measured of one segment (a named child module)."""
    name: str
    saved_bytes: int = 0  # A: every storage autograd saves inside the segment, once
    swappable_bytes: int = 0  # W: the part the prefetcher would swap (large, not parameters)
    swappable_sizes: list = dataclasses.field(default_factory=list)  # the swappable storages' bytes
    input_bytes: int = 0  # I: tensor inputs, which checkpointing keeps
    forward_seconds: float = 0.0


@dataclasses.dataclass
class Profile:
    """One training step of a model, as :func:`profile` measured it: its segments in forward order."""
    segments: list
    other_saved_bytes: int  # saved outside every segment (embeddings, head, loss): always kept
    forward_seconds: float
    backward_seconds: float

    @property
    def saved_bytes(self) -> int:
        """The bytes autograd saves in the step: every segment's and the rest."""
        return self.other_saved_bytes + sum(s.saved_bytes for s in self.segments)

    def to_dict(self) -> dict:
        """The profile as plain data (JSON-able)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Plan:
    """What to do with each segment, and what the planner predicts of it (see the module docstring)."""
    policy: str
    budget_bytes: int
    actions: dict  # segment name -> "keep" | "swap" | "recompute"
    predicted_peak_bytes: int
    unoptimized_peak_bytes: int
    predicted_overhead_seconds: float
    step_seconds: float
    fits: bool  # predicted peak <= budget
    min_bytes: int
    prefetch_depth: int
    store: str
    profile: Profile
    copy_model: dict
    notes: list = dataclasses.field(default_factory=list)
    floor_bytes: int = 0  # the lowest predicted peak any plan of this policy reaches (everything off-loaded)

    @property
    def reducible_bytes(self) -> int:
        """The saved bytes a plan can take off the unoptimized peak at most; the rest (saved outside every segment,
        such as the loss's logits, and what recomputing or swapping a segment still holds) no plan can reduce."""
        return max(self.unoptimized_peak_bytes - self.floor_bytes, 0)

    @property
    def predicted_overhead(self) -> float:
        """Predicted step-time overhead as a fraction of the unoptimized step."""
        return self.predicted_overhead_seconds / self.step_seconds if self.step_seconds else 0.0

    def segments_with(self, action: str) -> list[str]:
        """The segments whose action is ``action`` (``"keep"``, ``"swap"`` or ``"recompute"``), in model order."""
        return [name for name, a in self.actions.items() if a == action]

    def to_dict(self) -> dict:
        """The plan as plain data, with its predicted overhead."""
        d = dataclasses.asdict(self)
        d["predicted_overhead"] = self.predicted_overhead
        return d

    def state_dict(self) -> dict:
        """Plain data (JSON-able): a plan made once can be stored and installed again without re-profiling."""
        return self.to_dict()

    @classmethod
    def from_state_dict(cls, state: dict) -> "Plan":
        """The plan that ``state``, what :meth:`state_dict` returned, describes."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in state.items() if k in fields}
        prof = dict(values["profile"])
        prof["segments"] = [Segment(**seg) for seg in prof["segments"]]
        values["profile"] = Profile(**prof)
        return cls(**values)

    def summary(self) -> str:
        """One line: the actions' counts, the predicted peak against the budget, the predicted overhead."""
        counts = {a: len(self.segments_with(a)) for a in ACTIONS}
        return (f"{self.policy}: keep {counts['keep']}, swap {counts['swap']}, recompute {counts['recompute']}; "
                f"predicted peak {self.predicted_peak_bytes / 2**20:.1f} MiB of {self.budget_bytes / 2**20:.1f} MiB "
                f"budget (unoptimized {self.unoptimized_peak_bytes / 2**20:.1f} MiB), predicted overhead "
                f"{100 * self.predicted_overhead:.1f}%" + ("" if self.fits else
                                                            f" - DOES NOT FIT: no plan goes below "
                                                            f"{self.floor_bytes / 2**20:.1f} MiB (reducible "
                                                            f"{self.reducible_bytes / 2**20:.1f} MiB)"))


# ---- segments and profiling ----

def default_segments(model: torch.nn.Module) -> list[str]:
    """The children of the ModuleList/Sequential (with >= 2 children, below the model) that holds the most
    parameters, the shallower on a tie; else the top-level children: the blocks of a usual transformer or CNN."""
    best, best_key = None, None
    for name, module in model.named_modules():
        if module is model or not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        key = (sum(p.numel() for p in module.parameters()), -name.count("."))
        if best_key is None or key > best_key:
            best, best_key = name, key
    if best is None:
        return [n for n, _ in model.named_children()]
    return [f"{best}.{n}" for n, _ in model.get_submodule(best).named_children()]


def _check_segments(model, names):
    if not names:
        raise ValueError("plan: the model has no segments (child modules); name some with segments=[...]")
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"plan: segment {name!r} is not a submodule of the model") from e
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"plan: segments must not nest, but {b!r} is inside {a!r}")
    if len(set(names)) != len(names):
        raise ValueError("plan: a segment is named twice")


def _as_args(batch):
    return batch if isinstance(batch, tuple) else (batch,)


def _default_loss(output):
    if isinstance(output, (tuple, list)):
        output = output[0]
    return output.float().square().mean()


def _tensor_bytes(values):
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.nbytes
        elif isinstance(v, (tuple, list)):
            total += _tensor_bytes(v)
    return total


def profile(model: torch.nn.Module, example_batch: torch.Tensor | tuple, segments: list[str] | None = None,
            loss_fn: Callable[[object], torch.Tensor] | None = None, min_bytes: int = 1 << 20, warmup: int = 1,
            repeats: int = 3) -> Profile:
    """Runs ``warmup`` + ``repeats`` training steps on ``example_batch`` and measures each segment (times:
    medians); leaves the model's gradients, buffers (e.g. batch-norm statistics) and the RNG as they were.

    Parameters (and views of them) saved by autograd are not counted: they are in memory anyway.

    Args:
        model: the model.
        example_batch: its input (a tuple: positional arguments).
        segments: names of non-nested submodules (default: :func:`default_segments`).
        loss_fn: output -> scalar loss (default: the mean square of the (first) output).
        min_bytes: storages from this size count as swappable.
        warmup: untimed steps first.
        repeats: timed steps; the saved bytes come from the first.

    Raises:
        ValueError: bad segments or ``repeats < 1``.
    """
    names = list(segments) if segments is not None else default_segments(model)
    _check_segments(model, names)
    if repeats < 1:
        raise ValueError(f"profile: repeats must be >= 1, got {repeats}")
    loss_fn = loss_fn or _default_loss
    args = _as_args(example_batch)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None  # backward would accumulate into the user's gradient tensors in place
    buffers = {b: b.detach().clone() for b in model.buffers()}
    stats = {name: Segment(name) for name in names}
    seconds = {name: [] for name in names}
    active = []
    counted = set()
    outside_segments_bytes = 0

    def pre(name):
        def hook(module, inputs):
            sync(device)
            active.append((name, time.perf_counter()))
            stats[name].input_bytes = _tensor_bytes(inputs)
        return hook

    def post(name):
        def hook(module, inputs, output):
            sync(device)
            _, start = active.pop()
            seconds[name].append(time.perf_counter() - start)
        return hook

    def pack(t):
        nonlocal outside_segments_bytes
        strided = t.layout == torch.strided
        key = StorageWeakRef(t.untyped_storage()).cdata if strided else id(t)
        if key in counted or is_parameter_or_view(t):
            return t
        counted.add(key)
        nbytes = t.untyped_storage().nbytes() if strided else t.nbytes
        if not active:
            outside_segments_bytes += nbytes
            return t
        seg = stats[active[-1][0]]
        seg.saved_bytes += nbytes
        if strided and nbytes >= min_bytes:
            seg.swappable_bytes += nbytes
            seg.swappable_sizes.append(nbytes)
        return t

    handles = []
    forward, backward = [], []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for _ in range(warmup):
                loss_fn(model(*args)).backward()
            for name in names:
                module = model.get_submodule(name)
                handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]
            for step in range(repeats):
                count = step == 0  # saved bytes from the first step; times from all
                sync(device)
                start = time.perf_counter()
                if count:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        loss = loss_fn(model(*args))
                else:
                    loss = loss_fn(model(*args))
                sync(device)
                forward.append(time.perf_counter() - start)
                start = time.perf_counter()
                loss.backward()
                sync(device)
                backward.append(time.perf_counter() - start)
                del loss
    finally:
        for h in handles:
            h.remove()
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers.items():
                b.copy_(saved)
    for name in names:
        stats[name].forward_seconds = statistics.median(seconds[name])
    return Profile([stats[n] for n in names], outside_segments_bytes, statistics.median(forward),
                   statistics.median(backward))


# ---- planning ----

class _Costs:
    """Per-segment quantities of the cost model, in seconds and bytes. A swapped segment's reads start when
    backward reaches the next segment's output (AppliedPlan's prefetch triggers), so the next segment's
    backward is the work that hides them."""

    def __init__(self, prof, copy):
        segs = prof.segments
        ratio = prof.backward_seconds / max(prof.forward_seconds, 1e-12)  # backward ~ ratio x forward, per segment
        self.n = len(segs)
        self.recompute = [s.forward_seconds for s in segs]
        self.backward = [s.forward_seconds * ratio for s in segs]
        fwd_after = [sum(s.forward_seconds for s in segs[i + 1:]) for i in range(self.n)]
        bwd_after = [sum(self.backward[i + 1:]) for i in range(self.n)]
        self.staleness = [fwd_after[i] + bwd_after[i] + 1e-9 for i in range(self.n)]
        self.swap_exposed = []
        for i, s in enumerate(segs):
            count = len(s.swappable_sizes)
            write = copy.write_seconds(s.swappable_bytes, count) if count else 0.0
            read = copy.read_seconds(s.swappable_bytes, count) if count else 0.0
            window = self.backward[i + 1] if i + 1 < self.n else 0.0
            self.swap_exposed.append(max(0.0, write - fwd_after[i]) + max(0.0, read - window))
        self.write_total = lambda chosen: sum(
            copy.write_seconds(segs[i].swappable_bytes, len(segs[i].swappable_sizes)) for i in chosen)
        self.read_total = lambda chosen: sum(
            copy.read_seconds(segs[i].swappable_bytes, len(segs[i].swappable_sizes)) for i in chosen)
        self.forward_total = sum(s.forward_seconds for s in segs)
        self.backward_total = sum(self.backward)


def _predict_peak(prof, actions, depth):
    """Predicted peak of saved activation bytes: the larger of the end of forward and each step of backward.

    A segment leaves a residual behind in forward: A (keep), A - W (swap), I (recompute). At the end of forward
    all residuals are live, plus one swapped storage still being written. Backward visits the segments in
    reverse; while it works on segment s, the residuals of the segments before s are live, and s itself needs
    its A (keep), its residual plus the prefetch window - the (depth + 1) largest swapped storages of s and
    the segments before it - (swap), or its input plus its recomputed A (recompute). Bytes saved outside every
    segment are counted throughout."""
    segs = prof.segments
    residual = []
    for s in segs:
        a = actions[s.name]
        residual.append(s.saved_bytes if a == "keep" else
                        s.saved_bytes - s.swappable_bytes if a == "swap" else s.input_bytes)
    swapped = [s.swappable_sizes if actions[s.name] == "swap" else [] for s in segs]
    largest_swapped = max((n for sizes in swapped for n in sizes), default=0)
    peak = prof.other_saved_bytes + sum(residual) + largest_swapped
    before = prof.other_saved_bytes
    swapped_so_far = []
    for i, s in enumerate(segs):
        a = actions[s.name]
        swapped_so_far += swapped[i]
        if a == "keep":
            working = s.saved_bytes
        elif a == "swap":
            working = residual[i] + sum(sorted(swapped_so_far, reverse=True)[: depth + 1])
        else:
            working = s.input_bytes + s.saved_bytes
        peak = max(peak, before + working)
        before += residual[i]
    return peak


def _director(policy, i, seg, costs):
    if policy == "dtr" or seg.swappable_bytes == 0:
        return "recompute"
    return "swap" if costs.swap_exposed[i] < costs.recompute[i] else "recompute"


def _filter_order(policy, prof, costs):
    idx = range(costs.n)
    segs = prof.segments
    if policy == "delta":
        return sorted(idx, key=lambda i: (-segs[i].saved_bytes * costs.staleness[i], i))
    if policy == "dtr":
        return sorted(idx, key=lambda i: (costs.recompute[i] / (max(segs[i].saved_bytes, 1) * costs.staleness[i]), i))

    def msps(i):  # bytes saved per second of overhead by the segment's cheaper action
        s = segs[i]
        swap_saving, recompute_saving = s.swappable_bytes, max(0, s.saved_bytes - s.input_bytes)
        if s.swappable_bytes and costs.swap_exposed[i] < costs.recompute[i]:
            return swap_saving / max(costs.swap_exposed[i], 1e-9)
        return recompute_saving / max(costs.recompute[i], 1e-9)

    return sorted(idx, key=lambda i: (-msps(i), i))


def _greedy(prof, costs, policy, order, budget, depth, max_swaps):
    """Off-loads segments in filter order until the predicted peak fits, the director choosing each action
    (at most `max_swaps` swaps), then applies the feasibility check and keeps again what still fits."""
    segs = prof.segments
    actions = {s.name: "keep" for s in segs}
    notes = []
    swaps = 0
    for i in order:
        if _predict_peak(prof, actions, depth) <= budget:
            break
        action = _director(policy, i, segs[i], costs)
        if action == "swap" and swaps >= max_swaps:
            action = "recompute"
        swaps += action == "swap"
        actions[segs[i].name] = action
    swapped = [i for i, s in enumerate(segs) if actions[s.name] == "swap"]
    # Feasibility: the copy engine must keep up with the whole pass, not just with each segment on its own.
    by_advantage = sorted(swapped, key=lambda i: costs.recompute[i] - costs.swap_exposed[i])
    while swapped and (costs.write_total(swapped) > costs.forward_total
                       or costs.read_total(swapped) > costs.backward_total):
        i = by_advantage.pop(0)
        swapped.remove(i)
        actions[segs[i].name] = "recompute"
        notes.append(f"{segs[i].name}: swap infeasible at the calibrated bandwidth with the others swapped; "
                     "recomputed instead")
    # The last segment off-loaded may have overshot the budget: keep again what still fits, least urgent first.
    for i in reversed(order):
        name = segs[i].name
        if actions[name] != "keep":
            trial = dict(actions, **{name: "keep"})
            if _predict_peak(prof, trial, depth) <= budget:
                actions = trial
    overhead = sum(costs.swap_exposed[i] if actions[s.name] == "swap" else costs.recompute[i]
                   for i, s in enumerate(segs) if actions[s.name] != "keep")
    return actions, _predict_peak(prof, actions, depth), overhead, notes


def plan_from_profile(prof: Profile, budget_bytes: int, copy_model: CopyModel, policy: str = "delta",
                      prefetch_depth: int = 2, min_bytes: int = 1 << 20) -> Plan:
    """The planner on a given profile and copy model (what `plan` calls after measuring both).

    The greedy pass runs once per cap on the number of swapped segments (0 .. all): a swap's prefetch window
    is a transient that recomputation does not have, so the director's cheapest choice can make a budget
    unreachable that fewer swaps would meet. Of the candidates that fit, the one with the least predicted
    overhead wins (the uncapped, pure-policy plan on a tie); if none fits, the one with the lowest peak.

    Args:
        prof: the model's profile.
        budget_bytes: the most saved activation bytes the step may hold at once.
        copy_model: the copy engine's calibrated costs.
        policy: ``"delta"``, ``"dtr"`` or ``"msps"``.
        prefetch_depth: storages the prefetcher reads ahead.
        min_bytes: the prefetcher's smallest swapped storage (recorded in the plan).

    Raises:
        ValueError: an unknown policy or a negative budget.
    """
    if policy not in POLICIES:
        raise ValueError(f"plan: policy must be one of {POLICIES}, got {policy!r}")
    if budget_bytes is None or budget_bytes < 0:
        raise ValueError(f"plan: budget_bytes must be >= 0, got {budget_bytes}")
    costs = _Costs(prof, copy_model)
    order = _filter_order(policy, prof, costs)
    segs = prof.segments
    caps = [0] if policy == "dtr" else range(len(segs), -1, -1)
    candidates = [_greedy(prof, costs, policy, order, budget_bytes, prefetch_depth, cap) for cap in caps]
    fitting = [c for c in candidates if c[1] <= budget_bytes]
    actions, peak, overhead, notes = (min(fitting, key=lambda c: c[2]) if fitting
                                      else min(candidates, key=lambda c: (c[1], c[2])))
    unoptimized = _predict_peak(prof, {s.name: "keep" for s in segs}, prefetch_depth)
    floor = min(min(c[1] for c in candidates),
                *(_greedy(prof, costs, policy, order, 0, prefetch_depth, cap)[1] for cap in caps))
    if peak > budget_bytes:
        notes.append(f"the lowest predicted peak any plan reaches is {floor} bytes > budget {budget_bytes}: "
                     f"{prof.other_saved_bytes} bytes are saved outside every segment")
    return Plan(policy, int(budget_bytes), actions, int(peak), int(unoptimized), overhead,
                prof.forward_seconds + prof.backward_seconds, peak <= budget_bytes, min_bytes, prefetch_depth,
                copy_model.kind, prof, copy_model.to_dict(), notes, int(floor))


def plan(model: torch.nn.Module, example_batch: torch.Tensor | tuple, budget_bytes: int, policy: str = "delta",
         segments: list[str] | None = None, loss_fn: Callable[[object], torch.Tensor] | None = None,
         min_bytes: int = 1 << 20, prefetch_depth: int = 2, copy_model: CopyModel | None = None,
         path: str | None = None) -> Plan:
    """Profiles one step of ``model`` on ``example_batch`` and returns a Plan (keep/swap/recompute per segment)
    whose predicted peak of saved activation bytes is at most ``budget_bytes`` (see ``Plan.fits``).

    Args:
        model, example_batch, segments, loss_fn, min_bytes: as for :func:`profile`.
        budget_bytes, policy, prefetch_depth: as for :func:`plan_from_profile`.
        copy_model: the copy engine's costs (default: :func:`calibrate` of the store the batch's device needs).
        path: the file store's directory (default: the temp directory).
    """
    if policy not in POLICIES:
        raise ValueError(f"plan: policy must be one of {POLICIES}, got {policy!r}")
    prof = profile(model, example_batch, segments, loss_fn, min_bytes)
    if copy_model is None:
        args = _as_args(example_batch)
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        copy_model = calibrate("pinned" if on_cuda else "file", path=path)
    return plan_from_profile(prof, budget_bytes, copy_model, policy, prefetch_depth, min_bytes)


# ---- installing a plan ----

class AppliedPlan:
    """An installed plan: the wrapped segments and the prefetcher their swapped tensors go through (made by
    :func:`apply`; a context manager that removes the plan on exit).

    Args:
        model: the model the plan is installed on.
        plan: the plan.
        prefetcher: the SwapPrefetcher of the swapped segments, or None when nothing is swapped.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, prefetcher: SwapPrefetcher | None):
        self.model, self.plan, self.prefetcher = model, plan, prefetcher
        self._wrapped = []
        self._handles = []

    def _add_prefetch_triggers(self, names):
        """When backward reaches a segment's output, start reading the tails of the swapped storages of the
        segment before it (hidden behind this segment's backward) and of the segment itself."""
        marks = {"previous": None}

        def hook(module, inputs, output):
            if not torch.is_grad_enabled():
                return
            mark = self.prefetcher.mark()
            for out in output if isinstance(output, (tuple, list)) else (output,):
                if marks["previous"] is not None:
                    self.prefetcher.prefetch_on_grad(out, upto=marks["previous"])
                self.prefetcher.prefetch_on_grad(out, upto=mark)
            marks["previous"] = mark

        def reset(module, inputs):
            marks["previous"] = None

        self._handles.append(self.model.register_forward_pre_hook(reset))
        for name in names:
            self._handles.append(self.model.get_submodule(name).register_forward_hook(hook))

    def remove(self) -> None:
        """Restores the segments' own forward methods and closes the prefetcher."""
        for module in self._wrapped:
            del module.forward
        self._wrapped = []
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.prefetcher is not None:
            self.prefetcher.close()

    def stats(self) -> dict:
        """The prefetcher's :meth:`SwapPrefetcher.stats` ({} when nothing is swapped)."""
        return self.prefetcher.stats() if self.prefetcher is not None else {}

    def __enter__(self) -> "AppliedPlan":
        return self

    def __exit__(self, *exc: object) -> bool:
        self.remove()
        return False


def _recompute(forward):
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return wrapped


def _swap(forward, prefetcher):
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with prefetcher:
            return forward(*args, **kwargs)
    return wrapped


def apply(model: torch.nn.Module, plan: Plan, prefetcher: SwapPrefetcher | None = None,
          path: str | None = None) -> AppliedPlan:
    """Installs ``plan`` on ``model``: recomputed segments run under torch.utils.checkpoint (non-reentrant),
    swapped segments inside one SwapPrefetcher.

    Args:
        model: the model (its segments' forward methods are wrapped).
        plan: what to do with each segment.
        prefetcher: the prefetcher of the swapped segments (default: one made with the plan's settings).
        path: the file store's directory (default: the temp directory).

    Returns:
        The AppliedPlan; its ``remove()`` undoes the installation.

    Raises:
        ValueError: an unknown action, bad segments, or a segment that already has a plan installed.
    """
    for name, action in plan.actions.items():
        if action not in ACTIONS:
            raise ValueError(f"apply: segment {name!r} has action {action!r}; expected one of {ACTIONS}")
    _check_segments(model, list(plan.actions))
    if plan.segments_with("swap") and prefetcher is None:
        prefetcher = SwapPrefetcher(min_bytes=plan.min_bytes, prefetch_depth=plan.prefetch_depth, store=plan.store,
                                    path=path)
    applied = AppliedPlan(model, plan, prefetcher)
    if prefetcher is not None:
        applied._add_prefetch_triggers(list(plan.actions))
    for name, action in plan.actions.items():
        if action == "keep":
            continue
        module = model.get_submodule(name)
        if "forward" in module.__dict__:
            applied.remove()
            raise ValueError(f"apply: segment {name!r} already has a plan (or another forward override) installed")
        forward = module.forward
        module.forward = _recompute(forward) if action == "recompute" else _swap(forward, prefetcher)
        applied._wrapped.append(module)
    return applied


def optimize(model: torch.nn.Module, example_batch: torch.Tensor | tuple, budget_bytes: int, policy: str = "delta",
             best_effort: bool = False, **kwargs: object) -> AppliedPlan:
    """:func:`plan`, then :func:`apply` the plan.

    Args:
        model, example_batch, budget_bytes, policy: as for :func:`plan`.
        best_effort: when no plan fits, apply the one with the lowest predicted peak and warn, instead of raising.
        **kwargs: :func:`plan`'s other arguments (``path`` goes to :func:`apply` too).

    Raises:
        ValueError: no plan's predicted peak fits ``budget_bytes`` (and not ``best_effort``); the message says the
            lowest peak a plan reaches and how many bytes are reducible at all.
    """
    path = kwargs.get("path")
    p = plan(model, example_batch, budget_bytes, policy, **kwargs)
    if not p.fits:
        if not best_effort:
            raise ValueError(f"optimize: no plan fits {budget_bytes} bytes: {p.summary()}. A budget between "
                             f"{p.floor_bytes} and {p.unoptimized_peak_bytes} bytes can be met; "
                             "best_effort=True applies the closest plan")
        warnings.warn(f"optimize: best effort, the budget of {budget_bytes} bytes is not met: {p.summary()}",
                      stacklevel=2)
    return apply(model, p, path=path)
