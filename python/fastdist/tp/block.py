"""A GPT-style transformer block, and its tensor-parallel version with the Oases overlap schedule.

:class:`GPTBlock` is the plain single-device block (pre-LayerNorm, causal self-attention, GeLU MLP) built from
``nn.Linear`` layers named ``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``. :func:`fastdist.tp.parallelize`
turns it into Megatron's tensor-parallel block (column-parallel ``qkv``/``fc1``, row-parallel ``proj``/``fc2``),
whose forward all-reduces twice per layer and backward twice, each collective blocking the compute after it.
The qkv projection's output is laid out head by head (``[heads, 3, head_dim]``), so a contiguous column shard
holds whole heads.

:class:`OverlappedTransformerBlock` computes the same function with the Oases schedule (Li et al. 2023): the
batch is split into two sub-batches A and B, and each sub-batch's all-reduce runs while the other computes,
with exactly one collective in flight, in issue order:

forward   A: LN1, attention, proj       -> all-reduce A1
          B: LN1, attention, proj       -> wait A1, all-reduce B1
          A: + residual, LN2, MLP       -> wait B1, all-reduce A2
          B: + residual, LN2, MLP       -> wait A2, all-reduce B2
          A: + residual; wait B2; B: + residual
backward  B: MLP backward               -> all-reduce dB2 (input gradient of fc1)
          A: MLP backward               -> wait dB2, all-reduce dA2
          B: LN2 backward, attention bw -> wait dA2, all-reduce dB1 (input gradient of qkv)
          A: LN2 backward, attention bw -> wait dB1, all-reduce dA1
          B: LN1 backward; wait dA1; A: LN1 backward

With ``recompute=True`` the forward keeps only the block input and the two already-reduced outputs per
sub-batch; backward recomputes the rest from them, so recomputation issues no forward all-reduce: 4 all-reduces
of an activation per layer per step, where Megatron-style checkpointing (recompute the whole block, its
collectives included) issues 5.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdist.distributed import MismatchError, check_same, global_ranks
from fastdist.distributed.compat import all_gather_single
from fastdist.ops.epilogue import bias_epilogue
from fastdist.tp import comm

__all__ = ["GPTBlock", "OverlappedTransformerBlock", "check_block_input"]


def _attention(qkv, batch, seq, head_dim):
    """Causal self-attention of a head-major qkv [batch * seq, heads * 3 * head_dim] -> [batch * seq, heads * hd]."""
    heads = qkv.shape[-1] // (3 * head_dim)
    q, k, v = qkv.view(batch, seq, heads, 3, head_dim).permute(3, 0, 2, 1, 4).unbind(0)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(1, 2).reshape(batch * seq, heads * head_dim)


class _Attention(nn.Module):
    def __init__(self, hidden, heads, device=None, dtype=None):
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, device=device, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, device=device, dtype=dtype)

    def forward(self, x):
        batch, seq, _ = x.shape
        qkv = self.qkv(x).reshape(batch * seq, -1)
        return self.proj(_attention(qkv, batch, seq, self.head_dim).view(batch, seq, -1))


class _MLP(nn.Module):
    def __init__(self, hidden, mlp_ratio, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden, device=device, dtype=dtype)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden, device=device, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class GPTBlock(nn.Module):
    """``h = x + attn(ln1(x)); y = h + mlp(ln2(h))`` on ``[batch, seq, hidden]``.

    Args:
        hidden: the token width; divisible by ``heads``.
        heads: the attention heads.
        mlp_ratio: the MLP's hidden size over ``hidden``.
        eps: the LayerNorms' epsilon.
        device: where the parameters live.
        dtype: the parameters' dtype.
    """

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4, eps: float = 1e-5,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"fastdist: hidden={hidden} is not divisible by heads={heads}")
        self.hidden, self.heads, self.mlp_ratio = hidden, heads, mlp_ratio
        self.ln1 = nn.LayerNorm(hidden, eps=eps, device=device, dtype=dtype)
        self.attn = _Attention(hidden, heads, device, dtype)
        self.ln2 = nn.LayerNorm(hidden, eps=eps, device=device, dtype=dtype)
        self.mlp = _MLP(hidden, mlp_ratio, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block on ``x`` of shape ``[batch, seq, hidden]`` (same shape out)."""
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


# ---- the Oases block ----

# The block's parameters, named as GPTBlock's (so that state_dicts load into each other); with each one, the
# dimension along which a rank holds its part (column-parallel qkv and fc1 by rows, row-parallel proj and fc2 by
# columns; None: whole on every rank).
_PARAMS = {"ln1.weight": None, "ln1.bias": None, "attn.qkv.weight": 0, "attn.qkv.bias": 0, "attn.proj.weight": 1,
           "attn.proj.bias": None, "ln2.weight": None, "ln2.bias": None, "mlp.fc1.weight": 0, "mlp.fc1.bias": 0,
           "mlp.fc2.weight": 1, "mlp.fc2.bias": None}


class _Weights(nn.Module):
    """A weight and a bias, held where GPTBlock holds them (``attn.qkv``, ``ln1``, ...); computes nothing itself."""

    def __init__(self, weight_shape, bias_shape, factory):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(weight_shape, **factory))
        self.bias = nn.Parameter(torch.empty(bias_shape, **factory))


class _Segments:
    """The block cut at its collectives; each piece is a pure function of its inputs and the parameters."""

    def __init__(self, p, head_dim, eps, batch, seq):
        self.p, self.head_dim, self.eps, self.batch, self.seq = p, head_dim, eps, batch, seq

    def ln1(self, x):
        return F.layer_norm(x, x.shape[-1:], self.p["ln1.weight"], self.p["ln1.bias"], self.eps)

    def attn_partial(self, u1):
        """This rank's heads; the proj GEMM's partial sum (no bias: it is added once, after the all-reduce)."""
        qkv = torch.addmm(self.p["attn.qkv.bias"], u1, self.p["attn.qkv.weight"].t())
        return _attention(qkv, self.batch, self.seq, self.head_dim) @ self.p["attn.proj.weight"].t()

    def residual_ln2(self, x, r1):
        h = bias_epilogue(r1, self.p["attn.proj.bias"], x, "none")
        return h, F.layer_norm(h, h.shape[-1:], self.p["ln2.weight"], self.p["ln2.bias"], self.eps)

    def mlp_partial(self, u2):
        a = bias_epilogue(u2 @ self.p["mlp.fc1.weight"].t(), self.p["mlp.fc1.bias"], None, "gelu_tanh")
        return a @ self.p["mlp.fc2.weight"].t()

    def output(self, h, r2):
        return bias_epilogue(r2, self.p["mlp.fc2.bias"], h, "none")


_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


class _OneInFlight:
    """Issues all-reduces so that at most one is in flight: issuing waits for the previous one."""

    def __init__(self, group, backward):
        self.group, self.backward, self.pending = group, backward, None

    def issue(self, t, site):
        self.drain()
        self.pending = comm.all_reduce(t, self.group, site=site, backward=self.backward)

    def wait_for(self, t):
        """Makes sure the collective that produces ``t`` (if it is the one in flight) is complete."""
        if self.pending is not None and self.pending.out is t:
            self.drain()

    def drain(self):
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def _leaf(t):
    return t.detach().requires_grad_(True)


class _SubBatch:
    """One sub-batch's tensors between the schedule's steps."""

    def __init__(self, x):
        self.x = x


class SegmentGrads:
    """``grad(outputs, grad_outputs, inputs)``: the gradients w.r.t. ``inputs`` of one segment's local graph, while
    the parameters' gradients are accumulated on the side (``params``: one per parameter, None where unused)."""

    def __init__(self, params):
        self.leaves = list(params)
        self.params = [None] * len(self.leaves)

    def __call__(self, outputs, grad_outputs, inputs):
        got = torch.autograd.grad(outputs, list(inputs) + self.leaves, grad_outputs, allow_unused=True)
        for j, g in enumerate(got[len(inputs):]):
            if g is not None:
                self.params[j] = g if self.params[j] is None else self.params[j] + g
        return got[:len(inputs)]


class _OasesBlockFn(torch.autograd.Function):
    """The block as one autograd node: forward and backward run the Oases schedule over two sub-batches. The block
    is cut into segments (LN1 | attention | residual + LN2 | MLP | residual) whose inputs are detached leaves, so
    each segment's local graph is differentiated on its own with torch.autograd.grad, in the schedule's order,
    and every parameter's gradient is collected exactly once per segment."""

    @staticmethod
    def forward(ctx, x, meta, *params):
        group, head_dim, eps, recompute = meta
        batch, seq, hidden = x.shape
        parts = x.tensor_split(2, dim=0)
        ctx.meta, ctx.shape, ctx.sizes = meta, x.shape, [b.shape[0] for b in parts]
        leaves = [_leaf(p) for p in params]
        segs = [_Segments(dict(zip(_PARAMS, leaves)), head_dim, eps, b.shape[0], seq) for b in parts]
        subs = [_SubBatch(_leaf(b.reshape(-1, hidden))) for b in parts]
        ar = _OneInFlight(group, backward=False)
        with torch.set_grad_enabled(not recompute):
            for s, seg in zip(subs, segs):                       # A, then B: attention; all-reduce its output
                s.u1 = seg.ln1(s.x)
                s.u1_in = s.u1 if recompute else _leaf(s.u1)
                s.p1 = seg.attn_partial(s.u1_in)
                s.r1 = s.p1.detach()
                ar.issue(s.r1, "oases.forward.attn")
            for s, seg in zip(subs, segs):                       # A, then B: residual, LN2, MLP; all-reduce
                ar.wait_for(s.r1)
                s.r1 = s.r1 if recompute else _leaf(s.r1)
                s.h, s.u2 = seg.residual_ln2(s.x, s.r1)
                s.h_in, s.u2_in = (s.h, s.u2) if recompute else (_leaf(s.h), _leaf(s.u2))
                s.p2 = seg.mlp_partial(s.u2_in)
                s.r2 = s.p2.detach()
                ar.issue(s.r2, "oases.forward.mlp")
            for s, seg in zip(subs, segs):                       # A, then B: the second residual
                ar.wait_for(s.r2)
                s.r2 = s.r2 if recompute else _leaf(s.r2)
                s.y = seg.output(s.h_in, s.r2)
        out = torch.cat([s.y.detach() for s in subs]).view(batch, seq, hidden)
        if recompute:
            # Keep the input and the reduced outputs only; backward rebuilds the rest without a collective.
            ctx.save_for_backward(x, *[t for s in subs for t in (s.r1, s.r2)], *params)
        else:
            ctx.graphs = (subs, segs, leaves)
        return out

    @staticmethod
    def backward(ctx, gy):
        group, head_dim, eps, recompute = ctx.meta
        batch, seq, hidden = ctx.shape
        grads_y = [g.reshape(-1, hidden) for g in gy.tensor_split(2, dim=0)]
        n_sub = len(ctx.sizes)
        if recompute:
            x, *rest = ctx.saved_tensors
            reduced, params = rest[:2 * n_sub], rest[2 * n_sub:]
            leaves = [_leaf(p) for p in params]
            segs = [_Segments(dict(zip(_PARAMS, leaves)), head_dim, eps, n, seq) for n in ctx.sizes]
            subs = [_SubBatch(_leaf(b.reshape(-1, hidden))) for b in x.tensor_split(2, dim=0)]
            for i, s in enumerate(subs):
                s.r1, s.r2 = _leaf(reduced[2 * i]), _leaf(reduced[2 * i + 1])
        else:
            subs, segs, leaves = ctx.graphs
            ctx.graphs = None
        grad = SegmentGrads(leaves)

        ar = _OneInFlight(group, backward=True)
        order = list(reversed(range(n_sub)))  # B first: its output gradient is ready first
        for i in order:                                          # B, then A: output and MLP backward
            s, seg = subs[i], segs[i]
            if recompute:
                with torch.enable_grad():
                    s.h, s.u2 = seg.residual_ln2(s.x, s.r1)
                    s.h_in, s.u2_in = _leaf(s.h), _leaf(s.u2)
                    s.y = seg.output(s.h_in, s.r2)
                    s.p2 = seg.mlp_partial(s.u2_in)
            s.gh, s.gr2 = grad([s.y], [grads_y[i]], [s.h_in, s.r2])
            (s.gu2,) = grad([s.p2], [s.gr2], [s.u2_in])
            ar.issue(s.gu2, "oases.backward.mlp")             # fc1's input gradient: a partial sum
        for i in order:                                          # B, then A: LN2 and attention backward
            s, seg = subs[i], segs[i]
            ar.wait_for(s.gu2)
            s.gx, s.gr1 = grad([s.h, s.u2], [s.gh, s.gu2], [s.x, s.r1])
            if recompute:
                with torch.enable_grad():
                    s.u1 = seg.ln1(s.x)
                    s.u1_in = _leaf(s.u1)
                    s.p1 = seg.attn_partial(s.u1_in)
            (s.gu1,) = grad([s.p1], [s.gr1], [s.u1_in])
            ar.issue(s.gu1, "oases.backward.attn")             # qkv's input gradient: a partial sum
        for i in order:                                          # B, then A: LN1 backward
            s = subs[i]
            ar.wait_for(s.gu1)
            (gx_ln,) = grad([s.u1], [s.gu1], [s.x])
            s.gx = s.gx + gx_ln
        gx = torch.cat([s.gx for s in subs]).view(batch, seq, hidden)
        return (gx, None, *grad.params)


def _block_input_problem(x, what, hidden):
    if x.dim() != 3 or (hidden is not None and x.shape[-1] != hidden):
        return f"fastdist: {what} input must be [batch, seq, {hidden or 'hidden'}], got shape {list(x.shape)}"
    if x.shape[0] < 2:
        return f"fastdist: {what} splits the batch into two sub-batches; it needs batch >= 2, got {x.shape[0]}"
    return None


def check_block_input(x: torch.Tensor, what: str, group: dist.ProcessGroup | None, world_size: int,
                      hidden: int | None = None) -> None:
    """Checks a sub-batched block's input ``[batch >= 2, seq, hidden]`` on every rank together: each rank's shape
    and dtype are all-gathered (8 bytes x 3 per rank) before the first collective whose size depends on them, so
    ranks given different inputs raise MismatchError on every rank, and a rank whose input is invalid raises its own
    error while the others raise MismatchError, instead of all-reducing tensors of different sizes.

    Args:
        x: this rank's input.
        what: the block, named in errors.
        group: the tensor-parallel group.
        world_size: its size.
        hidden: the expected last dimension (None: any).
    """
    problem = _block_input_problem(x, what, hidden)
    if world_size == 1 or comm.compiling():
        if problem is not None:
            raise ValueError(problem)
        return
    mine = torch.tensor([-1, -1, -1] if problem else [x.shape[0], x.shape[1], _DTYPE_CODES.get(x.dtype, -2)],
                        dtype=torch.int64)
    gathered = torch.empty(3 * world_size, dtype=torch.int64)
    all_gather_single(gathered, mine, group=comm.host_group(group))
    if problem is not None:
        raise ValueError(problem)
    rows = gathered.view(world_size, 3).tolist()
    if any(r != rows[0] for r in rows):
        names = {v: str(k) for k, v in _DTYPE_CODES.items()}
        shown = {r: "invalid input" if b < 0 else f"batch={b}, seq={s}, dtype={names.get(d, 'other')}"
                 for r, (b, s, d) in zip(global_ranks(group), rows)}
        raise MismatchError(f"{what} input rows (batch, seq) and dtype; every rank must pass the same", shown)


class OverlappedTransformerBlock(nn.Module):
    """A tensor-parallel :class:`GPTBlock` whose all-reduces overlap compute (the Oases schedule, module docstring).

    Args:
        hidden: the full block's token width.
        heads: the full block's attention heads; ``heads`` and ``mlp_ratio * hidden`` must be divisible by the
            tensor-parallel world size.
        group: the tensor-parallel process group (None: the default group).
        mlp_ratio: the MLP's hidden size over ``hidden``.
        recompute: keep only the block input and the reduced outputs; recompute the rest in backward without
            repeating a forward all-reduce.
        eps: the LayerNorms' epsilon.
        device: where the parameters live.
        dtype: the parameters' dtype.

    Inputs are ``[batch, seq, hidden]``, replicated on the group's ranks, ``batch >= 2`` (the two sub-batches are
    its halves). Parameters are named as :class:`GPTBlock`'s (``ln1.weight``, ``attn.qkv.weight``, ...): LayerNorms
    and the row-parallel biases whole on every rank; ``qkv``/``fc1`` weights and biases by output rows,
    ``proj``/``fc2`` weights by input columns, as in :func:`fastdist.tp.parallelize`. ``load_state_dict`` takes a
    GPTBlock's ``state_dict`` (its full tensors are sharded) or this block's; :meth:`full_state_dict` gathers one a
    GPTBlock loads.
    """

    def __init__(self, hidden: int, heads: int, group: dist.ProcessGroup | None = None, mlp_ratio: int = 4,
                 recompute: bool = False, eps: float = 1e-5, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("fastdist: OverlappedTransformerBlock needs an initialized torch.distributed process "
                               "group")
        # First, before anything can raise on one rank only.
        check_same("OverlappedTransformerBlock config",
                   {"hidden": hidden, "heads": heads, "mlp_ratio": mlp_ratio, "eps": float(eps), "dtype": str(dtype)},
                   group)
        world = dist.get_world_size(group)
        if hidden % heads:
            raise ValueError(f"fastdist: hidden={hidden} is not divisible by heads={heads}")
        if heads % world:
            raise ValueError(f"fastdist: OverlappedTransformerBlock: heads={heads} is not divisible by the "
                             f"tensor-parallel world size {world}")
        if (mlp_ratio * hidden) % world:
            raise ValueError(f"fastdist: OverlappedTransformerBlock: the MLP size {mlp_ratio * hidden} is not "
                             f"divisible by the tensor-parallel world size {world}")
        self.group, self.world_size, self.rank = group, world, dist.get_rank(group)
        self.hidden, self.heads, self.mlp_ratio, self.eps = hidden, heads, mlp_ratio, eps
        self.head_dim = hidden // heads
        self.recompute = recompute
        f = {"device": device, "dtype": dtype}
        qkv_rows, mlp_rows = 3 * hidden // world, mlp_ratio * hidden // world
        self.ln1 = _Weights((hidden,), (hidden,), f)
        self.attn = nn.Module()
        self.attn.qkv = _Weights((qkv_rows, hidden), (qkv_rows,), f)
        self.attn.proj = _Weights((hidden, hidden // world), (hidden,), f)
        self.ln2 = _Weights((hidden,), (hidden,), f)
        self.mlp = nn.Module()
        self.mlp.fc1 = _Weights((mlp_rows, hidden), (mlp_rows,), f)
        self.mlp.fc2 = _Weights((hidden, mlp_rows), (hidden,), f)
        # A GPTBlock's full-size tensors load as this rank's shard of them.
        self._register_load_state_dict_pre_hook(self._shard_full_tensors)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draws the full block's initialization from one seed on every rank and keeps this rank's shard, so that
        the ranks agree."""
        g = torch.Generator().manual_seed(self.hidden * 7919 + self.heads)
        full = GPTBlock(self.hidden, self.heads, self.mlp_ratio, self.eps)
        with torch.no_grad():
            for p in full.parameters():
                if p.dim() > 1:
                    bound = 1 / math.sqrt(p.shape[1])
                    p.copy_(torch.rand(p.shape, generator=g) * 2 * bound - bound)
        self.load_full_block(full)

    def load_full_block(self, block: GPTBlock) -> None:
        """Copies this rank's shard of a :class:`GPTBlock`'s parameters (``load_state_dict(block.state_dict())``).

        Args:
            block: the single-process block of the same sizes.
        """
        self.load_state_dict(block.state_dict())

    def _shard_full_tensors(self, state_dict, prefix, *_):
        for name, dim in _PARAMS.items():
            key = prefix + name
            value = state_dict.get(key)
            if dim is None or value is None or value.shape == self.get_parameter(name).shape:
                continue
            if value.shape[dim] != self.get_parameter(name).shape[dim] * self.world_size:
                continue  # neither the full tensor nor this rank's part: load_state_dict reports the mismatch
            state_dict[key] = value.chunk(self.world_size, dim=dim)[self.rank]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole block's parameters, gathered from the group's ranks: a :class:`GPTBlock`'s ``state_dict``.
        A collective."""
        full = {}
        for name, dim in _PARAMS.items():
            part = self.get_parameter(name).detach()
            if dim is None:
                full[name] = part.clone()
                continue
            parts = [torch.empty_like(part) for _ in range(self.world_size)]
            dist.all_gather(parts, part.contiguous(), group=self.group)
            full[name] = torch.cat(parts, dim=dim)
        return full

    @classmethod
    def from_block(cls, block: GPTBlock, group: dist.ProcessGroup | None = None,
                   recompute: bool = False) -> "OverlappedTransformerBlock":
        """The tensor-parallel shard of a :class:`GPTBlock`, its weights copied.

        Args:
            block: the single-process block.
            group: the tensor-parallel process group (None: the default group).
            recompute: as for the constructor.

        Returns:
            This rank's block, computing what ``block`` computes together with the group's other ranks.
        """
        layer = cls(block.hidden, block.heads, group, block.mlp_ratio, recompute, block.ln1.eps,
                    device=block.ln1.weight.device, dtype=block.ln1.weight.dtype)
        layer.load_full_block(block)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block on ``x`` of shape ``[batch, seq, hidden]``, ``batch >= 2``, replicated on the group's ranks."""
        check_block_input(x, "OverlappedTransformerBlock", self.group, self.world_size, self.hidden)
        meta = (self.group, self.head_dim, self.eps, self.recompute)
        return _OasesBlockFn.apply(x, meta, *[self.get_parameter(n) for n in _PARAMS])

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, heads={self.heads}, mlp_ratio={self.mlp_ratio}, world_size={self.world_size}, "
                f"recompute={self.recompute}")
