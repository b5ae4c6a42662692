"""Typed wrappers for torch.ops.fastdist.*, with fake kernels and autograd, one module per op family."""
from fastdist.ops.bitpack import bitmap_from_indices, bitwise_or_reduce, pack_bits, unpack_bits
from fastdist.ops.epilogue import bias_epilogue, bias_epilogue_backward
from fastdist.ops.moe import moe_layout, moe_permute, moe_route, moe_unpermute
from fastdist.ops.quant4 import dequantize4, qlinear, qlinear_grad_input, quantize4
from fastdist.ops.quantize import dequantize, quantize
from fastdist.ops.sketch import (count_sketch, count_sketch_decode, count_sketch_decode_units, count_sketch_units,
                                 nonzero_bitmap, sketch_hash, union_sum_rows)
from fastdist.ops.topk import topk_bitmap_to_indices, topk_compress, topk_decompress, topk_indices_to_bitmap

__all__ = [
    "bitmap_from_indices", "bitwise_or_reduce", "pack_bits", "unpack_bits",
    "bias_epilogue", "bias_epilogue_backward",
    "moe_layout", "moe_permute", "moe_route", "moe_unpermute",
    "dequantize4", "qlinear", "qlinear_grad_input", "quantize4",
    "dequantize", "quantize",
    "count_sketch", "count_sketch_decode", "count_sketch_decode_units", "count_sketch_units", "nonzero_bitmap",
    "sketch_hash", "union_sum_rows",
    "topk_bitmap_to_indices", "topk_compress", "topk_decompress", "topk_indices_to_bitmap",
]
