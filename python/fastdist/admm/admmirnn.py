"""ADMMiRNN: training an unrolled tanh RNN with ADMM instead of backpropagation through time.

The network (many-to-one: one output after the last step, as a sequence classifier or regressor):

    a_t = u x_t + w s_{t-1} + b,   s_t = tanh(a_t),   o = v s_T + c,   s_0 = 0,   loss R(o, y)

Every equation becomes a constraint with its own penalty and dual (block names in brackets):

    r_a[t] = a_t - (u x_t + w s_{t-1} + b)     ["a", rho_a, dual lam_a[t]]
    r_s[t] = s_t - tanh(a_t)                   ["s", rho_s, dual lam_s[t]]
    r_o    = o - (v s_T + c)                   ["o", rho_o, dual lam_o]

    L = mean over samples of [ R(o, y) + sum_k <lam_k, r_k> + rho_k / 2 ||r_k||^2 ]

One sweep updates the blocks output to input, as the authors' code does (o, c, v; then s_t, a_t for t = T..1;
then b, w, u), each by the exact minimiser of L in that block where one exists in closed form (c, v, s_t, b, w,
u) and by a linearised proximal step otherwise (o under cross-entropy, a_t through the tanh), then takes a dual
ascent step lam_k += rho_k r_k. The derivations are in docs/admm.md.

The per-sample variables (a, s, o and their duals) belong to samples. By default an instance is bound to the batch
of its first `step` and trains on it full-batch, as the paper does. `minibatch="carry"` keeps them for every sample
of a data set of `num_samples` (each `step` names its samples by index: they are gathered, swept with the weights,
and written back); `minibatch="reinit"` starts them afresh at every batch (see `ADMMiRNN.step`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

__all__ = ["ADMMDivergenceError", "ADMMiRNN", "RNNClassifier", "SweepStats", "BLOCKS", "TANH_CURVATURE"]

BLOCKS = ("a", "s", "o")
"""The constraint blocks, in the order of their residuals in `SweepStats.residuals`."""

TANH_CURVATURE = 2.0 / (3.0 * math.sqrt(3.0))
"""max over a of |tanh(a) (1 - tanh(a)^2)|: bounds the second derivative of (p - tanh a)^2 / 2 (docs/admm.md)."""

_CE_CURVATURE = 0.5  # the largest eigenvalue of softmax cross-entropy's Hessian, diag(p) - p p^T, is at most 1/2
_RHO_RANGE = (1e-6, 1e6)
_TAU_RANGE = (1.0, 1e6)
_LOSSES = ("cross_entropy", "mse")
_DUALS = ("all", "last")
_MINIBATCH = (None, "carry", "reinit")


class ADMMDivergenceError(RuntimeError):
    """The ADMM iteration diverged; `block` names the first block whose update went non-finite, the constraint
    whose residual kept growing, or (the network's loss past its bound) the step where the forward pass left the
    auxiliary variables.

    Args:
        block: the block (or constraint) that diverged first.
        message: the error message, naming it and the sweep.
    """

    def __init__(self, block: str, message: str):
        super().__init__(message)
        self.block = block


@dataclasses.dataclass(frozen=True)
class SweepStats:
    """What one ADMM sweep reports.

    Attributes:
        sweep: How many sweeps the instance has done, this one included.
        loss: R of the network's own forward pass (weights only) on the batch, after the sweep: the training
            objective a user cares about.
        aux_loss: R at the auxiliary output variable o.
        lagrangian: The augmented Lagrangian L after the sweep (before the dual step, whose L is not a descent
            quantity).
        residuals: {"a", "s", "o"}: sqrt(mean over samples of ||r_k||^2), r_k summed over time steps; after the
            sweep's primal updates.
    """

    sweep: int
    loss: float
    aux_loss: float
    lagrangian: float
    residuals: dict[str, float]


class RNNClassifier(nn.Module):
    """The network ADMMiRNN trains, written as users write it: `torch.nn.RNN` (tanh, batch_first) and an
    `nn.Linear` head on the last hidden state. SGD-family baselines train this same module.

    Args:
        input_size: features per time step.
        hidden_size: the RNN's hidden units.
        output_size: the head's outputs (classes, or 1 for regression).
    """

    def __init__(self, input_size: int, hidden_size: int, output_size: int):
        super().__init__()
        self.rnn = nn.RNN(input_size, hidden_size, nonlinearity="tanh", batch_first=True)
        self.head = nn.Linear(hidden_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, F] -> outputs [B, output_size] from the last step."""
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ADMMiRNN: {name} must be an int >= 1, got {value!r}")
    return value


def _check_range(name: str, value: Any, low: float, high: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"ADMMiRNN: {name} must be a number in [{low:g}, {high:g}], got {value!r}") from None
    if not low <= value <= high:  # also rejects NaN
        raise ValueError(f"ADMMiRNN: {name} must be in [{low:g}, {high:g}], got {value!r}")
    return value


class ADMMiRNN:
    """ADMM training of an unrolled tanh RNN (Tang et al., arXiv 2006.05622), as plain torch ops.

    Args:
        input_size: F, features per time step.
        hidden_size: H.
        output_size: Classes (cross_entropy) or regression targets (mse).
        seq_len: T, the number of time steps every batch has.
        rho: Penalty of every constraint, or a mapping {"a": ..., "s": ..., "o": ...} (one per block); each in
            [1e-6, 1e6].
        tau: Proximal weight of the linearised blocks (o under cross-entropy, a) as a multiple of the block's
            curvature bound; in [1, 1e6]. At tau >= 1 every block update decreases L (docs/admm.md).
        loss: "cross_entropy" (y: int64 class ids [B]) or "mse" (y: [B, output_size], or [B] when output_size
            is 1; R = ||o - y||^2 / 2 per sample).
        duals: "all": a dual on every constraint of every time step; "last": duals on the last time step's
            constraints only and a plain quadratic penalty on the earlier ones (the authors' choice).
        damping: Proximal weight of the weight blocks (v, w, u), relative to the mean Gram matrix: keeps their
            least-squares solves well posed when a batch is smaller than the hidden size. In (0, 1].
        init_scale: Multiplies the initial weights (drawn as torch.nn.RNN / nn.Linear draw theirs).
        seed: Seeds the initial weights (drawn on the CPU in float64, then cast: the same start on every device
            and dtype).
        dtype: torch.float32 or torch.float64.
        device: Where every tensor lives.
        weight_decay: Omega = weight_decay / 2 * ||theta||^2 on every weight matrix (u, w, v) as in the paper's
            objective; bounds how much the weights amplify the residuals left in the constraints.
        divergence_window: A constraint whose residual grew in each of this many consecutive sweeps, by
            `divergence_factor` in all, raises ADMMDivergenceError.
        divergence_factor: See `divergence_window`.
        divergence_loss_factor: The network's own loss on a batch (`SweepStats.loss`) past this multiple of the
            reference loss raises ADMMDivergenceError naming where the forward pass leaves the auxiliary
            variables; the reference is fixed at the first sweep: the larger of the initial weights' loss and the
            loss of a constant prediction (the label frequencies, or the targets' mean under mse) on that batch.
            Catches what the residual check cannot: small residuals amplified through the time steps. In
            [1, inf]; inf turns the check off.
        minibatch: None: full batch, the per-sample variables bound to the first batch (the paper's setting).
            "carry": mini-batches of a data set of `num_samples` samples; every `step` passes the batch's sample
            indices, whose variables and duals are carried from their last batch (started at the forward pass, duals
            0, the first time a sample is seen). "reinit": every batch's variables start at the forward pass with
            duals 0 (no per-sample memory). In both, the weight blocks are solved on the batch with the `damping`
            proximal term toward the current weights.
        num_samples: The data set's size N for minibatch="carry" (the variables take 2 (2 T H + O) N numbers);
            must be None otherwise.
    """

    def __init__(self, input_size: int, hidden_size: int, output_size: int, seq_len: int, *,
                 rho: float | dict[str, float] = 1.0, tau: float = 1.0, loss: str = "cross_entropy",
                 duals: str = "last", damping: float = 1e-3, weight_decay: float = 0.0, init_scale: float = 1.0,
                 seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 divergence_window: int = 20, divergence_factor: float = 10.0,
                 divergence_loss_factor: float = 10.0,
                 minibatch: str | None = None, num_samples: int | None = None):
        self.input_size = _check_positive_int("input_size", input_size)
        self.hidden_size = _check_positive_int("hidden_size", hidden_size)
        self.output_size = _check_positive_int("output_size", output_size)
        self.seq_len = _check_positive_int("seq_len", seq_len)
        if isinstance(rho, dict):
            if set(rho) != set(BLOCKS):
                raise ValueError(f"ADMMiRNN: rho as a mapping needs exactly the keys {BLOCKS}, got {sorted(rho)}")
            self.rho = {k: _check_range(f"rho[{k!r}]", rho[k], *_RHO_RANGE) for k in BLOCKS}
        else:
            value = _check_range("rho", rho, *_RHO_RANGE)
            self.rho = {k: value for k in BLOCKS}
        self.tau = _check_range("tau", tau, *_TAU_RANGE)
        if loss not in _LOSSES:
            raise ValueError(f"ADMMiRNN: loss must be one of {_LOSSES}, got {loss!r}")
        if duals not in _DUALS:
            raise ValueError(f"ADMMiRNN: duals must be one of {_DUALS}, got {duals!r}")
        self.loss, self.duals = loss, duals
        self.damping = _check_range("damping", damping, 1e-12, 1.0)
        self.weight_decay = _check_range("weight_decay", weight_decay, 0.0, 1e6)
        self.init_scale = _check_range("init_scale", init_scale, 0.0, 1e6)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"ADMMiRNN: dtype must be torch.float32 or torch.float64, got {dtype}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compare against tensors' devices, which carry an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.device, self.seed = dtype, device, int(seed)
        self.divergence_window = _check_positive_int("divergence_window", divergence_window)
        self.divergence_factor = _check_range("divergence_factor", divergence_factor, 1.0, math.inf)
        self.divergence_loss_factor = _check_range("divergence_loss_factor", divergence_loss_factor, 1.0, math.inf)
        if minibatch not in _MINIBATCH:
            raise ValueError(f"ADMMiRNN: minibatch must be one of {_MINIBATCH}, got {minibatch!r}")
        if minibatch == "carry":
            num_samples = _check_positive_int("num_samples", num_samples)
        elif num_samples is not None:
            raise ValueError(f"ADMMiRNN: num_samples is for minibatch='carry' only, got num_samples={num_samples!r} "
                             f"with minibatch={minibatch!r}")
        self.minibatch, self.num_samples = minibatch, num_samples

        self.weights = self._initial_weights()
        self.variables: dict[str, torch.Tensor] = {}   # a, s: [T, B, H]; o: [B, O] (empty until bound)
        self.dual: dict[str, torch.Tensor] = {}        # a, s: [T, B, H]; o: [B, O]
        self.seen: torch.Tensor | None = None          # minibatch="carry": which samples hold variables [N]
        if minibatch == "carry":  # the whole data set's variables and duals, indexed by sample along dim 1 / 0
            self.variables = self._zero_variables(num_samples)
            self.dual = self._zero_variables(num_samples)
            self.seen = torch.zeros(num_samples, dtype=torch.bool, device=device)
        self.sweeps = 0
        self.history: dict[str, list[float]] = {k: [] for k in BLOCKS}
        self.loss_reference: float | None = None  # the loss check's reference, fixed at the first sweep
        self.diverged: str | None = None

    # ---- weights and the network ----

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        """nn.RNN / nn.Linear's initialisation, U(-1/sqrt(H), 1/sqrt(H)), from our own generator; the RNN's two
        biases (b_ih + b_hh) become one, b."""
        g = torch.Generator().manual_seed(self.seed)
        k = 1.0 / math.sqrt(self.hidden_size)
        H, F, O = self.hidden_size, self.input_size, self.output_size

        def uniform(*shape):
            return (torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * k

        w = {"u": uniform(H, F), "w": uniform(H, H), "b": uniform(H) + uniform(H), "v": uniform(O, H),
             "c": uniform(O)}
        return {n: (t * self.init_scale).to(device=self.device, dtype=self.dtype) for n, t in w.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The network's output [B, output_size] for x [B, T, F], from the weights alone (no auxiliary variables)."""
        x = self._check_x(x)
        return self._forward(x.transpose(0, 1))[2]

    __call__ = forward

    def _forward(self, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a [T, B, H], s [T, B, H], o [B, O]) of the forward pass for time-major xt [T, B, F]."""
        u, w, b, v, c = (self.weights[n] for n in "uwbvc")
        pre = torch.matmul(xt, u.t()) + b                  # the input part of every step at once
        a = torch.empty_like(pre)
        s = torch.empty_like(pre)
        prev = None
        for t in range(xt.shape[0]):
            a[t] = pre[t] if prev is None else pre[t] + prev @ w.t()
            s[t] = torch.tanh(a[t])
            prev = s[t]
        return a, s, s[-1] @ v.t() + c

    def model(self) -> RNNClassifier:
        """An `RNNClassifier` (torch.nn.RNN + nn.Linear) holding copies of the trained weights, for inference."""
        net = RNNClassifier(self.input_size, self.hidden_size, self.output_size).to(self.device, self.dtype)
        with torch.no_grad():
            net.rnn.weight_ih_l0.copy_(self.weights["u"])
            net.rnn.weight_hh_l0.copy_(self.weights["w"])
            net.rnn.bias_ih_l0.copy_(self.weights["b"])
            net.rnn.bias_hh_l0.zero_()
            net.head.weight.copy_(self.weights["v"])
            net.head.bias.copy_(self.weights["c"])
        return net

    # ---- input checks ----

    def _check_x(self, x: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ADMMiRNN: x must be a torch.Tensor [B, T, F], got {type(x).__name__}")
        want = (self.seq_len, self.input_size)
        if x.dim() != 3 or tuple(x.shape[1:]) != want:
            raise ValueError(f"ADMMiRNN: x must have shape [B, {want[0]}, {want[1]}] (batch, seq_len, input_size), "
                             f"got {list(x.shape)}")
        if x.shape[0] == 0:
            raise ValueError("ADMMiRNN: x is an empty batch")
        if not x.is_floating_point():
            raise TypeError(f"ADMMiRNN: x must be floating point, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"ADMMiRNN: x is on {x.device}, the model on {self.device}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("ADMMiRNN: x has non-finite values (NaN or inf)")
        return x.to(self.dtype)

    def _check_y(self, y: Any, batch: int) -> torch.Tensor:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"ADMMiRNN: y must be a torch.Tensor, got {type(y).__name__}")
        if y.device != self.device:
            raise ValueError(f"ADMMiRNN: y is on {y.device}, the model on {self.device}")
        if self.loss == "cross_entropy":
            if y.shape != (batch,) or y.dtype != torch.int64:
                raise ValueError(f"ADMMiRNN: y must be int64 class ids of shape [{batch}], got {y.dtype} "
                                 f"{list(y.shape)}")
            if bool(((y < 0) | (y >= self.output_size)).any()):
                raise ValueError(f"ADMMiRNN: y has class ids outside [0, {self.output_size})")
            return y
        if y.dim() == 1 and self.output_size == 1:
            y = y.unsqueeze(1)
        if y.shape != (batch, self.output_size) or not y.is_floating_point():
            raise ValueError(f"ADMMiRNN: y must be floating point of shape [{batch}, {self.output_size}] for "
                             f"loss='mse', got {y.dtype} {list(y.shape)}")
        if not bool(torch.isfinite(y).all()):
            raise ValueError("ADMMiRNN: y has non-finite values (NaN or inf)")
        return y.to(self.dtype)

    # ---- the loss ----

    def _loss_rows(self, o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """R per sample [B]."""
        if self.loss == "cross_entropy":
            return torch.nn.functional.cross_entropy(o, y, reduction="none")
        return 0.5 * (o - y).pow(2).sum(1)

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Mean R of the network's forward pass on (x, y)."""
        x = self._check_x(x)
        return float(self._loss_rows(self._forward(x.transpose(0, 1))[2], self._check_y(y, x.shape[0])).mean())

    # ---- the state bound to a batch ----

    @property
    def batch_size(self) -> int | None:
        """The batch size the per-sample variables are bound to; None before the first step or in mini-batch
        mode."""
        return None if not self.variables or self.minibatch else self.variables["o"].shape[0]

    def _zero_variables(self, n: int) -> dict[str, torch.Tensor]:
        T, H, O = self.seq_len, self.hidden_size, self.output_size
        z = dict(dtype=self.dtype, device=self.device)
        return {"a": torch.zeros(T, n, H, **z), "s": torch.zeros(T, n, H, **z), "o": torch.zeros(n, O, **z)}

    def _check_index(self, index: Any, batch: int) -> torch.Tensor | None:
        if self.minibatch != "carry":
            if index is not None:
                raise ValueError(f"ADMMiRNN: index is for minibatch='carry' only (this instance has "
                                 f"minibatch={self.minibatch!r})")
            return None
        if not isinstance(index, torch.Tensor):
            raise TypeError("ADMMiRNN: minibatch='carry' needs index, the batch's sample ids (int64 [B]), got "
                            f"{type(index).__name__}")
        if index.shape != (batch,) or index.dtype != torch.int64:
            raise ValueError(f"ADMMiRNN: index must be int64 sample ids of shape [{batch}], got {index.dtype} "
                             f"{list(index.shape)}")
        if index.device != self.device:
            raise ValueError(f"ADMMiRNN: index is on {index.device}, the model on {self.device}")
        if bool(((index < 0) | (index >= self.num_samples)).any()):
            raise ValueError(f"ADMMiRNN: index has sample ids outside [0, {self.num_samples})")
        if torch.unique(index).numel() != batch:  # two rows of one sample would write back over each other
            raise ValueError("ADMMiRNN: index names a sample twice in one batch")
        return index

    def _gather(self, xt: torch.Tensor, index: torch.Tensor) -> tuple[dict, dict]:
        """The batch's (variables, duals) from the data set's store: carried for samples seen before, the forward
        pass of the current weights (duals 0) for the others."""
        seen = self.seen[index]
        fresh = dict(zip(BLOCKS, self._forward(xt)))
        kept = {k: v.index_select(0 if k == "o" else 1, index) for k, v in self.variables.items()}
        variables = {k: torch.where(seen.view(-1, 1) if k == "o" else seen.view(1, -1, 1), kept[k], fresh[k])
                     for k in BLOCKS}
        dual = {k: v.index_select(0 if k == "o" else 1, index) for k, v in self.dual.items()}
        return variables, dual

    def _scatter(self, store: tuple[dict, dict], batch: tuple[dict, dict], index: torch.Tensor) -> None:
        for whole, part in zip(store, batch):
            for k in BLOCKS:
                whole[k].index_copy_(0 if k == "o" else 1, index, part[k])
        self.seen[index] = True

    def _bind(self, xt: torch.Tensor) -> None:
        """Starts the per-sample variables at the forward pass of the current weights (every residual 0) and the
        duals at 0."""
        a, s, o = self._forward(xt)
        self.variables = {"a": a, "s": s, "o": o}
        self.dual = {"a": torch.zeros_like(a), "s": torch.zeros_like(s), "o": torch.zeros_like(o)}

    def residual_tensors(self, xt: torch.Tensor) -> dict[str, torch.Tensor]:
        """The constraint residuals {"a": [T, B, H], "s": [T, B, H], "o": [B, O]} at the current state.

        Args:
            xt: the inputs, time-major [T, B, F], of the samples the current variables belong to.
        """
        u, w, b, v, c = (self.weights[n] for n in "uwbvc")
        a, s, o = (self.variables[k] for k in BLOCKS)
        pred = torch.matmul(xt, u.t()) + b
        pred[1:] += torch.matmul(s[:-1], w.t())
        return {"a": a - pred, "s": s - torch.tanh(a), "o": o - (s[-1] @ v.t() + c)}

    def lagrangian(self, xt: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The augmented Lagrangian L (a 0-dim tensor) at the current state.

        Args:
            xt: the inputs, time-major [T, B, F], of the samples the current variables belong to.
            y: their targets [B] (class indices) or [B, O] (regression).
        """
        r = self.residual_tensors(xt)
        total = self._loss_rows(self.variables["o"], y).sum()
        for k in BLOCKS:
            total = total + (self.dual[k] * r[k]).sum() + 0.5 * self.rho[k] * r[k].pow(2).sum()
        decay = sum(self.weights[n].pow(2).sum() for n in "uwv")
        return total / y.shape[0] + 0.5 * self.weight_decay * decay

    # ---- one sweep ----

    def step(self, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor | None = None) -> SweepStats:
        """One ADMM sweep over every block, then the dual step.

        Full batch (minibatch=None): the first call binds the per-sample variables to this batch (started at the
        forward pass, duals 0); later calls must pass a batch of the same size, normally the same batch. Passing
        other data of the same size continues from the current variables and duals as a warm start.
        minibatch="carry": any batch size; `index` names the batch's samples, whose variables and duals are read
        from and written back to the data set's store. minibatch="reinit": any batch size, variables started
        afresh. Either way the weights are updated from this batch alone.

        Args:
            x: [B, seq_len, input_size], floating point, on the model's device.
            y: Class ids int64 [B] (cross_entropy) or targets [B, output_size] (mse).
            index: minibatch="carry" only: the samples' ids in [0, num_samples), int64 [B], each at most once.

        Returns:
            The sweep's `SweepStats`.

        Raises:
            ValueError: A wrong shape, dtype or device, non-finite values, or a batch size other than the bound one.
            ADMMDivergenceError: A block's update went non-finite, or a residual kept growing (see the class);
                the instance then refuses further steps.
        """
        if self.diverged is not None:
            raise ADMMDivergenceError(self.diverged, f"ADMMiRNN: the iteration diverged earlier (block "
                                      f"{self.diverged!r}); load a state_dict saved before to continue")
        x = self._check_x(x)
        y = self._check_y(y, x.shape[0])
        index = self._check_index(index, x.shape[0])
        if self.minibatch is None and self.variables and x.shape[0] != self.batch_size:
            raise ValueError(f"ADMMiRNN: the per-sample variables are bound to a batch of {self.batch_size} "
                             f"samples, got {x.shape[0]}: train full-batch on one batch, or pass minibatch='carry' "
                             "(with num_samples and index) or minibatch='reinit'")
        xt = x.transpose(0, 1).contiguous()
        if self.loss_reference is None:
            self.loss_reference = self._reference_loss(xt, y)
        if self.minibatch == "carry":
            store = self.variables, self.dual
            self.variables, self.dual = self._gather(xt, index)
            try:
                flags, r, lagr, aux = self._primal_dual(xt, y)
                self._scatter(store, (self.variables, self.dual), index)
            finally:
                self.variables, self.dual = store
        else:
            if self.minibatch == "reinit" or not self.variables:
                self._bind(xt)
            flags, r, lagr, aux = self._primal_dual(xt, y)
        batch = y.shape[0]
        norms = torch.stack([r[k].pow(2).sum() / batch for k in BLOCKS]).sqrt()
        _, fwd_s, out = self._forward(xt)
        summary = torch.cat([norms, torch.stack([self._loss_rows(out, y).mean(), aux, lagr])])
        bad = torch.stack([f for _, f in flags])
        values, bad = summary.tolist(), bad.tolist()  # the sweep's one synchronisation
        self.sweeps += 1
        if any(bad):
            self.diverged = flags[bad.index(True)][0]
            raise ADMMDivergenceError(self.diverged, f"ADMMiRNN: sweep {self.sweeps}: the update of block "
                                      f"{self.diverged} produced non-finite values (rho={self.rho}, tau={self.tau})")
        residuals = dict(zip(BLOCKS, values[:3]))
        self._watch(residuals)
        bound = self.divergence_loss_factor * self.loss_reference
        if 0 < self.loss_reference and not values[3] <= bound:
            self.diverged = self._departure(fwd_s, r, index) if values[4] <= bound else "o"
            raise ADMMDivergenceError(
                self.diverged, f"ADMMiRNN: sweep {self.sweeps}: the network's loss {values[3]:.4g} passed "
                f"{self.divergence_loss_factor:g} x its reference {self.loss_reference:.4g} (auxiliary loss "
                f"{values[4]:.4g}, residuals " + ", ".join(f"{k} {v:.3g}" for k, v in residuals.items())
                + f"): the forward pass leaves the auxiliary variables at block {self.diverged}; raise rho or "
                "damping (mini-batches: or train full-batch)")
        return SweepStats(self.sweeps, values[3], values[4], values[5], residuals)

    def _reference_loss(self, xt: torch.Tensor, y: torch.Tensor) -> float:
        """The loss check's reference on the first batch: the larger of the current weights' loss and the loss of
        the best constant prediction."""
        start = self._loss_rows(self._forward(xt)[2], y).mean()
        if self.loss == "cross_entropy":
            p = torch.bincount(y, minlength=self.output_size).to(self.dtype) / y.shape[0]
            constant = -(p * torch.log(p.clamp_min(torch.finfo(self.dtype).tiny))).sum()
        else:
            constant = 0.5 * (y - y.mean(0)).pow(2).sum(1).mean()
        return float(torch.maximum(start, constant))

    def _departure(self, fwd_s: torch.Tensor, r: dict[str, torch.Tensor], index: torch.Tensor | None) -> str:
        """Names where the network's forward pass leaves the auxiliary variables: the first step whose state
        differs from the auxiliary s_t by more than `divergence_factor` times what that step's own residuals
        (r_a, r_s) account for; "o" (the head) when no step does."""
        s = self.variables["s"]
        if index is not None:  # mini-batch: the batch's rows, written back to the store by now
            s = s.index_select(1, index)
        gap = (fwd_s - s).pow(2).mean((1, 2)).sqrt()
        own = (r["a"].pow(2).mean((1, 2)) + r["s"].pow(2).mean((1, 2))).sqrt()
        beyond = (gap > self.divergence_factor * own).nonzero()
        return f"s (t={int(beyond[0]) + 1})" if len(beyond) else "o"

    def _primal_dual(self, xt: torch.Tensor, y: torch.Tensor) -> tuple[list, dict, torch.Tensor, torch.Tensor]:
        """The sweep's primal updates and the dual step on the current variables: (flags, residuals, L, R at o)."""
        flags = self._sweep(xt, y)
        r = self.residual_tensors(xt)
        lagr = self.lagrangian(xt, y)
        aux = self._loss_rows(self.variables["o"], y).mean()
        self._dual_step(r)
        return flags, r, lagr, aux

    def _watch(self, residuals: dict[str, float]) -> None:
        """Records the residuals; raises when one grew in each of the last `divergence_window` sweeps by
        `divergence_factor` in all, or is non-finite."""
        n = self.divergence_window
        for k in BLOCKS:
            h = self.history[k]
            h.append(residuals[k])
            del h[:-(n + 1)]
            grew = len(h) == n + 1 and all(h[i + 1] > h[i] for i in range(n)) and h[-1] > self.divergence_factor * h[0]
            if grew or not math.isfinite(h[-1]):
                self.diverged = f"r_{k}"
                raise ADMMDivergenceError(self.diverged, f"ADMMiRNN: sweep {self.sweeps}: the residual of constraint "
                                          f"block {k!r} grew in each of the last {n} sweeps, from {h[0]:.3g} to "
                                          f"{h[-1]:.3g} (rho={self.rho}, tau={self.tau}): lower tau's "
                                          "aggressiveness (raise tau) or change rho")

    def _solve_gram(self, z: torch.Tensor, target: torch.Tensor, current: torch.Tensor, decay: float) -> torch.Tensor:
        """argmin_M of mean_rows ||target - z M^T||^2 / 2 + decay ||M||^2 / 2 + damping ||M - current||^2 / 2, i.e.
        the weight block's exact minimiser with its proximal term; z [N, K], target [N, J], current [J, K]."""
        n, k = z.shape
        gram = z.t() @ z / n + (self.damping + decay) * torch.eye(k, dtype=z.dtype, device=z.device)
        rhs = z.t() @ target / n + self.damping * current.t()
        return torch.cholesky_solve(rhs, torch.linalg.cholesky(gram)).t()

    def _sweep(self, xt: torch.Tensor, y: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The primal updates in the sweep's order, output to input; returns (block, any-non-finite flag) in update
        order (flags stay on the device: the caller synchronises once)."""
        flags = []

        def update(label, block, t=None, cache=None):
            try:
                flags.append((label, ~torch.isfinite(self._update(block, xt, y, t, cache)).all()))
            except torch.linalg.LinAlgError as e:  # a Gram matrix lost definiteness: non-finite values upstream
                label = next((name for name, bad in flags if bool(bad)), label)
                self.diverged = label
                raise ADMMDivergenceError(label, f"ADMMiRNN: sweep {self.sweeps + 1}: the update of block {label} "
                                          f"failed ({e}); the state holds non-finite or overflowing values") from None

        for name in ("o", "c", "v"):
            update(name, name)
        try:
            cache = self._step_cache(xt)   # u, w, b, v, c stay fixed while the time loop runs
        except torch.linalg.LinAlgError:
            cache = None  # the s update names the failure
        for t in range(self.seq_len - 1, -1, -1):
            for name in ("s", "a"):
                update(f"{name} (t={t + 1})", name, t, cache)
        for name in ("b", "w", "u"):
            update(name, name)
        return flags

    def _step_cache(self, xt: torch.Tensor) -> dict[str, torch.Tensor]:
        """What every s_t / a_t update shares: u x_t + b [T, B, H] and the inverses of the s-blocks' matrices."""
        ra, rs, ro = (self.rho[k] for k in BLOCKS)
        w, v = self.weights["w"], self.weights["v"]
        eye = torch.eye(self.hidden_size, dtype=w.dtype, device=w.device)
        return {"pre": torch.matmul(xt, self.weights["u"].t()) + self.weights["b"],
                "inv_mid": torch.cholesky_inverse(torch.linalg.cholesky(rs * eye + ra * (w.t() @ w))),
                "inv_last": torch.cholesky_inverse(torch.linalg.cholesky(rs * eye + ro * (v.t() @ v)))}

    def _update(self, block: str, xt: torch.Tensor, y: torch.Tensor, t: int | None = None,
                cache: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Updates one block in place ("o", "c", "v", "s" or "a" at step index t (0-based), "b", "w", "u") to its
        minimiser of L (or of L's linearisation plus the proximal term) and returns its new value."""
        ra, rs, ro = (self.rho[k] for k in BLOCKS)
        A, S = self.variables["a"], self.variables["s"]
        la, ls, lo = (self.dual[k] for k in BLOCKS)
        wt = self.weights
        T, B, H = A.shape
        if block == "o":  # R(o) + rho_o/2 ||o - m||^2, m = v s_T + c - lam_o/rho_o
            m = S[-1] @ wt["v"].t() + wt["c"] - lo / ro
            o = self.variables["o"]
            if self.loss == "mse":
                o = (y + ro * m) / (1 + ro)
            else:  # prox-linear: R linearised at o, its curvature bounded by tau * 1/2
                g = torch.softmax(o, 1)
                g[torch.arange(B, device=o.device), y] -= 1
                kappa = self.tau * _CE_CURVATURE
                o = (kappa * o - g + ro * m) / (kappa + ro)
            self.variables["o"] = o
            return o
        if block in ("c", "v"):  # least squares of v s_T + c against o + lam_o/rho_o
            target = self.variables["o"] + lo / ro
            if block == "c":
                wt["c"] = (target - S[-1] @ wt["v"].t()).mean(0)
            else:
                wt["v"] = self._solve_gram(S[-1], target - wt["c"], wt["v"], self.weight_decay / ro)
            return wt[block]
        if block in ("s", "a"):
            if cache is None:
                cache = self._step_cache(xt)
            if block == "s":  # rho_s/2 ||s - (tanh a_t - lam_s/rho_s)||^2 + the next step's (or the output's) quadratic
                rhs = rs * torch.tanh(A[t]) - ls[t]
                if t == T - 1:
                    rhs = rhs + ro * (self.variables["o"] + lo / ro - wt["c"]) @ wt["v"]
                    S[t] = rhs @ cache["inv_last"]
                else:
                    rhs = rhs + ra * (A[t + 1] + la[t + 1] / ra - cache["pre"][t + 1]) @ wt["w"]
                    S[t] = rhs @ cache["inv_mid"]
                return S[t]
            # a: rho_a/2 (a - m)^2 + rho_s/2 (p - tanh a)^2 elementwise, the tanh term linearised at the current a
            m = cache["pre"][t] - la[t] / ra
            if t > 0:
                m = m + S[t - 1] @ wt["w"].t()
            p = S[t] + ls[t] / rs
            th = torch.tanh(A[t])
            grad = -rs * (p - th) * (1 - th * th)
            kappa = self.tau * rs * (1 + 2 * TANH_CURVATURE * (p.abs() + 1))
            A[t] = (kappa * A[t] - grad + ra * m) / (kappa + ra)
            return A[t]
        # b, w, u: least squares of u x_t + w s_{t-1} + b against a_t + lam_a[t]/rho_a over every step (s_0 = 0)
        target = (A + la / ra).reshape(T * B, H)
        s_prev = torch.cat([torch.zeros_like(S[:1]), S[:-1]]).reshape(T * B, H)
        x_flat = xt.reshape(T * B, -1)
        decay = self.weight_decay / (ra * T)  # L holds T copies of the constraint, one per step
        if block == "b":
            wt["b"] = (target - x_flat @ wt["u"].t() - s_prev @ wt["w"].t()).mean(0)
        elif block == "w":
            wt["w"] = self._solve_gram(s_prev, target - x_flat @ wt["u"].t() - wt["b"], wt["w"], decay)
        elif block == "u":
            wt["u"] = self._solve_gram(x_flat, target - s_prev @ wt["w"].t() - wt["b"], wt["u"], decay)
        else:
            raise ValueError(f"ADMMiRNN: no block {block!r}")
        return wt[block]

    def _dual_step(self, r: dict[str, torch.Tensor]) -> None:
        """lam_k += rho_k r_k: on every step's constraints, or (duals="last") on the last step's only."""
        for k in BLOCKS:
            if self.duals == "all" or k == "o":
                self.dual[k].add_(r[k], alpha=self.rho[k])
            else:
                self.dual[k][-1].add_(r[k][-1], alpha=self.rho[k])

    # ---- state ----

    def _config(self) -> dict[str, Any]:
        return {"input_size": self.input_size, "hidden_size": self.hidden_size, "output_size": self.output_size,
                "seq_len": self.seq_len, "rho": dict(self.rho), "tau": self.tau, "loss": self.loss,
                "duals": self.duals, "damping": self.damping, "weight_decay": self.weight_decay,
                "dtype": str(self.dtype).replace("torch.", ""),
                "divergence_window": self.divergence_window, "divergence_factor": self.divergence_factor,
                "divergence_loss_factor": self.divergence_loss_factor,
                "minibatch": self.minibatch, "num_samples": self.num_samples}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: weights, per-sample variables, duals, the sweep count and the residual
        history of the divergence check, with the configuration they belong to (tensors are clones)."""
        return {"config": self._config(), "sweeps": self.sweeps, "diverged": self.diverged,
                "loss_reference": self.loss_reference,
                "history": {k: list(v) for k, v in self.history.items()},
                "weights": {k: v.clone() for k, v in self.weights.items()},
                "variables": {k: v.clone() for k, v in self.variables.items()},
                "dual": {k: v.clone() for k, v in self.dual.items()},
                "seen": None if self.seen is None else self.seen.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a `state_dict`; the configuration must match this instance's (the first field that differs
        is named).

        Args:
            state: what `state_dict()` returned (full-batch states saved before mini-batches existed load too).
        """
        mine = self._config()
        # states saved before mini-batches and the loss check
        config = {"minibatch": None, "num_samples": None, "divergence_loss_factor": 10.0, **state["config"]}
        for key, value in config.items():
            if mine.get(key) != value:
                raise ValueError(f"ADMMiRNN.load_state_dict: {key} is {mine.get(key)!r} here but {value!r} in the "
                                 "state")
        if set(config) != set(mine):
            raise ValueError(f"ADMMiRNN.load_state_dict: the state's config has fields "
                             f"{sorted(config)}, expected {sorted(mine)}")

        def load(group):
            return {k: v.to(device=self.device, dtype=self.dtype).clone() for k, v in state[group].items()}

        self.weights, self.variables, self.dual = load("weights"), load("variables"), load("dual")
        self.seen = None if state.get("seen") is None else state["seen"].to(self.device).clone()
        self.sweeps, self.diverged = int(state["sweeps"]), state["diverged"]
        self.loss_reference = state.get("loss_reference")
        self.history = {k: list(v) for k, v in state["history"].items()}
