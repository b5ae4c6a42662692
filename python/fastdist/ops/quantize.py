"""Quantization to 1, 2, 4 or 8 bits with per-group scales and bit-packed codes, and the way back.

``x`` is viewed flat and cut into groups of ``group_size`` consecutive values: per-tensor is ``group_size =
x.numel()``, per-row of ``[B, D]`` is ``group_size = D``, per-group-of-G is ``group_size = G`` (it must divide the
number of values). Every group has a float32 scale (and, for minmax, a float32 zero point); every value a code
``q in [0, 2**bits - 1]`` (csrc/kernels/quantize.h):

* ``minmax``: ``scale = (max - min) / (2**bits - 1)``, ``zero = min``; ``x' = zero + q * scale``.
* ``absmax``: ``s = max |x|``. ``bits >= 2``: ``scale = s / (2**(bits-1) - 1)``, ``x' = (q - 2**(bits-1)) * scale``,
  symmetric levels ``-s .. s`` with ``0`` exact; ``bits == 1``: the two levels ``-s`` and ``+s``
  (``scale = 2 s``, ``x' = (q - 1/2) * scale``). ``zeros`` is all zero and need not be sent.

Nearest rounding (half to even) keeps ``|x - x'| <= scale / 2`` (up to float32 rounding); stochastic rounding
(``stochastic=True``) is unbiased with ``|x - x'| < scale``, its uniform numbers a function of ``(seed, flat index)``
only (a counter-based splitmix64), so CPU and CUDA, any thread count, give the same codes bit for bit.

Codes are packed least-significant-bit first: code ``i`` is bits ``[i * bits, (i + 1) * bits)`` of the byte stream
(``ceil(n * bits / 8)`` bytes). Non-finite values (NaN, inf) are refused with an error; a group whose range overflows
float32 too.

The ops are ``torch.ops.fastdist.{quantize, dequantize}`` with CPU and CUDA kernels and fake kernels. They are not
differentiable (codes are integers); compressors that need a gradient path use a straight-through estimator
(:mod:`fastdist.compress`).
"""
import math
from collections.abc import Sequence

import torch

from fastdist.ops._checks import (FLOAT32_OR_16BIT_DTYPES, check_allocatable, check_dtype, check_dtype_in,
                                  check_same_device, check_seed, checked_mul, packed_bytes)

__all__ = ["BITS", "SCHEMES", "dequantize", "quantize"]

BITS = (1, 2, 4, 8)
SCHEMES = ("minmax", "absmax")


def quantize(x: torch.Tensor, bits: int, scheme: str = "minmax", group_size: int | None = None,
             stochastic: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` group by group.

    Args:
        x: float32, float16 or bfloat16 tensor, any shape, finite.
        bits: 1, 2, 4 or 8.
        scheme: ``"minmax"`` or ``"absmax"``.
        group_size: values per group, dividing ``x.numel()``; None: the whole tensor is one group.
        stochastic: stochastic rounding (unbiased) instead of nearest.
        seed: seed of the stochastic rounding, ``0 <= seed < 2**63``.

    Returns:
        ``(packed, scales, zeros)``: uint8 ``[ceil(n * bits / 8)]``, float32 ``[n / group_size]`` twice.

    Raises:
        RuntimeError: bad dtype, bits, scheme, group_size or seed; NaN or inf in ``x``.
    """
    if group_size is None:
        group_size = max(x.numel(), 1)
    return torch.ops.fastdist.quantize.default(x, bits, scheme, group_size, stochastic, check_seed(seed))


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, scheme: str,
               group_size: int, shape: Sequence[int]) -> torch.Tensor:
    """The values ``x'`` of :func:`quantize`'s output, float32 of ``shape``.

    Args:
        packed: uint8 codes, as :func:`quantize` returns them.
        scales: float32 ``[n / group_size]`` scales, as :func:`quantize` returns them.
        zeros: float32 ``[n / group_size]`` zero points, as :func:`quantize` returns them.
        bits: the ``bits`` they were quantized with.
        scheme: the ``scheme`` they were quantized with.
        group_size: values per group (the ``group_size`` they were quantized with; ``n`` for one group).
        shape: the output's shape, of ``n`` values.

    Returns:
        float32 tensor of ``shape``.

    Raises:
        RuntimeError: bad bits or scheme; ``packed``, ``scales`` or ``zeros`` of the wrong dtype, shape or device.
    """
    return torch.ops.fastdist.dequantize.default(packed, scales, zeros, bits, scheme, group_size, list(shape))


# Fake kernels: output metadata for torch.compile / FakeTensor, with the same checks and messages as the C++ kernels
# (csrc/ops/quantize.h).

def _check_bits_scheme(bits, scheme):
    if bits not in BITS:
        raise RuntimeError(f"fastdist: 'bits' must be 1, 2, 4 or 8, got {bits}")
    if scheme not in SCHEMES:
        raise RuntimeError(f"fastdist: 'scheme' must be \"minmax\" or \"absmax\", got \"{scheme}\"")


def _check_group(n, group_size):
    if group_size < 1:
        raise RuntimeError(f"fastdist: 'group_size' must be >= 1, got {group_size}")
    torch._check(n % group_size == 0, lambda: "fastdist: 'group_size' must divide the number of values, got "
                                              f"group_size = {group_size} for {n} values")


@torch.library.register_fake("fastdist::quantize")
def _quantize_fake(x, bits, scheme, group_size, stochastic, seed):
    check_dtype_in("x", x, FLOAT32_OR_16BIT_DTYPES)
    _check_bits_scheme(bits, scheme)
    n = x.numel()
    _check_group(n, group_size)
    check_seed(seed)
    check_allocatable((n,), torch.float32, "the float32 copy of 'x'")
    checked_mul(n, bits, "the number of values * 'bits'")
    groups = n // group_size
    return (x.new_empty((packed_bytes(n * bits),), dtype=torch.uint8), x.new_empty((groups,), dtype=torch.float32),
            x.new_empty((groups,), dtype=torch.float32))


@torch.library.register_fake("fastdist::dequantize")
def _dequantize_fake(packed, scales, zeros, bits, scheme, group_size, shape):
    _check_bits_scheme(bits, scheme)
    if any(s < 0 for s in shape):
        raise RuntimeError(f"fastdist: 'shape' must not be negative, got {list(shape)}")
    check_allocatable(shape, torch.float32, "the output")
    n = math.prod(shape)
    checked_mul(n, bits, "the number of values * 'bits'")
    _check_group(n, group_size)
    check_dtype("packed", packed, torch.uint8)
    check_dtype("scales", scales, torch.float32)
    check_dtype("zeros", zeros, torch.float32)
    check_same_device("packed", packed, "scales", scales)
    check_same_device("packed", packed, "zeros", zeros)
    nbytes = packed_bytes(n * bits)
    torch._check(packed.dim() == 1 and packed.shape[0] == nbytes,
                 lambda: f"fastdist: 'packed' must have shape [{nbytes}] (ceil(n * bits / 8) for n = {n}, bits = "
                         f"{bits}), got shape {list(packed.shape)}")
    groups = n // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        torch._check(t.dim() == 1 and t.shape[0] == groups,
                     lambda: f"fastdist: '{name}' must have shape [{groups}] (one per group), got shape "
                             f"{list(t.shape)}")
    return scales.new_empty(list(shape))
