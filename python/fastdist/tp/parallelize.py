"""Turning a standard transformer into a tensor-parallel one without rewriting it.

:func:`parallelize` finds each block's attention and MLP, written the way the common projects write them, and
swaps their dense layers for :class:`ColumnParallelLinear` / :class:`RowParallelLinear` shards of the same
weights, like torch's ``parallelize_module`` with a column-wise/row-wise plan:

=====================  ==========================================  ==========================================
style                  attention: column linears -> row linear     MLP: column linears -> row linear
=====================  ==========================================  ==========================================
fastdist GPTBlock      ``attn.qkv`` -> ``attn.proj``               ``mlp.fc1`` -> ``mlp.fc2``
nanoGPT                ``attn.c_attn`` -> ``attn.c_proj``          ``mlp.c_fc`` -> ``mlp.c_proj``
Hugging Face GPT-2     the same names, ``Conv1D`` layers           the same names, ``Conv1D`` layers
Hugging Face LLaMA     ``self_attn.q_proj, k_proj, v_proj``        ``mlp.gate_proj, up_proj`` -> ``down_proj``
                       -> ``self_attn.o_proj``
Meta LLaMA             ``attention.wq, wk, wv`` -> ``wo``          ``feed_forward.w1, w3`` -> ``w2``
=====================  ==========================================  ==========================================

Each rank must hold whole heads. A separate q/k/v projection's contiguous shard is whole heads; a fused qkv
projection's is not when its output is ``[q | k | v]`` (nanoGPT, GPT-2): each rank then takes its heads' rows of
q, of k and of v (``ColumnParallelLinear.from_linear(parts=3)``). The attention module's head-count and width
attributes (``n_head``, ``num_heads``, ``num_key_value_heads``, ``n_embd``, ``embed_dim``, ``split_size``,
``hidden_size``, ...) become the local ones, since forwards shape their views with them. nanoGPT's forward takes its
width from the input (``C // self.n_head``), which stays the full hidden size, so its attention gets the same
forward written with the local width.

Before anything is swapped, each attention and MLP is checked on one process: the module's forward on a small
random input with random weights, against the sum over ranks of the same forward run on each rank's shards
(the row-parallel all-reduce). The layout is the first that reproduces it: contiguous, ``[q | k | v]`` (or
``[q | k | v]`` of a grouped-query attention's sizes), ``[gate | up]``. None does: a ValueError that says how to
write the module. A module whose forward needs more than the hidden states (rotary embeddings, masks) cannot be
run alone: separate projections are then sharded by whole heads as counted from ``head_dim`` and the head-count
attributes, and a fused one raises.
"""
import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdist.distributed import check_same
from fastdist.tp.cost import CostModel
from fastdist.tp.linear import ColumnParallelLinear, RowParallelLinear, dense_parameters, is_conv1d, output_rows
from fastdist.tp.planner import Plan

__all__ = ["parallelize"]

# (block child, its column-parallel linears, its row-parallel linear), per naming convention.
_PATTERNS = {
    "attention": [("attn", ("qkv",), "proj"), ("attn", ("c_attn",), "c_proj"),
                  ("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"), ("attention", ("wq", "wk", "wv"), "wo")],
    "mlp": [("mlp", ("fc1",), "fc2"), ("mlp", ("c_fc",), "c_proj"), ("mlp", ("gate_proj", "up_proj"), "down_proj"),
            ("feed_forward", ("w1", "w3"), "w2")],
}
# The attention attributes that count heads, or give the width of all heads together: each rank's become its own.
_HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_local_heads")
_KV_HEAD_COUNTS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_local_kv_heads")
_WIDTHS = ("n_embd", "embed_dim", "hidden_size", "split_size", "all_head_size")
# The probe: a [batch, seq, hidden] input, and how close the ranks' summed output must come to the module's (a wrong
# layout is off by the output's own size).
_PROBE_BATCH, _PROBE_SEQ = 2, 3
_PROBE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
_PROBE_TOLERANCE_LOW_PRECISION = 3e-2


def _is_dense(module):
    return isinstance(module, nn.Linear) or is_conv1d(module)


@dataclasses.dataclass
class _Region:
    """Column-parallel linears feeding one row-parallel linear, all children of ``module`` (at ``name``)."""
    name: str
    module: nn.Module
    columns: tuple[str, ...]
    row: str

    def where(self, child: str | None = None) -> str:
        path = ".".join(p for p in (self.name, child) if p)
        return path or type(self.module).__name__


def _find_region(block, name, op):
    for child, columns, row in _PATTERNS[op]:
        sub = getattr(block, child, None)
        if isinstance(sub, nn.Module) and all(_is_dense(getattr(sub, c, None)) for c in (*columns, row)):
            return _Region(f"{name}.{child}" if name else child, sub, columns, row)
    return None


def _blocks(model):
    """(name, attention region, MLP region) of every block of ``model``, in module order."""
    found = []
    for name, m in model.named_modules():
        attention, mlp = _find_region(m, name, "attention"), _find_region(m, name, "mlp")
        if attention and mlp:
            found.append((name, attention, mlp))
    return found


# ---- how a region is sharded ----

@dataclasses.dataclass
class _Sharding:
    parts: tuple          # per column linear: ColumnParallelLinear.from_linear's `parts`
    attributes: dict      # attribute -> this rank's value
    forward: Callable | None  # a replacement forward (a known style whose own forward cannot run on local heads)


def _int_attribute(module, name):
    value = module.__dict__.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_attention(module):
    return any(_int_attribute(module, a) is not None for a in (*_HEAD_COUNTS, *_KV_HEAD_COUNTS, "head_dim"))


def _split_head_error(what, heads, kind, world):
    return ValueError(
        f"fastdist: parallelize: {what} has {heads} {kind}head(s), not divisible by the tensor-parallel world size "
        f"{world}: sharding it would split a head. Keep this attention replicated (a plan with degree 1 for "
        f"attention), or use a tensor-parallel group of a size that divides the {kind}heads.")


def _local_attributes(region, world):
    """{attribute: this rank's value} of the attention's head counts and widths."""
    local = {}
    for name in (*_HEAD_COUNTS, *_KV_HEAD_COUNTS, *_WIDTHS):
        value = _int_attribute(region.module, name)
        if value is None:
            continue
        if value % world:
            if name in _WIDTHS:
                raise ValueError(f"fastdist: parallelize: {region.where(name)}={value} is not divisible by the "
                                 f"tensor-parallel world size {world}")
            raise _split_head_error(f"{region.where()} ({name}={value})", value,
                                    "key/value " if name in _KV_HEAD_COUNTS else "", world)
        local[name] = value // world
    return local


def _head_size(region, widths):
    """The attention's head size: its ``head_dim``, else its width over its head count; None when unknown."""
    head_dim = _int_attribute(region.module, "head_dim")
    if head_dim:
        return head_dim
    heads = next((_int_attribute(region.module, a) for a in _HEAD_COUNTS if _int_attribute(region.module, a)), None)
    if heads and widths[0] % heads == 0:
        # a separate q projection, or a fused [q|k|v] / head-major one of three equal parts
        return widths[0] // heads if len(widths) > 1 else widths[0] // (3 * heads)
    return None


def _candidates(region, world, attention):
    """The layouts worth trying, most likely first: tuples of each column linear's ``parts``."""
    widths = [dense_parameters(getattr(region.module, c))[0].shape[0] for c in region.columns]
    if len(widths) > 1:
        return [(1,) * len(widths)]
    layouts = [(1,), (3,), (2,)]
    head_dim = _head_size(region, widths) if attention else None
    heads = next((_int_attribute(region.module, a) for a in _HEAD_COUNTS if _int_attribute(region.module, a)), None)
    kv = next((_int_attribute(region.module, a) for a in _KV_HEAD_COUNTS if _int_attribute(region.module, a)), None)
    if head_dim and heads and kv and kv != heads and widths[0] == (heads + 2 * kv) * head_dim:
        layouts.insert(1, ((heads * head_dim, kv * head_dim, kv * head_dim),))  # fused grouped-query [q | k | v]
    return [p for p in layouts if _splits(widths[0], p[0], world, head_dim)]


def _splits(width, parts, world, head_dim):
    blocks = [width // parts] * parts if isinstance(parts, int) else list(parts)
    if sum(blocks) != width:
        return False
    unit = world * (head_dim or 1)
    return all(b % unit == 0 for b in blocks)


def _check_whole_heads(region, world):
    """For separate q/k/v projections that cannot be probed: each must hold a multiple of ``world`` heads."""
    widths = [dense_parameters(getattr(region.module, c))[0].shape[0] for c in region.columns]
    head_dim = _head_size(region, widths)
    if head_dim is None:
        raise ValueError(f"fastdist: parallelize: cannot tell the head size of {region.where()}: its forward needs "
                         "more than the hidden states, so it cannot be checked on a probe, and it has no head_dim "
                         "or head-count attribute (num_heads, n_head, ...). Give it one.")
    for column, width in zip(region.columns, widths):
        heads = width // head_dim
        if width % head_dim or heads % world:
            raise _split_head_error(f"{region.where(column)} (heads of size {head_dim})", heads,
                                    "key/value " if column != region.columns[0] else "", world)


# ---- the probe: the region's forward on one process, whole and sharded ----

def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


def _plain_linear(weight, bias):
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                      dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


@contextlib.contextmanager
def _installed(module, children, attributes, forward):
    """``module`` with some children, attributes and its forward replaced; all restored on exit."""
    saved_children = {n: module._modules[n] for n in children}
    saved_attributes = {n: module.__dict__[n] for n in attributes}
    saved_forward = module.__dict__.get("forward")
    training = module.training
    try:
        for n, child in children.items():
            setattr(module, n, child)
        module.__dict__.update(attributes)
        if forward is not None:
            module.forward = functools.partial(forward, module)
        module.eval()
        yield module
    finally:
        for n, child in saved_children.items():
            setattr(module, n, child)
        module.__dict__.update(saved_attributes)
        if saved_forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = saved_forward
        module.train(training)


class _Probe:
    """The region's forward on random weights and a random input, whole (``reference``) and as the sum of the
    ranks' outputs on their shards (:meth:`error`); no collective, nothing in the model changed."""

    def __init__(self, region, world):
        self.region, self.world = region, world
        first = dense_parameters(getattr(region.module, region.columns[0]))[0]
        self.device, self.dtype = first.device, first.dtype
        g = torch.Generator().manual_seed(0)

        def draw(*shape):
            return torch.randn(*shape, generator=g).to(self.device, self.dtype)

        self.full = {}
        for child in (*region.columns, region.row):
            weight, bias = dense_parameters(getattr(region.module, child))
            out_features, in_features = weight.shape
            self.full[child] = (draw(out_features, in_features) / math.sqrt(in_features),
                                None if bias is None else draw(out_features) / 4)
        self.x = draw(_PROBE_BATCH, _PROBE_SEQ, first.shape[1])
        self.reference, self.why_not = None, None
        if self.device.type == "meta":
            self.why_not = "its parameters are on the meta device"
            return
        children = {c: _plain_linear(*self.full[c]) for c in self.full}
        try:
            with torch.no_grad(), _installed(region.module, children, {}, None) as m:
                self.reference = _first_tensor(m(self.x))
        except Exception as e:  # noqa: BLE001 - any failure means: cannot be run on the hidden states alone
            self.why_not = f"its forward does not run on the hidden states alone ({type(e).__name__}: {e})"
        if self.reference is None and self.why_not is None:
            self.why_not = "its forward returns no tensor"

    def error(self, sharding):
        """The largest difference between the module's output and the ranks' summed outputs under ``sharding``,
        relative to the output's largest value; the exception's text when the sharded forward fails."""
        total = None
        row_weight, row_bias = self.full[self.region.row]
        cols_per_rank = row_weight.shape[1] // self.world
        for rank in range(self.world):
            children = {}
            for child, parts in zip(self.region.columns, sharding.parts):
                weight, bias = self.full[child]
                rows = output_rows(weight.shape[0], parts, self.world, rank).to(self.device)
                children[child] = _plain_linear(weight[rows], None if bias is None else bias[rows])
            cols = slice(rank * cols_per_rank, (rank + 1) * cols_per_rank)
            bias = None if row_bias is None else (row_bias if rank == 0 else torch.zeros_like(row_bias))
            children[self.region.row] = _plain_linear(row_weight[:, cols], bias)
            try:
                with torch.no_grad(), _installed(self.region.module, children, sharding.attributes,
                                                 sharding.forward) as m:
                    out = _first_tensor(m(self.x))
                if out is None or out.shape != self.reference.shape:
                    return f"its output has shape {None if out is None else list(out.shape)}"
            except Exception as e:  # noqa: BLE001 - a layout the forward cannot run is a wrong layout
                return f"{type(e).__name__}: {e}"
            total = out if total is None else total + out
        scale = self.reference.abs().max().clamp_min(1e-30)
        return float(((total - self.reference).abs().max() / scale).item())

    def tolerance(self):
        return _PROBE_TOLERANCE.get(self.dtype, _PROBE_TOLERANCE_LOW_PRECISION)


def _nanogpt_attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """nanoGPT's ``CausalSelfAttention.forward`` with the width of its heads taken from ``self.n_embd`` (this
    rank's heads once sharded) instead of from the input, which keeps the full hidden size."""
    batch, seq, _ = x.size()
    head_dim = self.n_embd // self.n_head
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
    q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
    v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
    if self.flash:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
    else:
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :seq, :seq] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
    y = y.transpose(1, 2).contiguous().view(batch, seq, self.n_embd)
    return self.resid_dropout(self.c_proj(y))


# Forwards of known styles whose own forward reads the full width from the input; each is used only where the
# probe shows it computes what the module's own forward computes.
_LOCAL_FORWARDS = (_nanogpt_attention_forward,)


def _choose(region, world):
    """How to shard ``region``: the first layout (and forward) the probe confirms."""
    attention = _is_attention(region.module)
    attributes = _local_attributes(region, world) if attention else {}
    layouts = _candidates(region, world, attention)
    probe = _Probe(region, world)
    if probe.why_not is not None:
        if len(region.columns) > 1:
            if attention:
                _check_whole_heads(region, world)
            return _Sharding(layouts[0], attributes, None)
        if not attention and layouts and layouts[0] == (1,):
            return _Sharding((1,), attributes, None)
        raise ValueError(
            f"fastdist: parallelize: cannot check how {region.where(region.columns[0])}'s fused output splits "
            f"into whole heads: {probe.why_not}. Use separate q, k and v linears (each is sharded by whole heads), "
            "or give the attention a forward that takes the hidden states alone.")
    tried = []
    for forward in (None, *(_LOCAL_FORWARDS if attention else ())):
        for parts in layouts:
            sharding = _Sharding(parts, attributes, forward)
            error = probe.error(sharding)
            if isinstance(error, float) and error <= probe.tolerance():
                return sharding
            shown = f"off by {error:.3g} of the output" if isinstance(error, float) else error
            tried.append(f"parts={parts[0] if len(parts) == 1 else parts}"
                         f"{'' if forward is None else ' with ' + forward.__name__}: {shown}")
    adapted = ", ".join(f"{a}={v}" for a, v in attributes.items()) or "none found"
    raise ValueError(
        f"fastdist: parallelize: sharding {region.where()} over {world} ranks does not reproduce the module with any "
        f"layout of whole heads ({'; '.join(tried)}). Attributes set to each rank's value: {adapted}. Write its "
        f"forward so that it shapes heads from attributes ({', '.join(_HEAD_COUNTS[:3])}, n_embd, head_dim) or "
        "from -1 (q.view(B, T, -1, head_dim)) rather than from the input's width, or keep it replicated (leave it "
        "out of the plan).")


def _region_signature(region):
    """What decides a region's sharding: its class, its attributes' values and its linears' kinds and shapes
    (the blocks of one model share it, so the probe runs once per kind of block)."""
    module = region.module
    attributes = tuple((a, _int_attribute(module, a)) for a in (*_HEAD_COUNTS, *_KV_HEAD_COUNTS, *_WIDTHS, "head_dim"))
    linears = tuple((c, type(getattr(module, c)).__name__, tuple(dense_parameters(getattr(module, c))[0].shape))
                    for c in (*region.columns, region.row))
    return type(module), attributes, linears


def _shard_region(region, group, world, kwargs, chosen):
    signature = _region_signature(region)
    if signature not in chosen:
        chosen[signature] = _choose(region, world)
    sharding = chosen[signature]
    module = region.module
    for child, parts in zip(region.columns, sharding.parts):
        setattr(module, child, ColumnParallelLinear.from_linear(getattr(module, child), group, parts=parts, **kwargs))
    setattr(module, region.row, RowParallelLinear.from_linear(getattr(module, region.row), group, **kwargs))
    module.__dict__.update(sharding.attributes)
    if sharding.forward is not None:
        module.forward = functools.partial(sharding.forward, module)


def _plan_regions(model, plan):
    """The regions of a ``{"path": "colwise" | "rowwise"}`` plan (colwise linears that share a parent with one
    rowwise linear), and the linears left over, each sharded on its own."""
    by_parent: dict[str, dict[str, list[str]]] = {}
    for name, style in plan.items():
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"fastdist: parallelize: style for {name} must be 'colwise' or 'rowwise', got {style!r}")
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, leaf, None)
        if not _is_dense(linear):
            raise ValueError(f"fastdist: parallelize: {name} is a {type(linear).__name__}, not an nn.Linear "
                             "(or a GPT-2 style Conv1D)")
        by_parent.setdefault(parent_name, {"colwise": [], "rowwise": []})[style].append(leaf)
    regions, alone = [], []
    for parent_name, styles in by_parent.items():
        parent = model.get_submodule(parent_name) if parent_name else model
        if styles["colwise"] and len(styles["rowwise"]) == 1:
            regions.append(_Region(parent_name, parent, tuple(styles["colwise"]), styles["rowwise"][0]))
        else:
            alone += [(parent, leaf, style) for style, leaves in styles.items() for leaf in leaves]
    return regions, alone


def _structure(model):
    """What every rank's model must share for its shards to compute one model: every parameter's shape and dtype,
    and every attention's head counts and widths (the settings parallelize reads), by module path. Other settings
    may differ by design (a rank's own index, its experts)."""
    out = {}
    for name, module in model.named_modules():
        settings = {k: (tuple(p.shape), str(p.dtype)) for k, p in module.named_parameters(recurse=False)}
        if _is_attention(module):
            settings.update({a: _int_attribute(module, a) for a in (*_HEAD_COUNTS, *_KV_HEAD_COUNTS, *_WIDTHS,
                                                                    "head_dim")
                             if _int_attribute(module, a) is not None})
        if settings:
            out[name or "."] = settings
    return out


def parallelize(model: nn.Module, group: dist.ProcessGroup | None = None, plan: Plan | dict[str, str] | None = None,
                overlap_chunks: int | str = "auto", cost_model: CostModel | None = None) -> nn.Module:
    """Shards ``model``'s transformer blocks over ``group`` in place and returns ``model``.

    Args:
        model: an ``nn.Module`` containing transformer blocks in one of the styles of the module docstring.
        group: the tensor-parallel process group (None: the default group).
        plan: None (every op at degree ``group``'s size), a :class:`fastdist.tp.Plan` (its degree per layer and
            op: the group's size, or 1 to keep the op replicated), or a dict ``{"module.path": "colwise" |
            "rowwise"}`` naming linears explicitly. Column-wise linears that share a parent module with one
            row-wise linear are sharded together, by whole heads, as the blocks are.
        overlap_chunks: passed to every parallel linear.
        cost_model: passed to every parallel linear.

    Returns:
        ``model``, sharded. Every rank must call it with the same model structure and plan (the linears check
        their configuration across ranks).

    Raises:
        ValueError: no block found, a named layer that is not dense, an unknown style, a plan made for another
            tensor-parallel degree, heads that do not divide over the ranks, or an attention whose sharded forward
            does not reproduce it (the message says how to write it).
    """
    world = dist.get_world_size(group)
    # First, before anything can raise on one rank only: the arguments and the model's structure (its modules'
    # settings, e.g. an attention's head count, and its parameters' shapes), by name.
    check_same("parallelize", {"plan": plan, "overlap_chunks": str(overlap_chunks),
                               "cost_model": None if cost_model is None else type(cost_model).__name__,
                               "model": _structure(model)}, group)
    kwargs = {"overlap_chunks": overlap_chunks, "cost_model": cost_model}
    chosen = {}  # region signature -> its sharding
    if isinstance(plan, dict):
        regions, alone = _plan_regions(model, plan)
        for region in regions:
            _shard_region(region, group, world, kwargs, chosen)
        for parent, leaf, style in alone:
            cls = ColumnParallelLinear if style == "colwise" else RowParallelLinear
            setattr(parent, leaf, cls.from_linear(getattr(parent, leaf), group, **kwargs))
        return model
    blocks = _blocks(model)
    if not blocks:
        styles = "; ".join(f"{child}.{'/'.join(columns)} -> {row}" for op in _PATTERNS
                           for child, columns, row in _PATTERNS[op])
        raise ValueError(f"fastdist: parallelize found no transformer block (a module with an attention and an MLP "
                         f"of dense layers named as: {styles}); name the linears with a dict plan instead")
    if isinstance(plan, Plan) and plan.world_size != world and any(d not in (1, world) for _, _, d in plan.degrees):
        raise ValueError(f"fastdist: parallelize: the plan was made for {plan.world_size} ranks with degrees "
                         f"{sorted({d for _, _, d in plan.degrees})}; this group has {world}")
    for layer, (_, attention, mlp) in enumerate(blocks):
        for op, region in (("attention", attention), ("mlp", mlp)):
            degree = world if plan is None else plan.degree(layer, op)
            if degree == 1:
                continue
            if degree != world:
                raise ValueError(f"fastdist: parallelize: layer {layer} {op} has degree {degree}; pass the "
                                 f"tensor-parallel group of that size (this one has {world} ranks)")
            _shard_region(region, group, world, kwargs, chosen)
    return model

