"""Mixture-of-experts routing: the gate, the layout (a stable counting sort of assignments by expert), and moving
token rows into expert order and back.

Definitions (also in csrc/kernels/moe.h). ``T`` tokens each choose ``k`` experts; assignment ``(t, j)`` is *slot*
``t * k + j``. Priority is choice-major, ``q = j * T + t``: all first choices come before any second choice and, within
a choice, tokens in order (DeepSpeed-MoE / GShard). ``position[t, j]`` counts the earlier-priority assignments to
the same expert; with ``capacity = C >= 0`` a slot is kept when ``position < C`` (``capacity = -1``: dropless). The
expert-ordered buffer holds the kept rows grouped by expert (increasing id, priority order inside), then the dropped
ones; ``row_of_slot[t, j]`` is a kept slot's row (``-1`` when dropped) and ``permutation[row]`` the slot of a row.

Ops: ``torch.ops.fastdist.{moe_route, moe_layout, moe_permute, moe_unpermute}`` with CPU and CUDA kernels, fake
kernels for ``torch.compile``, and autograd for route, permute and unpermute. Gate logits are float32 or float64;
row data may also be float16 or bfloat16 (computed in float32, rounded once per output value).
Every CPU result is bit-identical whatever the thread count; the CUDA layout is the same stable sort (no atomics on
positions), so CPU and CUDA layouts are equal.
"""
import math

import torch

from fastdist.ops._checks import check_allocatable, check_dim, check_dtype, check_dtype_in, check_nonnegative

__all__ = ["MAX_K", "capacity_for", "moe_layout", "moe_permute", "moe_route", "moe_unpermute"]

MAX_K = 16
_LOGIT_DTYPES = (torch.float32, torch.float64)
_ROW_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def capacity_for(tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int = 4) -> int:
    """Per-expert capacity ``max(min_capacity, ceil(k * tokens * capacity_factor / num_experts))``."""
    return max(min_capacity, math.ceil(k * tokens * capacity_factor / num_experts))


def moe_route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k gate: softmax in float32 (float64 logits: computed in float64, stored as float32), top-k choices.

    Args:
        logits: float32 or float64 ``[T, E]``; each row free of NaN and +inf and not all -inf, so that it has a
            softmax (-inf masks an expert). Checked on CPU; on CUDA such a row gets distinct valid but unspecified
            experts.
        k: choices per token, ``1 <= k <= min(16, E)``.

    Returns:
        ``(probs, lse, topk_idx, topk_weight)``: float32 ``[T, E]`` softmax, float32 ``[T]`` logsumexp of each row
        (for the z-loss), int64 ``[T, k]`` the experts in decreasing probability (ties to the lower expert id) and
        float32 ``[T, k]`` their probabilities. Differentiable in ``probs``, ``lse`` and ``topk_weight``.

    Raises:
        RuntimeError: logits not float32/float64 2-D with at least one column, ``k`` out of range, a row without a
            softmax (NaN, +inf, or all -inf; CPU only).
    """
    return torch.ops.fastdist.moe_route.default(logits, k)


def moe_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int = 1, capacity: int = -1) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the assignments by expert: a stable counting sort in priority order (module docstring).

    Args:
        topk_idx: int64 ``[T, k]`` expert ids in ``[0, num_experts)``.
        num_experts: ``E >= 1``.
        num_ranks: ``R``, dividing ``E``; rank ``r`` owns experts ``[r E/R, (r+1) E/R)``.
        capacity: per-expert capacity ``C >= 0``, or ``-1`` for dropless.

    Returns:
        ``(counts, offsets, rank_counts, permutation, row_of_slot, position, keep)``: int64 ``[E]`` assignments per
        expert (before dropping), int64 ``[E + 1]`` first kept row of each expert (``offsets[E]`` = rows kept),
        int64 ``[R]`` kept rows per owning rank, int64 ``[T * k]`` slot of each row (kept rows first), int64
        ``[T, k]`` row of each slot (``-1`` dropped), int64 ``[T, k]`` position inside the expert, bool ``[T, k]``.

    Raises:
        RuntimeError: bad dtype/shape, ``num_ranks`` not dividing ``num_experts``, ``capacity < -1``, ids out of
            range.
    """
    return torch.ops.fastdist.moe_layout.default(topk_idx, num_experts, num_ranks, capacity)


def moe_permute(x: torch.Tensor, row_of_slot: torch.Tensor, num_rows: int,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """Copies token rows into expert order: ``out[row_of_slot[t, j]] = x[t]`` (times ``weight[t, j]`` if given).

    Args:
        x: float32/float64/float16/bfloat16 ``[T, d]``.
        row_of_slot: int64 ``[T, k]``, entries in ``[-1, num_rows)``; every row named at most once (as moe_layout
            makes it).
        num_rows: rows of the output, ``>= 0``; rows no slot names are zero.
        weight: optional ``[T, k]`` of x's dtype.

    Returns:
        ``[num_rows, d]`` of x's dtype. Differentiable in ``x`` and ``weight``.

    Raises:
        RuntimeError: bad dtypes, shapes or devices; ``num_rows < 0``; an entry of ``row_of_slot`` outside
            ``[-1, num_rows)`` or a row named twice (both depend on the data: checked on CPU and CUDA, with one
            synchronization on CUDA, but not on fake tensors under ``torch.compile``).
    """
    return torch.ops.fastdist.moe_permute.default(x, row_of_slot, num_rows, weight)


def moe_unpermute(y: torch.Tensor, row_of_slot: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Combines expert rows back per token: ``out[t] = sum_j weight[t, j] * y[row_of_slot[t, j]]`` over kept slots.

    The sum runs in increasing ``j`` for each token (a gather, not an atomic scatter-add), so it is deterministic.

    Args:
        y: float32/float64/float16/bfloat16 ``[N, d]`` rows in expert order (16-bit rows: summed in float32,
            rounded once).
        row_of_slot: int64 ``[T, k]``, entries in ``[-1, N)``.
        weight: optional ``[T, k]`` of y's dtype (ones when None).

    Returns:
        ``[T, d]`` of y's dtype; a token with no kept slot gets zeros. Differentiable in ``y`` and ``weight``.
    """
    return torch.ops.fastdist.moe_unpermute.default(y, row_of_slot, weight)


# ---- fake kernels (same checks and messages as csrc/ops/moe.h) ----

def _check_slots(x, x_name, row_of_slot, weight, tokens):
    check_dtype("row_of_slot", row_of_slot, torch.int64)
    check_dim("row_of_slot", row_of_slot, 2)
    torch._check(row_of_slot.shape[0] == tokens,
                 lambda: f"fastdist: 'row_of_slot' must have {tokens} rows (one per token), "
                         f"got shape {list(row_of_slot.shape)}")
    if weight is not None:
        if weight.dtype != x.dtype:
            raise RuntimeError(f"fastdist: 'weight' must have the dtype of '{x_name}' ({x.dtype}), got {weight.dtype}")
        torch._check(weight.shape == row_of_slot.shape,
                     lambda: f"fastdist: 'weight' must have the shape of 'row_of_slot', got shape {list(weight.shape)}")


@torch.library.register_fake("fastdist::moe_route")
def _moe_route_fake(logits, k):
    check_dtype_in("logits", logits, _LOGIT_DTYPES)
    check_dim("logits", logits, 2)
    tokens, experts = logits.shape
    torch._check(experts >= 1, lambda: "fastdist: 'logits' must have at least 1 expert (column), got shape "
                                       f"{list(logits.shape)}")
    if not 1 <= k <= MAX_K:
        raise RuntimeError(f"fastdist: 'k' must be in [1, min({MAX_K}, num_experts = {experts})], got {k}")
    torch._check(k <= experts, lambda: f"fastdist: 'k' must be in [1, min({MAX_K}, num_experts = {experts})], got {k}")
    f32 = {"dtype": torch.float32}
    return (logits.new_empty((tokens, experts), **f32), logits.new_empty((tokens,), **f32),
            logits.new_empty((tokens, k), dtype=torch.int64), logits.new_empty((tokens, k), **f32))


@torch.library.register_fake("fastdist::moe_layout")
def _moe_layout_fake(topk_idx, num_experts, num_ranks, capacity):
    check_dtype("topk_idx", topk_idx, torch.int64)
    check_dim("topk_idx", topk_idx, 2)
    if num_experts < 1:
        raise RuntimeError(f"fastdist: 'num_experts' must be >= 1, got {num_experts}")
    if num_ranks < 1 or num_experts % num_ranks:
        raise RuntimeError(f"fastdist: 'num_ranks' must be >= 1 and divide num_experts = {num_experts}, "
                           f"got {num_ranks}")
    if capacity < -1:
        raise RuntimeError(f"fastdist: 'capacity' must be >= 0, or -1 for dropless, got {capacity}")
    check_allocatable((num_experts,), torch.int64, "the output 'counts'")
    check_allocatable((num_experts + 1,), torch.int64, "the output 'offsets'")
    check_allocatable((topk_idx.shape[1], num_experts), torch.int64, "the layout's histogram (choices x experts)")
    tokens, k = topk_idx.shape
    new = topk_idx.new_empty
    return (new((num_experts,)), new((num_experts + 1,)), new((num_ranks,)), new((tokens * k,)), new((tokens, k)),
            new((tokens, k)), new((tokens, k), dtype=torch.bool))


@torch.library.register_fake("fastdist::moe_permute")
def _moe_permute_fake(x, row_of_slot, num_rows, weight):
    check_dtype_in("x", x, _ROW_DTYPES)
    check_dim("x", x, 2)
    check_nonnegative("num_rows", num_rows)
    _check_slots(x, "x", row_of_slot, weight, x.shape[0])
    check_allocatable((num_rows, x.shape[1]), x.dtype, "the output")
    return x.new_empty((num_rows, x.shape[1]))


@torch.library.register_fake("fastdist::moe_unpermute")
def _moe_unpermute_fake(y, row_of_slot, weight):
    check_dtype_in("y", y, _ROW_DTYPES)
    check_dim("y", y, 2)
    check_dim("row_of_slot", row_of_slot, 2)
    _check_slots(y, "y", row_of_slot, weight, row_of_slot.shape[0])
    check_allocatable((row_of_slot.shape[0], y.shape[1]), y.dtype, "the output")
    return y.new_empty((row_of_slot.shape[0], y.shape[1]))


# ---- autograd ----

def _slot_dot(per_token, rows, row_of_slot):
    """[T, k]: <per_token[t], rows[row_of_slot[t, j]]> for kept slots, 0 for dropped ones."""
    tokens, k = row_of_slot.shape
    kept = row_of_slot >= 0
    if rows.shape[0] == 0:
        return per_token.new_zeros((tokens, k))
    gathered = rows.index_select(0, row_of_slot.clamp(min=0).reshape(-1)).reshape(tokens, k, -1)
    return torch.where(kept, (gathered * per_token.unsqueeze(1)).sum(-1), 0)


def _route_setup(ctx, inputs, output):
    logits, _ = inputs
    probs, _, idx, _ = output
    ctx.save_for_backward(probs, idx)
    ctx.logits_dtype = logits.dtype


def _route_backward(ctx, grad_probs, grad_lse, _grad_idx, grad_weight):
    probs, idx = ctx.saved_tensors
    g = grad_probs.clone() if grad_probs is not None else torch.zeros_like(probs)
    if grad_weight is not None:
        g = g.scatter_add(1, idx, grad_weight)
    grad = probs * (g - (g * probs).sum(-1, keepdim=True))
    if grad_lse is not None:
        grad = grad + grad_lse.unsqueeze(-1) * probs  # d lse / d logits = softmax
    return grad.to(ctx.logits_dtype), None


def _permute_setup(ctx, inputs, output):
    x, row_of_slot, _, weight = inputs
    ctx.save_for_backward(x, row_of_slot, weight)


def _permute_backward(ctx, grad_out):
    x, row_of_slot, weight = ctx.saved_tensors
    grad_x = moe_unpermute(grad_out, row_of_slot, weight) if ctx.needs_input_grad[0] else None
    grad_w = _slot_dot(x, grad_out, row_of_slot) if weight is not None and ctx.needs_input_grad[3] else None
    return grad_x, None, None, grad_w


def _unpermute_setup(ctx, inputs, output):
    y, row_of_slot, weight = inputs
    ctx.save_for_backward(y, row_of_slot, weight)


def _unpermute_backward(ctx, grad_out):
    y, row_of_slot, weight = ctx.saved_tensors
    grad_y = moe_permute(grad_out, row_of_slot, y.shape[0], weight) if ctx.needs_input_grad[0] else None
    grad_w = _slot_dot(grad_out, y, row_of_slot) if weight is not None and ctx.needs_input_grad[2] else None
    return grad_y, None, grad_w


torch.library.register_autograd("fastdist::moe_route", _route_backward, setup_context=_route_setup)
torch.library.register_autograd("fastdist::moe_permute", _permute_backward, setup_context=_permute_setup)
torch.library.register_autograd("fastdist::moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup)
