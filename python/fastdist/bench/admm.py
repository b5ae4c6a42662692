"""`fastdist-bench admm`: ADMMiRNN against SGD, SGD+momentum, Adam and RMSProp (each with and without gradient
clipping) training the same tanh RNN + linear head.

Tasks (no downloads): digits-rows (scikit-learn's 8x8 digits read row by row: 8 steps of 8 features, 10 classes),
digits-pixels (the same digits pixel by pixel: 64 steps of 1 feature), text (1600 sequences of 20 one-hot tokens
over a vocabulary of 8, each drawn from one of 4 seeded ZipfMarkovCorpus languages; the class is the language),
digits-28 (the digits upscaled bilinearly to 28x28 and read row by row, MNIST's shape: 28 steps of 28 features),
adding-20/50/100/200 (the adding problem: T steps of (value ~ U(0,1), marker), one marker in each half; regress the sum
of the two marked values; R = (o - y)^2 / 2; "test acc" is the fraction of test samples within 0.04 of the target).

Methods: admm (ADMMiRNN full batch: one sweep over the training set per epoch), admm-mb (ADMMiRNN
minibatch="carry" on the baselines' shuffled mini-batches: one sweep per batch) and the SGD family.

Tuning: every method gets a grid of --grid values (ADMMiRNN: rho; the baselines: lr), the same size for all (3: the
default grids; 5: each extended by one value on either side); the
setting with the lowest final training loss is kept (the test set is not used to choose); with --seeds K the kept
setting is rerun from K - 1 further initialisations (and mini-batch orders). Runs are interleaved: methods alternate
within each grid value and seed, so load drift on a shared machine falls on all of them. One epoch is one
ADMMiRNN sweep over the whole training set (full batch) or one pass of --batch-size mini-batches for a baseline.
Stability: every method at its tuned setting from init scales --scales times the default initialisation, on the
short (digits-rows) and long (digits-pixels) task; a run converges when its final training loss is finite and
below both its first epoch's and the loss of always predicting the class frequencies. For the baselines the
gradient's norm at the first and last input step, |dL/dx_1| / |dL/dx_T| (at the initialisation), shows vanishing
(<< 1) or exploding (>> 1).
Cost: one ADMMiRNN sweep against one full-batch SGD step with backpropagation through time, interleaved, median;
--cost-only runs that alone (the recording to take under a timing lock).
Plots: training loss and test accuracy against epochs and against wall time; per stability task the final loss and
the baselines' input-gradient ratio by init scale and their gradient norms per epoch at the extreme scales.

--reference PATH (a checkout of the authors' NumPy code, which has no license: it is run from PATH, never copied)
runs only the comparison with it (fastdist.admm.reference): every block updated once by their function and by
ours from one shared state, their update functions driven as their training script drives them against ours on
the same initial weights and one-sample batches of the digits read pixel by pixel as tokens, and their training
script itself, unmodified.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

from fastdist.admm import ADMMDivergenceError, ADMMiRNN
from fastdist.bench import report
from fastdist.bench.report import col, fixed, integer, percent, scientific, times, yes_no
from fastdist.bench.toolkit import at_least, comma_list, interleave, progress, time_fn, up_to

TASKS = ["digits-rows", "digits-pixels", "text", "digits-28", "adding-20", "adding-50", "adding-100", "adding-200"]
ADDING_TOLERANCE = 0.04  # an adding-problem prediction within this of the sum counts as correct
OPTIMIZERS = {"sgd": lambda p, lr: torch.optim.SGD(p, lr=lr),
              "sgd-momentum": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
              "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
              "rmsprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr)}
BASELINES = [f"{o}{c}" for o in OPTIMIZERS for c in ("", "+clip")]
METHODS = ["admm", "admm-mb"] + BASELINES
# --grid K takes the first K values: the first three are the recorded default grids, the fourth and fifth extend
# each grid by one value on either side, so --grid 5 brackets a best found at an end of the 3-value grid
LR_GRID = {"sgd": [0.3, 0.1, 0.03, 1.0, 0.01], "sgd-momentum": [0.1, 0.03, 0.01, 0.3, 0.003],
           "adam": [0.01, 0.003, 0.001, 0.03, 0.0003], "rmsprop": [0.01, 0.003, 0.001, 0.03, 0.0003]}
RHO_GRID = [1.0, 3.0, 10.0, 0.3, 30.0]


def adding_problem(samples: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The adding problem (Hochreiter & Schmidhuber): x [N, T, 2] of (value ~ U(0, 1), marker), one marker in each
    half of the sequence; y [N] the sum of the two marked values."""
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(samples, length, generator=g)
    half = length // 2
    first = torch.randint(0, half, (samples,), generator=g)
    second = torch.randint(half, length, (samples,), generator=g)
    marker = torch.zeros(samples, length)
    rows = torch.arange(samples)
    marker[rows, first] = 1.0
    marker[rows, second] = 1.0
    return torch.stack([values, marker], 2), (values * marker).sum(1)


def load_task(name: str, seed: int = 0, text_classes: int = 4, text_samples: int = 1600,
              text_vocab: int = 8, text_len: int = 20, adding_samples: int = 1000) -> dict:
    """{x_train, y_train, x_test, y_test} float32 [N, T, F] / int64 [N] (float32 [N] for the adding problem) and
    the sizes; an 80/20 seeded split."""
    loss = "cross_entropy"
    if name.startswith("digits"):
        from sklearn.datasets import load_digits
        d = load_digits()
        images = torch.tensor(d.images, dtype=torch.float32) / 16.0
        if name == "digits-28":
            x = nn.functional.interpolate(images.unsqueeze(1), size=(28, 28), mode="bilinear",
                                          align_corners=False).squeeze(1)
        else:
            x = images if name == "digits-rows" else images.reshape(-1, 64, 1)
        y = torch.tensor(d.target, dtype=torch.int64)
        classes = 10
    elif name.startswith("adding-"):
        x, y = adding_problem(adding_samples, int(name.split("-")[1]), seed)
        classes, loss = 1, "mse"
    elif name == "text":
        from fastdist.testing.corpus import ZipfMarkovCorpus, generator
        per = text_samples // text_classes
        tokens = torch.cat([ZipfMarkovCorpus(vocab=text_vocab, seed=seed + 100 * k, follow=0.9).sample(
            per, text_len, generator("admm-text", seed, k)) for k in range(text_classes)])
        x = nn.functional.one_hot(tokens, text_vocab).float()
        y = torch.arange(text_classes).repeat_interleave(per)
        classes = text_classes
    else:
        raise ValueError(f"unknown task {name!r}; choose from {TASKS}")
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    tr, te = perm[:cut], perm[cut:]
    return {"name": name, "x_train": x[tr], "y_train": y[tr], "x_test": x[te], "y_test": y[te],
            "seq_len": x.shape[1], "features": x.shape[2], "classes": classes, "loss": loss}


def _prior_loss(y: torch.Tensor, classes: int) -> float:
    """The loss of always predicting the training set's class frequencies (its mean for regression): the bar a run
    must beat."""
    if y.is_floating_point():
        return float(0.5 * y.double().var(unbiased=False))
    p = torch.bincount(y, minlength=classes).double() / len(y)
    return float(-(p[y]).log().mean())


def task_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean R over the batch: cross-entropy for class ids, (o - y)^2 / 2 for regression targets (ADMMiRNN's mse)."""
    if y.is_floating_point():
        return 0.5 * (out[:, 0] - y).pow(2).mean()
    return nn.functional.cross_entropy(out, y)


def _accuracy(out: torch.Tensor, y: torch.Tensor) -> float:
    if y.is_floating_point():
        return float(((out[:, 0] - y).abs() < ADDING_TOLERANCE).double().mean())
    return float((out.argmax(1) == y).double().mean())


def run_admm(task: dict, hidden: int, epochs: int, rho: float, scale: float = 1.0, seed: int = 0,
             tau: float = 1.0, weight_decay: float = 0.0, batch_size: int | None = None) -> dict:
    """One ADMMiRNN run: per-epoch training loss (the network's forward), test accuracy, wall time, residuals.
    batch_size None: full batch, one sweep per epoch; else minibatch="carry" over shuffled mini-batches, shuffled
    as `run_baseline` shuffles."""
    x, y = task["x_train"], task["y_train"]
    mode = {} if batch_size is None else {"minibatch": "carry", "num_samples": len(y)}
    m = ADMMiRNN(task["features"], hidden, task["classes"], task["seq_len"], rho=rho, tau=tau, init_scale=scale,
                 seed=seed, weight_decay=weight_decay, loss=task["loss"], **mode)
    g = torch.Generator().manual_seed(seed)
    curve = {"loss": [], "test_acc": [], "time_s": [], "residual": []}
    elapsed, error = 0.0, None
    for _ in range(epochs):
        start = time.perf_counter()
        try:
            if batch_size is None:
                stats = m.step(x, y)
            else:
                for idx in torch.randperm(len(y), generator=g).split(batch_size):
                    stats = m.step(x[idx], y[idx], idx)
        except ADMMDivergenceError as e:
            error = f"diverged at block {e.block}"
            break
        elapsed += time.perf_counter() - start
        curve["loss"].append(stats.loss if batch_size is None else m.loss_of(x, y))
        curve["residual"].append(max(stats.residuals.values()))
        curve["test_acc"].append(_accuracy(m.forward(task["x_test"]), task["y_test"]))
        curve["time_s"].append(elapsed)
    return {"curve": curve, "error": error}


def run_baseline(task: dict, hidden: int, epochs: int, method: str, lr: float, batch_size: int, scale: float = 1.0,
                 seed: int = 0, clip: float = 1.0) -> dict:
    """One SGD-family run on the same network, initialised exactly as ADMMiRNN initialises it."""
    net = ADMMiRNN(task["features"], hidden, task["classes"], task["seq_len"], init_scale=scale, seed=seed,
                   loss=task["loss"]).model()
    opt = OPTIMIZERS[method.replace("+clip", "")](net.parameters(), lr)
    x, y = task["x_train"], task["y_train"]
    grad_ratio = _input_gradient_ratio(net, x, y)
    g = torch.Generator().manual_seed(seed)
    curve = {"loss": [], "test_acc": [], "time_s": [], "grad_norm": []}
    elapsed, error = 0.0, None
    for _ in range(epochs):
        start = time.perf_counter()
        norms = []
        for idx in torch.randperm(len(y), generator=g).split(batch_size):
            opt.zero_grad()
            task_loss(net(x[idx]), y[idx]).backward()
            if method.endswith("+clip"):
                norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), clip)))
            else:
                norms.append(float(torch.cat([p.grad.flatten() for p in net.parameters()]).norm()))
            opt.step()
        elapsed += time.perf_counter() - start
        with torch.no_grad():
            loss = float(task_loss(net(x), y))
            acc = _accuracy(net(task["x_test"]), task["y_test"])
        curve["loss"].append(loss)
        curve["test_acc"].append(acc)
        curve["time_s"].append(elapsed)
        curve["grad_norm"].append(statistics.median(norms))
        if not math.isfinite(loss):
            error = "non-finite loss"
            break
    return {"curve": curve, "error": error, "grad_ratio": grad_ratio}


def _input_gradient_ratio(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """|dL/dx_1| and |dL/dx_T| at the current weights: how much gradient reaches the first step."""
    xg = x.clone().requires_grad_(True)
    task_loss(net(xg), y).backward()
    first, last = float(xg.grad[:, 0].norm()), float(xg.grad[:, -1].norm())
    net.zero_grad(set_to_none=True)
    return {"first": first, "last": last, "ratio": first / last if last > 0 else math.nan}


def _grid(method: str, args) -> list[float]:
    base = RHO_GRID if method.startswith("admm") else LR_GRID[method.replace("+clip", "")]
    return base[:args.grid]


def _run(task, method, value, args, scale=1.0, epochs=None, seed=None):
    epochs = epochs or args.epochs
    seed = args.seed if seed is None else seed
    if method.startswith("admm"):
        out = run_admm(task, args.hidden, epochs, value, scale, seed, args.tau, args.weight_decay,
                       args.batch_size if method == "admm-mb" else None)
    else:
        out = run_baseline(task, args.hidden, epochs, method, value, args.batch_size, scale, seed, args.clip)
    c = out["curve"]
    out.update(method=method, value=value, scale=scale, task=task["name"], seed=seed,
               final_loss=c["loss"][-1] if c["loss"] and out["error"] is None else math.nan,
               final_test_acc=c["test_acc"][-1] if c["test_acc"] and out["error"] is None else math.nan,
               epoch_s=c["time_s"][-1] / len(c["time_s"]) if c["time_s"] else math.nan)
    return out


def _sweep_cost(task: dict, args) -> dict:
    """Seconds of one ADMMiRNN sweep and of one full-batch SGD + BPTT step on the same batch, interleaved."""
    x, y = task["x_train"], task["y_train"]
    m = ADMMiRNN(task["features"], args.hidden, task["classes"], task["seq_len"], seed=args.seed, loss=task["loss"])
    net = m.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def sgd():
        opt.zero_grad()
        task_loss(net(x), y).backward()
        opt.step()

    fns = {"admm": lambda: m.step(x, y), "sgd": sgd}
    samples = {k: [] for k in fns}
    for _, name, phase in interleave(fns, warmup=1, reps=args.reps):
        t = time_fn(fns[name], reps=1, warmup=0).samples[0]
        if phase != "warm-up":
            samples[name].append(t)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"task": task["name"], "batch": len(y), "admm_s": med["admm"], "sgd_s": med["sgd"],
            "ratio": med["admm"] / med["sgd"], "samples": samples}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    p.add_argument("--tasks", type=comma_list(choices=TASKS), default=TASKS, help="subset of " + ",".join(TASKS))
    p.add_argument("--methods", type=comma_list(choices=METHODS), default=METHODS,
                   help="subset of " + ",".join(METHODS))
    p.add_argument("--hidden", type=at_least(1), default=32, help="hidden size (default 32)")
    p.add_argument("--epochs", type=at_least(1), default=30, help="epochs (ADMM sweeps) per tuning run (default 30)")
    p.add_argument("--grid", type=up_to(len(RHO_GRID), int), default=3,
                   help="grid size of rho (ADMM) and of lr (baselines), the same for every method, at most "
                        f"{len(RHO_GRID)}: 3 is rho 1,3,10; 5 adds 0.3 and 30 (the lr grids likewise; default 3)")
    p.add_argument("--tau", type=float, default=1.0, help="ADMMiRNN tau (fixed, not tuned; default 1)")
    p.add_argument("--weight-decay", type=float, default=1e-3,
                   help="ADMMiRNN's Omega = wd/2 |theta|^2, the paper's regulariser (fixed, not tuned; default 1e-3)")
    p.add_argument("--batch-size", type=at_least(1), default=128, help="baselines' mini-batch (default 128)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip of the +clip baselines (default 1)")
    p.add_argument("--scales", type=comma_list(float), default=[0.01, 0.1, 1.0, 3.0, 10.0],
                   help="init scales of the stability sweep (default 0.01,0.1,1,3,10)")
    p.add_argument("--stability-epochs", type=at_least(1), default=15, help="epochs per stability run (default 15)")
    p.add_argument("--stability-tasks", type=comma_list(choices=TASKS + ["none"]),
                   default=["digits-rows", "digits-pixels"],
                   help="tasks (sequence lengths) of the stability sweep, or none (default digits-rows,digits-pixels)")
    p.add_argument("--seeds", type=at_least(1), default=1,
                   help="initialisations per method at its tuned setting (the tuning seed and K - 1 more; default 1)")
    p.add_argument("--adding-samples", type=at_least(10), default=1000,
                   help="sequences of each adding-problem task (default 1000)")
    p.add_argument("--reps", type=at_least(1), default=5, help="timed repetitions of the cost comparison (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of data split and initialisation (default 0)")
    p.add_argument("--cost-only", action="store_true",
                   help="time only the sweep-cost comparison of --tasks (no training; the run to record under a "
                        "timing lock)")
    p.add_argument("--reference", metavar="PATH",
                   help="run only the comparison with the authors' code, from a checkout at PATH (see above)")
    p.add_argument("--reference-iterations", type=at_least(1), default=20,
                   help="one-sample iterations of the reference trajectory (default 20)")


def run(args: argparse.Namespace) -> dict:
    """Runs the suite; prints the header and tables; returns the JSON payload."""
    env = report.environment(backend="torch ops", device="cpu", ranks=1, network="none (single process)")
    print(report.format_environment(env))
    if args.reference:
        result = {"suite": "admm", "env": env, "config": vars(args),
                  "reference": run_reference(args.reference, args.reference_iterations, args.hidden, args.seed,
                                             args.threads)}
        print(report.text_parts(tables(result)))
        return result
    if args.cost_only:
        bar = progress(len(args.tasks), "admm cost")
        cost = []
        with report.torch_threads(args.threads):
            for t in args.tasks:
                cost.append(_sweep_cost(load_task(t, args.seed, adding_samples=args.adding_samples), args))
                bar.step(f"cost {t}")
        result = {"suite": "admm", "env": env, "config": vars(args), "cost": cost}
        print(report.text_parts(tables(result)))
        return result
    with report.torch_threads(args.threads):
        stability_tasks = [t for t in args.stability_tasks if t != "none"]
        tasks = {name: load_task(name, args.seed, adding_samples=args.adding_samples)
                 for name in dict.fromkeys(args.tasks + stability_tasks)}
        # interleaved: the methods alternate inside each grid position (and seed, scale)
        grid_runs = [(t, m, _grid(m, args)[i]) for t in args.tasks for i in range(args.grid) for m in args.methods]
        stab_runs = [(t, m, s) for t in stability_tasks for s in args.scales for m in args.methods]
        extra_seeds = [args.seed + k for k in range(1, args.seeds)]
        bar = progress(len(grid_runs) + len(args.tasks) * len(extra_seeds) * len(args.methods) + len(stab_runs)
                       + len(args.tasks), "admm")
        runs = []
        for t, m, v in grid_runs:
            runs.append(_run(tasks[t], m, v, args))
            bar.step(f"{t} {m} {v:g}")
        best = {}
        for r in runs:
            key = (r["task"], r["method"])
            score = r["final_loss"] if math.isfinite(r["final_loss"]) else math.inf
            if key not in best or score < best[key][0]:
                best[key] = (score, r)
        tuned = [best[(t, m)][1] for t in args.tasks for m in args.methods]
        seed_runs = []
        for t in args.tasks:
            for seed in extra_seeds:
                for m in args.methods:
                    seed_runs.append(_run(tasks[t], m, best[(t, m)][1]["value"], args, seed=seed))
                    bar.step(f"{t} {m} seed {seed}")
        stability = []
        for t, m, s in stab_runs:
            value = (best.get((t, m)) or (0, {"value": _grid(m, args)[len(_grid(m, args)) // 2]}))[1]["value"]
            r = _run(tasks[t], m, value, args, scale=s, epochs=args.stability_epochs)
            r["prior_loss"] = _prior_loss(tasks[t]["y_train"], tasks[t]["classes"])
            r["converged"] = bool(math.isfinite(r["final_loss"])
                                  and r["final_loss"] < min(r["prior_loss"], r["curve"]["loss"][0]))
            stability.append(r)
            bar.step(f"stability {t} {m} x{s:g}")
        cost = []
        for t in args.tasks:
            cost.append(_sweep_cost(tasks[t], args))
            bar.step(f"cost {t}")
    result = {"suite": "admm", "env": env, "config": vars(args), "runs": runs, "tuned": tuned,
              "stability": stability, "cost": cost}
    if extra_seeds:
        result["seed_runs"] = seed_runs
        result["seeds"] = _seed_rows(tuned, seed_runs)
    result["summary"] = _summary(result)
    print(report.text_parts(tables(result)))
    return result


def run_reference(path: str, iterations: int, hidden: int, seed: int, threads: int) -> dict:
    """The comparison with the authors' code at `path` (fastdist.admm.reference): the block check, trajectories
    of theirs (alpha 10 as their script, alpha 1 as their functions' default) and ours, their script's own run."""
    from fastdist.admm import reference as ref_mod
    ref = ref_mod.load_reference(path)
    state = ref_mod.block_state(seed=seed)
    with report.torch_threads(threads):
        blocks = ref_mod.block_check(state, ref_mod.their_block_updates(ref, state))
        runs = {alpha: ref_mod.trajectory(ref, iterations, hidden, alpha=alpha, seed=seed) for alpha in (10.0, 1.0)}
        published = ref_mod.published_run(path, seed)
    return {"commit": ref_mod.reference_commit(path), "blocks": blocks,
            "trajectory": {"alpha10": runs[10.0], "alpha1": runs[1.0]}, "published": published}


def _plot_stability(row, runs: list[dict], task: str, style) -> None:
    """One stability task: final training loss (the prior's as a line) and the input-gradient ratio at
    initialisation against the init scale; the SGD-family runs' median gradient norm per epoch at the smallest and
    the largest scale."""
    methods = list(dict.fromkeys(r["method"] for r in runs))
    for m in methods:
        mine = sorted((r for r in runs if r["method"] == m), key=lambda r: r["scale"])
        scales = [r["scale"] for r in mine]
        final = [r["curve"]["loss"][-1] if r["curve"]["loss"] else math.nan for r in mine]
        row[0].plot(scales, final, marker="o", **style(m, m))
        if mine and mine[0].get("grad_ratio"):
            row[1].plot(scales, [max(r["grad_ratio"]["ratio"], 1e-30) for r in mine], marker="o", **style(m, m))
            for ax, r in ((row[2], mine[0]), (row[3], mine[-1])):
                ax.plot(range(1, len(r["curve"]["grad_norm"]) + 1), r["curve"]["grad_norm"], **style(m, m))
    if runs:
        row[0].axhline(runs[0]["prior_loss"], color="k", lw=0.8, ls=":", label="class prior")
    smallest, largest = min(r["scale"] for r in runs), max(r["scale"] for r in runs)
    for ax, (xl, yl, title) in zip(row, [
            ("init scale", "final training loss", f"{task}: stability"),
            ("init scale", "|dL/dx_1| / |dL/dx_T| at init (0 plotted as 1e-30)", f"{task}: vanishing / exploding"),
            ("epoch", "median gradient norm (before clipping)", f"{task}: init scale {smallest:g}"),
            ("epoch", "median gradient norm (before clipping)", f"{task}: init scale {largest:g}"
             + (" (NaN runs not drawn)" if any(r["error"] for r in runs if r["scale"] == largest) else ""))]):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    for ax in row[:2]:
        ax.set_xscale("log")
    row[0].legend(fontsize=6)


def _reference_parts(result: dict) -> list[report.Part]:
    r = result["reference"]
    blocks = report.Part(
        "reference-blocks", [col("block", "block"), col("relation", "relation"),
                             col("relation holds to", "relation_rel_diff", scientific(0)),
                             col("ours vs theirs", "ours_vs_theirs", scientific(1)),
                             col("dL theirs", "dL_theirs", scientific(2)), col("dL ours", "dL_ours", scientific(2))],
        r["blocks"], f"One state (T = 6, H = 5, 3 classes, 4 tokens, batch 1, float64) handed to both; every penalty "
        "and their mu 0.1, their alpha 1. Relation: what holds between their update and ours (or L's gradient), "
        "with its max relative difference; dL: the change of the augmented Lagrangian each update makes.")
    t10, t1 = r["trajectory"]["alpha10"], r["trajectory"]["alpha1"]
    st = t10["setting"]
    rows = [{"it": i, "theirs10": t10["loss_theirs"][i], "theirs1": t1["loss_theirs"][i], "ours": t10["loss_ours"][i],
             "u10": t10["norms_theirs"][i]["u"], "u_ours": t10["norms_ours"][i]["u"],
             "rel": t10["rel_diff"][i]} for i in range(len(t10["loss_ours"]))]
    traj = report.Part(
        "reference-trajectory", [col("iteration", "it", integer), col("theirs, alpha 10", "theirs10", fixed(4)),
                                 col("theirs, alpha 1", "theirs1", fixed(4)), col("ours", "ours", fixed(4)),
                                 col("|u| theirs (alpha 10)", "u10", scientific(2)),
                                 col("|u| ours", "u_ours", scientific(2)),
                                 col("rel. diff (alpha 10)", "rel", scientific(1))],
        rows, f"Network loss on the first {st['eval_samples']} samples of {st['task']} (prior {st['prior_loss']:.3f}) "
        f"after each one-sample iteration from the same initialisation (randn * 0.01, hidden {st['hidden']}, seed "
        f"{st['seed']}); rho {st['rho']:g} both, their mu {st['mu']:g}; ours minibatch='reinit', tau 1, damping "
        f"1e-3. Max relative difference: {t10['max_rel_diff']:.3f} (alpha 10), {t1['max_rel_diff']:.3f} (alpha 1).")
    pub = r["published"]
    marks = [i for i in (0, 1, 2, 3, 5, 10, 20, 50, 100, 200, 500) if i < len(pub["loss"])] + [len(pub["loss"]) - 1]
    prow = [{"it": i + 1, "loss": pub["loss"][i], **{k: pub["norms"][i][k] for k in "uwvc"}} for i in marks]
    published = report.Part(
        "reference-published", [col("iteration", "it", integer), col("loss", "loss", fixed(3))]
        + [col(f"|{k}| after", k, scientific(2)) for k in "uwvc"],
        prow, f"Their rnn_text.py as published (hidden 128, 25-character chunks, rho 0.025, mu 1e-8, alpha 10), "
        f"numpy seeded; loss per character before the iteration's update, weight norms after it. Vocabulary "
        f"{pub['vocab']} (uniform loss {math.log(pub['vocab']):.3f}); the characters' frequencies alone give "
        f"{pub['unigram_loss']:.3f}.")
    return [blocks, traj, published]


def _summary(result: dict) -> dict:
    """Per method: the fraction of stability runs that converged; per task: ADMM's tuned accuracy vs the best
    baseline's."""
    frac = {}
    for r in result["stability"]:
        frac.setdefault(r["method"], []).append(r["converged"])
    out = {"converged_fraction": {m: sum(v) / len(v) for m, v in frac.items()}, "accuracy_gap": {}}
    for t in dict.fromkeys(r["task"] for r in result["tuned"]):
        rows = [r for r in result["tuned"] if r["task"] == t]
        admm = next((r for r in rows if r["method"] == "admm"), None)
        base = [r for r in rows if not r["method"].startswith("admm") and math.isfinite(r["final_test_acc"])]
        if admm and base:
            top = max(base, key=lambda r: r["final_test_acc"])
            out["accuracy_gap"][t] = {"admm": admm["final_test_acc"], "best_baseline": top["method"],
                                      "baseline": top["final_test_acc"],
                                      "gap": admm["final_test_acc"] - top["final_test_acc"]}
    return out


def _seed_rows(tuned: list[dict], seed_runs: list[dict]) -> list[dict]:
    """Per task and method at its tuned setting: final training loss and test accuracy over every seed (median,
    min, max; a diverged run counts as NaN loss and is reported, not dropped)."""
    rows = []
    for r in tuned:
        group = [r] + [s for s in seed_runs if (s["task"], s["method"]) == (r["task"], r["method"])]
        acc = [g["final_test_acc"] for g in group if math.isfinite(g["final_test_acc"])]
        loss = [g["final_loss"] for g in group if math.isfinite(g["final_loss"])]
        rows.append({"task": r["task"], "method": r["method"], "value": r["value"], "seeds": len(group),
                     "failed": len(group) - len(loss),
                     "loss_median": statistics.median(loss) if loss else math.nan,
                     "acc_median": statistics.median(acc) if acc else math.nan,
                     "acc_min": min(acc) if acc else math.nan, "acc_max": max(acc) if acc else math.nan,
                     "acc": [g["final_test_acc"] for g in group], "loss": [g["final_loss"] for g in group]})
    return rows


def _stability_rows(result):
    rows = {}
    for r in result["stability"]:
        row = rows.setdefault((r["task"], r["method"]), {"task": r["task"], "method": r["method"]})
        row[f"x{r['scale']:g}"] = ("yes" if r["converged"] else "no") + (
            f" ({r['grad_ratio']['ratio']:.0e})" if r.get("grad_ratio") else "")
    return list(rows.values())


def tables(result: dict) -> list[report.Part]:
    """The suite's tables of `result` (its JSON payload)."""
    if "reference" in result:
        return _reference_parts(result)
    c = result["config"]
    cost = report.Part(
        "cost", [col("task", "task"), col("batch", "batch", integer),
                 col("ADMM sweep (ms)", lambda r: 1e3 * r["admm_s"], fixed(1)),
                 col("SGD+BPTT step (ms)", lambda r: 1e3 * r["sgd_s"], fixed(1)), col("ratio", "ratio", times(1))],
        result["cost"], f"Full-batch, median of {c['reps']} interleaved repetitions, {c['threads']} torch thread(s).")
    if "tuned" not in result:  # --cost-only
        return [cost]
    adding = (f" Adding problem: test acc = fraction of test sequences predicted within {ADDING_TOLERANCE} of the "
              "sum." if any(t.startswith("adding") for t in c["tasks"]) else "")
    batched = "baselines' and admm-mb's" if "admm-mb" in c["methods"] else "baselines'"
    tuned = report.Part(
        "tuned", [col("task", "task"), col("method", "method"), col("rho / lr", "value", scientific(0)),
                  col("train loss", "final_loss", fixed(3)), col("test acc (%)", "final_test_acc", percent(1)),
                  col("s / epoch", "epoch_s", fixed(3)), col("note", lambda r: r["error"] or "")],
        result["tuned"], f"Each method at the best of its {c['grid']}-value grid (lowest final training loss), "
        f"{c['epochs']} epochs, hidden {c['hidden']}, {batched} batch {c['batch_size']}." + adding)
    scales = [f"x{s:g}" for s in c["scales"]]
    stab = report.Part(
        "stability", [col("task", "task"), col("method", "method")] + [col(s, s) for s in scales],
        _stability_rows(result),
        f"Converged (final training loss finite, below the first epoch's and the class-prior loss) after "
        f"{c['stability_epochs']} epochs, by init scale; in brackets |dL/dx_1| / |dL/dx_T| at initialisation "
        "(baselines).",
        [f"{m}: {100 * f:.0f}% of runs converged" for m, f in result["summary"]["converged_fraction"].items()])
    parts = [tuned] + ([stab] if result["stability"] else []) + [cost]
    if result.get("seeds"):
        parts.insert(1, report.Part(
            "seeds", [col("task", "task"), col("method", "method"), col("rho / lr", "value", scientific(0)),
                      col("seeds", "seeds", integer), col("failed", "failed", integer),
                      col("train loss (median)", "loss_median", fixed(3)),
                      col("test acc % (median)", "acc_median", percent(1)),
                      col("min", "acc_min", percent(1)), col("max", "acc_max", percent(1))],
            result["seeds"], f"Each method's tuned setting from {c['seeds']} initialisations (seeds {c['seed']}.."
            f"{c['seed'] + c['seeds'] - 1}; the tuning seed included), {c['epochs']} epochs." + adding))
    return parts


def plot(result: dict, path: str) -> None:
    """Training loss and test accuracy of the tuned runs against epochs and against wall time, one row per task;
    one row per stability task (final loss by init scale, the baselines' |dL/dx_1| / |dL/dx_T|, the median gradient
    norm per epoch at each scale); the reference comparison: the loss trajectories."""
    if "reference" in result:
        plt, fig, ax = report.subplots(1, 1, figsize=(7, 4))
        for key, label in (("alpha10", "theirs, alpha 10"), ("alpha1", "theirs, alpha 1")):
            ax.plot(result["reference"]["trajectory"][key]["loss_theirs"], label=label)
        ax.plot(result["reference"]["trajectory"]["alpha10"]["loss_ours"], label="ours", lw=2.5)
        ax.set_xlabel("iteration (one sample)")
        ax.set_ylabel("network loss (evaluation set)")
        ax.set_yscale("log")
        ax.legend()
        report.save_figure(fig, path)
        return
    if "tuned" not in result:  # --cost-only
        plt, fig, ax = report.subplots(1, 1, figsize=(7, 4))
        report.grouped_bars(ax, [f"{r['task']} (B={r['batch']})" for r in result["cost"]],
                            {"ADMM sweep": [1e3 * r["admm_s"] for r in result["cost"]],
                             "SGD+BPTT step": [1e3 * r["sgd_s"] for r in result["cost"]]}, "ms (median)",
                            title="one full-batch ADMMiRNN sweep vs one SGD step with BPTT")
        report.save_figure(fig, path)
        return
    tasks = list(dict.fromkeys(r["task"] for r in result["tuned"]))
    stab_tasks = list(dict.fromkeys(r["task"] for r in result["stability"]))
    plt, fig, axes = report.subplots(len(tasks) + len(stab_tasks), 4, figsize=(20, 4 * (len(tasks) + len(stab_tasks))),
                                     squeeze=False)
    cmap = plt.get_cmap("tab10")
    colour = {m: cmap(i % 10) for i, m in enumerate(dict.fromkeys(r["method"] for r in result["tuned"]))}

    def style(method: str, label: str) -> dict:
        return dict(color=colour.get(method, "k"), lw=2.5 if method.startswith("admm") else 1.2,
                    ls="--" if method.endswith("+clip") else "-", label=label)

    panels = [("epoch", "loss"), ("epoch", "test_acc"), ("time_s", "loss"), ("time_s", "test_acc")]
    for row, t in zip(axes, tasks):
        for r in (x for x in result["tuned"] if x["task"] == t):
            cv = r["curve"]
            epochs = list(range(1, len(cv["loss"]) + 1))
            for ax, (xk, yk) in zip(row, panels):
                ax.plot(epochs if xk == "epoch" else cv["time_s"], cv[yk], marker="o" if len(epochs) == 1 else None,
                        **style(r["method"], f"{r['method']} ({r['value']:g})"))
        for ax, (xk, yk) in zip(row, panels):
            if yk == "loss":
                ax.set_yscale("log")
            ax.set_xlabel("epoch (full-batch admm: one sweep)" if xk == "epoch" else "training wall time (s)")
            ax.set_ylabel("training loss" if yk == "loss" else "test accuracy")
            ax.set_title(t)
            ax.grid(True, alpha=0.3)
        row[0].legend(fontsize=6)
    for row, t in zip(axes[len(tasks):], stab_tasks):
        _plot_stability(row, [r for r in result["stability"] if r["task"] == t], t, style)
    fig.suptitle(f"fastdist-bench admm: {result['env']['device']}", fontsize=9)
    report.save_figure(fig, path)
