"""Typed wrappers for torch.ops.fastdist.*, with fake kernels and autograd, one module per op family."""
from fastdist.ops.bitpack import bitwise_or_reduce, pack_bits, unpack_bits
from fastdist.ops.moe import moe_layout, moe_permute, moe_route, moe_unpermute
from fastdist.ops.sketch import (count_sketch, count_sketch_decode, count_sketch_decode_units, count_sketch_units,
                                 nonzero_bitmap, sketch_hash)

__all__ = [
    "bitwise_or_reduce", "pack_bits", "unpack_bits",
    "moe_layout", "moe_permute", "moe_route", "moe_unpermute",
    "count_sketch", "count_sketch_decode", "count_sketch_decode_units", "count_sketch_units", "nonzero_bitmap",
    "sketch_hash",
]
