"""`fastdist-bench sparse`: sketch_allreduce against the gradient reductions a user would otherwise pick.

Embedding-shaped gradients (--shape) at several row densities (--densities), each rank's rows those of distinct
tokens drawn from one shared Zipf distribution (fastdist.testing.synthetic): frequent rows are non-zero everywhere,
rare ones on one rank. Per density every method runs interleaved (the order rotated each repetition), warm-up
first, each call on a fresh copy of the same gradient:

  dense       dist.all_reduce
  fp16, bf16  torch's fp16/bf16 compress hook steps (cast, all-reduce, cast back)
  agsparse    all-gather of (index, value) row lists padded to the largest count (Horovod / PyTorch sparse)
  omnireduce  sketch_allreduce(mode="exact"): union bitmap + all-reduce of the union's rows (lossless)
  powersgd    torch's powerSGD_hook (rank --powersgd-rank, error feedback and warm start on)
  topk        GRACE-style TopK + all-gather, k sized so its all-gather sends what the sketch's table
              all-reduce sends (or --topk-ratio x numel)
  sketch      sketch_allreduce(mode="sketch"), a table of --sketch-rows x cols holding --sketch-size x the
              union's non-zero values in all (default 0.5; as in sparse-lm: 1.0 sends what the union does)
  auto        sketch_allreduce(mode="auto") with the same sketch size; the note says what it chose. Its first
              EXACT_EXPLORE_CALLS calls per density (timing both exact collectives) run before the repetitions

Time is the median of the slowest rank's time per call; wire bytes are the method's model of what the busiest rank
sends, tx what its interface really sent (simulated network only); the error is ||g_hat - g|| / ||g|| against the
exact sum (the synthetic values make every float32 sum exact: lossless methods show 0). powersgd keeps its
warm-start matrices across repetitions, as in training; its error-feedback residual is zeroed before every call
(untimed), so that each call compresses the same gradient as every other method.

Part "ddp" (`--parts ddp`): DDP training steps over an nn.EmbeddingBag(--ddp-table, sparse=True) and an MLP head,
each rank's bags holding --ddp-density percent of the rows per step, every method from the same weights on the
same batches, interleaved:

  ddp-sparse  DDP's own reduction: gloo's sparse all-reduce of the table's gradient, the head all-reduced
  auto        sketch_hook(SketchState(mode="auto", dense_hook=allreduce_hook)): the head's bucket through torch's
              plain all-reduce hook, the table through sketch_allreduce
  auto-bg     the same with background=True
  auto-nodh   auto without dense_hook (the head's bucket through the bitmap path too, as before dense_hook)
Time is the median of the slowest rank's step; every method's parameters after the run are compared with
ddp-sparse's (lossless methods show 0).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from fastdist.bench import report
from fastdist.bench.report import MIB, col, fixed, percent, scaled, scientific, times
from fastdist.bench.launch import add_launch_arguments, pin_local_rank, run_suite, tx_counter
from fastdist.bench.peers import ddp_sparse
from fastdist.bench.toolkit import (all_max, at_least, comma_list, progress, rank_device, rounds, shape_type,
                                     time_interleaved, together, up_to)

METHODS = ["dense", "fp16", "agsparse", "omnireduce", "powersgd", "topk", "sketch", "auto"]
DDP_METHODS = ["ddp-sparse", "auto", "auto-bg", "auto-nodh"]
PARTS = ["collectives", "ddp"]
EXTRA_METHODS = ["bf16"]
SKETCH_METHODS = {"omnireduce", "sketch", "auto"}
LOSSLESS = {"dense", "agsparse", "omnireduce"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=3600.0)
    p.add_argument("--shape", type=shape_type(2), default="32768x1024",
                   help="gradient rows x dim, float32 (default 32768x1024 = 128 MiB)")
    p.add_argument("--densities", type=comma_list(up_to(100)), default="0.5,2,10",
                   help="row densities per rank in percent (default 0.5,2,10)")
    p.add_argument("--methods", type=comma_list(choices=METHODS + EXTRA_METHODS), default=METHODS,
                   help="comma-separated subset of " + ",".join(METHODS + EXTRA_METHODS))
    p.add_argument("--reps", type=at_least(1), default=5, help="timed repetitions per method, >= 5 for a claim")
    p.add_argument("--warmup", type=at_least(0), default=1, help="untimed repetitions of every method first")
    p.add_argument("--sketch-size", type=up_to(math.inf), default=0.5,
                   help="sketch table values (rows x cols) as a multiple of the union's non-zero values (default 0.5)")
    p.add_argument("--sketch-rows", type=int, default=3, help="sketch rows r (default 3)")
    p.add_argument("--topk-ratio", type=up_to(1.0), default=None,
                   help="topk keeps this fraction of each rank's elements (default: k whose all-gather "
                        "sends what the sketch's table all-reduce sends)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix rank (default 4)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the token distribution (default 1.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic gradients and the sketch hashes")
    p.add_argument("--parts", type=comma_list(choices=PARTS), default=["collectives"],
                   help="collectives (the reductions above), ddp (DDP training steps), or both (default collectives)")
    p.add_argument("--ddp-table", type=shape_type(2), default="65536x128",
                   help="part ddp: EmbeddingBag rows x dim (default 65536x128)")
    p.add_argument("--ddp-density", type=up_to(100), default=3.9,
                   help="part ddp: percent of the table's rows each rank's batch touches per step (default 3.9)")
    p.add_argument("--ddp-methods", type=comma_list(choices=DDP_METHODS), default=DDP_METHODS,
                   help="part ddp: comma-separated subset of " + ",".join(DDP_METHODS))


CONFIG = ("methods", "reps", "warmup", "sketch_size", "sketch_rows", "topk_ratio", "powersgd_rank", "zipf", "seed",
          "parts", "ddp_methods")
"""The options the ranks are given as they are (the payload's config has them and those _config_from derives)."""


def _config_from(args):
    (rows, dim), densities = args.shape, [d / 100 for d in args.densities]
    return {"rows": rows, "dim": dim, "densities": densities, "measure_tx": False, "ddp_table": list(args.ddp_table),
            "ddp_density": args.ddp_density / 100, **{k: getattr(args, k) for k in CONFIG}}


class _Gradient:
    """One density's gradient on this rank, its exact sum, and the sizes every method is configured with."""

    def __init__(self, config, density, world, rank, device):
        from fastdist.testing import synthetic
        from fastdist.comm import baselines

        self.spec = synthetic.GradientSpec(rows=config["rows"], dim=config["dim"], density=density,
                                           exponent=config["zipf"], seed=config["seed"])
        grad, _ = synthetic.zipf_embedding_grad(self.spec, rank)
        self.grad = grad.to(device)
        self.ref = synthetic.exact_sum(self.spec, world).to(device)
        self.ref_norm = float(torch.linalg.vector_norm(self.ref, dtype=torch.float64))
        self.local_rows = self.spec.local_rows
        self.union_rows = int(synthetic.union_rows(self.spec, world).numel())
        numel = self.grad.numel()
        self.sketch_rows = config["sketch_rows"]
        self.sketch_cols = max(1, math.ceil(config["sketch_size"] * self.union_rows * config["dim"] / self.sketch_rows))
        if config["topk_ratio"] is not None:
            self.topk_k = baselines.topk_k(numel, ratio=config["topk_ratio"])
        else:
            table_bytes = baselines.ring_allreduce_bytes(self.sketch_rows * self.sketch_cols * 4, world)
            self.topk_k = baselines.topk_for_wire_budget(table_bytes, world, numel, self.grad.element_size())
        self.powersgd = baselines.make_powersgd_state(rank=config["powersgd_rank"], start_iter=2, seed=config["seed"])
        self.work = torch.empty_like(self.grad)

    def error(self, result: torch.Tensor) -> float:
        """The relative L2 error ||result - exact sum|| / ||exact sum||."""
        diff = torch.linalg.vector_norm(result - self.ref, dtype=torch.float64)
        return float(diff) / self.ref_norm if self.ref_norm else float(diff)

    def call(self, name: str) -> tuple[int, str]:
        """Reduces self.work with method `name`; returns (wire bytes model, what ran)."""
        from fastdist.comm import baselines as bl
        from fastdist.comm import last_stats, sketch_allreduce

        w = self.work
        if name in SKETCH_METHODS:
            mode = {"omnireduce": "exact", "sketch": "sketch", "auto": "auto"}[name]
            sketch_allreduce(w, mode=mode, cols=self.sketch_cols, rows=self.sketch_rows, seed=self.spec.seed,
                             exact_collective="allreduce-union" if name == "omnireduce" else "auto")
            s = last_stats()
            return s.wire_bytes, f"{s.method}/{s.exact_collective}" if name == "auto" and s.exact_collective \
                else s.method
        {"dense": lambda: bl.dense_allreduce(w), "fp16": lambda: bl.fp16_allreduce(w),
         "bf16": lambda: bl.bf16_allreduce(w), "agsparse": lambda: bl.agsparse_allreduce(w, granularity="row"),
         "topk": lambda: bl.topk_allgather(w, k=self.topk_k),
         "powersgd": lambda: bl.powersgd_allreduce(self.powersgd, w)}[name]()
        s = bl.last_baseline_stats()
        return s.wire_bytes, s.method


def _timed_call(g, name, config, device):
    """One call of `name` on a fresh copy of the gradient, all ranks started together: (seconds, bytes the
    interface sent, wire bytes model, what ran)."""
    g.work.copy_(g.grad)
    for residual in g.powersgd.error_dict.values():
        residual.zero_()
    with together(device) as watch:
        tx0 = tx_counter(config["measure_tx"])
        wire_bytes, ran = g.call(name)
    return watch.seconds, tx_counter(config["measure_tx"]) - tx0, wire_bytes, ran


def _bench_density(config, density, world, rank, device, bar):
    from fastdist.comm.sketch import EXACT_EXPLORE_CALLS

    g = _Gradient(config, density, world, rank, device)
    methods = config["methods"]
    if "powersgd" in methods:  # torch's hook all-reduces densely for its first start_powerSGD_iter calls
        while g.powersgd.iter < g.powersgd.start_powerSGD_iter:
            g.work.copy_(g.grad)
            g.call("powersgd")
    # auto times both exact collectives on its first calls at a new size: kept apart from its repetitions
    explore = [_timed_call(g, "auto", config, device)[0] for _ in range(EXACT_EXPLORE_CALLS)] \
        if "auto" in methods else []
    calls = {m: [] for m in methods}  # per timed call: seconds, bytes sent, wire bytes model, error, what ran
    for _, name, timed in rounds(methods, config["warmup"], config["reps"], f"{density * 100:g}%", bar=bar):
        dt, sent, wire_bytes, ran = _timed_call(g, name, config, device)
        if timed:
            calls[name].append((dt, sent, wire_bytes, g.error(g.work), ran))
    rows = []
    nbytes = g.grad.numel() * g.grad.element_size()
    for name in methods:
        seconds, sent, wire, errors, ran = zip(*calls[name])
        # a call lasts until its slowest rank is done; the bytes and the error are the busiest and worst rank's
        times, tx_max, wire_max, err_max = (all_max(list(v), device) for v in (seconds, sent, wire, errors))
        t = statistics.median(times)
        rows.append({
            "method": name, "density": density, "local_rows": g.local_rows, "union_rows": g.union_rows,
            "density_union": g.union_rows / config["rows"], "time_ms": t * 1e3,
            "samples_ms": [s * 1e3 for s in times], "wire_bytes": statistics.median(wire_max),
            "tx_bytes": statistics.median(tx_max) if config["measure_tx"] else None,
            "tx_samples": tx_max if config["measure_tx"] else None,
            "rel_error": statistics.median(err_max), "error_samples": err_max,
            "algbw": nbytes / t / 1e9, "size": nbytes, "ran": sorted(set(ran)),
            "sketch_shape": [g.sketch_rows, g.sketch_cols] if name in ("sketch", "auto") else None,
            "topk_k": g.topk_k if name == "topk" else None,
            "explore_ms": statistics.median(all_max(explore, device)) * 1e3 if name == "auto" and explore else None,
        })
    report.set_speedups(rows, "dense")
    gradient = {"density": density, "local_rows": g.local_rows, "union_rows": g.union_rows,
                "union_density": g.union_rows / config["rows"], "union_values": g.union_rows * config["dim"],
                "sketch_shape": [g.sketch_rows, g.sketch_cols], "topk_k": g.topk_k, "bytes": nbytes}
    del g
    return rows, gradient


DDP_BAG = 8  # ids per bag


def _ddp_batch(config, rank, step):
    """Rank `rank`'s bags at `step`: its distinct Zipf-drawn rows (fastdist.testing.synthetic) in a shuffled order,
    DDP_BAG per bag, and regression targets."""
    from fastdist.testing import synthetic
    rows, dim = config["ddp_table"]
    spec = synthetic.GradientSpec(rows=rows, dim=dim, density=config["ddp_density"], exponent=config["zipf"],
                                  seed=config["seed"])
    ids = synthetic.zipf_rows(spec, rank, step)
    g = torch.Generator().manual_seed(config["seed"] * 1000003 + step * 1009 + rank)
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    offsets = torch.arange(0, ids.numel(), DDP_BAG)
    return ids, offsets, torch.randn(offsets.numel(), generator=g)


def _ddp_method(name, config):
    """(DDP model, optimizer, hook state or None) of part ddp's method `name`, from the same initial weights (seed)
    as every other."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from fastdist.comm.hooks import SketchState, sketch_hook
    from fastdist.testing.models import BagModel

    torch.manual_seed(config["seed"])
    model, state = ddp_sparse(BagModel(*config["ddp_table"])), None
    if name != "ddp-sparse":
        state = SketchState(mode="auto", seed=config["seed"], background=name == "auto-bg",
                            dense_hook=None if name == "auto-nodh" else allreduce_hook)
        model.register_comm_hook(state, sketch_hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), state


def _ddp_step(model, opt, batches):
    """One training step of `model` on the next of `batches` (made before the timing)."""
    def call():
        ids, offsets, target = next(batches)
        opt.zero_grad(set_to_none=True)
        (model(ids, offsets) - target).square().mean().backward()
        opt.step()
    return call


def _bench_ddp(config, rank, device):
    """Part ddp on this rank: rows of (method, step time, parameter difference from ddp-sparse) on rank 0."""
    methods = config["ddp_methods"]
    built = {name: _ddp_method(name, config) for name in methods}
    steps = [_ddp_batch(config, rank, it) for it in range(config["warmup"] + config["reps"])]
    calls = {name: _ddp_step(*built[name][:2], iter(steps)) for name in methods}
    samples = time_interleaved(calls, config["warmup"], config["reps"], "sparse ddp", device=device)
    params = {name: torch.cat([p.detach().flatten() for p in built[name][0].parameters()]) for name in methods}
    reference = params[methods[0]]
    rows = []
    for name in methods:
        times = samples[name]
        rows.append({"method": name, "time_ms": statistics.median(times) * 1e3,
                     "samples_ms": [t * 1e3 for t in times],
                     "param_diff": float((params[name] - reference).abs().max()),
                     "methods": [] if built[name][2] is None else
                     [b["last_method"] for b in built[name][2].stats().values()]})
    if "ddp-sparse" in methods:
        report.set_speedups(rows, "ddp-sparse", "vs_ddp_sparse")
        for r in rows:
            r["ratio"] = r["time_ms"] / next(q["time_ms"] for q in rows if q["method"] == "ddp-sparse")
    del built, params
    gc.collect()  # DDP's and gloo's threads gone before the process group is destroyed
    return rows


def bench_rank(config: dict) -> Any:
    """Runs the asked parts on this rank; returns (rows, gradients, ddp rows) on rank 0, None elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    rows, gradients, ddp_rows = [], [], []
    if "collectives" in config["parts"]:
        steps = len(config["densities"]) * (config["warmup"] + config["reps"]) * len(config["methods"])
        bar = progress(steps, "sparse", enabled=rank == 0)
        for density in config["densities"]:
            r, g = _bench_density(config, density, world, rank, device, bar)
            rows += r
            gradients.append(g)
    if "ddp" in config["parts"]:
        pin_local_rank(device)
        ddp_rows = _bench_ddp(config, rank, device)
    return (rows, gradients, ddp_rows) if rank == 0 else None


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and table on the printing rank; returns the JSON payload."""
    result = run_suite("sparse", args, bench_rank, _config_from(args), _collect, tables)
    if result is not None and result["rows"]:
        bad = [f"{r['method']}@{r['density'] * 100:g}%" for r in result["rows"]
               if r["method"] in LOSSLESS and r["rel_error"] != 0]
        print("# lossless methods (dense, agsparse, omnireduce) exact: " + ("yes" if not bad else f"NO: {bad}"))
    return result


def _collect(out: tuple, config: dict, launch: Any) -> dict:
    rows, gradients, ddp_rows = out
    return {"gradients": gradients, "rows": rows, "ddp_rows": ddp_rows, "load_average": list(os.getloadavg())}


def _note(r):
    notes = []
    if r["method"] == "auto":
        notes.append("chose " + ", ".join(r["ran"]))
        if r.get("explore_ms") is not None:
            notes.append(f"explored {r['explore_ms']:.0f} ms")
    if r.get("sketch_shape"):
        notes.append("x".join(map(str, r["sketch_shape"])))
    if r.get("topk_k"):
        notes.append(f"k={r['topk_k']}")
    return ", ".join(notes)


def tables(result: dict) -> list[report.Part]:
    """The suite's table of `result` (its JSON payload), printed by `run` and shown in the docs."""
    c = result["config"]
    size = c.get("sketch_size", c.get("sketch_ratio"))  # recordings before --sketch-size have a per-row ratio
    sizing = (f"{c['sketch_rows']} rows holding {size} x the union's values in all" if "sketch_size" in c
              else f"{c['sketch_rows']} rows of {size} x the union's values each")
    caption = (f"Gradient {c['rows']} x {c['dim']} float32, Zipf({c['zipf']}) rows, seed {c['seed']}; sketch "
               f"{sizing}; PowerSGD rank {c['powersgd_rank']}; median of {c['reps']} after {c['warmup']} warm-up.")
    columns = [col("method", "method"), col("rows, local (%)", "density", percent(1)),
               col("union (%)", "density_union", percent(2)), col("time (ms)", "time_ms", fixed(1)),
               col("vs dense", "speedup", times(2)), col("wire (MiB/rank)", "wire_bytes", scaled(MIB, 2)),
               col("tx (MiB/rank)", "tx_bytes", scaled(MIB, 2)), col("rel. error", "rel_error", scientific(2)),
               col("eff. algbw (GB/s)", "algbw", fixed(3)), col("note", _note, numeric=False)]
    parts = [report.Part("sparse", columns, result["rows"], caption)] if result["rows"] else []
    if result.get("ddp_rows"):
        rows_, dim = c["ddp_table"]
        load = result.get("load_average")
        caption = (f"DDP steps: EmbeddingBag({rows_}, {dim}, sparse=True) + MLP head, {c['ddp_density'] * 100:g}% "
                   f"of the rows per rank per step, Zipf({c['zipf']}); median of {c['reps']} steps after "
                   f"{c['warmup']} warm-up, interleaved" + (f"; load average {load[0]:.1f} at the end" if load else ""))
        ddp_columns = [col("method", "method"), col("step (ms)", "time_ms", fixed(1)),
                       col("time / ddp-sparse", "ratio", fixed(3)), col("vs ddp-sparse", "vs_ddp_sparse", times(2)),
                       col("max. param. diff. vs ddp-sparse", "param_diff", scientific(1)),
                       col("buckets went", lambda r: ", ".join(sorted(set(r["methods"]))) or "-", numeric=False)]
        parts.append(report.Part("sparse-ddp", ddp_columns, result["ddp_rows"], caption))
    return parts


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    rows, config, env = result["rows"], result["config"], result["env"]
    if not rows:  # part ddp alone: its step times
        _, fig, ax = report.subplots(1, 1, figsize=(6, 4))
        ddp = result["ddp_rows"]
        report.grouped_bars(ax, [r["method"] for r in ddp], {None: [r["time_ms"] for r in ddp]},
                            "step time (ms, median)")
        report.save_figure(fig, path, f"fastdist-bench sparse, part ddp: {env['ranks']} ranks, {env['network']}")
        return
    methods, densities = config["methods"], config["densities"]
    row = {(r["method"], r["density"]): r for r in rows}
    union = {g["density"]: g["union_density"] for g in result["gradients"]}
    plt, fig, (ax_t, ax_e) = report.subplots(1, 2, figsize=(13, 5))
    report.grouped_bars(ax_t, [f"{d * 100:g}% rows/rank\nunion {union[d] * 100:.1f}%" for d in densities],
                        {m: [row[m, d]["time_ms"] for d in densities] for m in methods},
                        "time per call (ms, median; log scale)")
    ax_t.set_yscale("log")
    lo, hi = min(r["time_ms"] for r in rows), max(r["time_ms"] for r in rows)
    ax_t.set_ylim(lo / 2, hi * 8)  # room above the bars for the legend
    ax_t.grid(True, axis="y", which="both", alpha=0.3)
    ax_t.legend(fontsize=8, ncol=4, loc="upper center")
    cmap, markers = plt.get_cmap("tab10"), "osD^v<>"
    for i, m in enumerate(methods):
        for j, d in enumerate(densities):
            ax_e.scatter(row[m, d]["wire_bytes"], row[m, d]["rel_error"], color=cmap(i % 10),
                         marker=markers[j % len(markers)], label=m if j == 0 else None, s=40)
    for j, d in enumerate(densities):
        ax_e.scatter([], [], facecolors="none", edgecolors="black", marker=markers[j % len(markers)],
                     label=f"{d * 100:g}% rows")
    ax_e.set(xscale="log", xlabel="wire bytes per rank (model)", ylabel="relative L2 error ||g' - g|| / ||g||")
    ax_e.grid(True, which="both", alpha=0.3)
    ax_e.legend(fontsize=7, ncol=2)
    rows_, dim = config["rows"], config["dim"]
    report.save_figure(fig, path, f"fastdist-bench sparse: {rows_} x {dim} float32, {env['ranks']} ranks, "
                       f"{env['backend']}, {env['network']}")
