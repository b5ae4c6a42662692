"""Low-rank adapters on a frozen (quantized or float) linear layer, all at a parameter budget given as a LoRA rank.

Every adapter adds ``delta(x) = x @ dW.T`` for a weight update ``dW`` of the layer's shape, built from pooling the
input by ``g`` (average of ``g`` adjacent features, ``d_in -> d_in / g``) and repeating each output ``h`` times
(``d_out / h -> d_out``):

=============  =====  =====  ============================================  =========================================
method          g      h      trainable                                     dW[o, c]
=============  =====  =====  ============================================  =========================================
``LoRA``        1      1      ``A [r, d_in]``, ``B [d_out, r]``             ``s (B A)[o, c]``
``QALoRA``      group  1      ``A [r', d_in/group]``, ``B [d_out, r']``     ``s / group (B A)[o, c // group]``
``QBaRA``       2      2      ``A [2r, d_in/2]``, ``B [d_out/2, 2r]``       ``s / 2 (B A)[o // 2, c // 2]``
``QAHiRA``      4      8      ``M [d_out/8, d_in/4]`` (zero-initialised)    ``s / 4 M[o // 8, c // 4]``
=============  =====  =====  ============================================  =========================================

The ``1 / g`` in ``dW`` is the average pooling's: ``pool_g(x)[j] = (1/g) sum_{c in group j} x[c]``. Q-BaRA's rank is
chosen by the general rule ``r' = r (d_in + d_out) / (d_in/g + d_out/h)`` (exactly ``2r`` for ``g = h = 2``), so its
parameter count equals LoRA(r)'s; QA-LoRA's rank follows the same rule with ``h = 1`` (rounded down), so it never
exceeds LoRA(r)'s count. QA-HiRA has no rank: its single matrix holds ``d_out d_in / 32`` parameters (LoRA r = 64 on a
4096 x 4096 layer) and reaches rank ``min(d_out/8, d_in/4)``. ``s = alpha / r`` as in PEFT (``alpha`` defaults to
``r``, so ``s = 1``); QA-HiRA uses ``s = alpha`` (default 1).

Because ``dW`` is constant on each ``[h, g]`` tile, QA-LoRA and QA-HiRA fold exactly into the zero points of an int4
model whose quantization blocks lie inside the pooling groups (``g % block == 0``): see :func:`fastdist.adapters.merge`.
"""
import math

import torch
from torch import nn

__all__ = ["Adapter", "LoRA", "QALoRA", "QAHiRA", "QBaRA"]


def _pool_sum(x: torch.Tensor, g: int) -> torch.Tensor:
    """``g`` times the average pooling: the ``1 / g`` is folded into the adapter's (small) output instead."""
    return x if g == 1 else x.unflatten(-1, (x.shape[-1] // g, g)).sum(-1)


def _repeat(y: torch.Tensor, h: int) -> torch.Tensor:
    return y if h == 1 else y.unsqueeze(-1).expand(*y.shape, h).flatten(-2)


class Adapter(nn.Module):
    """Base class: ``forward(x)`` is ``delta(x)``; ``add_to(y, x)`` is ``y + delta(x)`` with the output repeat left to
    broadcasting; ``delta_weight()`` the dense ``dW``.

    Args:
        in_features: the adapted layer's input features (divisible by the pooling ``g``).
        out_features: the adapted layer's output features (divisible by the repeat ``h``).
        name: the layer's path in its model, for error messages.

    Raises:
        ValueError: a layer shape the pooling or the repeat does not divide.
    """

    method = ""
    pool_in = 1   # g
    repeat_out = 1  # h

    def __init__(self, in_features: int, out_features: int, name: str = "") -> None:
        super().__init__()
        where = f" of layer '{name}'" if name else ""
        if in_features % self.pool_in or out_features % self.repeat_out:
            raise ValueError(f"{type(self).__name__}: the layer shape [{out_features}, {in_features}]{where} must have "
                             f"in_features divisible by {self.pool_in} and out_features by {self.repeat_out}")
        self.in_features, self.out_features = in_features, out_features

    def config(self) -> dict:
        """What rebuilds this adapter (saved with its weights)."""
        raise NotImplementedError

    def low_rank(self) -> torch.Tensor:
        """The pooled update ``[d_out / h, d_in / g]`` before scaling by ``s / g`` and expanding."""
        raise NotImplementedError

    def delta_weight(self) -> torch.Tensor:
        """``dW [d_out, d_in]``, float32."""
        small = self.low_rank().float() * (self.scaling / self.pool_in)
        return small.repeat_interleave(self.repeat_out, 0).repeat_interleave(self.pool_in, 1)

    def pooled_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The update before the output repeat: ``[..., d_out / h]``, ``delta(x)``'s every ``h``-th feature."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``delta(x) = x @ dW.T``.

        Args:
            x: the layer's input ``[..., d_in]``.

        Returns:
            The update ``[..., d_out]``, to add to the base layer's output.
        """
        return _repeat(self.pooled_delta(x), self.repeat_out)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y + delta(x)`` in ``y``'s dtype; the output repeat is a broadcast add, never materialized."""
        z = self.pooled_delta(x).to(y.dtype)
        h = self.repeat_out
        return y + z if h == 1 else (y.unflatten(-1, (y.shape[-1] // h, h)) + z.unsqueeze(-1)).flatten(-2)


def _scaled(z: torch.Tensor, c: float) -> torch.Tensor:
    return z if c == 1.0 else z * c


class _TwoFactor(Adapter):
    """``s rep_h(B A pool_g(x))`` with A kaiming-uniform (as PEFT and nn.Linear) and B zero."""

    def _build(self, rank: int, alpha: float | None, scaling_rank: int) -> None:
        if rank < 1:
            raise ValueError(f"{type(self).__name__}: the rank must be >= 1, got {rank}")
        self.rank = rank
        self.alpha = float(scaling_rank if alpha is None else alpha)
        self.scaling = self.alpha / scaling_rank
        self.A = nn.Parameter(torch.empty(rank, self.in_features // self.pool_in))
        self.B = nn.Parameter(torch.zeros(self.out_features // self.repeat_out, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

    def low_rank(self) -> torch.Tensor:
        return self.B @ self.A

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(A', B', c)`` with ``delta(x) = c x A'^T B'^T``: the pooling and the repeat folded into the factors,
        ``A' [r, d_in]`` (each column of A repeated g times, times ``s / g``) and ``B' [d_out, r]`` (each row of B
        repeated h times). Only the small factors are expanded, so the activations never go through a pooling or a
        repeat, and the adapter costs two thin matmuls, as LoRA does."""
        a, b, g, h = self.A, self.B, self.pool_in, self.repeat_out
        if h > 1:
            b = b.unsqueeze(1).expand(b.shape[0], h, b.shape[1]).flatten(0, 1)
        if g == 1:
            return a, b, self.scaling
        return a.unsqueeze(-1).expand(*a.shape, g).flatten(-2) * (self.scaling / g), b, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.factors()
        return _scaled(x.to(a.dtype) @ a.T @ b.T, c)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y + self(x).to(y.dtype)


def _balanced_rank(r: int, d_in: int, d_out: int, g: int, h: int) -> int:
    """``r' = r (d_in + d_out) / (d_in/g + d_out/h)``, rounded down: LoRA(r)'s parameter count at pooling g, h."""
    return max(1, (r * (d_in + d_out)) // (d_in // g + d_out // h))


class LoRA(_TwoFactor):
    """LoRA: ``dW = (alpha / r) B A`` (PEFT's ``LoraConfig(r, lora_alpha=alpha)`` computes the same).

    Args:
        in_features: the adapted layer's input features.
        out_features: the adapted layer's output features.
        r: the rank (>= 1).
        alpha: the scale numerator, ``s = alpha / r`` (default ``r``, so ``s = 1``).
        name: the layer's path in its model, for error messages.
    """

    method = "lora"

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float | None = None,
                 name: str = "") -> None:
        super().__init__(in_features, out_features, name)
        self.r = r
        self._build(r, alpha, r)

    def config(self) -> dict:
        return {"method": self.method, "r": self.r, "alpha": self.alpha}


class QALoRA(_TwoFactor):
    """QA-LoRA: the input average-pooled by ``group`` (the quantization group) before ``A``, LoRA(r)'s budget.

    Args:
        in_features: the adapted layer's input features (divisible by ``group``).
        out_features: the adapted layer's output features.
        r: the parameter budget as a LoRA rank (>= 1); the rank used is the largest within that budget.
        group: the pooling group (>= 1), the base's quantization block so that the adapter merges exactly.
        alpha: the scale numerator, ``s = alpha / r`` (default ``r``, so ``s = 1``).
        name: the layer's path in its model, for error messages.
    """

    method = "qalora"

    def __init__(self, in_features: int, out_features: int, r: int, group: int = 64, alpha: float | None = None,
                 name: str = "") -> None:
        if group < 1:
            raise ValueError(f"QALoRA: group must be >= 1, got {group}")
        self.pool_in = group
        super().__init__(in_features, out_features, name)
        self.r, self.group = r, group
        self._build(_balanced_rank(r, in_features, out_features, group, 1), alpha, r)

    def config(self) -> dict:
        return {"method": self.method, "r": self.r, "group": self.group, "alpha": self.alpha}


class QBaRA(_TwoFactor):
    """Q-BaRA: pool the input by 2, rank 2r, repeat the output by 2: LoRA(r)'s parameter count, rank up to 2r.

    Args:
        in_features: the adapted layer's input features (even).
        out_features: the adapted layer's output features (even).
        r: the parameter budget as a LoRA rank (>= 1).
        alpha: the scale numerator, ``s = alpha / r`` (default ``r``, so ``s = 1``).
        name: the layer's path in its model, for error messages.
    """

    method = "qbara"
    pool_in = 2
    repeat_out = 2

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float | None = None,
                 name: str = "") -> None:
        super().__init__(in_features, out_features, name)
        self.r = r
        self._build(_balanced_rank(r, in_features, out_features, 2, 2), alpha, r)

    def config(self) -> dict:
        return {"method": self.method, "r": self.r, "alpha": self.alpha}


class QAHiRA(Adapter):
    """QA-HiRA: ``dW = (s / 4) rep_8(M pool_4(x))``, one zero-initialised matrix ``M [d_out/8, d_in/4]``.

    Args:
        in_features: the adapted layer's input features (divisible by 4).
        out_features: the adapted layer's output features (divisible by 8).
        r: unused (QA-HiRA's size is fixed by the layer's); accepted so that every method is built alike.
        alpha: the scale ``s`` (default 1).
        name: the layer's path in its model, for error messages.
    """

    method = "qahira"
    pool_in = 4
    repeat_out = 8

    def __init__(self, in_features: int, out_features: int, r: int | None = None, alpha: float = 1.0,
                 name: str = "") -> None:
        super().__init__(in_features, out_features, name)
        self.alpha = float(alpha)
        self.scaling = self.alpha
        self.M = nn.Parameter(torch.zeros(out_features // 8, in_features // 4))

    def low_rank(self) -> torch.Tensor:
        return self.M

    def pooled_delta(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(_pool_sum(x.to(self.M.dtype), 4) @ self.M.T, self.scaling / 4)

    def config(self) -> dict:
        return {"method": self.method, "alpha": self.alpha}


METHODS = {cls.method: cls for cls in (LoRA, QALoRA, QBaRA, QAHiRA)}
