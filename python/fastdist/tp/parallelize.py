"""Turning a standard GPT-style model into a tensor-parallel one without rewriting it.

:func:`parallelize` swaps the ``nn.Linear`` layers of every GPT-style block (attention ``qkv``/``proj``, MLP
``fc1``/``fc2``, as in :class:`fastdist.tp.GPTBlock`; nanoGPT's ``c_attn``/``c_proj``/``c_fc`` names too) for
:class:`ColumnParallelLinear` / :class:`RowParallelLinear` shards of the same weights, like torch's
``parallelize_module`` with a column-wise/row-wise plan. The attention then runs the local heads only (the qkv
output is head-major, so a column shard holds whole heads).
"""
import torch.distributed as dist
from torch import nn

from fastdist.tp.cost import CostModel
from fastdist.tp.linear import ColumnParallelLinear, RowParallelLinear
from fastdist.tp.planner import Plan

__all__ = ["parallelize"]

# (block child, its column-parallel linear, its row-parallel linear), per naming convention.
_PAIRS = {
    "attention": [("attn", "qkv", "proj"), ("attn", "c_attn", "c_proj")],
    "mlp": [("mlp", "fc1", "fc2"), ("mlp", "c_fc", "c_proj")],
}


def _find_pair(block, op):
    for child, column, row in _PAIRS[op]:
        sub = getattr(block, child, None)
        if sub is not None and isinstance(getattr(sub, column, None), nn.Linear) \
                and isinstance(getattr(sub, row, None), nn.Linear):
            return sub, column, row
    return None


def _blocks(model):
    """GPT-style blocks of `model` in module order: modules with an attention and an MLP pair of linears."""
    return [m for m in model.modules() if _find_pair(m, "attention") and _find_pair(m, "mlp")]


def parallelize(model: nn.Module, group: dist.ProcessGroup | None = None, plan: Plan | dict[str, str] | None = None,
                overlap_chunks: int | str = "auto", cost_model: CostModel | None = None) -> nn.Module:
    """Shards ``model``'s GPT-style blocks over ``group`` in place and returns ``model``.

    Args:
        model: an ``nn.Module`` containing GPT-style blocks (found by their linears' names; see module docstring).
        group: the tensor-parallel process group (None: the default group).
        plan: None (every op at degree ``group``'s size), a :class:`fastdist.tp.Plan` (its degree per layer and
            op: the group's size, or 1 to keep the op replicated), or a dict ``{"module.path": "colwise" |
            "rowwise"}`` naming linears explicitly.
        overlap_chunks: passed to every parallel linear.
        cost_model: passed to every parallel linear.

    Returns:
        ``model``, sharded. Every rank must call it with the same model structure and plan (the linears check
        their configuration across ranks).

    Raises:
        ValueError: no GPT-style block, a linear that is not an ``nn.Linear``, an unknown style, or a plan made
            for another tensor-parallel degree.
    """
    world = dist.get_world_size(group)
    kwargs = {"overlap_chunks": overlap_chunks, "cost_model": cost_model}
    if isinstance(plan, dict):
        for name, style in plan.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            linear = getattr(parent, leaf)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"fastdist: parallelize: {name} is a {type(linear).__name__}, not an nn.Linear")
            if style == "colwise":
                setattr(parent, leaf, ColumnParallelLinear.from_linear(linear, group, **kwargs))
            elif style == "rowwise":
                setattr(parent, leaf, RowParallelLinear.from_linear(linear, group, **kwargs))
            else:
                raise ValueError(f"fastdist: parallelize: style for {name} must be 'colwise' or 'rowwise', "
                                 f"got {style!r}")
        return model
    blocks = _blocks(model)
    if not blocks:
        raise ValueError("fastdist: parallelize found no GPT-style block (attn.qkv/attn.proj and mlp.fc1/mlp.fc2 "
                         "linears, or nanoGPT's attn.c_attn/c_proj and mlp.c_fc/c_proj)")
    if isinstance(plan, Plan) and plan.world_size != world and any(d not in (1, world) for _, _, d in plan.degrees):
        raise ValueError(f"fastdist: parallelize: the plan was made for {plan.world_size} ranks with degrees "
                         f"{sorted({d for _, _, d in plan.degrees})}; this group has {world}")
    for layer, block in enumerate(blocks):
        for op in ("attention", "mlp"):
            degree = world if plan is None else plan.degree(layer, op)
            if degree == 1:
                continue
            if degree != world:
                raise ValueError(f"fastdist: parallelize: layer {layer} {op} has degree {degree}; pass the "
                                 f"tensor-parallel group of that size (this one has {world} ranks)")
            sub, column, row = _find_pair(block, op)
            setattr(sub, column, ColumnParallelLinear.from_linear(getattr(sub, column), group, **kwargs))
            setattr(sub, row, RowParallelLinear.from_linear(getattr(sub, row), group, **kwargs))
    return model
