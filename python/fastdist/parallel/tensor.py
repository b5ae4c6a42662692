"""The tensor-parallel dimension of :func:`fastdist.parallel.parallelize`: a stage's dense layers sharded with
:func:`fastdist.tp.parallelize`, and where each sharded parameter's slice sits in the full one (for gathering the
full state dict and re-sharding a loaded one)."""
from __future__ import annotations

import collections
import dataclasses
import fnmatch
import inspect
import types
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from fastdist.distributed import check_same

__all__ = ["OasesBlock", "Shard", "TP_OVERLAPS", "dense_layers", "expand_tp_plan", "install_oases", "shard_of",
           "shard_stage"]


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
        overlap: "oases": every block runs under the Oases sub-batch schedule (:class:`OasesBlock`), its linears
            unchunked; "auto": when fastdist.tp's default cost model is calibrated, each block runs under it for the
            input shapes where the model predicts that it pays (:func:`oases_pays`); otherwise, and uncalibrated,
            the linears' chunk counts are the model's; an int: the linears' ``overlap_chunks``.
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
        tp.parallelize(stage, group, plan=plan, overlap_chunks=1 if overlap == "oases" else overlap)
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
    if overlap == "oases" or (overlap == "auto" and tp.default_cost_model().calibrated):
        install_oases(stage, group, auto=overlap == "auto")
    return layouts


def expand_tp_plan(stage: nn.Module, plan: Mapping[str, str] | None) -> dict[str, str] | None:
    """A user's plan with wildcards (``blocks.*.mlp.0``) expanded to the stage's dense layer names.

    Args:
        stage: this rank's pipeline stage.
        plan: {pattern: style}, or None (then None).
    """
    if plan is None:
        return None
    names = list(dense_layers(stage))
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


# ---- tp_overlap="oases": the user's blocks under the Oases sub-batch schedule ----

# A pre-norm block's (first norm, attention, second norm, MLP) children, per naming convention: fastdist's GPTBlock,
# nanoGPT and Hugging Face GPT-2, fastdist.testing's Block, Hugging Face LLaMA, Meta's LLaMA.
_BLOCK_STYLES = (("ln1", "attn", "ln2", "mlp"), ("ln_1", "attn", "ln_2", "mlp"), ("norm1", "attn", "norm2", "mlp"),
                 ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),
                 ("attention_norm", "attention", "ffn_norm", "feed_forward"))
# Arguments a block uses itself rather than passing to its attention (cross-attention of an encoder-decoder).
_BLOCK_OWN_ARGUMENTS = ("encoder_hidden_states", "encoder_attention_mask")
# A key/value cache serves generation; the schedule trains, and its sub-batches would each append to one cache.
_CACHE_ARGUMENTS = {"cache": None, "past_key_values": None, "past_key_value": None, "layer_past": None,
                    "use_cache": False}
# The first call of every Oases block is checked against the block's own (tensor-parallel) forward: relative error.
_CHECK_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_CHECK_TOLERANCE_LOW_PRECISION = 3e-2
TP_OVERLAPS = ("auto", "oases")
"""The named ``tp_overlap`` choices besides an int (the parallel linears' chunk count)."""


@dataclasses.dataclass
class _Branch:
    """One residual branch ``x + f(norm(x))`` of a block; ``row``: its row-parallel linear, whose partial sums the
    schedule all-reduces (None: the branch is replicated and computes whole on every rank)."""
    norm: nn.Module
    call: object  # (normalized sub-batch, sub-batch index) -> the branch's output (a partial sum when `row`)
    row: nn.Module | None


def _local_forwards(module: nn.Module):
    """Instance forwards that make ``module``'s parallel linears compute their shard with no collective: a column
    linear's ``x W^T + b`` (its input gradient then a partial sum), a row linear's ``x W^T`` (the partial sum; its
    bias is the schedule's to add once)."""
    from fastdist.tp.linear import ColumnParallelLinear, RowParallelLinear

    forwards = {}
    for m in module.modules():
        if isinstance(m, ColumnParallelLinear):
            forwards[m] = (lambda layer: lambda x: torch.nn.functional.linear(x, layer.weight, layer.bias))(m)
        elif isinstance(m, RowParallelLinear):
            forwards[m] = (lambda layer: lambda x, residual=None: x @ layer.weight.t())(m)
    return forwards


class _Installed:
    """``with`` body runs with ``forwards`` installed as the modules' instance forwards; restored after."""

    def __init__(self, forwards):
        self.forwards = forwards

    def __enter__(self):
        for m, f in self.forwards.items():
            m.forward = f

    def __exit__(self, *exc):
        for m in self.forwards:
            m.__dict__.pop("forward", None)


def _dropout_problem(block: nn.Module) -> str | None:
    for name, m in block.named_modules():
        p = m.p if isinstance(m, nn.modules.dropout._DropoutNd) else getattr(m, "dropout", None)
        if isinstance(p, float) and p > 0:
            return f"{name or type(block).__name__} has dropout {p}"
    return None


class OasesBlock:
    """The Oases sub-batch schedule installed as a user's block's forward, on the block's own (sharded) layers.

    The block must be a pre-norm ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))`` with its children named in one of
    the conventions of ``_BLOCK_STYLES``; each branch holding a row-parallel linear (sharded by fastdist.tp) becomes
    a partial sum that the schedule all-reduces while the other sub-batch computes, a branch without one
    (``nn.MultiheadAttention`` left replicated) computes whole. Parameters are the block's own: nothing is copied.
    The first call is checked against the block's own forward (raises on every rank when they differ).

    Args:
        block: the sharded block (its ``forward`` is replaced; :meth:`remove` restores it).
        group: the tensor-parallel group.
        name: the block's path, named in errors.
        auto: run the schedule only for input shapes where fastdist.tp's calibrated cost model predicts that it
            beats the block's own forward by more than the model's error (:func:`oases_pays`); the block's own
            forward otherwise, and wherever the model is uncalibrated.
    """

    def __init__(self, block: nn.Module, group: dist.ProcessGroup | None, name: str, auto: bool = False):
        from fastdist.tp.linear import ColumnParallelLinear, RowParallelLinear

        self.block, self.group, self.name, self.auto = block, group, name, auto
        self.world = dist.get_world_size(group)
        self.chosen: dict[tuple, bool] = {}
        where = f"{name} ({type(block).__name__})"
        style = next((s for s in _BLOCK_STYLES if all(isinstance(getattr(block, c, None), nn.Module) for c in s)),
                     None)
        if style is None:
            raise ValueError(
                f"fastdist: tp_overlap='oases' cannot map block {where}: the Oases schedule runs pre-norm blocks "
                f"whose children are named as one of {[s for s in _BLOCK_STYLES]} (first norm, attention, second "
                f"norm, MLP); it has {list(dict(block.named_children()))}. Use tp_overlap='auto' or an int for it")
        self.style = style
        self.branches = []
        for norm, branch in ((style[0], style[1]), (style[2], style[3])):
            module = getattr(block, branch)
            rows = [m for m in module.modules() if isinstance(m, RowParallelLinear)]
            cols = [m for m in module.modules() if isinstance(m, ColumnParallelLinear)]
            if len(rows) > 1 or (cols and not rows):
                raise ValueError(f"fastdist: tp_overlap='oases' cannot map block {where}: its {branch} holds "
                                 f"{len(cols)} column- and {len(rows)} row-parallel linears; the schedule needs "
                                 "column linears feeding one row linear per branch (or none)")
            if rows and (rows[0].sequence_parallel or not rows[0].input_is_parallel):
                raise ValueError(f"fastdist: tp_overlap='oases' cannot map block {where}: its {branch}'s row "
                                 "linear must take the column linears' output (input_is_parallel, no sequence "
                                 "parallelism)")
            if any(c.activation != "none" or c.gather_output or c.sequence_parallel for c in cols):
                raise ValueError(f"fastdist: tp_overlap='oases' cannot map block {where}: a column linear of its "
                                 f"{branch} fuses an activation, gathers or is sequence-parallel")
            self.branches.append(_Branch(getattr(block, norm), branch, rows[0] if rows else None))
        if not any(b.row is not None for b in self.branches):
            raise ValueError(f"fastdist: tp_overlap='oases' cannot map block {where}: none of its linears is "
                             "tensor-parallel")
        problem = _dropout_problem(block)
        if problem:
            raise ValueError(f"fastdist: tp_overlap='oases' cannot map block {where}: {problem}; every rank would "
                             "drop different elements of its partial sums. Set dropout to 0 (as large-model "
                             "pre-training does) or use tp_overlap='auto'")
        self.local = _local_forwards(block)
        # (K, N) of each sharded branch's GEMMs, for the cost model
        self.gemms = [[(m.in_features, m.out_per_rank) if isinstance(m, ColumnParallelLinear) else
                       (m.in_per_rank, m.out_features) for m in getattr(block, br.call).modules()
                       if isinstance(m, (ColumnParallelLinear, RowParallelLinear))] for br in self.branches]
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.signature = inspect.signature(block.forward)
        self.checked = False
        self.original = block.__dict__.get("forward")
        self.own = self.original or types.MethodType(type(block).forward, block)
        block.forward = self.forward

    def remove(self) -> None:
        """Restores the block's own forward."""
        if self.original is None:
            self.block.__dict__.pop("forward", None)
        else:
            self.block.forward = self.original

    def _attention_call(self, arguments: dict, batch: int, sizes: list[int]):
        """(u, sub-batch index) -> the attention's output on that sub-batch, with the block's other arguments
        (masks, rotary tables) split like the hidden states where they have the batch's leading size."""
        attn = getattr(self.block, self.style[1])
        def split(v):
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
                return list(v.split(sizes))
            if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
                parts = [split(t) for t in v]
                return [tuple(p[i] if isinstance(p, list) else p for p in parts) for i in range(len(sizes))]
            return v
        parts = {k: split(v) for k, v in arguments.items()}
        def at(i):
            return {k: (v[i] if isinstance(v, list) else v) for k, v in parts.items()}
        if isinstance(attn, nn.MultiheadAttention):
            mask = next(iter(arguments.values()), None)
            if isinstance(mask, torch.Tensor) and mask.dim() == 3:
                raise ValueError(f"fastdist: tp_overlap='oases': block {self.name}'s attention mask has 3 dimensions; "
                                 "only a [seq, seq] mask is supported")
            return lambda u, i: attn(u, u, u, attn_mask=mask, need_weights=False)[0]
        return lambda u, i: _first_tensor(attn(u, **at(i)))

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        """The block on ``x`` ``[batch, seq, hidden]`` (``batch >= 2``) under the Oases schedule."""
        from fastdist.tp.block import check_block_input
        if self.auto and not self._chosen(x):
            return self.own(x, *args, **kwargs)
        bound = self.signature.bind(x, *args, **kwargs)
        arguments = {}
        for k, v in list(bound.arguments.items())[1:]:
            if self.signature.parameters[k].kind == inspect.Parameter.VAR_KEYWORD:
                arguments.update(v)
            elif k in _BLOCK_OWN_ARGUMENTS:
                if v is not None:
                    raise ValueError(f"fastdist: tp_overlap='oases': block {self.name} got {k}; cross-attention "
                                     "is not mapped")
            else:
                arguments[k] = v
        arguments.update({k: v for k, v in _CACHE_ARGUMENTS.items() if k in arguments})
        check_block_input(x, f"the Oases schedule of block {self.name}", self.group, self.world)
        sizes = [t.shape[0] for t in x.tensor_split(2)]
        calls = [self._attention_call(arguments, x.shape[0], sizes), lambda u, i: getattr(self.block, self.style[3])(u)]
        plan = (self, calls, torch.is_grad_enabled())
        y = _OasesFn.apply(x, plan, *self.params)
        if not self.checked and self._check(x, args, kwargs, y) is False:
            return self.own(x, *args, **kwargs)
        return y

    def _chosen(self, x):
        """Whether the schedule runs for ``x``'s shape (auto mode): decided once per shape, agreed by the ranks."""
        from fastdist.tp.cost import default_cost_model
        key = (tuple(x.shape), x.dtype)
        if key not in self.chosen:
            use = x.dim() == 3 and x.shape[0] >= 2 and oases_pays(
                default_cost_model(), self.gemms, x.shape[0] * x.shape[1], x.shape[-1], x.dtype, self.world)
            check_same(f"tp_overlap='auto': the Oases schedule for block {self.name} on {list(x.shape)}", use,
                       self.group)
            self.chosen[key] = use
        return self.chosen[key]

    def _check(self, x, args, kwargs, y):
        """The block's own forward on the same input (its parallel linears' collectives); raises on every rank when
        the schedule computed something else (a forward that is not the pre-norm residual form)."""
        self.checked = True
        with torch.no_grad():
            self.remove()
            try:
                want = self.block(x, *args, **kwargs)
            finally:
                self.block.forward = self.forward
            want = _first_tensor(want)
            error = ((y.detach() - want).abs().max() / want.abs().max().clamp_min(1e-30)).reshape(1).double()
        dist.all_reduce(error, op=dist.ReduceOp.MAX, group=self.group)
        tolerance = _CHECK_TOLERANCE.get(x.dtype, _CHECK_TOLERANCE_LOW_PRECISION)
        if not error.item() <= tolerance and self.auto:
            warnings.warn(f"fastdist: tp_overlap='auto' leaves block {self.name} to its own forward: the Oases "
                          f"schedule differs from it by {error.item():.3g} of its output", UserWarning, stacklevel=3)
            self.chosen = collections.defaultdict(bool)
            return False
        if not error.item() <= tolerance:
            from fastdist.distributed.failure import agreed
            raise agreed(ValueError(
                f"fastdist: tp_overlap='oases' cannot map block {self.name} ({type(self.block).__name__}): the "
                f"schedule, which computes x + attn(norm1(x)) then + mlp(norm2(.)) from its children {self.style}, "
                f"differs from the block's own forward by {error.item():.3g} of its output. Use tp_overlap='auto' "
                "or an int for it"))


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return next(o for o in out if isinstance(o, torch.Tensor))


def _leaf(t):
    return t.detach().requires_grad_(True)


class _Sub:
    """One sub-batch's tensors per branch between the schedule's steps."""

    def __init__(self, x, n):
        self.xin = [x] + [None] * n
        self.u, self.uin, self.p, self.r, self.rin, self.out = ([None] * n for _ in range(6))
        self.gu, self.gx_part, self.gx = ([None] * (n + 1) for _ in range(3))


class _OasesFn(torch.autograd.Function):
    """A block as one autograd node whose forward and backward run the Oases schedule over two sub-batches, as
    fastdist.tp.block's does for its own block, on any sequence of residual branches: each branch's input and
    reduced output are detached leaves, so each piece is differentiated on its own (torch.autograd.grad) in the
    schedule's order, and every parameter's gradient is collected once per piece."""

    @staticmethod
    def forward(ctx, x, plan, *params):
        from fastdist.tp.block import _OneInFlight
        oases, calls, build = plan
        branches, n = oases.branches, len(oases.branches)
        subs = [_Sub(_leaf(b), n) for b in x.tensor_split(2)]
        ar = _OneInFlight(oases.group, backward=False)

        def finish(s, b):  # the branch's residual, once its partial sum is reduced
            if branches[b].row is not None:
                ar.wait_for(s.r[b])
                s.rin[b] = _leaf(s.r[b]) if build else s.r[b]
                bias = branches[b].row.bias
                s.out[b] = s.xin[b] + (s.rin[b] if bias is None else s.rin[b] + bias)
            s.xin[b + 1] = _leaf(s.out[b]) if build else s.out[b]

        with torch.set_grad_enabled(build), _Installed(oases.local):
            for b, branch in enumerate(branches):
                for i, s in enumerate(subs):
                    if b > 0:
                        finish(s, b - 1)
                    if branch.row is None:
                        s.out[b] = s.xin[b] + calls[b](branch.norm(s.xin[b]), i)
                        continue
                    s.u[b] = branch.norm(s.xin[b])
                    s.uin[b] = _leaf(s.u[b]) if build else s.u[b]
                    s.p[b] = calls[b](s.uin[b], i)
                    s.r[b] = s.p[b].detach()
                    ar.issue(s.r[b], f"oases.forward.{branch.call}")
            for s in subs:
                finish(s, n - 1)
        if build:
            ctx.state = (oases, subs)
        return torch.cat([s.out[n - 1].detach() for s in subs])

    @staticmethod
    def backward(ctx, gy):
        from fastdist.tp.block import SegmentGrads, _OneInFlight
        oases, subs = ctx.state
        ctx.state = None
        branches, n = oases.branches, len(oases.branches)
        grad = SegmentGrads(oases.params)

        ar = _OneInFlight(oases.group, backward=True)

        def input_grad(s, b):  # the gradient w.r.t. branch b's input, once its partial input gradient is reduced
            if branches[b].row is not None:
                ar.wait_for(s.gu[b])
                (g,) = grad([s.u[b]], [s.gu[b]], [s.xin[b]])
                s.gx[b] = s.gx_part[b] + g
            return s.gx[b]

        for s, g in zip(subs, gy.tensor_split(2)):
            s.gx[n] = g
        order = list(reversed(range(len(subs))))  # the last sub-batch's output gradient is ready first
        for b in reversed(range(n)):
            branch = branches[b]
            for i in order:
                s = subs[i]
                g_out = s.gx[n] if b == n - 1 else input_grad(s, b + 1)
                if branch.row is None:
                    (s.gx[b],) = grad([s.out[b]], [g_out], [s.xin[b]])
                    continue
                s.gx_part[b], g_r = grad([s.out[b]], [g_out], [s.xin[b], s.rin[b]])
                (s.gu[b],) = grad([s.p[b]], [g_r], [s.uin[b]])
                ar.issue(s.gu[b], f"oases.backward.{branch.call}")
        gx = torch.cat([input_grad(subs[i], 0) for i in range(len(subs))])
        return (gx, None, *grad.params)


def install_oases(stage: nn.Module, group: dist.ProcessGroup | None, auto: bool = False) -> list[OasesBlock]:
    """Runs every block of ``stage`` that holds a row-parallel linear under the Oases schedule.

    Args:
        stage: a stage already sharded by :func:`shard_stage`.
        group: the tensor-parallel group.
        auto: :class:`OasesBlock`'s ``auto``; a block the schedule cannot map then keeps its own forward.

    Returns:
        The installed schedules, one per block.

    Raises:
        ValueError: a sharded block the schedule cannot map (the message names it and why).
    """
    from fastdist.tp.linear import RowParallelLinear

    def sharded(m):
        return any(isinstance(c, RowParallelLinear) for c in m.modules())

    names = {id(m): n for n, m in stage.named_modules()}
    blocks = getattr(stage, "pipeline_blocks", None)
    if blocks is None:  # the outermost modules named as a block style
        blocks = []
        for n, m in stage.named_modules():
            if not any(n.startswith(names[id(b)] + ".") for b in blocks) and \
                    any(all(isinstance(getattr(m, c, None), nn.Module) for c in style) for style in _BLOCK_STYLES):
                blocks.append(m)
    installed = []
    for b in blocks:
        if not sharded(b):
            continue
        try:
            installed.append(OasesBlock(b, group, names.get(id(b), type(b).__name__), auto))
        except ValueError:
            if not auto:
                raise
    return installed


def _simulate(gemm, comm, busy, order):
    """Seconds of one direction of the schedule: ``order`` lists (branch, sub-batch) computations in issue order;
    each one's GEMMs take ``gemm[branch]``, then its all-reduce ``comm[branch]`` (one in flight), which takes
    ``busy[branch]`` of compute from whatever runs beside it; a sub-batch's next branch waits for its all-reduce."""
    compute = link = 0.0
    ready = {}
    for b, s in order:
        start = max(compute, ready.get(s, 0.0))
        compute = start + gemm[b] + (busy[b] if link > start else 0.0)
        link = max(link, compute) + comm[b]
        ready[s] = link
    return max(compute, link)


def oases_pays(model, gemms: list[list[tuple[int, int]]], tokens: int, hidden: int, dtype: torch.dtype,
               world: int) -> bool:
    """Whether the Oases schedule is predicted to beat the plain tensor-parallel block (each branch's GEMMs, then
    its all-reduce, forward and backward) by more than the model's error: fastdist.tp's cost model times each
    sharded branch's GEMMs and all-reduce on half the tokens and the schedule is simulated (:func:`_simulate`).
    Only the GEMMs are counted (attention's other compute would hide more): the prediction errs toward the plain
    block.

    Args:
        model: a :class:`fastdist.tp.CostModel`; uncalibrated: False.
        gemms: (K, N) of each sharded branch's GEMMs, per branch.
        tokens: the block's input rows (batch x seq).
        hidden: the all-reduced width.
        dtype: the activations' dtype.
        world: the tensor-parallel ranks.
    """
    from fastdist.tp.cost import CHUNK_TOLERANCE
    if not model.calibrated or not any(gemms):
        return False
    nbytes = tokens * hidden * torch.empty((), dtype=dtype).element_size()
    branches = [b for b, g in enumerate(gemms) if g]

    def gemm(rows):  # forward GEMMs; backward computes two of each shape (input and weight gradients)
        return {b: sum(model.gemm_time(rows, k, n, dtype) for k, n in gemms[b]) for b in branches}

    whole, half = gemm(tokens), gemm(-(-tokens // 2))
    comm_whole = {b: model.allreduce_time(nbytes, world) for b in branches}
    comm_half = {b: model.allreduce_time(nbytes / 2, world) for b in branches}
    busy = {b: model.comm_compute_time(nbytes / 2) for b in branches}
    plain = sum(3 * whole[b] + 2 * comm_whole[b] for b in branches)
    forward = [(b, s) for b in branches for s in (0, 1)]
    backward = [(b, s) for b in reversed(branches) for s in (1, 0)]
    oases = _simulate(half, comm_half, busy, forward) + \
        _simulate({b: 2 * g for b, g in half.items()}, comm_half, busy, backward)
    return plain > oases * (1 + max(CHUNK_TOLERANCE, model.error))
