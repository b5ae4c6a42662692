"""`fastdist-bench tp`: tensor-parallel linears and GPT blocks with overlapped communication vs sequential.

Two ranks (--ranks), each pinned to its own core with one torch thread (every thread of the rank, gloo's
included), on a simulated cluster. The link rate is chosen so that communication takes as long as computation
(measured here first, on one core; the rates are printed), then 10x that (--rate-multipliers): for the row op,
the ring all-reduce of its output against its GEMM; for the block, its 4 all-reduces per step against the
single-process block's forward + backward divided by the ranks. Each (part, rate) is its own run on its own
simulated cluster. Per rate, one run, every variant interleaved (the order shuffled every repetition, the same
on every rank), warm-up first, median of --op-reps (op) or --reps (block) of the slowest rank's time:

  row op      RowParallelLinear forward on [M, K] x [K, N] (--op-shape M,K,N, full K), overlap_chunks
              k = 1 (sequential: GEMM, then all-reduce), 2, 4, 8 and auto (a CostModel calibrated in the run
              on this shape); beside each, the cost model's predicted T(k) and its error. Also timed, in the
              same interleaving: the k = 1 and k = 8 GEMMs alone, without the collective, so that a gain that
              comes from chunking the GEMM (cache effects on a CPU) is told apart from overlap.
  GPT block   forward + backward of one block (--block hidden,heads,seq,batch): Megatron-style (parallelize,
              k = 1: each all-reduce blocks), chunked (parallelize, k = auto), and the Oases schedule
              (OverlappedTransformerBlock: two sub-batches, one collective in flight), each without and with
              recompute (Megatron and chunked: torch.utils.checkpoint of the block; Oases: its own recompute,
              which keeps the reduced outputs).

Speed-ups are against k = 1 (op) and the Megatron-style block with the same recompute setting. Without root
(no simulated cluster) it runs on loopback and says so.
"""
from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastdist import netsim
from fastdist.bench import report
from fastdist.bench.report import col, fixed, percent, times
from fastdist.bench.launch import add_launch_arguments, pin_to_core, run_ranks
from fastdist.bench.toolkit import (all_max, at_least, comma_list, interleave, progress, shape_type, time_fn,
                                     together, up_to)

OP_KS = [1, 2, 4, 8, "auto"]
GEMM_ONLY_KS = [1, 8]
BLOCK_VARIANTS = ["megatron", "chunked", "oases", "megatron+recompute", "chunked+recompute", "oases+recompute"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=1800.0)  # one core per rank
    p.set_defaults(ranks=2, net="auto")
    p.add_argument("--rate-multipliers", type=comma_list(up_to(math.inf)), default="1,10",
                   help="with --net auto: links at these multiples of the rate where all-reduce time = GEMM time")
    p.add_argument("--op-shape", type=shape_type(3), default="2048,2048,1024",
                   help="row op M,K,N (full K; default 2048,2048,1024)")
    p.add_argument("--block", type=shape_type(4), default="768,12,128,8",
                   help="GPT block hidden,heads,seq,batch (default 768,12,128,8)")
    p.add_argument("--reps", type=at_least(1), default=15, help="timed repetitions per block variant, >= 5 for a claim")
    p.add_argument("--op-reps", type=at_least(1), default=45,
                   help="timed repetitions per row-op variant (cheap, and its k = 1 vs auto comparison is a few %%)")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed repetitions of every variant first")
    p.add_argument("--skip-block", action="store_true", help="only the row-parallel op")
    p.add_argument("--gemm-check", type=shape_type(3), metavar="M,K,N", default=None,
                   help="only measure what splitting one GEMM into 2, 4, 8 row chunks costs on this process's "
                        "device (CUDA: bf16, events, L2 flushed; CPU: fp32), e.g. 8192,8192,8192")


# --- one rank --------------------------------------------------------------------------------------

def _interleaved(variants, reps, warmup, bar, label):
    """{name: [seconds per rep]} of the slowest rank; `variants` maps name -> callable."""
    names = list(variants)
    samples = {n: [] for n in names}
    for it in range(warmup + reps):
        # A fresh order every repetition (the same on every rank): a variant's time depends a little on what ran
        # before it, and a fixed rotation would give each variant the same predecessor every time.
        order = random.Random(it).sample(names, len(names))
        for name in order:
            with together() as watch:
                variants[name]()
            if it >= warmup:
                samples[name].append(watch.seconds)
            bar.step(f"{label} {name}")
    slowest = all_max([t for n in names for t in samples[n]])  # a step lasts until its slowest rank is done
    return {n: slowest[i * reps:(i + 1) * reps] for i, n in enumerate(names)}


def _op_variants(config, model):
    from fastdist.tp import RowParallelLinear, chunk_bounds

    m, k_full, n = config["op_shape"]
    torch.manual_seed(0)
    full = torch.nn.Linear(k_full, n)
    layers = {k: RowParallelLinear.from_linear(full, None, overlap_chunks=k,
                                               cost_model=model if k == "auto" else None) for k in OP_KS}
    x = torch.randn(m, layers[1].in_per_rank)

    def forward_of(layer):
        def call():
            with torch.no_grad():
                layer(x)
        return call

    out = torch.empty(m, n)
    weight_t = layers[1].weight.detach().t()

    def gemm_only(k):
        # The same chunked GEMMs into the preallocated output, no collective: what chunking does to the GEMM alone.
        def call():
            for start, stop in chunk_bounds(m, k):
                torch.matmul(x[start:stop], weight_t, out=out[start:stop])
        return call

    variants = {f"k={k}": forward_of(layer) for k, layer in layers.items()}
    variants.update({f"gemm k={k}": gemm_only(k) for k in GEMM_ONLY_KS})
    return variants, layers["auto"].chunks_for(m)


def _block_variants(config, model):
    import copy

    from torch.utils.checkpoint import checkpoint

    from fastdist.tp import GPTBlock, OverlappedTransformerBlock, parallelize

    hidden, heads, seq, batch = config["block"]
    torch.manual_seed(1)
    ref = GPTBlock(hidden, heads)
    x = torch.randn(batch, seq, hidden)
    megatron = parallelize(copy.deepcopy(ref), None, overlap_chunks=1)
    chunked = parallelize(copy.deepcopy(ref), None, overlap_chunks="auto", cost_model=model)
    oases = OverlappedTransformerBlock.from_block(ref, None, recompute=False)
    oases_recompute = OverlappedTransformerBlock.from_block(ref, None, recompute=True)

    def step(block, checkpointed):
        def call():
            xs = x.detach().requires_grad_()
            y = checkpoint(block, xs, use_reentrant=False) if checkpointed else block(xs)
            y.sum().backward()
        return call

    return {"megatron": step(megatron, False), "chunked": step(chunked, False), "oases": step(oases, False),
            "megatron+recompute": step(megatron, True), "chunked+recompute": step(chunked, True),
            "oases+recompute": step(oases_recompute, False)}


def bench_rank(config: dict) -> Any:
    """Runs the suite's measurements on this rank (a collective); returns the results on rank 0, None elsewhere."""
    from fastdist.tp import CostModel, TPOp

    rank, world = dist.get_rank(), dist.get_world_size()
    core = pin_to_core(rank)
    m, k_full, n = config["op_shape"]
    k_local = k_full // world
    model = CostModel.calibrate(None, shapes=((m, k_local, n),), reps=5)
    per_rep = len(OP_KS) + len(GEMM_ONLY_KS) if config["part"] == "op" else len(BLOCK_VARIANTS)
    reps = config["op_reps"] if config["part"] == "op" else config["reps"]
    steps = (config["warmup"] + reps) * per_rep
    bar = progress(steps, f"tp {config['part']} {config['label']}", enabled=rank == 0)
    op_rows, block_rows, gemm_rows = [], [], []
    if config["part"] == "op":
        variants, auto_k = _op_variants(config, model)
        op_samples = _interleaved(variants, reps, config["warmup"], bar, "op")
        for k in OP_KS:
            kk = auto_k if k == "auto" else k
            op_rows.append({"k": str(k), "chunks": kk, "samples_ms": [s * 1e3 for s in op_samples[f"k={k}"]],
                            "time_ms": statistics.median(op_samples[f"k={k}"]) * 1e3,
                            "predicted_ms": model.predict(TPOp("row", m, k_local, n, world), kk) * 1e3})
        gemm_rows = [{"k": k, "samples_ms": [s * 1e3 for s in op_samples[f"gemm k={k}"]],
                      "time_ms": statistics.median(op_samples[f"gemm k={k}"]) * 1e3} for k in GEMM_ONLY_KS]
    else:
        block_samples = _interleaved(_block_variants(config, model), reps, config["warmup"], bar,
                                     "block")
        for name in BLOCK_VARIANTS:
            block_rows.append({"variant": name, "samples_ms": [s * 1e3 for s in block_samples[name]],
                               "time_ms": statistics.median(block_samples[name]) * 1e3})
    lone_gemm = model.gemm_time(m, k_local, n)
    lone_comm = model.allreduce_time(m * n * 4, world)
    result = {"op_rows": op_rows, "gemm_rows": gemm_rows, "block_rows": block_rows, "core": core,
              "cost_model": model.state_dict(),
              "cost_model_repr": repr(model), "gemm_ms": lone_gemm * 1e3, "allreduce_ms": lone_comm * 1e3,
              "calibration": model.samples}
    return result if rank == 0 else None


# --- driver ----------------------------------------------------------------------------------------

def op_balanced_rate(op_shape: Sequence[int], world: int) -> tuple[float, float]:
    """(bit/s, GEMM s): the link rate at which the ring all-reduce of the row op's float32 output takes as long
    as its GEMM on one core: 2 (t - 1) / t * M * N * 4 bytes over the GEMM time."""
    m, k_full, n = op_shape
    x, w = torch.randn(m, k_full // world), torch.randn(n, k_full // world)
    with report.torch_threads(1):
        gemm_s = time_fn(lambda: x @ w.t(), reps=5, warmup=2).median
    return 8 * 2 * (world - 1) / world * m * n * 4 / gemm_s, gemm_s


def block_balanced_rate(block: Sequence[int], world: int) -> tuple[float, float]:
    """(bit/s, compute s): the rate at which a block step's 4 all-reduces of [batch * seq, hidden] float32 take as
    long as its compute, estimated as the single-process block's forward + backward on one core over t."""
    from fastdist.tp import GPTBlock

    hidden, heads, seq, batch = block
    torch.manual_seed(0)
    ref = GPTBlock(hidden, heads)
    x = torch.randn(batch, seq, hidden)
    with report.torch_threads(1):
        compute_s = time_fn(lambda: ref(x.requires_grad_()).sum().backward(), reps=3, warmup=2).median / world
    wire = 4 * 2 * (world - 1) / world * batch * seq * hidden * 4
    return 8 * wire / compute_s, compute_s


def chunked_gemm_cost(shape: Sequence[int], reps: int = 7, warmup: int = 2,
                      device: torch.device | str | None = None) -> dict:
    """Median time of one [M, K] x [K, N] GEMM and of the same GEMM as k = 2, 4, 8 row chunks written into one
    preallocated output (the chunked linears' GEMMs), on `device` (default: CUDA when available, bf16 there;
    CPU fp32 otherwise). CUDA: events, 256 MiB written between samples to flush L2. Rows: k, ms, overhead."""
    from fastdist.tp import chunk_bounds

    m, k_in, n = shape
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k_in, generator=g).to(device, dtype)
    w = torch.randn(k_in, n, generator=g).to(device, dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def gemm(chunks):
        for start, stop in chunk_bounds(m, chunks):
            torch.matmul(x[start:stop], w, out=out[start:stop])

    def sample(chunks):
        if device.type == "cuda":
            flush.fill_(1)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            gemm(chunks)
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        gemm(chunks)
        return time.perf_counter() - t0

    ks = [1, 2, 4, 8]
    samples = {k: [] for k in ks}
    for it, k, _ in interleave(ks, warmup, reps):
        t = sample(k)
        if it >= warmup:
            samples[k].append(t)
    base = statistics.median(samples[1])
    return {"device": str(device), "dtype": str(dtype), "shape": list(shape),
            "rows": [{"k": k, "time_ms": statistics.median(samples[k]) * 1e3,
                      "samples_ms": [t * 1e3 for t in samples[k]],
                      "overhead_pct": (statistics.median(samples[k]) / base - 1) * 100} for k in ks]}


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and tables on the printing rank; returns the JSON payload (None on the
    other torchrun ranks)."""
    if args.gemm_check:
        result = chunked_gemm_cost(args.gemm_check, reps=args.reps, warmup=args.warmup)
        print(f"# chunked GEMM {result['shape']} {result['dtype']} on {result['device']} (median of {args.reps})")
        print(report.format_table(["chunks", "time(ms)", "vs one GEMM"],
                                  [[r["k"], r["time_ms"], f"{r['overhead_pct']:+.1f}%"] for r in result["rows"]]))
        return {"suite": "tp", "gemm_check": result, "runs": []}
    op_shape, block, world = args.op_shape, args.block, args.ranks
    if op_shape[1] % world or block[1] % world or block[0] % block[1] or block[3] < 2:
        raise SystemExit("fastdist-bench tp: K, heads must divide by --ranks; hidden by heads; block batch >= 2")
    parts = ["op"] + ([] if args.skip_block else ["block"])
    plan = []  # (part, label, net)
    if args.net == "auto":
        op_rate, gemm_s = op_balanced_rate(op_shape, world)
        print(f"# op balanced rate {netsim.format_rate(op_rate)}: the all-reduce of the {op_shape[0]}x{op_shape[2]} "
              f"float32 output takes as long as its GEMM ({gemm_s * 1e3:.2f} ms on one core)")
        rates = {"op": op_rate}
        if "block" in parts:
            block_rate, compute_s = block_balanced_rate(block, world)
            print(f"# block balanced rate {netsim.format_rate(block_rate)}: 4 all-reduces of the block's activation "
                  f"take as long as its compute ({compute_s * 1e3:.1f} ms fwd+bwd per rank on one core)")
            rates["block"] = block_rate
        for part in parts:
            for mult in args.rate_multipliers:
                plan.append((part, f"{mult:g}x balanced", f"{max(int(rates[part] * mult / 1e6), 1)}mbit"))
    else:
        plan = [(part, args.net, args.net) for part in parts]
    runs = []
    env = None
    for part, label, net in plan:
        config = {"op_shape": op_shape, "block": block, "reps": args.reps, "op_reps": args.op_reps,
                  "warmup": args.warmup, "part": part,
                  "label": label}
        launch = run_ranks(bench_rank, config, ranks=world, net=net, delay=args.delay, timeout=args.timeout,
                           backend="gloo")
        if launch.result is None:
            return None
        env = env or report.environment(backend=launch.backend, device="cpu", ranks=launch.world,
                                        network=launch.network)
        runs.append({"part": part, "label": label, "net": net, "network": launch.network,
                     "link_gbps": launch.link_gbps, **launch.result})
    env["network"] = "; ".join(sorted({r["network"] for r in runs}))
    print(report.format_environment(env))
    print(f"# ranks pinned to one core each, 1 torch thread; medians of {args.op_reps} (row op) and {args.reps} "
          f"(block) interleaved repetitions")
    result = {"suite": "tp", "env": env, "op_shape": op_shape, "block": block, "reps": args.reps,
              "op_reps": args.op_reps, "runs": runs}
    for r in runs:
        if r["op_rows"]:
            print(f"# {r['label']}: {r['cost_model_repr']}; op GEMM {r['gemm_ms']:.2f} ms, all-reduce "
                  f"{r['allreduce_ms']:.2f} ms (cost model)")
    print(report.text_parts(tables(result)))
    return result


def _network_rate(net: str) -> str:
    m = re.search(r"([\d.]+ [MG]bit/s)", net or "")
    return m.group(1) if m else (net or "-")


def tables(result: dict) -> list[report.Part]:
    """The row op's and the GPT block's table per network of `result` (its JSON payload), printed by `run` and
    shown in the docs."""
    parts = []
    for run in result["runs"]:
        where = f"{run['label']}, {_network_rate(run['network'])}"
        if run.get("op_rows"):
            base = run["op_rows"][0]["time_ms"]
            columns = [col("chunks k", lambda r: f"{r['k']} ({r['chunks']})" if r["k"] == "auto" else r["k"],
                           numeric=False),
                       col("time (ms)", "time_ms", fixed(1)),
                       col("vs k=1", lambda r, base=base: base / r["time_ms"], times(2)),
                       col("predicted (ms)", "predicted_ms", fixed(1)),
                       col("model error (%)", lambda r: r["predicted_ms"] / r["time_ms"] - 1, percent(0, signed=True))]
            gemm = ", ".join(f"k={g['k']} {g['time_ms']:.1f} ms" for g in run.get("gemm_rows") or [])
            shape = "x".join(map(str, result["op_shape"]))
            parts.append(report.Part(f"op-{run['net']}", columns, run["op_rows"],
                                     f"Row-parallel op {shape}, {where}; median of {result['op_reps']}.",
                                     [f"the GEMMs alone (no collective): {gemm}"] if gemm else []))
        if run.get("block_rows"):
            by_variant = {r["variant"]: r["time_ms"] for r in run["block_rows"]}

            def vs_megatron(r: dict, by_variant: dict = by_variant) -> float:
                return by_variant["megatron+recompute" if "+" in r["variant"] else "megatron"] / r["time_ms"]

            columns = [col("GPT block", "variant"), col("fwd+bwd (ms)", "time_ms", fixed(1)),
                       col("vs Megatron", vs_megatron, times(2))]
            shape = ", ".join(f"{k} {v}" for k, v in zip(("hidden", "heads", "seq", "batch"), result["block"]))
            parts.append(report.Part(f"block-{run['net']}", columns, run["block_rows"],
                                     f"GPT block ({shape}), {where}; median of {result['reps']}; +recompute rows "
                                     "against Megatron with checkpointing."))
    return parts


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    if not result["runs"]:
        raise SystemExit("fastdist-bench tp: --gemm-check has no plot; use --json")
    op_runs = [r for r in result["runs"] if r["op_rows"]]
    block_runs = [r for r in result["runs"] if r["block_rows"]]
    _, fig, axes = report.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    runs = op_runs
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(r["op_rows"]))]
        ax.bar(xs, [row["time_ms"] for row in r["op_rows"]], width, label=f"{r['label']} ({r['net']}) measured")
        ax.scatter(xs, [row["predicted_ms"] for row in r["op_rows"]], color="black", marker="_", s=200,
                   label="predicted" if i == 0 else None, zorder=3)
    ax.set_xticks(range(len(runs[0]["op_rows"])))
    ax.set_xticklabels([f"k={row['k']}" for row in runs[0]["op_rows"]])
    m, k, n = result["op_shape"]
    ax.set_ylabel("row-parallel forward (ms, median)")
    ax.set_title(f"row op {m}x{k}x{n} fp32", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    runs = block_runs
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(r["block_rows"]))]
        ax.bar(xs, [row["time_ms"] for row in r["block_rows"]], width, label=f"{r['label']} ({r['net']})")
    ax.set_xticks(range(len(BLOCK_VARIANTS)))
    ax.set_xticklabels(BLOCK_VARIANTS, rotation=20, fontsize=8)
    ax.set_ylabel("GPT block fwd+bwd (ms, median)")
    h, heads, seq, batch = result["block"]
    ax.set_title(f"block hidden {h}, {heads} heads, seq {seq}, batch {batch}", fontsize=9)
    ax.legend(fontsize=8)
    env = result["env"]
    kind = "simulated links" if any(r["link_gbps"] for r in result["runs"]) else "loopback"
    fig.suptitle(f"fastdist-bench tp: {env['ranks']} ranks, one core each, {kind}",
                 fontsize=9)
    report.save_figure(fig, path)
