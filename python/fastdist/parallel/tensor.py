"""The tensor-parallel dimension of :func:`fastdist.parallel.parallelize`: a stage's dense layers sharded with
:func:`fastdist.tp.parallelize`, and where each sharded parameter's slice sits in the full one (for gathering the
full state dict and re-sharding a loaded one)."""
from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Shard", "dense_layers", "expand_tp_plan", "shard_of", "shard_stage"]


@dataclasses.dataclass
class Shard:
    """How a tensor-parallel parameter of the stage relates to the full one: ``rows`` of the [out, in] weight (a
    column-parallel layer, its bias too) or a ``cols`` slice (a row-parallel weight); ``transposed``: the user's
    layer stores [in, out] (GPT-2's Conv1D)."""
    rows: torch.Tensor | None
    cols: tuple[int, int] | None
    transposed: bool


_MARK_BASE, _MARK_DIGITS = 256, 3  # row numbers written into a weight's first columns, in digits exact in any dtype


def dense_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The dense layers a tensor-parallel plan can name: ``nn.Linear`` and GPT-2's ``Conv1D``, by qualified name.

    Args:
        module: the stage (or any module) to search.
    """
    from fastdist.tp.linear import is_conv1d
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}


def shard_stage(stage: nn.Module, group: dist.ProcessGroup, plan: dict | None, overlap: int | str) -> dict[str, Shard]:
    """Shards ``stage`` over ``group`` with fastdist.tp.parallelize and returns each sharded parameter's layout.

    fastdist.tp decides each layer's layout (contiguous, or [q | k | v] blocks). To learn it, every dense weight's
    first columns are overwritten with its row numbers before sharding; the shards' first columns then say which
    rows each rank took, and the real values are copied in from the saved weights.

    Args:
        stage: this rank's pipeline stage, sharded in place.
        group: the tensor-parallel group.
        plan: {layer name: "colwise" | "rowwise"}, or None for fastdist.tp's default policy.
        overlap: ``overlap_chunks`` of the parallel linears ("auto" or an int).
    """
    from fastdist import tp
    from fastdist.tp.linear import ColumnParallelLinear, RowParallelLinear, dense_parameters, is_conv1d

    dense = dense_layers(stage)
    saved = {}
    digits = {}
    with torch.no_grad():
        for name, layer in dense.items():
            weight, _ = dense_parameters(layer)
            saved[name] = (weight.detach().clone(), is_conv1d(layer))
            k = min(_MARK_DIGITS, weight.shape[1])
            digits[name] = k
            rows = torch.arange(weight.shape[0])
            for d in range(k):
                weight[:, d] = ((rows // _MARK_BASE ** d) % _MARK_BASE).to(weight.dtype)
    try:
        tp.parallelize(stage, group, plan=plan, overlap_chunks=overlap)
    except ValueError as e:
        if "found no transformer block" in str(e):
            raise ValueError(f"{e}. With parallelize(tp_plan=...) name them with wildcards, e.g. "
                             "{'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.2': 'rowwise'}") from e
        raise
    layouts = {}
    modules = dict(stage.named_modules())
    with torch.no_grad():
        for name, (full, transposed) in saved.items():
            layer = modules[name]
            if isinstance(layer, ColumnParallelLinear):
                marks = layer.weight[:, :digits[name]].round().long()
                rows = sum(marks[:, d] * _MARK_BASE ** d for d in range(digits[name]))
                layer.weight.copy_(full[rows])
                layouts[f"{name}.weight"] = Shard(rows, None, transposed)
                if layer.bias is not None:
                    layouts[f"{name}.bias"] = Shard(rows, None, False)
            elif isinstance(layer, RowParallelLinear):
                cols = (layer.rank * layer.in_per_rank, (layer.rank + 1) * layer.in_per_rank)
                layer.weight.copy_(full[:, cols[0]:cols[1]])
                layouts[f"{name}.weight"] = Shard(None, cols, transposed)
            else:
                dense_parameters(layer)[0].copy_(full)
    return layouts


def expand_tp_plan(stage: nn.Module, plan: Mapping[str, str] | None) -> dict[str, str] | None:
    """A user's plan with wildcards (``blocks.*.mlp.0``) expanded to the stage's dense layer names.

    Args:
        stage: this rank's pipeline stage.
        plan: {pattern: style}, or None (then None).
    """
    if plan is None:
        return None
    names = [n for n in dense_layers(stage)]
    out = {}
    for pattern, style in plan.items():
        for n in names:
            if fnmatch.fnmatchcase(n, pattern):
                out[n] = style
    return out


def shard_of(full: torch.Tensor, layout: Shard) -> torch.Tensor:
    """This rank's tensor-parallel slice of a full parameter (or of a tensor of its shape).

    Args:
        full: the full parameter (or optimizer state of its shape).
        layout: where this rank's slice sits.
    """
    full = full.t() if layout.transposed else full
    return full[:, layout.cols[0]:layout.cols[1]] if layout.cols is not None else full[layout.rows]
