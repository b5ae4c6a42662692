"""MoELayer: a top-k mixture-of-experts FFN with expert parallelism and load-aware expert replication.

One forward, on every rank of `group` (R ranks, E experts, rank r owns experts [r E/R, (r+1) E/R)):

1. Replica parameters for this step's plan start moving (owner -> holder, point-to-point on a separate process
   group, asynchronous), so they travel while the gate, the layout and the dispatch all-to-all run.
2. Gate: fp32 softmax top-k (fastdist.ops.moe_route); layout: stable counting sort by expert with capacity or
   dropless (moe_layout); token rows copied into expert order (moe_permute).
3. One all-gather of the per-expert kept and total counts and a header (2 E + 8 int64 per rank, the only host
   sync): it gives every rank the count matrix, hence the all-to-all split sizes and the next plan, identically
   everywhere, and checks that every rank runs the same call of the same layer (layer index and per-layer call
   number), in the same dtypes, with the same cost model and this step's plan; a mismatch raises MismatchError on
   every rank before any size-dependent collective runs. It also carries each rank's measured time of the previous
   step, so that every planner checks its model against the same (slowest) time.
4. Rows for experts this rank holds a replica of stay here; the rest go to their owners in one variable-size
   all_to_all_single (autograd backward swaps the splits). Ranks with no tokens still take part.
5. Owned experts compute first (their inputs have arrived), then the replica parameters are waited for and the
   replicated experts compute; outputs return by the reverse all-to-all, and moe_unpermute combines each token's
   k rows weighted by its gate probabilities (dropped slots contribute nothing).
6. Backward: replica gradients are sent to the owners as soon as autograd produces them and are received
   asynchronously; the owners add them to their parameters' .grad in a callback at the end of the backward pass,
   i.e. before any optimizer step. Under data parallelism (fastdist.moe.data_parallel) that callback also sums the
   expert gradients over the expert's data-parallel replicas and averages them as DDP averages the others.

Under torch.compile the gate, route and layout compile; everything from the count all-gather to the combine (sizes
that depend on the data) runs eagerly behind torch.compiler.disable, so a compiled model breaks its graph there and
never recompiles for a new routing.

The plan for step n+1 is computed from step n's counts (expert load changes slowly; Pro-Prophet's observation), by
the same deterministic planner on every rank, on a CPU thread while step n's all-to-alls and experts run. Step 1's
transfer can start earlier than the layer's forward: MoELayer.prefetch_replicas() (e.g. before the block's attention).
"""
import concurrent.futures
import contextlib
import contextvars
import copy
import dataclasses
import math
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdist.distributed import MismatchError, check_same, compat, failure, fingerprint
from fastdist.moe.calibrate import calibrate as measure_cost_model
from fastdist.moe.planner import CostModel, Plan, Planner, loads
from fastdist.ops.moe import capacity_for, moe_layout, moe_permute, moe_route, moe_unpermute

__all__ = ["MoELayer", "step"]

_STEP: contextvars.ContextVar = contextvars.ContextVar("fastdist_moe_step", default=None)
_WATCHES: dict = {}  # the job's store -> this process's FailureWatch for MoE steps


def _watch() -> failure.FailureWatch | None:
    """This process's watch over MoE steps (one per process group), None on one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    if store not in _WATCHES:
        _WATCHES.clear()
        _WATCHES[store] = failure.FailureWatch("fastdist.moe")
    return _WATCHES[store]


def _failed(error: BaseException, context: str) -> BaseException:
    """What to raise for ``error`` (raised here in ``context``): see fastdist.distributed.failure.FailureWatch.fail."""
    watch = _watch()
    return error if watch is None else watch.fail(error, _STEP.get(), context)


def _guarded(layer_index: int | None = None, phase: str = "") -> contextlib.AbstractContextManager:
    """Runs the ``with`` body under this process's MoE watch: an exception becomes what its ``fail`` returns, named
    as raised in MoE layer ``layer_index``'s ``phase`` ("forward" or "backward"; None: the step itself)."""
    context = "" if layer_index is None else f"MoE layer {layer_index}'s {phase}"
    return failure.replaced_by(lambda e: _failed(e, context))


@contextlib.contextmanager
def step(number: int) -> Iterator[None]:
    """Numbers the training step the MoE layer calls inside it belong to: ``with fastdist.moe.step(i): loss =
    model(x)``.

    Each call's header carries its layer and a number that every rank's call must share. Without a step that number
    is the layer's count of calls, which a rank that skipped or added a step of a model's only MoE layer shifts
    alike for all its later calls: they pair with the others' calls of another step, and the rank with a call more
    raises :class:`UnmatchedCallError` at the group's timeout. Inside ``step(i)`` the number is ``i``, so such a
    rank's next call raises MismatchError on every rank.

    A step that raises on one rank (its loss, its forward, anything inside the ``with``) makes the other ranks raise
    ``fastdist.distributed.RankFailedError`` naming it within seconds, wherever they wait (an MoE all-to-all, DDP's
    reduce), instead of at the process group's timeout; so does a rank whose process dies. The job's process groups
    are aborted then (fastdist.distributed.failure).

    Args:
        number: the step, counted alike on every rank (e.g. the training loop's iteration).
    """
    token = _STEP.set(int(number))
    try:
        with _guarded():
            yield
    finally:
        _STEP.reset(token)

class UnmatchedCallError(failure.JobFailureError):
    """No other rank joined this call of an MoE layer within the group's timeout.

    A rank that skipped or added a call of the model's only MoE layer, without :func:`step` numbers, pairs its later
    calls with the others' calls of another step, and the rank with one call more waits here. Inside ``step(i)`` the
    mismatch is raised on every rank at the call where it happens instead.

    Args:
        layer: the layer's index in its group.
        number: this rank's number for the call (its step inside :func:`step`, else its count of calls).
        numbered: whether the call ran inside :func:`step`.
    """

    def __init__(self, layer: int, number: int, numbered: bool):
        what = f"step {number}" if numbered else f"call {number}"
        cure = "" if numbered else (" Number the steps with `with fastdist.moe.step(i):` so that a skipped or added "
                                    "call raises on every rank where it happens.")
        super().__init__(f"fastdist: MoELayer (layer {layer} of its group), {what}: no other rank joined this call "
                         "within the process group's timeout; a rank skipped or added a call of this layer, or "
                         f"stopped.{cure}")


_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


@dataclasses.dataclass
class _StepClock:
    """One step's time in the layer: its exchange's forward, and its backward from the combine's all-to-all to the
    dispatch's (the layer's backward, waits for other ranks included)."""
    forward_s: float = 0.0
    backward_start: float | None = None
    backward_end: float | None = None

    def seconds(self) -> float:
        """Forward + backward seconds, or 0 while the backward has not run."""
        if self.backward_start is None or self.backward_end is None:
            return 0.0
        return self.forward_s + self.backward_end - self.backward_start


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward sends the gradients back with the splits swapped, and marks
    the start or the end of the layer's backward on the step's clock."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, clock, marks_backward_start, layer_index):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        ctx.clock, ctx.marks_backward_start = clock, marks_backward_start
        ctx.layer_index = layer_index
        out = x.new_empty((sum(out_splits), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.clock is not None and ctx.marks_backward_start:
            ctx.clock.backward_start = time.perf_counter()
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), grad.shape[1]))
        with _guarded(ctx.layer_index, "backward"):
            dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        if ctx.clock is not None and not ctx.marks_backward_start:
            ctx.clock.backward_end = time.perf_counter()
        return grad_in, None, None, None, None, None, None


class _ReplicaTraffic:
    """One step's replica messages: parameters owner -> holder now, gradients holder -> owner in backward.

    Every rank walks the plan's (expert, holder) pairs in the same sorted order; the tag is the expert id, and each
    (owner, holder, expert) pair carries one message per direction per step.
    """

    def __init__(self, layer, plan):
        self.layer = layer
        self.plan = plan
        self.pending = []            # forward receives: (expert, handle, buffer)
        self.sends = []
        self.grad_recvs = []         # backward: (local expert index, handle, buffer)
        self.owned_grads = None      # backward, under data parallelism: this step's (w1, b1, w2, b2) gradients
        self.clock = None            # the step's _StepClock: the owned experts' backward may end the layer's
        self.finish_queued = False
        rank = layer.rank
        for e, holder in plan.replicas:
            owner = layer.owner(e)
            if owner == rank:
                self.sends.append(dist.isend(layer.pack_expert(e), layer.global_rank(holder),
                                             group=layer.replica_group, tag=e))
            elif holder == rank:
                buf = torch.empty(layer.expert_numel, dtype=layer.w1.dtype, device=layer.w1.device)
                handle = dist.irecv(buf, layer.global_rank(owner), group=layer.replica_group, tag=e)
                self.pending.append((e, handle, buf))

    def replica_params(self):
        """Waits for this rank's replica parameters; returns [(expert, w1, b1, w2, b2)] in expert order."""
        out = []
        for e, handle, buf in self.pending:
            handle.wait()
            out.append((e, *self.layer.split_expert(buf)))  # views: the buffer is ours alone
        for handle in self.sends:
            handle.wait()
        self.sends = []
        return out

    def send_grads(self, expert_grads):
        """Holder side: sends each (expert, flat gradient of its replica here) to the expert's owner."""
        for e, grad in expert_grads:
            self.sends.append(dist.isend(grad, self.layer.global_rank(self.layer.owner(e)),
                                         group=self.layer.replica_group, tag=e))

    def post_grad_receives(self):
        """Owner side: posts a receive for the gradient of every replica of an expert it owns."""
        layer = self.layer
        for e, holder in self.plan.replicas:
            if layer.owner(e) == layer.rank:
                buf = torch.empty(layer.expert_numel, dtype=layer.w1.dtype, device=layer.w1.device)
                handle = dist.irecv(buf, layer.global_rank(holder), group=layer.replica_group, tag=e)
                self.grad_recvs.append((e - layer.first_expert, handle, buf))

    def finish_at_end_of_backward(self):
        if not self.finish_queued:
            self.finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grads)

    def finish_grads(self):
        """End of backward: adds the received replica gradients into the owner's .grad (in plan order); under data
        parallelism first sums this step's expert gradients over the expert's replicas and averages them."""
        with _guarded(self.layer.layer_index, "backward"):
            self._finish_grads()

    def _finish_grads(self):
        layer = self.layer
        params = (layer.w1, layer.b1, layer.w2, layer.b2)
        averaging = layer._averaging
        if averaging is None:
            for local, handle, buf in self.grad_recvs:
                handle.wait()
                for p, g in zip(params, layer.split_expert(buf)):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad[local] += g
        else:
            # Only this step's gradient is reduced (not what .grad accumulated before), so accumulation over
            # micro-batches stays a sum of averages.
            owned = self.owned_grads or (None,) * 4
            flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                              for g, p in zip(owned, params)])
            grads = [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in params]), params)]
            for local, handle, buf in self.grad_recvs:
                handle.wait()
                for g, replica_grad in zip(grads, layer.split_expert(buf)):
                    g[local] += replica_grad
            if averaging.group is not None:
                dist.all_reduce(flat, group=averaging.group)
            flat.div_(averaging.divisor)
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
        for handle in self.sends:
            handle.wait()
        self.grad_recvs, self.sends, self.owned_grads = [], [], None


class _OwnedExperts(torch.autograd.Function):
    """Identity on the owned expert parameters; its backward posts the receives for their replicas' gradients.

    The owners add those gradients at the end of the backward pass (queue_callback), so no rank blocks inside
    autograd on a peer that may still be running another part of its backward. Under data parallelism the owned
    gradients go to that callback too (which reduces and averages them) instead of to .grad.
    """

    @staticmethod
    def forward(ctx, traffic, w1, b1, w2, b2):
        ctx.traffic = traffic
        return w1.view_as(w1), b1.view_as(b1), w2.view_as(w2), b2.view_as(b2)

    @staticmethod
    def backward(ctx, gw1, gb1, gw2, gb2):
        traffic = ctx.traffic
        if traffic.clock is not None:  # the layer's backward ends here unless its input needs a gradient
            traffic.clock.backward_end = time.perf_counter()
        with _guarded(traffic.layer.layer_index, "backward"):
            traffic.post_grad_receives()
        traffic.finish_at_end_of_backward()
        if traffic.layer._averaging is not None:
            traffic.owned_grads = (gw1, gb1, gw2, gb2)
            return None, None, None, None, None
        return None, gw1, gb1, gw2, gb2


class _ReplicaParams(torch.autograd.Function):
    """Waits for this rank's replica parameters and returns them as differentiable tensors; backward sends their
    gradients to the owners. `anchor` (an owned parameter) only makes autograd record the node."""

    @staticmethod
    def forward(ctx, traffic, anchor):
        replicas = traffic.replica_params()
        ctx.traffic = traffic
        ctx.replica_experts = [r[0] for r in replicas]
        return tuple(t for r in replicas for t in r[1:])

    @staticmethod
    def backward(ctx, *replica_grads):
        grads = []
        for i, e in enumerate(ctx.replica_experts):
            parts = replica_grads[4 * i:4 * i + 4]
            grads.append((e, torch.cat([p.reshape(-1) for p in parts]).contiguous()))
        with _guarded(ctx.traffic.layer.layer_index, "backward"):
            ctx.traffic.send_grads(grads)
        ctx.traffic.finish_at_end_of_backward()
        return None, None


@dataclasses.dataclass
class _DispatchPlan:
    kept_rows: int            # rows this rank routes (kept assignments)
    local_experts: list       # experts replicated here, computed here
    send_index: torch.Tensor  # rows to send, in send order
    local_index: torch.Tensor  # rows computed here, in local_experts order
    send_splits: list
    recv_splits: list
    to_expert_major: torch.Tensor  # received (source-major) rows -> owned-expert-major order
    owned_sizes: list         # received rows per owned expert
    local_sizes: list         # local rows per replicated expert


@dataclasses.dataclass
class ExpertGradientAveraging:
    """How data parallelism reduces a layer's expert gradients (set by fastdist.moe.data_parallel)."""
    divisor: int                        # the data-parallel ranks: gradients are averaged over them, as DDP does
    group: dist.ProcessGroup | None     # the ranks holding the same experts (None: this rank alone)


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_LAYERS_PER_GROUP = {}  # ranks of a group -> MoELayers built on it by this process (every rank counts alike)

_PLANNER_THREAD = []


def _planner_thread():
    """One background thread shared by every layer of the process (plans are small; they never overlap)."""
    if not _PLANNER_THREAD:
        _PLANNER_THREAD.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdist-plan"))
    return _PLANNER_THREAD[0]


def _segments_index(starts, lengths, device):
    """Concatenation of arange(start, start + length) over the segments, as int64 on `device`."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    seg_first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    index = np.repeat(starts, lengths) + (np.arange(total) - seg_first)
    return torch.from_numpy(index).to(device)


class MoELayer(nn.Module):
    """Top-k MoE FFN over expert-parallel ranks with load-aware replication (Pro-Prophet).

    Args:
        d_model, d_ff: token width and expert hidden width.
        num_experts: E, divisible by the group size; each rank owns E / R experts, contiguously.
        k: experts per token.
        capacity_factor: capacity per expert = max(min_capacity, ceil(k * T * capacity_factor / E)) with T this
            rank's tokens (DeepSpeed-MoE semantics); ignored when dropless.
        dropless: keep every assignment.
        activation: "gelu", "relu" or "silu".
        group: the expert-parallel process group (None: the default group; no process group: one rank, no comm).
        balance: "prophet" (greedy planner), "shadow" (FasterMoE-style), "replicate_topk" or "none".
        plan_interval: replan every this many steps.
        max_replicas_per_rank: replicas one rank may hold (memory bound).
        aux_loss_coef: weight of the Switch load-balancing loss in `self.aux_loss` (add it to your loss).
        cost_model: a fastdist.moe.CostModel. "prophet" and "shadow" need one on more than one rank: pass it, or
            call :meth:`calibrate` before the first forward (the first forward raises otherwise).
        min_capacity, replan_gain, planner_budget: see fastdist.moe.planner.

    Every rank must construct the layer with the same configuration (cost model included, and the same number of
    layers on the group before it): a fingerprint check raises fastdist.distributed.MismatchError on every rank
    otherwise. Pickling (and torch.save of a model) leaves the process group out; :meth:`attach` binds an unpickled
    layer to one again.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, k: int = 2, capacity_factor: float = 1.25,
                 dropless: bool = False, activation: str = "gelu", group: dist.ProcessGroup | None = None,
                 balance: str = "prophet", plan_interval: int = 1, max_replicas_per_rank: int = 2,
                 aux_loss_coef: float = 0.01, cost_model: CostModel | None = None, min_capacity: int = 4,
                 replan_gain: float = 0.03, planner_budget: int | None = None):
        super().__init__()
        self.d_model, self.d_ff, self.num_experts, self.k = d_model, d_ff, num_experts, k
        self.capacity_factor, self.dropless, self.min_capacity = capacity_factor, dropless, min_capacity
        self.activation = activation
        self.aux_loss_coef = aux_loss_coef
        self.balance = balance
        self.config = {"d_model": d_model, "d_ff": d_ff, "num_experts": num_experts, "k": k,
                       "capacity_factor": float(capacity_factor), "dropless": bool(dropless),
                       "min_capacity": min_capacity, "activation": activation, "balance": balance,
                       "plan_interval": plan_interval, "max_replicas_per_rank": max_replicas_per_rank,
                       "replan_gain": float(replan_gain), "planner_budget": planner_budget}
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.layer_index = 0
        if self.distributed:
            ranks = self._group_ranks(group)
            self.layer_index = _LAYERS_PER_GROUP.get(ranks, 0)
            _LAYERS_PER_GROUP[ranks] = self.layer_index + 1
        # Checked before anything can raise on one rank only: every rank then raises alike, none waits.
        self._bind(group, cost_model)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"fastdist: activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if num_experts < 1 or num_experts % self.world:
            raise ValueError(f"fastdist: num_experts ({num_experts}) must be a positive multiple of the group size "
                             f"({self.world})")
        if not 1 <= k <= num_experts:
            raise ValueError(f"fastdist: k must be in [1, num_experts = {num_experts}], got {k}")
        self.experts_per_rank = num_experts // self.world
        self.first_expert = self.rank * self.experts_per_rank
        self.planner = Planner(balance, cost_model, max_replicas_per_rank, plan_interval, replan_gain,
                               planner_budget)
        self._make_replica_group()
        _watch()  # publishes this rank's heartbeat, so that peers can name it if its process dies
        e_local = self.experts_per_rank
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(e_local, d_model, d_ff))
        self.b1 = nn.Parameter(torch.zeros(e_local, d_ff))
        self.w2 = nn.Parameter(torch.empty(e_local, d_ff, d_model))
        self.b2 = nn.Parameter(torch.zeros(e_local, d_model))
        nn.init.normal_(self.w1, std=1.0 / math.sqrt(d_model))
        nn.init.normal_(self.w2, std=1.0 / math.sqrt(d_ff))
        self.expert_numel = 2 * d_model * d_ff + d_model + d_ff
        self.aux_loss = None
        self._stats = {}
        self._prefetched = None
        self._calls = 0             # forwards so far: each one's number travels in its header
        self._clock = None          # the last forward's _StepClock
        self._averaging = None      # set by fastdist.moe.data_parallel

    # ---- the process group: bound at construction or by attach(), never pickled ----

    @staticmethod
    def _group_ranks(group):
        world = dist.get_world_size(group)
        return tuple(dist.get_global_rank(group, i) if group is not None else i for i in range(world))

    def _bind(self, group, cost_model):
        """Binds the layer to `group` after checking, in one collective, that every rank configured it alike."""
        self.group = group
        self.replica_group = None
        self._unbound = False
        if self.distributed:
            setting = {**self.config, "aux_loss_coef": float(self.aux_loss_coef), "cost_model": cost_model,
                       "layer_index": self.layer_index,
                       "group_size": self.world}
            try:
                check_same("MoELayer configuration", setting, group)
            except MismatchError:
                # Name the fields that differ (the whole configuration is too long to show): every rank is here.
                everyone = [None] * self.world
                dist.all_gather_object(everyone, setting, group=group)
                differ = [f for f in setting if any(e[f] != setting[f] for e in everyone)]
                raise MismatchError("MoELayer configuration",
                                    {r: {f: e[f] for f in differ} for r, e in enumerate(everyone)}) from None

    def _make_replica_group(self):
        # Replica traffic has its own process group so it can run beside the all-to-all. Only the members of
        # `group` create it (other expert-parallel groups create theirs concurrently): local synchronization
        # names the group by its ranks instead of a world-wide counter.
        if self.distributed and self.world > 1 and self.balance != "none":
            self.replica_group = dist.new_group(list(self._group_ranks(self.group)),
                                                use_local_synchronization=self.group is not None)

    def attach(self, group: dist.ProcessGroup | None = None) -> None:
        """Binds a layer that was unpickled (which leaves its process group out) to ``group``.

        A collective over ``group``: every rank of it attaches its layer. The group must have the size and this
        rank the position the layer had when it was pickled; the configuration check of the constructor runs again.
        Data parallelism (fastdist.moe.data_parallel) is set up again by wrapping the model again.

        Args:
            group: the expert-parallel process group (None: the default group).

        Raises:
            RuntimeError: no process group is initialized, or the group's size or this rank's position differ
                from the layer's.
            MismatchError: the ranks' layers are configured differently.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("fastdist: MoELayer.attach needs an initialized torch.distributed process group")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if (world, rank) != (self.world, self.rank):
            raise RuntimeError(f"fastdist: this MoELayer holds the experts of rank {self.rank} of {self.world}; "
                               f"it cannot attach as rank {rank} of {world}")
        self._bind(group, self.planner.cost)
        self._make_replica_group()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # Process groups and in-flight messages belong to this process; aux_loss to this step's graph.
        state.update(group=None, replica_group=None, _prefetched=None, _averaging=None, aux_loss=None,
                     _clock=None, _unbound=self.distributed)
        return state

    def __deepcopy__(self, memo: dict) -> "MoELayer":
        # A copy in this process shares the process groups (handles, not state) and starts with no step in flight.
        for shared in (self.group, self.replica_group, self._averaging):
            if shared is not None:
                memo[id(shared)] = shared
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        state = {**self.__dict__, "_prefetched": None, "aux_loss": None}
        state.pop("_compiled_call_impl", None)
        twin.__dict__.update(copy.deepcopy(state, memo))
        return twin

    # ---- calibration ----

    def calibrate(self, cache: str | None = None, **options: object) -> CostModel:
        """Measures the planner's cost model on this machine for this layer's shape and uses it from now on.

        A collective over the layer's group (every rank calls it; each gets the slowest rank's figures). Run it once
        before training, never inside a step; layers of equal shape on one group share the measurement.

        Args:
            cache: a JSON file keeping calibrations keyed by hardware and shape: a calibration found there (by every
                rank) is used without measuring; a new one is added to it.
            **options: passed to fastdist.moe.calibrate (reps, tokens, ...).

        Returns:
            The cost model, also in ``self.planner.cost``.
        """
        self.planner.cost = measure_cost_model(self.group if self.distributed else None, self.d_model, self.d_ff,
                                               self.w1.dtype, device=self.w1.device, num_experts=self.num_experts,
                                               k=self.k, cache=cache, **options)
        return self.planner.cost

    # ---- helpers for the replica traffic ----

    def owner(self, expert: int) -> int:
        """The group rank that owns ``expert``."""
        return expert // self.experts_per_rank

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of the layer group's ``group_rank``."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def pack_expert(self, expert: int) -> torch.Tensor:
        """The parameters of ``expert`` (owned here) as one flat tensor, in :meth:`split_expert`'s order."""
        i = expert - self.first_expert
        return torch.cat([self.w1[i].reshape(-1), self.b1[i], self.w2[i].reshape(-1), self.b2[i]]).detach() \
            .contiguous()

    def split_expert(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, b1, w2, b2) views of a flat tensor :meth:`pack_expert` made."""
        d, f = self.d_model, self.d_ff
        w1, b1, w2, b2 = flat.split([d * f, f, f * d, d])
        return w1.view(d, f), b1, w2.view(f, d), b2


    @property
    def plan(self) -> Plan:
        """The replicas this step uses."""
        return self.planner.plan

    def prefetch_replicas(self) -> None:
        """Starts sending this step's replica parameters now, so that they travel while earlier work runs.

        Call it after the optimizer step and before the layer's input is ready (e.g. at the start of the block, so
        the transfer overlaps the attention); forward() starts the transfer itself when nobody did. Every rank of
        the group must call it for the same steps (it issues point-to-point messages on the replica group). Under
        torch.compile it breaks the graph only where the layer can replicate (balance other than "none").
        """
        if self.world > 1 and self.balance != "none":
            self._prefetch()

    @torch.compiler.disable
    def _prefetch(self):
        self._check_bound()
        if self.plan.replicas and self._prefetched is None:
            self._prefetched = _ReplicaTraffic(self, self.plan)

    def _check_bound(self):
        if self._unbound:  # raised before any collective: nothing to abort (agreed), the layer can be attached
            raise failure.agreed(RuntimeError(
                "fastdist: this MoELayer was unpickled, which leaves its process group out; call layer.attach(group) "
                "on every rank of the group before using it"))

    # ---- compute ----

    def _ffn(self, x, w1, b1, w2, b2):
        # addmm, as nn.Linear: under autocast the experts compute in its dtype and return it
        return torch.addmm(b2, _ACTIVATIONS[self.activation](torch.addmm(b1, x, w1)), w2)

    def _experts(self, rows, sizes, params):
        """rows grouped by expert, sizes[i] rows for params[i] = (w1, b1, w2, b2)."""
        if not params:
            return rows[:0]
        parts = rows.split(sizes)
        return torch.cat([self._ffn(p, *w) for p, w in zip(parts, params)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE FFN of every token of ``x`` (``[..., d_model]``, this rank's tokens; any count, none included).

        A collective over the group; sets ``aux_loss`` and :meth:`stats`. Under autocast the experts compute, and
        the result comes, in the autocast dtype.

        Raises:
            MismatchError: on every rank, when the ranks run different layers or calls of this layer, in different
                dtypes, with different cost models or plans.
            RuntimeError: on every rank, when balance "prophet" or "shadow" has no cost model on more than one rank.
        """
        shape = x.shape
        x = x.reshape(-1, self.d_model)
        tokens = x.shape[0]
        logits = self.gate(x).float()
        probs, _, topk_idx, topk_weight = moe_route(logits, self.k)
        capacity = -1 if self.dropless else capacity_for(tokens, self.num_experts, self.k, self.capacity_factor,
                                                         self.min_capacity)
        counts, offsets, _, _, row_of_slot, _, _ = moe_layout(topk_idx, self.num_experts, 1, capacity)
        out = self._exchange(x, counts, offsets, row_of_slot, topk_weight)
        # Switch load-balancing loss on this rank's tokens: E * sum_e f_e * mean_t p_e.
        if tokens:
            fraction = counts.to(probs.dtype) / (tokens * self.k)
            self.aux_loss = self.aux_loss_coef * self.num_experts * (fraction * probs.mean(0)).sum()
        else:
            self.aux_loss = probs.sum() * 0.0
        return out.reshape(shape)

    def _header(self, x):
        """This call's identity and settings, as int64s: the layer, its call number (the step inside
        :func:`step`), the dtypes of the rows sent,
        the parameters and the experts' compute, and the cost model's fingerprint (0: none)."""
        device = x.device.type
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else \
            torch.promote_types(x.dtype, self.w1.dtype)
        cost = self.planner.cost
        number = _STEP.get()
        return [self.layer_index, self._calls if number is None else number] + \
            [_DTYPES.index(d) if d in _DTYPES else -1
                                                  for d in (x.dtype, self.w1.dtype, compute)] + \
            [fingerprint(cost) if cost is not None else 0]

    def _check_headers(self, headers):
        """Raises on every rank (each holds every rank's header) when the ranks' calls disagree."""
        def dtype_name(code):
            return str(_DTYPES[code]).replace("torch.", "") if code >= 0 else "other"

        def differ(columns):
            return len({tuple(row) for row in headers[:, columns].tolist()}) > 1

        if differ([0, 1]):
            number = "step" if _STEP.get() is not None else "call"
            raise MismatchError("MoELayer call", {r: f"layer {h[0]} of its group, {number} {h[1]}"
                                                  for r, h in enumerate(headers.tolist())})
        if differ([2, 3, 4]):
            raise MismatchError("MoELayer dtype", {
                r: f"rows {dtype_name(h[2])}, parameters {dtype_name(h[3])}, experts compute in {dtype_name(h[4])}"
                for r, h in enumerate(headers.tolist())})
        if differ([5]):
            raise MismatchError("MoELayer cost model", {r: f"fingerprint {h[5]:#x}" if h[5] else "none"
                                                        for r, h in enumerate(headers.tolist())})
        if differ([6]):
            raise MismatchError("MoELayer plan", {r: f"plan fingerprint {h[6]:#x}"
                                                  for r, h in enumerate(headers.tolist())})
        if self.planner.cost is None and self.balance in ("prophet", "shadow"):
            raise failure.agreed(RuntimeError(
                f"fastdist: MoELayer(balance={self.balance!r}) plans with a cost model and has none: call "
                "layer.calibrate() on every rank before the first forward (cache=PATH keeps the measurement), or "
                "pass cost_model="))

    @torch.compiler.disable
    def _exchange(self, x, counts, offsets, row_of_slot, topk_weight):
        """Everything whose sizes depend on the routing: the count all-gather, dispatch, experts and combine.

        An exception here (other than the checks every rank makes alike) records this rank's failure and aborts the
        process groups; a collective failed by another rank's failure raises RankFailedError naming it."""
        with _guarded(self.layer_index, "forward"):
            return self._exchange_steps(x, counts, offsets, row_of_slot, topk_weight)

    def _exchange_steps(self, x, counts, offsets, row_of_slot, topk_weight):
        start = time.perf_counter()
        self._check_bound()
        plan = self.plan if self.world > 1 else Plan()
        self.prefetch_replicas()
        traffic, self._prefetched = self._prefetched, None
        if traffic is None and self.world > 1:
            traffic = _ReplicaTraffic(self, plan)  # no message: it carries the backward's clock and gradient step
        previous, self._clock = self._clock, _StepClock() if self.world > 1 and torch.is_grad_enabled() else None
        clock = self._clock
        if traffic is not None:
            traffic.clock = clock
        kept = offsets[1:] - offsets[:-1]
        # The count matrix [R, E] of kept (and all) assignments and every rank's header: one all-gather, the
        # layer's host sync, and the check that every rank runs the same call alike, at no extra collective. The
        # header ends with the previous step's time in microseconds, for the planner's check of its model.
        header = self._header(x) + [fingerprint(plan), round(previous.seconds() * 1e6) if previous else 0]
        mine = torch.cat([kept, counts, torch.tensor(header, dtype=torch.int64, device=counts.device)]).to(x.device)
        if self.world > 1:
            gathered = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=x.device)
            try:
                compat.all_gather_single(gathered, mine, group=self.group)
            except RuntimeError as e:
                timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
                if not timed_out or failure.recorded_failure() is not None:
                    raise  # a rank failed (fastdist.distributed.failure names it)
                raise UnmatchedCallError(self.layer_index, header[1], _STEP.get() is not None) from e
        else:
            gathered = mine
        self._calls += 1
        gathered = gathered.view(self.world, -1).cpu().numpy()
        if self.world > 1:
            self._check_headers(gathered[:, 2 * self.num_experts:])
        kept_counts = gathered[:, :self.num_experts]
        all_counts = gathered[:, self.num_experts:2 * self.num_experts]
        # Next step's plan is computed on a CPU thread while this step's all-to-alls and experts run.
        if self.world > 1:
            measured = gathered[:, -1]  # the slowest rank's time, when every rank measured the step
            planning = _planner_thread().submit(self._plan_next, kept_counts,
                                                float(measured.max()) / 1e6 if measured.min() > 0 else 0.0)
        else:
            planning = None

        route = self._dispatch_plan(kept_counts, plan, x.device)
        rows = moe_permute(x, row_of_slot, route.kept_rows)
        if route.local_experts:
            send_rows = rows.index_select(0, route.send_index)
            local_rows = rows.index_select(0, route.local_index)
        else:
            send_rows, local_rows = rows, rows[:0]
        if self.world > 1:
            received = _AllToAll.apply(send_rows, route.recv_splits, route.send_splits, self.group, clock, False,
                                       self.layer_index)
        else:
            received = send_rows
        by_expert = received.index_select(0, route.to_expert_major)

        # Owned experts first (their rows have arrived), then the replicas (their parameters had the longest to
        # arrive), both before the combine all-to-all so that owners and holders compute at the same time.
        owned = (self.w1, self.b1, self.w2, self.b2)
        if traffic is not None:
            owned = _OwnedExperts.apply(traffic, *owned)
        owned_params = list(zip(*(p.unbind(0) for p in owned)))  # one backward node per weight, not per expert
        y_by_expert = self._experts(by_expert, route.owned_sizes, owned_params)
        if route.local_experts:
            replica_flat = _ReplicaParams.apply(traffic, self.b2)
            replica_params = [tuple(replica_flat[4 * i:4 * i + 4]) for i in range(len(route.local_experts))]
            y_local = self._experts(local_rows, route.local_sizes, replica_params)
        elif traffic is not None:
            traffic.replica_params()  # no replica here; completes this rank's parameter sends
        y_received = torch.empty_like(y_by_expert).index_copy(0, route.to_expert_major, y_by_expert) \
            if y_by_expert.shape[0] else y_by_expert
        y_sent = _AllToAll.apply(y_received, route.send_splits, route.recv_splits, self.group, clock, True,
                                 self.layer_index) if self.world > 1 else y_received
        if route.local_experts:
            y_rows = y_sent.new_empty(rows.shape).index_copy(0, torch.cat([route.send_index, route.local_index]),
                                                             torch.cat([y_sent, y_local]))
        else:
            y_rows = y_sent
        out = moe_unpermute(y_rows, row_of_slot, topk_weight.to(y_rows.dtype))
        forward_s = time.perf_counter() - start
        if clock is not None:
            clock.forward_s = forward_s
        self._record(kept_counts, all_counts, plan, forward_s, route.send_splits, route.recv_splits)
        if planning is not None:
            planning.result()  # the next forward's all-gather checks that every rank planned alike
        self._stats["planner_searches"] = self.planner.searches  # skipped while the last search's result stands
        return out

    def _plan_next(self, kept_counts, previous_seconds):
        self.planner.observe(previous_seconds)
        return self.planner.update(kept_counts)

    def _dispatch_plan(self, kept_counts, plan, device):
        """Where this rank's rows go and where the received rows come from, from the count matrix and the plan.

        Rows (kept assignments, grouped by expert) of experts this rank replicates stay here (local_index, in expert
        order); the others go to their owners (send_index: destination-major, expert order inside). The received
        rows are source-major; to_expert_major reorders them for the owned experts.
        """
        replicated_here = set(plan.replicated_on(self.rank))
        my_kept = kept_counts[self.rank]
        my_offsets = np.cumsum(my_kept) - my_kept
        send_experts = [e for e in range(self.num_experts) if e not in replicated_here]
        local_experts = sorted(replicated_here)
        per = self.experts_per_rank
        send_splits = [int(sum(my_kept[e] for e in range(r * per, (r + 1) * per) if e not in replicated_here))
                       for r in range(self.world)]
        # What each source sends here: its rows for my experts it does not replicate. [R, E_local]
        mine = range(self.first_expert, self.first_expert + per)
        recv_counts = np.array([[0 if e in plan.replicated_on(s) else kept_counts[s, e] for e in mine]
                                for s in range(self.world)], dtype=np.int64)
        flat_counts = recv_counts.reshape(-1)
        src_starts = np.cumsum(flat_counts) - flat_counts
        expert_major = [s * per + i for i in range(per) for s in range(self.world)]
        return _DispatchPlan(
            kept_rows=int(my_kept.sum()),
            local_experts=local_experts,
            send_index=_segments_index(my_offsets[send_experts], my_kept[send_experts], device),
            local_index=_segments_index(my_offsets[local_experts], my_kept[local_experts], device),
            send_splits=send_splits,
            recv_splits=[int(v) for v in recv_counts.sum(axis=1)],
            to_expert_major=_segments_index(src_starts[expert_major], flat_counts[expert_major], device),
            owned_sizes=[int(v) for v in recv_counts.sum(axis=0)],
            local_sizes=[int(my_kept[e]) for e in local_experts])

    def _record(self, kept_counts, all_counts, plan, seconds, send_splits, recv_splits):
        h, inbound, outbound = loads(kept_counts, plan)
        h0, _, _ = loads(kept_counts, Plan())
        per_expert = kept_counts.sum(axis=0)
        mean_h = max(h.mean(), 1e-12)
        elem = self.w1.element_size()
        rank_self = self.rank
        a2a_bytes = [(sum(send_splits) - send_splits[rank_self]) * self.d_model * elem,
                     (sum(recv_splits) - recv_splits[rank_self]) * self.d_model * elem]
        cost = self.planner.cost
        self._stats = {
            "tokens_per_rank": h.tolist(),
            "tokens_max_over_mean": float(h.max() / mean_h),
            "tokens_max_over_mean_unbalanced": float(h0.max() / max(h0.mean(), 1e-12)),
            "tokens_in": inbound.tolist(), "tokens_out": outbound.tolist(),
            "a2a_bytes_per_rank": [int(max(i, o)) * self.d_model * elem for i, o in zip(inbound, outbound)],
            "a2a_bytes_this_rank": a2a_bytes,
            "dropped": int(all_counts.sum() - kept_counts.sum()),
            "tokens_per_expert": per_expert.tolist(),
            "std_tokens_per_expert": float(per_expert.std()),
            "std_tokens_per_rank_before": float(h0.std()),
            "std_tokens_per_rank_after": float(h.std()),
            "replicas": [list(p) for p in plan.replicas],
            "predicted_s": cost.time(kept_counts, plan)[0] if cost is not None else None,
            "predicted_unbalanced_s": cost.time(kept_counts, Plan())[0] if cost is not None else None,
            "forward_s": seconds,
        }

    def stats(self) -> dict:
        """Metrics of the last forward. Count-derived figures are global over the group and count token-expert
        assignments (a token routed to k experts counts k times); a2a_bytes_this_rank is [sent, received]."""
        return dict(self._stats)

    def get_extra_state(self) -> dict:
        """The planner's state (plan, counts, steps) for ``state_dict``, with the configuration's fingerprint."""
        return {"planner": self.planner.state_dict(), "config_fingerprint": fingerprint(self.config)}

    def set_extra_state(self, state: dict) -> None:
        """Restores what :meth:`get_extra_state` returned.

        Raises:
            ValueError: the state comes from a layer configured differently.
        """
        if state["config_fingerprint"] != fingerprint(self.config):
            raise ValueError("fastdist: MoELayer state_dict comes from a layer with a different configuration")
        self.planner.load_state_dict(state["planner"])
