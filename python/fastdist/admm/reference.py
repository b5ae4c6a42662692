"""ADMMiRNN against the authors' own NumPy code, run from a checkout the user names (it has no license: nothing of
it is copied here; this module imports its `common.py` from the given path and calls its update functions).

Their code trains a character-level RNN, one sequence (batch 1) of one-hot tokens at a time. Every check here
therefore uses a token task both implementations accept: scikit-learn's digits read pixel by pixel, each pixel's
intensity (0..16) one token (`digits_tokens`: 64 steps, 17 tokens, 10 classes; the digits exactly, one-hot coded),
many-to-one (the loss on the last step's output only; their earlier steps' output gradients are passed as 0).

Two comparisons, both on a state handed to both sides (docs/admm.md lists every difference they show):

- `block_check`: one random state (weights, a, s, o, duals; their dual = minus ours, their sign convention),
  each block updated once by their function and by ours, with the relation that should hold between the two, the
  relative difference of that relation, and the change of the augmented Lagrangian L each side's update makes.
- `trajectory`: the same initial weights (their initialisation, randn * 0.01, zero biases) and the same sample
  order; their update functions driven the way their training script drives them (every iteration restarts the
  auxiliary variables at the forward pass, sweeps o, c, v, s, a, b, w, u and back, then the three dual updates;
  their mu and alpha), against ours with minibatch="reinit" on the same one-sample batches. The network's own loss
  on a fixed evaluation set after each iteration, side by side.

`published_run` runs their training script (rnn_text.py) itself, unmodified, and records its loss and the weights'
norms per iteration.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import runpy
import sys
import types
from typing import Any

import numpy as np
import torch

from fastdist.admm.admmirnn import ADMMiRNN

__all__ = ["load_reference", "digits_tokens", "block_state", "their_block_updates", "block_check", "trajectory",
           "published_run", "record_blocks", "reference_commit", "BLOCK_RELATIONS"]

BLOCK_RELATIONS = {
    "o": "ours = (kappa o_old + rho o_theirs) / (kappa + rho): the same linearisation, ours with the proximal term",
    "c": "ours = theirs (their mu = 0): both the closed-form minimiser",
    "v": "theirs = v_old + dL/dv: one gradient step with the sign of ascent; ours the exact minimiser",
    "s": "theirs s_T = (rho tanh(a) + lam_s + tau s_old + dL_o/ds) / (rho + tau): ascent on the output term",
    "a": "theirs = a_old + dL/da with 1 - a^2 for tanh'(a): ascent, and the derivative at a not at tanh(a)",
    "b": "ours = theirs (their mu = rho): both the closed-form minimiser",
    "w": "theirs = w_old + dL/dw: one gradient step with the sign of ascent; ours the exact minimiser",
    "u": "theirs = u_old + dL/du: one gradient step with the sign of ascent; ours the exact minimiser",
    "dual": "theirs = -(lam_ours + rho r) / 10: ours' ascent step divided by 10 (their sign convention)",
}


def load_reference(path: str) -> types.ModuleType:
    """Imports `common.py` (the authors' update functions) from the checkout at `path`.

    Args:
        path: a checkout of the authors' ADMMiRNN repository.

    Raises:
        FileNotFoundError: `path` has no common.py.
    """
    file = os.path.join(path, "common.py")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"admm reference: no common.py under {path!r}; pass a checkout of the authors' "
                                "ADMMiRNN repository")
    spec = importlib.util.spec_from_file_location("admmirnn_reference_common", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_tokens(samples: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, 64] int64 in 0..16, labels [N] int64): scikit-learn's digits read pixel by pixel, the first
    `samples` of them (None: all 1797)."""
    from sklearn.datasets import load_digits
    d = load_digits()
    tokens, labels = d.data.astype(np.int64), d.target.astype(np.int64)
    return (tokens, labels) if samples is None else (tokens[:samples], labels[:samples])


# ---- the state both sides share ----

def _ours(vocab: int, hidden: int, classes: int, steps: int, rho: float, damping: float = 1e-12,
          **kw: Any) -> ADMMiRNN:
    """Ours in float64, tau 1, duals on the last step; damping 1e-12: the weight blocks' exact minimisers."""
    return ADMMiRNN(vocab, hidden, classes, steps, rho=rho, tau=1.0, duals="last", damping=damping,
                    dtype=torch.float64, **kw)


def _one_hot(tokens: np.ndarray, vocab: int) -> torch.Tensor:
    """[B, T] tokens -> x [B, T, vocab] float64."""
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).to(torch.float64)


def _set(m: ADMMiRNN, weights: dict, a=None, s=None, o=None, duals=None) -> None:
    """Hands a state (their layout: columns [K, 1], per-step dicts) to our instance (batch 1)."""
    m.weights = {"u": torch.tensor(weights["u"]), "w": torch.tensor(weights["w"]),
                 "b": torch.tensor(weights["b"][:, 0]), "v": torch.tensor(weights["v"]),
                 "c": torch.tensor(weights["c"][:, 0])}
    if a is None:
        return
    T = len(a)
    m.variables = {"a": torch.tensor(np.stack([a[t][:, 0] for t in range(T)]))[:, None],
                   "s": torch.tensor(np.stack([s[t][:, 0] for t in range(T)]))[:, None],
                   "o": torch.tensor(o[T - 1][:, 0])[None]}
    la, ls = torch.zeros_like(m.variables["a"]), torch.zeros_like(m.variables["s"])
    la[-1, 0], ls[-1, 0] = -torch.tensor(duals[0][:, 0]), -torch.tensor(duals[1][:, 0])  # their sign convention
    m.dual = {"a": la, "s": ls, "o": -torch.tensor(duals[2][:, 0])[None]}


def _forward_np(weights: dict, tokens: np.ndarray) -> tuple[dict, dict, dict]:
    """The forward pass in their layout: a, s (with s[-1] = 0), o per step, columns."""
    u, w, b, v, c = (weights[k] for k in "uwbvc")
    a, s, o = {}, {-1: np.zeros((w.shape[0], 1))}, {}
    for t, tok in enumerate(tokens):
        a[t] = u[:, [tok]] + w @ s[t - 1] + b
        s[t] = np.tanh(a[t])
        o[t] = v @ s[t] + c
    return a, s, o


def _softmax_grad(o: np.ndarray, label: int) -> np.ndarray:
    p = np.exp(o - o.max())
    p /= p.sum()
    p[label] -= 1
    return p


def _rel(x: Any, y: Any) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-300))


# ---- one block at a time ----

def block_state(steps: int = 6, hidden: int = 5, classes: int = 3, vocab: int = 4, seed: int = 0) -> dict:
    """One random state of the block check, in their layout (columns [K, 1], per-step dicts): weights, a, s
    (0.3-perturbed off the forward pass), o (the earlier steps' on their constraint, many-to-one), duals in their
    sign convention, the token sequence and its label, and `do` (dR/do: 0 before the last step)."""
    rng = np.random.RandomState(seed)
    T, H, O, V = steps, hidden, classes, vocab
    tokens = rng.randint(0, V, size=T)
    label = int(rng.randint(0, O))
    wts = {"u": rng.randn(H, V) * 0.5, "w": rng.randn(H, H) * 0.5, "b": rng.randn(H, 1) * 0.5,
           "v": rng.randn(O, H) * 0.5, "c": rng.randn(O, 1) * 0.5}
    a0, s0, _ = _forward_np(wts, tokens)
    a = {t: a0[t] + 0.3 * rng.randn(H, 1) for t in range(T)}
    s = {-1: s0[-1], **{t: s0[t] + 0.3 * rng.randn(H, 1) for t in range(T)}}
    o = {t: wts["v"] @ s[t] + wts["c"] for t in range(T)}
    o[T - 1] = o[T - 1] + 0.3 * rng.randn(O, 1)
    duals = (rng.randn(H, 1) * 0.1, rng.randn(H, 1) * 0.1, rng.randn(O, 1) * 0.1)
    do = {t: np.zeros((O, 1)) for t in range(T)}
    do[T - 1] = _softmax_grad(o[T - 1], label)
    return {"T": T, "H": H, "O": O, "V": V, "tokens": tokens, "label": label, "weights": wts, "a": a, "s": s,
            "o": o, "duals": duals, "do": do}


def their_block_updates(ref: types.ModuleType, state: dict, rho: float = 0.1) -> dict[str, list]:
    """Their update of every block from `state` (their alpha 1; their mu = rho, except c's: 0), as nested lists:
    o, s (the last step's), a (every step's, [T, H]), c, v, b, w, u, and the three duals concatenated."""
    st, mu = state, rho
    T, wts, a, s, o, (l1, l2, l3) = st["T"], st["weights"], st["a"], st["s"], st["o"], st["duals"]
    u, w, b, v, c = (wts[k] for k in "uwbvc")
    inputs = [int(t) for t in st["tokens"]]
    new_a = ref.update_a(a, {}, inputs, l1, u, w, s, b, rho, l2, rho, mu)
    out = {"o": ref.update_o(o, st["do"], inputs, l3, v, s, c, rho, mu, 1)[T - 1][:, 0],
           "c": ref.update_c(c, 0, inputs, l3, o, v, s, rho, 0.0, 1)[:, 0],
           "v": ref.update_v(v, 0, inputs, l3, o, s, c, rho, mu, 1),
           "s": ref.update_s(s, {}, inputs, l1, a, u, w, b, rho, l2, rho, l3, o, v, c, rho, mu, 1)[T - 1][:, 0],
           "a": np.stack([new_a[t][:, 0] for t in range(T)]),
           "b": ref.update_b(b, 0, inputs, l1, a, u, w, s, rho, mu, 1)[:, 0],
           "w": ref.update_w(w, 0, inputs, l1, a, u, s, b, rho, mu, 1),
           "u": ref.update_u(u, 0, inputs, l1, a, w, s, b, rho, mu, 1),
           "dual": np.concatenate([ref.update_lambda1(inputs, l1, rho, a, u, w, s, b)[:, 0],
                                   ref.update_lambda2(inputs, l2, rho, s, a)[:, 0],
                                   ref.update_lambda3(inputs, l3, rho, o, v, s, c)[:, 0]])}
    return {k: np.asarray(val).tolist() for k, val in out.items()}


def block_check(state: dict, theirs: dict[str, list], rho: float = 0.1) -> list[dict]:
    """Each block updated once by their function (`theirs`: `their_block_updates`, run now or recorded) and by
    ours from the same `state` (`block_state`).

    rho is every penalty and their mu (the weight of the earlier steps' constraints), and must be 0.1: their w
    update fixes mu at 0.1 inside, and only there do their objective and ours (duals="last": the earlier steps
    penalised with rho) coincide. Their alpha is 1 (the update functions' default; their script passes 10).

    Returns:
        One row per block: relation (BLOCK_RELATIONS), relation_rel_diff (max |lhs - rhs| / max |rhs|: float
        rounding where the relation holds), ours_vs_theirs (max relative difference of the updated block),
        dL_theirs / dL_ours (the change of L = R + the penalties and duals, ours' L, each side's update makes).
    """
    if rho != 0.1:
        raise ValueError("admm reference: block_check needs rho = 0.1 (their w update fixes mu = 0.1)")
    T, H, O, V = state["T"], state["H"], state["O"], state["V"]
    wts, a, s, o, duals = state["weights"], state["a"], state["s"], state["o"], state["duals"]
    theirs = {k: np.asarray(val, dtype=np.float64) for k, val in theirs.items()}
    x = _one_hot(np.asarray(state["tokens"])[None], V)
    xt = x.transpose(0, 1).contiguous()
    y = torch.tensor([state["label"]])

    def fresh() -> ADMMiRNN:
        m = _ours(V, H, O, T, rho)
        _set(m, wts, a, s, o, duals)
        return m

    def lag(m: ADMMiRNN) -> float:
        return float(m.lagrangian(xt, y))

    def grad(name: str) -> np.ndarray:
        """dL/d(block) of ours' L at the shared state, in their layout."""
        m = fresh()
        group = m.weights if name in "uwv" else m.variables
        group[name] = group[name].clone().requires_grad_(True)
        m.lagrangian(xt, y).backward()
        return group[name].grad.numpy()

    def ours_after(block: str, t: int | None = None) -> ADMMiRNN:
        m = fresh()
        m._update(block, xt, y, t)
        return m

    def theirs_in(block: str) -> ADMMiRNN:
        m = fresh()
        if block in "uwvbc":
            m.weights[block] = torch.tensor(theirs[block])
        elif block == "o":
            m.variables["o"] = torch.tensor(theirs["o"])[None]
        elif block == "s":
            m.variables["s"][T - 1, 0] = torch.tensor(theirs["s"])
        else:
            m.variables["a"] = torch.tensor(theirs["a"])[:, None]
        return m

    L0 = lag(fresh())
    rows = []

    def row(block: str, ours: ADMMiRNN, ours_value: np.ndarray, lhs: np.ndarray, rhs: np.ndarray) -> None:
        rows.append({"block": block, "relation": BLOCK_RELATIONS[block], "relation_rel_diff": _rel(lhs, rhs),
                     "ours_vs_theirs": _rel(ours_value, theirs[block]), "dL_theirs": lag(theirs_in(block)) - L0,
                     "dL_ours": lag(ours) - L0})

    # o: theirs takes the gradient at the current o (their script: at the forward pass) and no proximal term
    m = ours_after("o")
    kappa = m.tau * 0.5
    ours_o = m.variables["o"][0].numpy()
    row("o", m, ours_o, ours_o, (kappa * o[T - 1][:, 0] + rho * theirs["o"]) / (kappa + rho))
    m = ours_after("c")
    row("c", m, m.weights["c"].numpy(), m.weights["c"].numpy(), theirs["c"])
    for name in "vwu":
        m = ours_after(name)
        row(name, m, m.weights[name].numpy(), theirs[name] - wts[name], grad(name))
    # s, the last step (the earlier steps: docs/admm.md); dL_o/ds_T is ours' gradient less its s-constraint part
    m = ours_after("s", T - 1)
    r_s = s[T - 1][:, 0] - np.tanh(a[T - 1][:, 0])
    g_o = grad("s")[T - 1, 0] - (rho * r_s - duals[1][:, 0])
    tau = 1.0
    expect = (rho * np.tanh(a[T - 1][:, 0]) + duals[1][:, 0] + tau * s[T - 1][:, 0] + g_o) / (rho + tau)
    row("s", m, m.variables["s"][T - 1, 0].numpy(), theirs["s"], expect)
    # a: every step at once on their side; ours step by step (its update of a_t reads no other a)
    m = fresh()
    for t in range(T - 1, -1, -1):
        m._update("a", xt, y, t)
    a_old = np.stack([a[t][:, 0] for t in range(T)])
    g_a = grad("a")[:, 0]
    # their derivative of tanh at a is 1 - a^2: swap it into the s-constraint part of ours' gradient
    s_part = g_a - _a_constraint_grad(fresh(), xt, a_old, duals, rho)
    expect_a = a_old + g_a - s_part + s_part / (1 - np.tanh(a_old) ** 2) * (1 - a_old ** 2)
    row("a", m, m.variables["a"][:, 0].numpy(), theirs["a"], expect_a)
    m = ours_after("b")
    row("b", m, m.weights["b"].numpy(), m.weights["b"].numpy(), theirs["b"])
    # the dual step, from the shared state's residuals
    m = fresh()
    m._dual_step(m.residual_tensors(xt))
    ours_l = torch.cat([m.dual["a"][-1, 0], m.dual["s"][-1, 0], m.dual["o"][0]]).numpy()
    rows.append({"block": "dual", "relation": BLOCK_RELATIONS["dual"],
                 "relation_rel_diff": _rel(-theirs["dual"], ours_l / 10),
                 "ours_vs_theirs": _rel(ours_l, -theirs["dual"]),
                 "dL_theirs": math.nan, "dL_ours": math.nan})
    return rows


def _a_constraint_grad(m: ADMMiRNN, xt: torch.Tensor, a_old: np.ndarray, duals: tuple, rho: float) -> np.ndarray:
    """The part of dL/da_t from a_t's own constraint: rho r_a[t], less their dual on the last step."""
    m.variables["a"] = torch.tensor(a_old)[:, None]
    out = rho * m.residual_tensors(xt)["a"][:, 0].numpy()
    out[-1] -= duals[0][:, 0]
    return out


# ---- whole iterations ----

def _their_iteration(ref: types.ModuleType, wts: dict, duals: list, tokens: np.ndarray, label: int, classes: int,
                     rho: float, mu: float, alpha: float) -> None:
    """One iteration of theirs, in place: the auxiliary variables restarted at the forward pass, the sweep out and
    back, the dual updates (as their script orders them)."""
    inputs = [int(t) for t in tokens]
    T = len(inputs)
    a, s, o = _forward_np(wts, tokens)
    do = {t: np.zeros((classes, 1)) for t in range(T)}
    do[T - 1] = _softmax_grad(o[T - 1], label)
    l1, l2, l3 = duals
    u, w, b, v, c = (wts[k] for k in "uwbvc")

    def out_and_in(first: bool) -> None:
        nonlocal o, c, v, s, a, b, w, u
        order = ["o", "c", "v", "s", "a", "b", "w", "u"]
        for name in order if first else order[::-1]:
            if name == "o":
                o = ref.update_o(o, do, inputs, l3, v, s, c, rho, mu, alpha)
            elif name == "c":
                c = ref.update_c(c, 0, inputs, l3, o, v, s, rho, mu, alpha)
            elif name == "v":
                v = ref.update_v(v, 0, inputs, l3, o, s, c, rho, mu, alpha)
            elif name == "s":
                s = ref.update_s(s, {}, inputs, l1, a, u, w, b, rho, l2, rho, l3, o, v, c, rho, mu, alpha)
            elif name == "a":
                a = ref.update_a(a, {}, inputs, l1, u, w, s, b, rho, l2, rho, mu)
            elif name == "b":
                b = ref.update_b(b, 0, inputs, l1, a, u, w, s, rho, mu, alpha)
            elif name == "w":
                w = ref.update_w(w, 0, inputs, l1, a, u, s, b, rho, mu, alpha)
            else:
                u = ref.update_u(u, 0, inputs, l1, a, w, s, b, rho, mu, alpha)

    out_and_in(True)
    out_and_in(False)
    duals[:] = [ref.update_lambda1(inputs, l1, rho, a, u, w, s, b), ref.update_lambda2(inputs, l2, rho, s, a),
                ref.update_lambda3(inputs, l3, rho, o, v, s, c)]
    wts.update(u=u, w=w, b=b, v=v, c=c)


def trajectory(ref: types.ModuleType, iterations: int = 20, hidden: int = 16, rho: float = 0.025,
               mu: float = 1e-8, alpha: float = 10.0, eval_samples: int = 200, seed: int = 0) -> dict:
    """Theirs and ours from the same initial weights on the same one-sample batches of `digits_tokens`.

    Args:
        ref: `load_reference`'s module.
        iterations: one-sample iterations (one sweep each).
        hidden: H.
        rho: every penalty (theirs and ours; their script's 0.025).
        mu: their weight of the earlier steps' constraints (their script's 1e-8).
        alpha: their divisor of every block's update (their script's 10; the functions' default is 1).
        eval_samples: the first samples of the data set on which the network's loss is measured.
        seed: their initialisation (randn * 0.01, zero biases) and the sample order.

    Returns:
        {"loss_theirs", "loss_ours"} (the network's loss on the evaluation set, before the first iteration and
        after each), the weight norms per iteration, "max_rel_diff" over every iteration, and the setting.
    """
    tokens, labels = digits_tokens()
    V, T, O, H = 17, tokens.shape[1], 10, hidden
    rng = np.random.RandomState(seed)
    init = {"u": rng.randn(H, V) * 0.01, "w": rng.randn(H, H) * 0.01, "v": rng.randn(O, H) * 0.01,
            "b": np.zeros((H, 1)), "c": np.zeros((O, 1))}
    order = rng.permutation(len(labels))[:iterations]
    x_eval, y_eval = _one_hot(tokens[:eval_samples], V), torch.as_tensor(labels[:eval_samples])
    probe = _ours(V, H, O, T, rho)

    def loss(wts: dict) -> float:
        _set(probe, wts)
        return probe.loss_of(x_eval, y_eval)

    def norms(wts: dict) -> dict:
        return {k: float(np.linalg.norm(wts[k])) for k in "uwbvc"}

    theirs = {k: v.copy() for k, v in init.items()}
    duals = [np.zeros((H, 1)), np.zeros((H, 1)), np.zeros((O, 1))]
    ours = _ours(V, H, O, T, rho, damping=1e-3, minibatch="reinit")  # as a user runs it: the default damping
    _set(ours, init)
    out = {"loss_theirs": [loss(theirs)], "loss_ours": [loss(init)], "norms_theirs": [norms(theirs)],
           "norms_ours": [norms(init)], "theirs_error": None}
    for i in order:
        if out["theirs_error"] is None:
            with np.errstate(all="ignore"):
                _their_iteration(ref, theirs, duals, tokens[i], int(labels[i]), O, rho, mu, alpha)
            lt = loss(theirs)
            if not math.isfinite(lt):
                out["theirs_error"] = f"non-finite loss at iteration {len(out['loss_theirs'])}"
            out["loss_theirs"].append(lt)
            out["norms_theirs"].append(norms(theirs))
        ours.step(_one_hot(tokens[i][None], V), torch.tensor([int(labels[i])]))
        mine = {k: ours.weights[k].numpy()[:, None] if k in "bc" else ours.weights[k].numpy() for k in "uwbvc"}
        out["loss_ours"].append(loss(mine))
        out["norms_ours"].append(norms(mine))
    pairs = list(zip(out["loss_theirs"], out["loss_ours"]))
    out["rel_diff"] = [abs(p - q) / abs(q) if math.isfinite(p) else math.inf for p, q in pairs]
    out["max_rel_diff"] = max(out["rel_diff"][1:])
    out["setting"] = {"iterations": iterations, "hidden": H, "rho": rho, "mu": mu, "alpha": alpha,
                      "eval_samples": eval_samples, "seed": seed, "task": "digits-tokens (64 steps, 17 tokens)",
                      "prior_loss": _prior(labels[:eval_samples])}
    return out


def _prior(labels: np.ndarray) -> float:
    """The loss of always predicting the labels' frequencies."""
    p = np.bincount(labels) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def published_run(path: str, seed: int = 0) -> dict:
    """Runs their training script (rnn_text.py, unmodified: hidden 128, 25-character chunks, rho 0.025, mu 1e-8,
    alpha 10, 1000 iterations) with numpy seeded, and records its raw per-iteration loss and, per iteration, the
    norms of the weights their dual updates see.

    Returns:
        {"loss": [...], "norms": [{"u", "w", "b", "v", "c"}...], "vocab", "unigram_loss"} (unigram_loss: the loss
        of always predicting the text's character frequencies, what an output bias alone can reach).
    """
    ref = load_reference(path)
    norms: list[dict] = []
    seen: dict = {}

    def watch_lambda1(inputs, lambda1, rho1, a, u, w, s, b):
        seen.update(u=float(np.linalg.norm(u)), w=float(np.linalg.norm(w)), b=float(np.linalg.norm(b)))
        return ref.update_lambda1(inputs, lambda1, rho1, a, u, w, s, b)

    def watch_lambda3(inputs, lambda3, rho3, o, v, s, c):
        seen.update(v=float(np.linalg.norm(v)), c=float(np.linalg.norm(c)))
        norms.append(dict(seen))
        return ref.update_lambda3(inputs, lambda3, rho3, o, v, s, c)

    watched = types.ModuleType("common")
    watched.__dict__.update({k: v for k, v in vars(ref).items() if not k.startswith("__")})
    watched.update_lambda1, watched.update_lambda3 = watch_lambda1, watch_lambda3
    saved = sys.modules.get("common")
    cwd = os.getcwd()
    state = np.random.get_state()
    try:
        sys.modules["common"] = watched
        os.chdir(path)
        np.random.seed(seed)
        with contextlib.redirect_stdout(io.StringIO()), np.errstate(all="ignore"):
            g = runpy.run_path(os.path.join(path, "rnn_text.py"), run_name="admmirnn_reference_script")
    finally:
        os.chdir(cwd)
        np.random.set_state(state)
        if saved is None:
            sys.modules.pop("common", None)
        else:
            sys.modules["common"] = saved
    with open(os.path.join(path, "text.txt")) as f:
        text = f.read()
    counts = np.unique(list(text[1:]), return_counts=True)[1]
    p = counts / counts.sum()
    return {"loss": [float(v) for v in g["loss_"]], "norms": norms, "vocab": int(g["vocab_size"]),
            "unigram_loss": float(-(p * np.log(p)).sum())}


def reference_commit(path: str) -> str | None:
    """The checkout's HEAD commit, or None when `path` is not a git checkout."""
    import subprocess
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def record_blocks(path: str, seed: int = 0) -> dict:
    """Their block updates on `block_state(seed=seed)`, run now from the checkout at `path`, as the JSON data the
    tests compare ours with when the checkout is absent (numbers their code produced; none of its code)."""
    state = block_state(seed=seed)
    return {"command": f"python -m fastdist.admm.reference --ref PATH --record FILE --seed {seed}",
            "reference_commit": reference_commit(path),
            "state": {"steps": state["T"], "hidden": state["H"], "classes": state["O"], "vocab": state["V"],
                      "seed": seed}, "rho": 0.1, "theirs": their_block_updates(load_reference(path), state)}


def main(argv: list[str] | None = None) -> int:
    """`python -m fastdist.admm.reference --ref PATH`: prints the block check; --record FILE writes their block
    updates as test data."""
    import argparse
    import json
    p = argparse.ArgumentParser(prog="python -m fastdist.admm.reference", description=__doc__.split("\n")[0])
    p.add_argument("--ref", required=True, help="a checkout of the authors' ADMMiRNN repository")
    p.add_argument("--record", metavar="FILE", help="write their block updates (JSON) to FILE")
    p.add_argument("--seed", type=int, default=0, help="seed of the block check's state (default 0)")
    args = p.parse_args(argv)
    data = record_blocks(args.ref, args.seed)
    if args.record:
        with open(args.record, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    for row in block_check(block_state(seed=args.seed), data["theirs"]):
        print(f"{row['block']:5s} relation holds to {row['relation_rel_diff']:.1e}; ours vs theirs "
              f"{row['ours_vs_theirs']:.2e}; dL theirs {row['dL_theirs']:+.3e}, ours {row['dL_ours']:+.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
