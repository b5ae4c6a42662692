"""Typed wrappers for torch.ops.fastdist.*, with fake kernels and autograd, one module per op family."""
from fastdist.ops.bitpack import bitwise_or_reduce, pack_bits, unpack_bits
from fastdist.ops.epilogue import bias_epilogue, bias_epilogue_backward
from fastdist.ops.sketch import count_sketch, count_sketch_decode, nonzero_bitmap, sketch_hash

__all__ = ["bias_epilogue", "bias_epilogue_backward", "bitwise_or_reduce", "count_sketch", "count_sketch_decode",
           "nonzero_bitmap", "pack_bits", "sketch_hash", "unpack_bits"]
