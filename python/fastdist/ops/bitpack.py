"""Bit packing: bool masks <-> packed uint8 bytes, and the union (OR) of packed bitmaps.

Bit order is little-endian within a byte: bit ``j`` of byte ``i`` along the last dimension is element
``8 * i + j`` of the mask, as ``numpy.packbits(..., bitorder="little")``. The padding bits of the last byte
are zero after :func:`pack_bits` and ignored by :func:`unpack_bits`.

The ops are ``torch.ops.fastdist.{pack_bits, unpack_bits, bitwise_or_reduce, bitmap_from_indices}`` with CPU and CUDA kernels
(C++ in csrc/kernels/bitpack.*) and fake kernels for ``torch.compile``. Inputs may be non-contiguous
(they are made contiguous first); outputs are contiguous and on the input's device.
"""
import torch

from fastdist.ops._checks import (check_allocatable, check_dim, check_dim_at_least, check_dtype, check_last_dim,
                                  check_nonnegative, packed_bytes)

__all__ = ["pack_bits", "unpack_bits", "bitwise_or_reduce", "bitmap_from_indices"]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Packs a bool mask along its last dimension, 8 elements per byte.

    Args:
        mask: bool tensor of shape ``[..., n]``, at least 1-D.

    Returns:
        uint8 tensor of shape ``[..., ceil(n / 8)]``; bit ``j`` of byte ``i`` is ``mask[..., 8 * i + j]``,
        padding bits are zero.

    Raises:
        RuntimeError: ``mask`` is not bool (convert with ``mask != 0``) or is 0-D.
    """
    return torch.ops.fastdist.pack_bits.default(mask)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``unpack_bits(pack_bits(mask), mask.shape[-1])`` equals ``mask``.

    Args:
        packed: uint8 tensor of shape ``[..., ceil(n / 8)]``, at least 1-D.
        n: number of mask elements per row, ``n >= 0``.

    Returns:
        bool tensor of shape ``[..., n]``. Padding bits of ``packed`` are ignored.

    Raises:
        RuntimeError: ``packed`` is not uint8, is 0-D, its last dimension is not ``ceil(n / 8)``,
            or ``n < 0``.
    """
    return torch.ops.fastdist.unpack_bits.default(packed, n)


def bitwise_or_reduce(packed: torch.Tensor) -> torch.Tensor:
    """Bitwise OR over the rows of ``packed``: the union of ``P`` packed bitmaps.

    Args:
        packed: uint8 tensor of shape ``[P, B]``.

    Returns:
        uint8 tensor of shape ``[B]``; all zeros when ``P == 0``.

    Raises:
        RuntimeError: ``packed`` is not uint8 or not 2-D.
    """
    return torch.ops.fastdist.bitwise_or_reduce.default(packed)


def bitmap_from_indices(indices: torch.Tensor, n: int) -> torch.Tensor:
    """The packed bitmap of the units ``indices`` lists: ``pack_bits`` of a mask of ``n`` units set at ``indices``,
    without the mask (e.g. a sparse gradient's rows, from its row indices, coalesced or not).

    Args:
        indices: int64 tensor of shape ``[k]``, in any order, repeats allowed.
        n: number of units, ``n >= 0``.

    Returns:
        uint8 tensor of shape ``[ceil(n / 8)]``; padding bits are zero.

    Raises:
        RuntimeError: ``indices`` is not int64 or not 1-D, or ``n < 0``; on CPU, an index outside ``[0, n)`` (CUDA
            skips such indices instead: checking them would need a copy to the host).
    """
    return torch.ops.fastdist.bitmap_from_indices.default(indices, n)


# Fake kernels: output metadata for torch.compile / FakeTensor, with the checks the shapes depend on and the
# same messages as the C++ kernels (csrc/ops/bitpack.h).

@torch.library.register_fake("fastdist::pack_bits")
def _pack_bits_fake(mask):
    check_dtype("mask", mask, torch.bool)
    check_dim_at_least("mask", mask, 1)
    shape = (*mask.shape[:-1], packed_bytes(mask.shape[-1]))
    check_allocatable(shape, torch.uint8, "the output")
    return mask.new_empty(shape, dtype=torch.uint8)


@torch.library.register_fake("fastdist::unpack_bits")
def _unpack_bits_fake(packed, n):
    check_dtype("packed", packed, torch.uint8)
    check_dim_at_least("packed", packed, 1)
    check_nonnegative("n", n)
    check_last_dim("packed", packed, packed_bytes(n), f"ceil(n / 8) for n = {n}")
    shape = (*packed.shape[:-1], n)
    check_allocatable(shape, torch.bool, "the output")
    return packed.new_empty(shape, dtype=torch.bool)


@torch.library.register_fake("fastdist::bitwise_or_reduce")
def _bitwise_or_reduce_fake(packed):
    check_dtype("packed", packed, torch.uint8)
    check_dim("packed", packed, 2)
    return packed.new_empty((packed.shape[1],))


@torch.library.register_fake("fastdist::bitmap_from_indices")
def _bitmap_from_indices_fake(indices, n):
    check_dtype("indices", indices, torch.int64)
    check_dim("indices", indices, 1)
    check_nonnegative("n", n)
    return indices.new_empty((packed_bytes(n),), dtype=torch.uint8)
