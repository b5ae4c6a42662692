"""Magnitude TopK: keep the ``k`` largest ``|x|`` of each row, put them back, and the bitmap form of the mask.

Selection (csrc/kernels/topk.h): each value's key is the order-preserving integer image of its magnitude, the float's
bits with the sign cleared; row ``r`` keeps the ``k`` values with the largest keys, found by radix select (histograms
of the key's bits 20..30, then 10..19 and 0..9 of the bucket that holds the k-th key), not a sort. Among equal
magnitudes the lower index wins, so the result is a function of the input alone (``+0.0`` and ``-0.0`` tie). NaN
ranks above ``+-inf``, which ranks above every finite magnitude, as in ``torch.topk``: a NaN is always kept. Every
NaN has the same key, so NaNs tie too (the lower index wins), whatever their sign and payload.

Output order: ascending index within each row. So ``values[r]`` lists the kept values in their order in ``x[r]``,
and a bitmap of the kept positions plus ``values`` is a complete encoding (:func:`topk_indices_to_bitmap` /
:func:`topk_bitmap_to_indices`): it is the smaller one when ``k > d / 32`` (``d / 8`` bytes against ``4 k``).

Per-tensor TopK is the same op on ``x.reshape(1, -1)`` (indices are then flat positions; a row of 2**20 or more
values is split between CPU threads).

The ops are ``torch.ops.fastdist.{topk_compress, topk_decompress, topk_indices_to_bitmap, topk_bitmap_to_indices}``
with CPU and CUDA kernels, fake kernels for ``torch.compile`` and autograd: :func:`topk_decompress` is linear in
``values`` (its gradient gathers), and :func:`topk_compress` passes the gradient of ``values`` back to the kept
positions of ``x`` (the exact derivative of masking). Inputs may be non-contiguous; outputs are contiguous.
"""
import math

import torch

from fastdist.ops._checks import (FLOAT32_OR_16BIT_DTYPES, check_allocatable, check_dim, check_dtype, check_dtype_in,
                                  check_last_dim, check_same_device, packed_bytes)

__all__ = ["topk_bitmap_to_indices", "topk_compress", "topk_decompress", "topk_indices_to_bitmap", "topk_k"]

_MAX_D = 2**31 - 1


def topk_k(ratio: float, d: int) -> int:
    """``k = ceil(ratio * d)``, at least 1: how many of ``d`` values a TopK keeping ``ratio`` keeps."""
    if not 0 < ratio <= 1:
        raise ValueError(f"fastdist: 'ratio' must be in (0, 1], got {ratio}")
    if d < 1:
        raise ValueError(f"fastdist: TopK needs at least one value per row, got d = {d}")
    # rounded first, so that float error (0.1 * 30 = 3.0000000000000004) does not add one
    return min(max(math.ceil(round(ratio * d, 6)), 1), d)


def topk_compress(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude values of each row of ``x`` and their positions, in ascending position order.

    Args:
        x: float32, float16 or bfloat16 tensor ``[B, D]`` (``B >= 0``, ``D < 2**31``); may hold NaN / inf (kept first).
        k: values kept per row, ``1 <= k <= D``.

    Returns:
        ``(values, indices)``: ``values`` ``[B, k]`` in ``x.dtype``, ``indices`` int32 ``[B, k]``, ascending per row,
        with ``values[r, j] == x[r, indices[r, j]]``.

    Raises:
        RuntimeError: ``x`` not 2-D or not float32/float16/bfloat16; ``k`` outside ``[1, D]``.
    """
    return torch.ops.fastdist.topk_compress.default(x, k)


def topk_decompress(values: torch.Tensor, indices: torch.Tensor, d: int) -> torch.Tensor:
    """The dense rows: zeros ``[B, d]`` with ``out[r, indices[r, j]] = values[r, j]``.

    Args:
        values: float32, float16 or bfloat16 ``[B, k]``.
        indices: int32 ``[B, k]``, each in ``[0, d)`` (a repeated index keeps its last value).
        d: row length, ``k <= d < 2**31``.

    Returns:
        tensor ``[B, d]`` in ``values.dtype``.

    Raises:
        RuntimeError: bad dtypes or shapes; ``d`` too small; on CPU, an index outside ``[0, d)`` (on CUDA such
            indices are skipped, not checked, to avoid a synchronization).
    """
    return torch.ops.fastdist.topk_decompress.default(values, indices, d)


def topk_indices_to_bitmap(indices: torch.Tensor, d: int) -> torch.Tensor:
    """The kept positions as a bitmap, uint8 ``[B, ceil(d / 8)]`` in :func:`fastdist.ops.pack_bits` bit order.

    Args:
        indices: int32 ``[B, k]``, strictly ascending within ``[0, d)`` in every row (as :func:`topk_compress` gives).
        d: row length.

    Raises:
        RuntimeError: bad dtype or shape; on CPU, a row that is not strictly ascending within ``[0, d)``.
    """
    return torch.ops.fastdist.topk_indices_to_bitmap.default(indices, d)


def topk_bitmap_to_indices(bitmap: torch.Tensor, d: int, k: int) -> torch.Tensor:
    """Inverse of :func:`topk_indices_to_bitmap`: the set positions of each row, ascending, int32 ``[B, k]``.

    Padding bits past ``d`` are ignored.

    Args:
        bitmap: uint8 ``[B, ceil(d / 8)]``, as :func:`topk_indices_to_bitmap` gives.
        d: row length.
        k: set bits per row, ``0 <= k <= d``.

    Returns:
        int32 ``[B, k]``, each row ascending.

    Raises:
        RuntimeError: bad dtype or shape; ``k`` outside ``[0, d]``; on CPU, a row without exactly ``k`` set bits.
    """
    return torch.ops.fastdist.topk_bitmap_to_indices.default(bitmap, d, k)


# Fake kernels: output metadata for torch.compile / FakeTensor, with the checks the shapes depend on and the same
# messages as the C++ kernels (csrc/ops/topk.h).

def _check_d(d):
    if not 0 <= d <= _MAX_D:
        raise RuntimeError(f"fastdist: 'd' must be in [0, 2^31 - 1], got {d}")


@torch.library.register_fake("fastdist::topk_compress")
def _topk_compress_fake(x, k):
    check_dtype_in("x", x, FLOAT32_OR_16BIT_DTYPES)
    check_dim("x", x, 2)
    d = x.shape[1]
    torch._check(d <= _MAX_D, lambda: "fastdist: 'x' rows must have at most 2^31 - 1 values (indices are int32), "
                                      f"got shape {list(x.shape)}")
    torch._check(1 <= k <= d, lambda: f"fastdist: 'k' must be in [1, d] with d = {d} (the row length), got {k}")
    check_allocatable(x.shape, torch.float32, "the float32 copy of 'x'")
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32)


@torch.library.register_fake("fastdist::topk_decompress")
def _topk_decompress_fake(values, indices, d):
    check_dtype_in("values", values, FLOAT32_OR_16BIT_DTYPES)
    check_dtype("indices", indices, torch.int32)
    check_dim("values", values, 2)
    check_dim("indices", indices, 2)
    check_same_device("values", values, "indices", indices)
    torch._check(values.shape == indices.shape,
                 lambda: f"fastdist: 'values' and 'indices' must have the same shape, got {list(values.shape)} and "
                         f"{list(indices.shape)}")
    _check_d(d)
    torch._check(values.shape[1] <= d, lambda: f"fastdist: 'values' must have at most d = {d} columns, got shape "
                                               f"{list(values.shape)}")
    check_allocatable((values.shape[0], d), torch.float32, "the output")
    return values.new_empty((values.shape[0], d))


@torch.library.register_fake("fastdist::topk_indices_to_bitmap")
def _topk_indices_to_bitmap_fake(indices, d):
    check_dtype("indices", indices, torch.int32)
    check_dim("indices", indices, 2)
    _check_d(d)
    torch._check(indices.shape[1] <= d, lambda: f"fastdist: 'indices' must have at most d = {d} columns, got shape "
                                                f"{list(indices.shape)}")
    check_allocatable((indices.shape[0], packed_bytes(d)), torch.uint8, "the output")
    return indices.new_empty((indices.shape[0], packed_bytes(d)), dtype=torch.uint8)


@torch.library.register_fake("fastdist::topk_bitmap_to_indices")
def _topk_bitmap_to_indices_fake(bitmap, d, k):
    check_dtype("bitmap", bitmap, torch.uint8)
    check_dim("bitmap", bitmap, 2)
    _check_d(d)
    check_last_dim("bitmap", bitmap, packed_bytes(d), f"ceil(d / 8) for d = {d}")
    if not 0 <= k <= d:
        raise RuntimeError(f"fastdist: 'k' must be in [0, d] with d = {d}, got {k}")
    check_allocatable((bitmap.shape[0], k), torch.int32, "the output")
    return bitmap.new_empty((bitmap.shape[0], k), dtype=torch.int32)


# Autograd. compress: d values / d x = the kept positions (indices are not differentiable).
# decompress: linear in values; d out / d values gathers the kept positions of the output gradient.

def _compress_setup(ctx, inputs, output):
    x, _ = inputs
    ctx.d = x.shape[1]
    ctx.save_for_backward(output[1])


def _compress_backward(ctx, grad_values, grad_indices):
    (indices,) = ctx.saved_tensors
    if grad_values is None:
        return None, None
    return topk_decompress(grad_values.contiguous(), indices, ctx.d), None


def _decompress_setup(ctx, inputs, output):
    _, indices, _ = inputs
    ctx.save_for_backward(indices)


def _decompress_backward(ctx, grad_out):
    (indices,) = ctx.saved_tensors
    return grad_out.gather(1, indices.long()), None, None


torch.library.register_autograd("fastdist::topk_compress", _compress_backward, setup_context=_compress_setup)
torch.library.register_autograd("fastdist::topk_decompress", _decompress_backward, setup_context=_decompress_setup)
