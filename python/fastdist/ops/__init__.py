"""Typed wrappers for torch.ops.fastdist.*, with fake kernels and autograd, one module per op family."""
