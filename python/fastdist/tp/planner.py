"""The Oases planner: a tensor-parallel degree per op (attention, MLP of every layer), data parallelism filling
the rest of the machines, minimizing the step time under a memory limit.

For ``world`` ranks and an op run with tensor-parallel degree ``d`` (``world / d`` data-parallel replicas), per
training step (forward + backward, 3x the forward FLOPs):

* compute per rank is the same for every ``d`` (each replica's tokens, split ``d`` ways);
* tensor-parallel communication: one forward and one backward all-reduce of the replica's activation
  (``tokens * d / world`` rows of ``hidden``) over ``d`` ranks, overlapped with compute (Oases/chunking):
  the op costs ``max(compute, tp_comm + dp_comm)``, where ``dp_comm`` is the all-reduce of the op's gradient
  shard (``params / d``) over the ``world / d`` replicas;
* memory per rank: ``params / d`` times the optimizer's bytes per parameter, plus activations (the replicated
  part whole, the tensor-parallel part ``/ d``) of the replica's tokens;
* changing the degree between consecutive ops reshards the activation: an all-gather (forward) and a
  reduce-scatter (backward) of it among ``max(d1, d2) / min(d1, d2)`` ranks.

An integer program (scipy.optimize.milp) over paths through the ops: binary ``y[op, d1, d2]`` (the previous
op at degree d1, this one at d2) with flow conservation, the costs on the edges, and total memory within the
limit. A 48-layer model (96 ops, 4 degrees each) solves in well under a second.
"""
import dataclasses
import time

import numpy as np

from fastdist.tp.cost import CostModel

__all__ = ["ModelConfig", "Plan", "op_cost", "plan", "plan_cost"]

# The link and GEMM figures used when no calibrated CostModel is given: one 8-GPU NVLink-class node
# (alpha 5 us, 150 GB/s per link, 200 TFLOP/s sustained). Pass `cost_model` to plan for another machine.
NOMINAL = CostModel(alpha=5e-6, beta=150e9, gemm_overhead=5e-6, gemm_rate=200e12)


_TIE_BREAK = 1e-6


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A GPT-style model: ``layers`` blocks of attention (4 h^2 parameters) and MLP (2 r h^2)."""
    layers: int
    hidden: int
    heads: int
    seq_len: int
    global_batch: int              # sequences per step, over all data-parallel replicas
    mlp_ratio: int = 4
    dtype_bytes: int = 2           # activations and communication
    optimizer_bytes_per_param: int = 16  # bf16 weight + grad, fp32 master + Adam moments

    def params(self, op: str) -> int:
        """The parameters of ``op`` (``"attention"`` or ``"mlp"``) in one layer."""
        return 4 * self.hidden ** 2 if op == "attention" else 2 * self.mlp_ratio * self.hidden ** 2

    def forward_flops(self, op: str, tokens: int) -> int:
        """The forward FLOPs of ``op`` on ``tokens`` tokens (attention's scores and values included)."""
        if op == "attention":
            return 2 * tokens * self.params(op) + 4 * tokens * self.seq_len * self.hidden
        return 2 * tokens * self.params(op)

    def activation_bytes(self, op: str, tokens: int, degree: int) -> float:
        """Stored activations per rank of ``op`` ("attention" or "mlp") on ``tokens`` tokens at tensor-parallel
        ``degree`` d: the replicated part (LayerNorm input, residual) whole, the rest / d."""
        sharded = 5 if op == "attention" else 2 * self.mlp_ratio  # qkv + attention output; fc1 + GeLU output
        return tokens * self.hidden * self.dtype_bytes * (2 + sharded / degree)

    def shard_unit(self, op: str) -> int:
        """What a tensor-parallel degree of ``op`` must divide: its heads, or the MLP's hidden size."""
        return self.heads if op == "attention" else self.mlp_ratio * self.hidden


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen tensor-parallel degree of every op; data parallelism is ``world_size / degree``."""
    world_size: int
    degrees: tuple                 # ((layer, op, degree), ...) in model order
    step_time_s: float             # predicted
    memory_per_rank: float         # bytes
    solve_s: float

    def degree(self, layer: int, op: str) -> int:
        """The tensor-parallel degree of ``op`` (``"attention"`` or ``"mlp"``) in ``layer``.

        Raises:
            KeyError: the plan has no such op.
        """
        for entry_layer, entry_op, d in self.degrees:
            if entry_layer == layer and entry_op == op:
                return d
        raise KeyError(f"fastdist: the plan has no op {op!r} in layer {layer}")


def op_cost(config: ModelConfig, world: int, degree: int, op: str, model: CostModel) -> tuple[float, float]:
    """(seconds per step, bytes per rank) of one op at tensor-parallel degree ``degree`` on ``world`` ranks.

    Args:
        config: the model.
        world: ranks in all; the op's data-parallel degree is ``world / degree``.
        degree: the op's tensor-parallel degree.
        op: ``"attention"`` or ``"mlp"``.
        model: a calibrated cost model.
    """
    tokens_total = config.global_batch * config.seq_len
    replica_tokens = tokens_total * degree // world
    compute = 3 * config.forward_flops(op, replica_tokens) / degree / model.gemm_rate
    act = replica_tokens * config.hidden * config.dtype_bytes
    tp_comm = 2 * model.allreduce_time(act, degree) if degree > 1 else 0.0
    replicas = world // degree
    grad_bytes = config.params(op) // degree * config.dtype_bytes
    dp_comm = model.allreduce_time(grad_bytes, replicas) if replicas > 1 else 0.0
    time_s = max(compute, tp_comm + dp_comm)
    # Ties (communication hidden at several degrees) go to the degree that communicates least.
    time_s += _TIE_BREAK * (tp_comm + dp_comm)
    memory = config.params(op) / degree * config.optimizer_bytes_per_param \
        + config.activation_bytes(op, replica_tokens, degree)
    return time_s, memory


def _reshard_cost(config, world, d1, d2, model):
    if d1 == d2:
        return 0.0
    ratio = max(d1, d2) // min(d1, d2)
    tokens = config.global_batch * config.seq_len * max(d1, d2) // world
    nbytes = tokens * config.hidden * config.dtype_bytes
    # all-gather forward + reduce-scatter backward among `ratio` ranks: (ratio - 1) / ratio of the bytes each
    return 2 * ((ratio - 1) * model.alpha + (ratio - 1) / ratio * nbytes / model.beta)


def plan(model_config: ModelConfig, world_size: int, memory_limit: float, cost_model: CostModel | None = None,
         max_degree: int | None = None) -> Plan:
    """Chooses the tensor-parallel degree of every attention and MLP op (see the module docstring).

    Args:
        model_config: a :class:`ModelConfig`.
        world_size: ranks in all; each op's data-parallel degree is ``world_size / degree``.
        memory_limit: bytes per rank.
        cost_model: a calibrated :class:`fastdist.tp.CostModel` (default: the nominal NVLink node, ``NOMINAL``).
        max_degree: the largest tensor-parallel degree allowed (default ``world_size``; typically the GPUs of a
            node).

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: no assignment fits ``memory_limit`` (the message names the smallest footprint possible).
    """
    import scipy.sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    start = time.perf_counter()
    model = cost_model if cost_model is not None and cost_model.calibrated else NOMINAL
    cfg = model_config
    ops = [(layer, op) for layer in range(cfg.layers) for op in ("attention", "mlp")]
    max_degree = max_degree or world_size
    choices = {}
    for op in ("attention", "mlp"):
        choices[op] = [d for d in range(1, max_degree + 1)
                       if world_size % d == 0 and cfg.shard_unit(op) % d == 0
                       and (cfg.global_batch * d) % world_size == 0]
        if not choices[op]:
            raise ValueError(f"fastdist: plan: no tensor-parallel degree divides both world_size={world_size} and "
                             f"the {op}'s shard unit; check the model config")
    costs = {(op, d): op_cost(cfg, world_size, d, op, model) for op in choices for d in choices[op]}
    # A path through the ops: binary y[i, d1, d2] = "op i-1 runs at d1 and op i at d2" (i >= 1). Flow
    # conservation makes the y's one path; the node costs, resharding costs and memory sit on the edges. Apart
    # from the one memory row the matrix is a network's, so the LP relaxation is nearly integral and branch and
    # bound is quick.
    edges = {}
    for i in range(1, len(ops)):
        for d1 in choices[ops[i - 1][1]]:
            for d2 in choices[ops[i][1]]:
                edges[i, d1, d2] = len(edges)
    n = len(edges)
    c, mem = np.zeros(n), np.zeros(n)
    for (i, d1, d2), j in edges.items():
        t2, m2 = costs[ops[i][1], d2]
        c[j] = t2 + _reshard_cost(cfg, world_size, d1, d2, model)
        mem[j] = m2
        if i == 1:
            t1, m1 = costs[ops[0][1], d1]
            c[j] += t1
            mem[j] += m1
    r_idx, c_idx, vals, lo, hi = [], [], [], [], []

    def add_row(cols, coefs, low, high):
        row = len(lo)
        r_idx.extend([row] * len(cols)), c_idx.extend(cols), vals.extend(coefs)
        lo.append(low), hi.append(high)

    first = [j for (i, _, _), j in edges.items() if i == 1]
    add_row(first, [1.0] * len(first), 1, 1)
    for i in range(1, len(ops) - 1):  # what enters op i at degree d leaves it at degree d
        for d in choices[ops[i][1]]:
            into = [edges[i, d1, d] for d1 in choices[ops[i - 1][1]]]
            out = [edges[i + 1, d, d2] for d2 in choices[ops[i + 1][1]]]
            add_row(into + out, [1.0] * len(into) + [-1.0] * len(out), 0, 0)
    add_row(list(range(n)), list(mem), 0, memory_limit)
    matrix = scipy.sparse.csr_array((vals, (r_idx, c_idx)), shape=(len(lo), n))
    result = milp(c, constraints=LinearConstraint(matrix, lo, hi), integrality=np.ones(n), bounds=Bounds(0, 1))
    if result.status != 0 or result.x is None:
        smallest = sum(min(costs[op, d][1] for d in choices[op]) for _, op in ops)
        raise ValueError(f"fastdist: plan: no assignment of tensor-parallel degrees fits memory_limit="
                         f"{memory_limit:.3g} bytes per rank (the smallest footprint is {smallest:.3g} bytes)")
    chosen = {i: (d1, d2) for (i, d1, d2), j in edges.items() if result.x[j] > 0.5}
    degrees = [(ops[0][0], ops[0][1], chosen[1][0])]
    degrees += [(ops[i][0], ops[i][1], chosen[i][1]) for i in range(1, len(ops))]
    memory = sum(costs[op, d][1] for _, op, d in degrees)
    return Plan(world_size, tuple(degrees), plan_cost(cfg, world_size, degrees, model), float(memory),
                time.perf_counter() - start)


def plan_cost(model_config: ModelConfig, world_size: int, degrees: list[tuple[int, str, int]],
              cost_model: CostModel | None = None) -> float:
    """The predicted step time of an assignment ``[(layer, op, degree), ...]``: the planner's objective.

    Args:
        model_config: the model.
        world_size: ranks in all.
        degrees: the tensor-parallel degree of every op, in model order.
        cost_model: a calibrated cost model (default: ``NOMINAL``).
    """
    model = cost_model if cost_model is not None and cost_model.calibrated else NOMINAL
    total, previous = 0.0, None
    for _, op, d in degrees:
        t, _ = op_cost(model_config, world_size, d, op, model)
        total += t
        if previous is not None:
            total += _reshard_cost(model_config, world_size, previous, d, model)
        previous = d
    return float(total)
