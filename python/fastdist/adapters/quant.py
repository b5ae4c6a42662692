"""Frozen 4-bit linear layers over :func:`fastdist.ops.qlinear`, and the model pass that installs them."""
from collections.abc import Sequence

import torch
from torch import nn

from fastdist.ops.quant4 import SCHEMES, dequantize4, qlinear, quantize4

__all__ = ["QuantLinear", "quantize_model"]


class QuantLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is 4-bit block-quantized (``nf4`` or ``int4``; blocks of ``block`` input
    columns, and of ``block_rows`` output rows for 2-D blocks).

    The quantized weight (``packed``, ``scales``, ``zeros``) and the bias are buffers: they are in ``state_dict`` and
    move with ``.to()``, but are not parameters, so optimizers and DDP never see them. ``forward`` is the fused
    :func:`~fastdist.ops.qlinear`; gradients flow to the input only.

    Args:
        in_features: input features (divisible by ``block``).
        out_features: output features (divisible by ``block_rows``).
        bias: whether the layer has a bias (a float32 buffer).
        scheme: ``"nf4"`` or ``"int4"`` (``int4`` has per-block zero points).
        block: input columns per quantization block (even).
        block_rows: output rows per quantization block.
        device: where the buffers live.

    Raises:
        ValueError: an unknown scheme, or a block (or block_rows) that does not divide the layer's shape.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, scheme: str = "nf4", block: int = 64,
                 block_rows: int = 1, device: torch.device | str | None = None) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"QuantLinear: scheme must be one of {SCHEMES}, got {scheme!r}")
        if block < 2 or block % 2 or in_features % block:
            raise ValueError(f"QuantLinear: block must be even and divide in_features = {in_features}, got {block}")
        if block_rows < 1 or out_features % block_rows:
            raise ValueError(f"QuantLinear: block_rows must divide out_features = {out_features}, got {block_rows}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.block, self.block_rows = block, block_rows
        shape = (out_features // block_rows, in_features // block)
        self.register_buffer("packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(shape, device=device))
        self.register_buffer("zeros", torch.zeros(shape, device=device) if scheme == "int4" else None)
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str = "nf4", block: int = 64, block_rows: int = 1,
                    name: str = "") -> "QuantLinear":
        """Quantizes ``linear``'s weight; ``name`` (the module's path) goes into error messages.

        Args:
            linear: the float layer to quantize (left unchanged).
            scheme: ``"nf4"`` or ``"int4"``.
            block: input columns per quantization block (even, dividing ``linear.in_features``).
            block_rows: output rows per quantization block (dividing ``linear.out_features``).
            name: the layer's path in its model, for error messages.

        Returns:
            A new :class:`QuantLinear` on ``linear``'s device holding its quantized weight and its bias.

        Raises:
            ValueError: a block (or block_rows) that does not divide the layer's shape (the message names the layer).
            RuntimeError: the weight cannot be quantized (NaN or inf; named too).
        """
        where = f" '{name}'" if name else ""
        if linear.in_features % block:
            raise ValueError(f"QuantLinear: layer{where} has in_features = {linear.in_features}, not divisible by "
                             f"block = {block}; skip it or pick a block that divides it")
        if linear.out_features % block_rows:
            raise ValueError(f"QuantLinear: layer{where} has out_features = {linear.out_features}, not divisible by "
                             f"block_rows = {block_rows}; skip it or pick block_rows that divides it")
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme, block, block_rows,
                  device=linear.weight.device)
        try:
            packed, scales, zeros = quantize4(linear.weight.detach(), scheme, block, block_rows)
        except RuntimeError as e:
            raise RuntimeError(f"QuantLinear: cannot quantize layer{where}: {e}") from e
        out.packed.copy_(packed)
        out.scales.copy_(scales)
        if zeros is not None:
            out.zeros.copy_(zeros)
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach().float())
        return out

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight ``[out_features, in_features]`` this layer computes with."""
        return dequantize4(self.packed, self.scales, self.zeros, self.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` with ``W`` the dequantized weight, by the fused kernel.

        Args:
            x: the input ``[..., in_features]``.

        Returns:
            The output ``[..., out_features]``.
        """
        return qlinear(x, self.packed, self.scales, self.zeros, self.scheme, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme}, block={self.block}, block_rows={self.block_rows}")


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Puts `module` at the dotted path `name` of `model` in place of what is there."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model(model: nn.Module, scheme: str = "nf4", block: int = 64, skip: Sequence[str] = ("lm_head",),
                   block_rows: int = 1) -> nn.Module:
    """Replaces every ``nn.Linear`` of ``model`` (in place) by a frozen :class:`QuantLinear`.

    Args:
        model: any module.
        scheme: ``"nf4"`` or ``"int4"``.
        block: columns per quantization block (even, dividing each layer's in_features).
        skip: layers whose name ends with (or equals) one of these stay in floating point.
        block_rows: output rows per block (2-D blocks: ``block=4, block_rows=8`` lets QA-HiRA merge exactly at the
            metadata cost of 1-D blocks of 32).

    Returns:
        ``model``. Its remaining parameters (embeddings, norms, skipped layers) are frozen too, as in QLoRA.

    Raises:
        ValueError: a layer's in_features is not divisible by ``block``, or its out_features by ``block_rows`` (the
            message names the layer).
        RuntimeError: a layer's weight holds NaN or inf (named too).
    """
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and not any(name == s or name.endswith("." + s) for s in skip)]
    for name, linear in targets:
        replace_submodule(model, name, QuantLinear.from_linear(linear, scheme, block, block_rows, name))
    for p in model.parameters():
        p.requires_grad_(False)
    return model
