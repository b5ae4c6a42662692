"""Argument checks shared by the fake kernels, mirroring csrc/ops/checks.h.

A fake kernel rejects what its C++ kernel rejects, with the same message, so that a bad input fails alike on real and
on fake tensors (``torch.compile``). Checks of a size that may be symbolic go through ``torch._check``.
"""
import math
from collections.abc import Sequence

import torch

INT64_MAX = 2**63 - 1

# The dtypes the kernels store, in the order the messages list them.
FLOATING_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The dtypes of the ops that compute in float32: float32 itself and the 16-bit formats it holds exactly.
FLOAT32_OR_16BIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def packed_bytes(bits: int) -> int:
    """Bytes that hold ``bits`` bits packed eight to a byte, ``ceil(bits / 8)``."""
    return (bits + 7) // 8


def dtype_list(dtypes: Sequence[torch.dtype]) -> str:
    """``"torch.float32, torch.float16 or torch.bfloat16"``: the dtypes in the order given."""
    names = [str(dtype) for dtype in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """``t`` (named ``name``) must have ``dtype``."""
    if t.dtype != dtype:
        raise RuntimeError(f"fastdist: '{name}' must have dtype {dtype}, got {t.dtype}")


def check_dtype_in(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    """``t`` must have one of ``allowed``; the message lists them in that order, as "a floating dtype (...)" when they
    are every dtype the kernels store."""
    if t.dtype in allowed:
        return
    if set(FLOATING_DTYPES) <= set(allowed):
        raise RuntimeError(f"fastdist: '{name}' must have a floating dtype ({dtype_list(allowed)}), got {t.dtype}")
    raise RuntimeError(f"fastdist: '{name}' must have dtype {dtype_list(allowed)}, got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, dim: int) -> None:
    """``t`` must have exactly ``dim`` dimensions."""
    if t.dim() != dim:
        raise RuntimeError(f"fastdist: '{name}' must have {dim} dimension(s), got shape {list(t.shape)}")


def check_dim_at_least(name: str, t: torch.Tensor, dim: int) -> None:
    """``t`` must have at least ``dim`` dimensions."""
    if t.dim() < dim:
        raise RuntimeError(f"fastdist: '{name}' must have at least {dim} dimension(s), got shape {list(t.shape)}")


def check_same_device(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """``t`` must be on ``other``'s device."""
    if t.device != other.device:
        raise RuntimeError(f"fastdist: '{name}' and '{other_name}' must be on the same device, got {t.device} and "
                           f"{other.device}")


def check_nonnegative(name: str, value: int) -> None:
    """``value`` (an int argument named ``name``) must be >= 0."""
    if value < 0:
        raise RuntimeError(f"fastdist: '{name}' must be >= 0, got {value}")


def check_last_dim(name: str, t: torch.Tensor, expected: int, why: str) -> None:
    """``t``'s last dimension must be ``expected``; ``why`` says where that size comes from."""
    torch._check(t.dim() >= 1 and t.shape[-1] == expected,
                 lambda: f"fastdist: '{name}' must have last dimension {expected} ({why}), got shape {list(t.shape)}")


def check_seed(seed: int) -> int:
    """``seed``, which must be in ``[0, 2^63)``: the kernels take it as an unsigned 64-bit value, and a Python int
    past int64 could not reach the op to get its message."""
    if not 0 <= seed < 2**63:
        raise RuntimeError(f"fastdist: 'seed' must be in [0, 2^63), got {seed}")
    return seed


# ---- sizes: every product of sizes that the glue or the kernels form is checked first, so that none wraps ----

def checked_mul(a: int, b: int, what: str) -> int:
    """``a * b``, where ``what`` names the two factors (``"'n' * 'm'"``); past int64 it raises an error stating both."""
    product = a * b
    torch._check(product <= INT64_MAX, lambda: f"fastdist: {what} = {a} * {b} does not fit in int64")
    return product


def checked_product(sizes: Sequence[int], what: str) -> int:
    """The product of ``sizes`` (part of a tensor's shape, named by ``what``); past int64 it raises an error that
    states them."""
    product = math.prod(sizes)
    torch._check(product <= INT64_MAX, lambda: f"fastdist: {what} {list(sizes)} multiply past int64")
    return product


def check_allocatable(sizes: Sequence[int], dtype: torch.dtype, what: str) -> None:
    """A tensor of ``sizes`` and ``dtype`` that the op is about to make (``what`` names it): as torch requires, its
    strides (the products of the sizes after each, zeros counted as ones) and its size in bytes must fit in int64."""
    stride = math.prod(max(size, 1) for size in sizes[1:])
    nbytes = math.prod(sizes) * dtype.itemsize
    torch._check(stride <= INT64_MAX and nbytes <= INT64_MAX,
                 lambda: f"fastdist: {what} would have shape {list(sizes)} of {dtype}: its strides or its size in "
                         "bytes pass int64")
