"""The peers a user would pick instead of fastdist, as the benchmark suites run them: one definition each, used by
every suite that runs that peer.

- torch DTensor tensor parallelism (`dtensor_parallel`, `ready`): `tp`'s row op, MLP and GPT block.
- torch.utils.checkpoint as users call it (`checkpointed`): recompute in `tp` and `memory`.
- Tutel's dropless MoE (`PaddedDroplessMoE`, an equivalent on torch ops: Tutel is not in the package registry):
  `moe`'s tutel-padded.
- DDP with sparse embedding gradients (`ddp_sparse`, `ddp_sparse_wire_bytes`): `sparse`'s part ddp and
  `sparse-lm`'s agsparse.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastdist.distributed.compat import all_gather_single


def dtensor_parallel(module: nn.Module, plan: dict[str, str], mesh: Any) -> nn.Module:
    """`module` made tensor-parallel by torch's parallelize_module on `mesh`.

    Args:
        module: The unsharded module (it is sharded in place).
        plan: Submodule paths (or "" for the module itself) -> "colwise" / "rowwise".
        mesh: The device mesh, e.g. init_device_mesh("cpu", (world,)) over the run's gloo group.

    Returns:
        The parallelized module.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = styles[plan[""]]() if "" in plan else {path: styles[kind]() for path, kind in plan.items()}
    return parallelize_module(module, mesh, plan)


DTENSOR_GPT_BLOCK_PLAN = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
"""dtensor_parallel's plan for fastdist.tp.GPTBlock: its qkv output is head-major, so DTensor's contiguous column
shard holds whole heads, and its attention takes the head count from the width it is given."""


def ready(t: torch.Tensor) -> torch.Tensor:
    """`t` once every collective that produces it is complete: DTensor's collectives are functional ones whose
    result (an AsyncCollectiveTensor) is waited for only where it is read, so a timed call must read it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def checkpointed(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) under torch.utils.checkpoint, non-reentrant (torch's recommended form): activations recomputed in
    the backward."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False)


class PaddedDroplessMoE(nn.Module):
    """Tutel's dropless MoE layer (``capacity_factor=0``), re-implemented on torch ops as the benchmark's
    equivalent of the peer (Tutel is not in the package registry and its source is not at hand).

    As Tutel does it: softmax gate scores, top-k, each assignment's position in its expert's buffer with every
    first choice before any second choice; the capacity is the largest per-expert count on any rank (one small
    collective); every rank scatters its rows into ``[experts, capacity, d_model]`` zeros, an equal-split
    all-to-all brings each owner ``[ranks, local experts, capacity, d_model]``, the experts run as batched GEMMs
    over all of it (padding included), a second all-to-all returns the rows and each token sums its k rows
    weighted by its gates, normalized to sum 1 (Tutel's default ``normalize_gate=True``). Parameters are laid out
    as MoELayer's (``gate``, ``w1 [local experts, d_model, d_ff]``, ``b1``, ``w2``, ``b2``), so its weights can be
    the same.

    Args:
        d_model, d_ff, num_experts, k: as for MoELayer.
        activation: "gelu", "relu" or "silu" (Tutel's default is ReLU; the benchmark uses MoELayer's).
        group: the expert-parallel process group (None: the default group).
        normalize_gate: divide each token's top-k gates by their sum.
    """

    _ACTIVATIONS = {"gelu": torch.nn.functional.gelu, "relu": torch.nn.functional.relu,
                    "silu": torch.nn.functional.silu}

    def __init__(self, d_model: int, d_ff: int, num_experts: int, k: int = 2, activation: str = "gelu",
                 group: dist.ProcessGroup | None = None, normalize_gate: bool = True):
        super().__init__()
        self.group, self.world = group, dist.get_world_size(group)
        if num_experts % self.world:
            raise ValueError(f"PaddedDroplessMoE: num_experts={num_experts} is not a multiple of the group size "
                             f"{self.world}")
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.act, self.normalize_gate = self._ACTIVATIONS[activation], normalize_gate
        e_local = num_experts // self.world
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(e_local, d_model, d_ff))
        self.b1 = nn.Parameter(torch.zeros(e_local, d_ff))
        self.w2 = nn.Parameter(torch.empty(e_local, d_ff, d_model))
        self.b2 = nn.Parameter(torch.zeros(e_local, d_model))
        self._stats = {}

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their gates [T, k], normalized when configured) of tokens ``x [T, d_model]``."""
        scores = torch.softmax(self.gate(x).float(), dim=-1)
        top, idx = torch.topk(scores, self.k, dim=1)
        if self.normalize_gate:
            top = top / top.sum(dim=1, keepdim=True).clamp_min(torch.finfo(top.dtype).eps)
        return idx, top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on this rank's tokens ``x [..., d_model]`` (a collective over the group)."""
        from torch.distributed.nn.functional import all_to_all_single  # differentiable; imports rpc: not at start

        shape = x.shape
        x = x.reshape(-1, self.d_model)
        tokens, experts, e_local = x.shape[0], self.num_experts, self.num_experts // self.world
        idx, gates = self.gates(x)
        choice_major = idx.t().reshape(-1)  # all first choices, then all second choices, token order within each
        one_hot = torch.nn.functional.one_hot(choice_major, experts)
        location = (one_hot.cumsum(0) - 1).gather(1, choice_major[:, None]).squeeze(1)
        counts = one_hot.sum(0)
        every = torch.empty(self.world * experts, dtype=counts.dtype)
        all_gather_single(every, counts, group=self.group)  # Tutel all-reduces the max: one small collective too
        every = every.view(self.world, experts)
        capacity = max(int(every.max()), 1)
        slot = choice_major * capacity + location
        padded = x.new_zeros(experts * capacity, self.d_model).index_add(0, slot, x.repeat(self.k, 1))
        received = all_to_all_single(torch.empty_like(padded), padded, group=self.group)  # equal splits
        rows = received.view(self.world, e_local, capacity, self.d_model).transpose(0, 1) \
            .reshape(e_local, self.world * capacity, self.d_model)
        y = torch.baddbmm(self.b2[:, None], self.act(torch.baddbmm(self.b1[:, None], rows, self.w1)), self.w2)
        back = y.view(e_local, self.world, capacity, self.d_model).transpose(0, 1).reshape(-1, self.d_model)
        returned = all_to_all_single(torch.empty_like(back), back, group=self.group)
        out = (returned.index_select(0, slot).view(self.k, tokens, self.d_model)
               * gates.t().to(x.dtype)[..., None]).sum(0)
        self._record(every.numpy(), capacity, x.element_size())
        return out.reshape(shape)

    def _record(self, every, capacity, elem):
        e_local = self.num_experts // self.world
        loads = every.sum(axis=0).reshape(self.world, e_local).sum(axis=1)  # assignments each owner computes
        computed = e_local * self.world * capacity
        wire = (self.num_experts - e_local) * capacity * self.d_model * elem
        self._stats = {"tokens_max_over_mean": float(loads.max() / max(loads.mean(), 1e-12)),
                       "tokens_max_over_mean_unbalanced": float(loads.max() / max(loads.mean(), 1e-12)),
                       "a2a_bytes_per_rank": [wire] * self.world, "std_tokens_per_rank_before": float(loads.std()),
                       "std_tokens_per_rank_after": float(loads.std()),
                       "dropped": 0, "replicas": [], "predicted_s": None,
                       "rows_computed_over_routed": computed * self.world / max(int(every.sum()), 1)}

    def stats(self) -> dict:
        """The last forward's figures, named as MoELayer.stats()'s: tokens per rank are the assignments routed to
        each owner's experts (all of its padded rows are computed: rows_computed_over_routed)."""
        return dict(self._stats)


def ddp_sparse(model: nn.Module, **ddp_options: Any) -> nn.Module:
    """DDP over `model`, whose embeddings give sparse gradients: gloo's sparse all-reduce all-gathers each rank's
    coalesced (index, row) lists of a table's gradient; the dense parameters are all-reduced.

    Args:
        model: A model with at least one nn.Embedding / nn.EmbeddingBag built with sparse=True.
        ddp_options: Passed to DistributedDataParallel (bucket_cap_mb, ...).

    Returns:
        The DistributedDataParallel model.

    Raises:
        ValueError: no embedding of `model` is sparse (DDP would all-reduce the dense table gradients).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse for m in model.modules()):
        raise ValueError(f"ddp_sparse: {type(model).__name__} has no embedding with sparse=True")
    return DistributedDataParallel(model, **ddp_options)


def ddp_sparse_wire_bytes(rows_per_rank: Sequence[int], row_values: int, value_bytes: int = 4) -> int:
    """Bytes the busiest rank sends in DDP-sparse's all-gather of one table's gradient: a ring all-gatherv of each
    rank's (int64 index, row) list, in which the busiest rank forwards every list but the smallest.

    Args:
        rows_per_rank: The distinct rows of the table each rank's gradient holds.
        row_values: Values per row (the table's width).
        value_bytes: Bytes per value.
    """
    lists = [int(rows) * (8 + row_values * value_bytes) for rows in rows_per_rank]
    return sum(lists) - min(lists)
