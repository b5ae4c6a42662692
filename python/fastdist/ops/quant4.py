"""4-bit block quantization of weight matrices and the fused 4-bit linear layer.

A weight ``w`` of shape ``[n, k]`` (n outputs, k inputs) is cut into blocks of ``block_rows`` rows x ``block``
columns (``block`` even and dividing ``k``, ``block_rows`` dividing ``n``; ``block_rows = 1``, the default, is the
usual block along the input); each block has a float32 scale, and for ``int4`` a float32 zero point; each value a
4-bit code, two per byte (csrc/kernels/quant4.h):

* ``nf4``: the QLoRA NormalFloat-4 codebook ``c`` times the block's absmax ``s``: ``w' = c[q] * s``. Quantization is
  bitsandbytes' ``quantize_4bit(quant_type="nf4")`` arithmetic, bit for bit (the same codes and absmax; packed the
  same way: ``byte = q[2j] << 4 | q[2j + 1]``).
* ``int4``: asymmetric, ``scale = (max - min) / 15``, ``zero = min``, ``w' = q * scale + zero`` (round half to even,
  ``|w - w'| <= scale / 2``). The zero point is in weight units: adding ``d`` to a block of ``w'`` is ``zero += d``.

Layout: ``packed`` uint8 ``[n, k / 2]``, ``scales`` float32 ``[n / block_rows, k / block]``, ``zeros`` float32 of the
same shape (``None`` for nf4). ``qlinear(x, ...)`` is ``x @ w'.T + bias`` without materializing ``w'``: for up to 32
rows of ``x`` (decoding) one fused pass streams the packed weight once (AVX-512 when the CPU has it); above that a
tile of output rows (16 MiB of float32) is dequantized at a time and multiplied by the BLAS. Autograd gives the
gradient to ``x`` (and ``bias``); the quantized weight is frozen.

Ops: ``torch.ops.fastdist.{quant4_quantize, quant4_dequantize, qlinear, qlinear_grad_input}``, CPU and CUDA, with fake
kernels (``torch.compile``) and the same error messages on real and fake tensors.
"""
import torch

from fastdist.ops._checks import (FLOAT32_OR_16BIT_DTYPES, check_allocatable, check_dim, check_dim_at_least,
                                  check_dtype, check_dtype_in, check_same_device)

__all__ = ["SCHEMES", "dequantize4", "qlinear", "qlinear_grad_input", "quantize4"]

SCHEMES = ("nf4", "int4")


def quantize4(w: torch.Tensor, scheme: str = "nf4", block: int = 64,
              block_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantizes a weight matrix to 4 bits, block by block.

    Args:
        w: ``[n, k]`` float32, float16 or bfloat16, finite.
        scheme: ``"nf4"`` or ``"int4"``.
        block: columns per block, even, dividing ``k``.
        block_rows: rows per block (2-D blocks), dividing ``n``.

    Returns:
        ``(packed, scales, zeros)``: uint8 ``[n, k / 2]``, float32 ``[n / block_rows, k / block]``, and float32 of the
        scales' shape for int4 or ``None`` for nf4.

    Raises:
        RuntimeError: bad dtype, shape, scheme or block; NaN or inf in ``w``.
    """
    packed, scales, zeros = torch.ops.fastdist.quant4_quantize.default(w, scheme, block, block_rows)
    return packed, scales, zeros if scheme == "int4" else None


def dequantize4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """The float32 weight ``w'`` ``[n, k]`` of :func:`quantize4`'s output.

    Args:
        packed: uint8 ``[n, k / 2]``, two 4-bit codes per byte.
        scales: float32 ``[n / block_rows, k / block]``.
        zeros: float32 of the scales' shape for int4, ``None`` for nf4.
        scheme: ``"nf4"`` or ``"int4"``.

    Returns:
        ``w'`` float32 ``[n, k]``.
    """
    return torch.ops.fastdist.quant4_dequantize.default(packed, scales, zeros, scheme)


def qlinear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, scheme: str,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w'.T + bias`` for a 4-bit weight, without materializing ``w'``; differentiable in ``x`` and ``bias``.

    Args:
        x: ``[..., k]`` float32, float16 or bfloat16 (computed in float32).
        packed, scales, zeros, scheme: a quantized weight (:func:`quantize4`).
        bias: optional ``[n]``.

    Returns:
        ``[..., n]`` in ``x``'s dtype.
    """
    return torch.ops.fastdist.qlinear.default(x, packed, scales, zeros, scheme, bias)


def qlinear_grad_input(grad: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       scheme: str) -> torch.Tensor:
    """``grad @ w'``: the gradient of :func:`qlinear` with respect to ``x``, ``[..., k]`` in ``grad``'s dtype.

    Args:
        grad: the gradient of :func:`qlinear`'s output, ``[..., n]``.
        packed: uint8 ``[n, k / 2]``, two 4-bit codes per byte.
        scales: float32 ``[n / block_rows, k / block]``.
        zeros: float32 of the scales' shape for int4, ``None`` for nf4.
        scheme: ``"nf4"`` or ``"int4"``.

    Returns:
        ``grad @ w'``, ``[..., k]`` in ``grad``'s dtype.
    """
    return torch.ops.fastdist.qlinear_grad_input.default(grad, packed, scales, zeros, scheme)


# ---- fake kernels: the C++ checks (csrc/ops/quant4.h) with the same messages ----

def _check_scheme(scheme):
    if scheme not in SCHEMES:
        raise RuntimeError(f"fastdist: 'scheme' must be \"nf4\" or \"int4\", got \"{scheme}\"")


def _layout(packed, scales, zeros, scheme):
    """(n, k) of a quantized weight, after the checks of check_layout."""
    _check_scheme(scheme)
    check_dtype("packed", packed, torch.uint8)
    check_dim("packed", packed, 2)
    check_dtype("scales", scales, torch.float32)
    check_dim("scales", scales, 2)
    check_same_device("packed", packed, "scales", scales)
    n, k = packed.shape[0], 2 * packed.shape[1]
    row_blocks, groups = scales.shape
    rows_ok = row_blocks == 0 if n == 0 else row_blocks >= 1 and n % row_blocks == 0
    cols_ok = groups == 0 if k == 0 else groups >= 1 and k % groups == 0 and (k // groups) % 2 == 0
    torch._check(rows_ok and cols_ok,
                 lambda: "fastdist: 'scales' must have shape [n / block_rows, k / block] with block_rows dividing n = "
                         f"{n} and an even block dividing k = {k} (2 * packed.shape[1]), got shape "
                         f"{list(scales.shape)}")
    if scheme == "int4":
        if zeros is None:
            raise RuntimeError("fastdist: 'zeros' must be given for scheme \"int4\"")
        check_dtype("zeros", zeros, torch.float32)
        check_same_device("packed", packed, "zeros", zeros)
        torch._check(zeros.shape == scales.shape,
                     lambda: f"fastdist: 'zeros' must have the shape of 'scales' ({list(scales.shape)}), got shape "
                             f"{list(zeros.shape)}")
    elif zeros is not None:
        raise RuntimeError("fastdist: 'zeros' must be None for scheme \"nf4\"")
    return n, k


@torch.library.register_fake("fastdist::quant4_quantize")
def _quantize_fake(w, scheme, block, block_rows=1):
    check_dtype_in("w", w, FLOAT32_OR_16BIT_DTYPES)
    check_dim("w", w, 2)
    _check_scheme(scheme)
    if block < 2 or block % 2:
        raise RuntimeError(f"fastdist: 'block' must be even and >= 2, got {block}")
    n, k = w.shape
    torch._check(k % block == 0, lambda: "fastdist: 'block' must divide the input dimension (w.shape[1]), got block "
                                         f"= {block} for w of shape {list(w.shape)}")
    if block_rows < 1:
        raise RuntimeError(f"fastdist: 'block_rows' must be >= 1, got {block_rows}")
    torch._check(n % block_rows == 0,
                 lambda: "fastdist: 'block_rows' must divide the output dimension (w.shape[0]), got block_rows = "
                         f"{block_rows} for w of shape {list(w.shape)}")
    check_allocatable(w.shape, torch.float32, "the float32 copy of 'w'")
    shape = (n // block_rows, k // block)
    zeros = w.new_empty(shape if scheme == "int4" else (0,), dtype=torch.float32)
    return w.new_empty((n, k // 2), dtype=torch.uint8), w.new_empty(shape, dtype=torch.float32), zeros


@torch.library.register_fake("fastdist::quant4_dequantize")
def _dequantize_fake(packed, scales, zeros, scheme):
    n, k = _layout(packed, scales, zeros, scheme)
    return scales.new_empty((n, k))


def _check_input(name, t, packed, last, what):
    check_dtype_in(name, t, FLOAT32_OR_16BIT_DTYPES)
    check_dim_at_least(name, t, 1)
    check_same_device(name, t, "packed", packed)
    torch._check(t.shape[-1] == last,
                 lambda: f"fastdist: '{name}' must have last dimension {last} ({what}), got shape {list(t.shape)}")


@torch.library.register_fake("fastdist::qlinear")
def _qlinear_fake(x, packed, scales, zeros, scheme, bias):
    n, k = _layout(packed, scales, zeros, scheme)
    _check_input("x", x, packed, k, "the weight's input dimension")
    if bias is not None:
        check_dtype_in("bias", bias, FLOAT32_OR_16BIT_DTYPES)
        check_same_device("x", x, "bias", bias)
        torch._check(bias.dim() == 1 and bias.shape[0] == n,
                     lambda: f"fastdist: 'bias' must have shape [{n}] (the weight's output dimension), got shape "
                             f"{list(bias.shape)}")
    shape = (*x.shape[:-1], n)
    check_allocatable(shape, torch.float32, "the output")
    return x.new_empty(shape)


@torch.library.register_fake("fastdist::qlinear_grad_input")
def _qlinear_grad_input_fake(grad, packed, scales, zeros, scheme):
    n, k = _layout(packed, scales, zeros, scheme)
    _check_input("grad", grad, packed, n, "the weight's output dimension")
    shape = (*grad.shape[:-1], k)
    check_allocatable(shape, torch.float32, "the output")
    return grad.new_empty(shape)


# ---- autograd: the gradient to x (and bias); the quantized weight is frozen ----

def _setup_context(ctx, inputs, output):
    x, packed, scales, zeros, scheme, bias = inputs
    ctx.scheme = scheme
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(packed, scales, zeros)


def _backward(ctx, grad):
    packed, scales, zeros = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.fastdist.qlinear_grad_input.default(grad, packed, scales, zeros, ctx.scheme)
    grad_bias = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[5]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, None, None, None, None, grad_bias


torch.library.register_autograd("fastdist::qlinear", _backward, setup_context=_setup_context)
