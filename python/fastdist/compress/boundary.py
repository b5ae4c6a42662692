"""Boundary: a module placed between blocks in one process that compresses the activation in the forward pass and
the gradient in the backward pass (the setting of Rudakov et al.: a simulated pipeline boundary).

Backward with ``backward_mask="reuse"`` and a sparsifying forward compressor (TopK, Chain, ErrorFeedback(TopK)):
the gradient is masked with the forward's kept positions, which is the exact derivative of the masking, and only
those k values per row are (optionally) compressed by ``bwd`` and "sent". With ``"independent"`` the gradient is
passed straight through the forward compressor and compressed by ``bwd`` on its own. Without a mask (quantization,
AQ-SGD) the forward is treated as the identity for the gradient (straight-through).
"""
import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

from fastdist.compress.aqsgd import AQSGD
from fastdist.compress.compressors import Compressor, Identity
from fastdist.ops import topk_decompress

__all__ = ["Boundary", "batch", "check_boundary_arguments", "current_batch"]

_BATCH = contextvars.ContextVar("fastdist_compress_batch", default=None)


@contextlib.contextmanager
def batch(sample_ids: torch.Tensor | None = None, next_sample_ids: torch.Tensor | None = None,
          epoch: int | None = None) -> Iterator[None]:
    """Tells the AQ-SGD boundaries inside the block which samples the batch holds (and which come next, to prefetch
    their stored activations), without threading the ids through every module's forward.

    Args:
        sample_ids: the batch's sample ids, one per row.
        next_sample_ids: the next batch's, whose stored activations are read in the background.
        epoch: the epoch, passed to every AQ-SGD boundary's ``set_epoch``.
    """
    token = _BATCH.set({"sample_ids": sample_ids, "next_sample_ids": next_sample_ids, "epoch": epoch})
    try:
        yield
    finally:
        _BATCH.reset(token)


def current_batch() -> dict:
    """What the innermost :func:`batch` said (``sample_ids``, ``next_sample_ids``, ``epoch``); {} outside one."""
    return _BATCH.get() or {}


def check_boundary_arguments(who: str, fwd: Compressor | None, bwd: Compressor | None, backward_mask: str) -> None:
    """The argument checks :class:`Boundary` and :class:`~fastdist.compress.StageBoundary` share.

    Args:
        who: the class's name, for the messages.
        fwd: the activation's compressor, or None.
        bwd: the gradient's compressor, or None (never AQ-SGD, which keeps state per sample).
        backward_mask: ``"reuse"`` or ``"independent"``.

    Raises:
        TypeError: ``fwd`` or ``bwd`` is not a compressor, or ``bwd`` is AQ-SGD.
        ValueError: ``backward_mask`` is neither choice.
    """
    for name, c in (("fwd", fwd), ("bwd", bwd)):
        if c is not None and not isinstance(c, Compressor):
            raise TypeError(f"fastdist.compress.{who}: '{name}' must be a fastdist.compress compressor or None, "
                            f"got {type(c).__name__}")
    if isinstance(bwd, AQSGD):
        raise TypeError(f"fastdist.compress.{who}: AQ-SGD compresses activations per sample; gradients are "
                        "quantized directly (e.g. bwd=Quantize(8))")
    if backward_mask not in ("reuse", "independent"):
        raise ValueError(f"fastdist.compress.{who}: 'backward_mask' must be \"reuse\" or \"independent\", got "
                         f"{backward_mask!r}")


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, boundary, fwd, sample_ids):
        ctx.boundary = boundary
        ctx.kept = None
        if fwd is None:
            return x.clone()
        if isinstance(fwd, AQSGD):
            x_hat, packet = fwd.roundtrip(x, sample_ids)
        else:
            x_hat, packet = fwd.roundtrip(x)
        boundary.stats["fwd_wire_bytes"] = fwd.wire_bytes(packet)
        boundary.stats["fwd_dense_bytes"] = x.numel() * x.element_size()
        if boundary.backward_mask == "reuse" and boundary.training:
            ctx.kept = fwd.kept_indices(packet)
        return x_hat.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        b = ctx.boundary
        bwd = b.bwd
        if ctx.kept is not None:
            indices, d = ctx.kept
            rows = grad.reshape(indices.shape[0], d)
            values = rows.gather(1, indices.long())
            if bwd is not None:
                values, packet = bwd.roundtrip(values)
                b.stats["bwd_wire_bytes"] = bwd.wire_bytes(packet)
            else:
                b.stats["bwd_wire_bytes"] = values.numel() * values.element_size()
            out = topk_decompress(values.to(grad.dtype).contiguous(), indices, d).reshape(grad.shape)
        elif bwd is not None:
            out, packet = bwd.roundtrip(grad)
            b.stats["bwd_wire_bytes"] = bwd.wire_bytes(packet)
        else:
            out = grad
            b.stats["bwd_wire_bytes"] = grad.numel() * grad.element_size()
        b.stats["bwd_dense_bytes"] = grad.numel() * grad.element_size()
        return out.to(grad.dtype), None, None, None


class Boundary(nn.Module):
    """Compresses activations (``fwd``) and gradients (``bwd``) between two blocks in one process.

    Args:
        fwd: compressor of the activation, or None.
        bwd: compressor of the gradient, or None.
        backward_mask: ``"reuse"`` (mask the gradient with the forward's kept positions) or ``"independent"``.
        at_inference: also compress in eval mode (with ``fwd.stateless()``: the inner compressor of an
            ErrorFeedback / EF21 / AQ-SGD, whose state inference must not change).

    ``forward(x, sample_ids=None)``; AQ-SGD needs the batch's sample ids, here or from :func:`batch`.
    ``stats`` holds the last step's wire and dense bytes of each direction.
    """

    def __init__(self, fwd: Compressor | None = None, bwd: Compressor | None = None, backward_mask: str = "reuse",
                 at_inference: bool = False):
        super().__init__()
        check_boundary_arguments("Boundary", fwd, bwd, backward_mask)
        self.fwd, self.bwd = fwd, bwd
        self.backward_mask, self.at_inference = backward_mask, bool(at_inference)
        self.stats = {}

    def extra_repr(self) -> str:
        return f"fwd={self.fwd!r}, bwd={self.bwd!r}, backward_mask={self.backward_mask!r}, " \
               f"at_inference={self.at_inference}"

    def forward(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """What the next block sees of ``x`` (and, in backward, of its gradient).

        Args:
            x: the activation, one row per sample.
            sample_ids: the batch's sample ids, for AQ-SGD (default: those of the enclosing :func:`batch`).
        """
        if self.training:
            fwd = self.fwd
        else:
            fwd = self.fwd.stateless() if (self.at_inference and self.fwd is not None) else None
            if fwd is None:
                return x
        if isinstance(fwd, Identity):
            fwd = None
        if isinstance(fwd, AQSGD):
            ctx = current_batch()
            if sample_ids is None:
                sample_ids = ctx.get("sample_ids")
            if ctx.get("epoch") is not None:
                fwd.set_epoch(ctx["epoch"])
        if fwd is None and self.bwd is None:
            return x
        out = _BoundaryFunction.apply(x, self, fwd, sample_ids)
        if isinstance(fwd, AQSGD) and current_batch().get("next_sample_ids") is not None:
            fwd.prefetch(current_batch()["next_sample_ids"])
        return out

    def state_dict_compressors(self) -> dict:
        """The two compressors' state (part of the module's ``state_dict`` as its extra state)."""
        return {"fwd": self.fwd.state_dict() if self.fwd else {}, "bwd": self.bwd.state_dict() if self.bwd else {}}

    def get_extra_state(self) -> dict:
        return self.state_dict_compressors()

    def set_extra_state(self, state: dict) -> None:
        if self.fwd is not None:
            self.fwd.load_state_dict(state["fwd"])
        if self.bwd is not None:
            self.bwd.load_state_dict(state["bwd"])
