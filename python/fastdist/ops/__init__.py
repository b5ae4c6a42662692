"""Typed wrappers for torch.ops.fastdist.*, with fake kernels and autograd, one module per op family."""
from fastdist.ops.bitpack import bitwise_or_reduce, pack_bits, unpack_bits

__all__ = ["bitwise_or_reduce", "pack_bits", "unpack_bits"]
