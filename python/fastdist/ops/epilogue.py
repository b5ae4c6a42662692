"""The fused epilogue of a tensor-parallel linear: ``act(x + bias) + residual`` in one memory pass.

After a row-parallel linear's all-reduce (or a column-parallel linear's GEMM) three elementwise passes usually
follow: the bias add, the activation, the residual add. ``torch.ops.fastdist.bias_epilogue`` does them in one read
of ``x`` (and ``residual``) and one write. ``x`` is viewed as rows of ``cols = x.shape[-1]`` values; ``bias`` is
``[cols]``; ``residual`` has ``x``'s shape; both are optional. Activations: ``"none"``, ``"gelu_tanh"`` (the GPT-2
approximation, torch's ``gelu(approximate="tanh")``) and ``"gelu_erf"`` (the exact GeLU).

float16 and bfloat16 are computed in float32 and rounded once; float32 uses vectorizable approximations (a rational
erf within 5e-7, a polynomial exp within 2e-7 relative, GeLU tanh written through exp(-2|z|) so it stays
relatively accurate where tanh saturates); float64 uses the C library. At any input GeLU saturates as the exact
function rounds (u or -0, derivative 1 or 0, whatever overflow u^3 or u^2 would have), and +-inf and NaN give what
torch gives. CPU (parallel over rows, bit-identical for any thread count) and CUDA kernels; fake kernels for
``torch.compile``; autograd through ``torch.ops.fastdist.bias_epilogue_backward`` (``grad * act'(x + bias)``).
"""
import torch

from fastdist.ops._checks import (FLOATING_DTYPES, check_allocatable, check_dim_at_least, check_dtype_in,
                                  check_same_device)

__all__ = ["ACTIVATIONS", "bias_epilogue", "bias_epilogue_backward"]

ACTIVATIONS = ("none", "gelu_tanh", "gelu_erf")


def bias_epilogue(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  activation: str = "none") -> torch.Tensor:
    """``act(x + bias) + residual``, differentiable in ``x``, ``bias`` and ``residual``.

    Args:
        x: float32, float16, bfloat16 or float64 tensor with at least one dimension.
        bias: optional ``[x.shape[-1]]`` tensor of ``x``'s dtype and device.
        residual: optional tensor of ``x``'s shape, dtype and device, added after the activation.
        activation: ``"none"``, ``"gelu_tanh"`` or ``"gelu_erf"``.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype.

    Raises:
        RuntimeError: ``x`` not floating point or 0-d; ``bias`` or ``residual`` of another dtype, device or shape;
            an unknown ``activation``.
    """
    return torch.ops.fastdist.bias_epilogue.default(x, bias, residual, activation)


def bias_epilogue_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
                           activation: str = "none") -> torch.Tensor:
    """``grad * act'(x + bias)``: the gradient of :func:`bias_epilogue` with respect to ``x``.

    The bias gradient is this summed over all but the last dimension; the residual gradient is ``grad``.

    Args:
        grad: the gradient of the output, of ``x``'s shape, dtype and device.
        x: the forward's ``x``.
        bias: the forward's ``bias`` (None: none).
        activation: the forward's activation, ``"none"``, ``"gelu_tanh"`` or ``"gelu_erf"``.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype.

    Raises:
        RuntimeError: ``x`` not floating point or 0-d; ``grad`` or ``bias`` of another dtype, device or shape; an
            unknown ``activation``.
    """
    return torch.ops.fastdist.bias_epilogue_backward.default(grad, x, bias, activation)


# ---- fake kernels: the C++ checks (csrc/ops/epilogue.h) with the same messages ----

def _check_x_and_bias(x, bias):
    check_dtype_in("x", x, FLOATING_DTYPES)
    check_dim_at_least("x", x, 1)
    check_allocatable(x.shape, x.dtype, "the output")
    if bias is not None:
        _check_like_x(bias, "bias", x)
        cols = x.shape[-1]
        torch._check(bias.dim() == 1 and bias.shape[0] == cols,
                     lambda: f"fastdist: 'bias' must have shape [{cols}] (the last dimension of 'x'), "
                             f"got shape {list(bias.shape)}")


def _check_like_x(t, name, x):
    if t.dtype != x.dtype:
        raise RuntimeError(f"fastdist: '{name}' must have the dtype of 'x' ({x.dtype}), got {t.dtype}")
    check_same_device(name, t, "x", x)


def _check_same_shape(t, name, x):
    torch._check(t.shape == x.shape,
                 lambda: f"fastdist: '{name}' must have the shape of 'x' ({list(x.shape)}), got shape {list(t.shape)}")


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise RuntimeError(f"fastdist: 'activation' must be \"none\", \"gelu_tanh\" or \"gelu_erf\", "
                           f"got \"{activation}\"")


@torch.library.register_fake("fastdist::bias_epilogue")
def _bias_epilogue_fake(x, bias, residual, activation):
    _check_x_and_bias(x, bias)
    if residual is not None:
        _check_like_x(residual, "residual", x)
        _check_same_shape(residual, "residual", x)
    _check_activation(activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fastdist::bias_epilogue_backward")
def _bias_epilogue_backward_fake(grad, x, bias, activation):
    _check_x_and_bias(x, bias)
    _check_like_x(grad, "grad", x)
    _check_same_shape(grad, "grad", x)
    _check_activation(activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---- autograd ----

def _setup_context(ctx, inputs, output):
    x, bias, residual, activation = inputs
    ctx.activation = activation
    ctx.has_bias = bias is not None
    ctx.has_residual = residual is not None
    ctx.save_for_backward(x if activation != "none" else None, bias if activation != "none" else None)


def _backward(ctx, grad):
    x, bias = ctx.saved_tensors
    if ctx.activation == "none":
        grad_x = grad
    else:
        grad_x = torch.ops.fastdist.bias_epilogue_backward.default(grad.contiguous(), x, bias, ctx.activation)
    grad_bias = None
    if ctx.has_bias and ctx.needs_input_grad[1]:
        # Sum in float32 (at least) so a bfloat16 bias gradient over many rows does not lose its low bits.
        acc = torch.promote_types(grad_x.dtype, torch.float32)
        grad_bias = grad_x.reshape(-1, grad_x.shape[-1]).sum(0, dtype=acc).to(grad_x.dtype)
    grad_residual = grad if ctx.has_residual else None
    return grad_x, grad_bias, grad_residual, None


torch.library.register_autograd("fastdist::bias_epilogue", _backward, setup_context=_setup_context)
