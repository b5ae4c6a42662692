"""Row-wise sparse optimizers for table shards: state on the owner only, updates for the rows looked up only.

Each takes a shard's sparse gradient (``sparse=True``; a dense gradient is refused, as its zero rows would count
as looked up), sums the rows of each id (``coalesce``) and updates those rows, with state tensors the size of the
shard, so a table's optimizer state is split over the ranks with its rows. Each equals a torch optimizer run on the
unsharded ``nn.Embedding(sparse=True)``:

- :class:`RowWiseSGD` = ``torch.optim.SGD(lr)`` (no momentum, no weight decay: torch refuses both with sparse
  gradients too);
- :class:`RowWiseAdagrad` = ``torch.optim.Adagrad(lr, lr_decay, initial_accumulator_value, eps)``;
- :class:`RowWiseAdam` = ``torch.optim.SparseAdam(lr, betas, eps)`` ("lazy" Adam: moments of rows not looked up
  do not decay; bias correction by the optimizer's step count).

The step count is per parameter and counts every ``step()`` in which the parameter has a gradient, as torch's
does; every shard gets one (possibly empty) every step, so the counts match the unsharded run's.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

__all__ = ["RowWiseAdagrad", "RowWiseAdam", "RowWiseSGD"]


def _check(name, value, low=0.0, high=math.inf, closed_low=True):
    ok = (value >= low if closed_low else value > low) and value < high
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not ok:
        bound = f"[{low}, {high})" if closed_low else f"({low}, {high})"
        raise ValueError(f"fastdist: '{name}' must be a finite number in {bound}, got {value!r}")


class _RowWise(torch.optim.Optimizer):
    """The shared loop: for each parameter with a gradient, its coalesced rows and their values."""

    def _rows(self, p):
        grad = p.grad
        if not grad.is_sparse:
            raise RuntimeError(f"fastdist: {type(self).__name__} takes sparse gradients (build the table with "
                               "sparse=True); for dense gradients use torch's own optimizer on the shard")
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; returns ``closure()``'s loss if given.

        Args:
            closure: re-evaluates the model and returns the loss, as for torch's optimizers (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, values = self._rows(p)
                state = self.state[p]
                if not state:
                    self._init_state(p, state, group)
                state["step"] += 1
                if values.numel():
                    self._update(p, rows, values, state, group)
        return loss

    def _init_state(self, p, state, group):
        state["step"] = 0


class RowWiseSGD(_RowWise):
    """``p[rows] -= lr * g[rows]``: equals ``torch.optim.SGD(params, lr)`` on sparse gradients.

    Args:
        params: shard parameters (or parameter groups).
        lr: learning rate, ``> 0``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-2) -> None:
        _check("lr", lr, closed_low=False)
        super().__init__(params, {"lr": lr})

    def _update(self, p, rows, values, state, group):
        p.index_add_(0, rows, values, alpha=-group["lr"])


class RowWiseAdagrad(_RowWise):
    """Adagrad on the looked-up rows: equals ``torch.optim.Adagrad`` on sparse gradients.

    Args:
        params: shard parameters (or parameter groups).
        lr: learning rate, ``> 0``.
        lr_decay: the learning rate at step t is ``lr / (1 + (t - 1) lr_decay)``.
        initial_accumulator_value: the sum of squares' start, ``>= 0``.
        eps: added to the root of the sum of squares, ``>= 0``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-2, lr_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> None:
        _check("lr", lr, closed_low=False)
        _check("lr_decay", lr_decay)
        _check("initial_accumulator_value", initial_accumulator_value)
        _check("eps", eps)
        super().__init__(params, {"lr": lr, "lr_decay": lr_decay,
                                  "initial_accumulator_value": initial_accumulator_value, "eps": eps})

    def _init_state(self, p, state, group):
        super()._init_state(p, state, group)
        state["sum"] = torch.full_like(p, group["initial_accumulator_value"], memory_format=torch.preserve_format)

    def _update(self, p, rows, values, state, group):
        clr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
        state["sum"].index_add_(0, rows, values.pow(2))
        std = state["sum"].index_select(0, rows).sqrt_().add_(group["eps"])
        p.index_add_(0, rows, values / std, alpha=-clr)


class RowWiseAdam(_RowWise):
    """Lazy Adam on the looked-up rows: equals ``torch.optim.SparseAdam``.

    Args:
        params: shard parameters (or parameter groups).
        lr: learning rate, ``> 0``.
        betas: the moments' decay rates, each in ``[0, 1)``.
        eps: added to the root of the second moment, ``> 0``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        _check("lr", lr, closed_low=False)
        _check("betas[0]", betas[0], high=1.0)
        _check("betas[1]", betas[1], high=1.0)
        _check("eps", eps, closed_low=False)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps})

    def _init_state(self, p, state, group):
        super()._init_state(p, state, group)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, p, rows, values, state, group):
        beta1, beta2 = group["betas"]
        m_old = state["exp_avg"].index_select(0, rows)
        v_old = state["exp_avg_sq"].index_select(0, rows)
        m_step = values.sub(m_old).mul_(1 - beta1)
        v_step = values.pow(2).sub_(v_old).mul_(1 - beta2)
        state["exp_avg"].index_add_(0, rows, m_step)
        state["exp_avg_sq"].index_add_(0, rows, v_step)
        numer = m_step.add_(m_old)
        denom = v_step.add_(v_old).sqrt_().add_(group["eps"])
        step = state["step"]
        step_size = group["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        p.index_add_(0, rows, numer.div_(denom).mul_(-step_size))
