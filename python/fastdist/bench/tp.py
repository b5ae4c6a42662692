"""`fastdist-bench tp`: tensor-parallel linears and GPT blocks with overlapped communication vs sequential.

Two ranks, each pinned to its own core with one torch thread (gloo's threads included), on a simulated cluster
whose link rate makes communication take as long as computation (measured here first, on one core), then 10x that
(--rate-multipliers); each (part, rate) is its own run. Every variant runs interleaved (the order shuffled every
repetition, the same on every rank), warm-up first, median of the slowest rank's time:

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
  MLP         forward + backward of a column -> row MLP (--mlp tokens,hidden,ffn; GeLU): Megatron-style (k = 1)
              and chunked (auto) fastdist linears.

The peer a user would pick instead runs in the same interleaving on the same weights and inputs: torch's DTensor
tensor parallelism (parallelize_module with ColwiseParallel / RowwiseParallel, `peers.dtensor_parallel`). Before
timing, every variant's output (and input gradient) is checked against the unsharded module; one off by more than
CHECK_TOLERANCE stops the run. Speed-ups are against k = 1 (op) and Megatron-style with the same recompute
setting. Without root it runs on loopback and says so.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastdist import netsim
from fastdist.bench import peers, report
from fastdist.bench.report import col, fixed, integer, percent, times
from fastdist.bench.launch import add_launch_arguments, pin_to_core, run_ranks
from fastdist.bench.toolkit import (at_least, comma_list, relative_error, shape_type, time_fn, time_interleaved, up_to,
                                     worst_errors)
from fastdist.comm.wire import ring_allreduce_bytes

OP_KS = [1, 2, 4, 8, "auto"]
GEMM_ONLY_KS = [1, 8]
OP_PEER = "dtensor"
"""The row op's DTensor row: a RowwiseParallel linear, timed beside the k values."""
MLP_VARIANTS = ["megatron", "chunked", "dtensor"]
BLOCK_VARIANTS = ["megatron", "chunked", "oases", "dtensor", "megatron+recompute", "chunked+recompute",
                  "oases+recompute", "dtensor+recompute"]
PARTS = ["op", "mlp", "block"]
CHECK_TOLERANCE = 1e-4
"""Largest |variant - unsharded| over the unsharded result's largest |value| that a variant may show (float32)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=1800.0, net_default="auto",  # one core per rank
                         net_words={"auto": "links at --rate-multipliers of the balanced rate, measured first"})
    p.set_defaults(ranks=2)
    p.add_argument("--rate-multipliers", type=comma_list(up_to(math.inf)), default="1,10",
                   help="with --net auto: links at these multiples of the rate where all-reduce time = GEMM time")
    p.add_argument("--op-shape", type=shape_type(3), default="2048,2048,1024",
                   help="row op M,K,N (full K; default 2048,2048,1024)")
    p.add_argument("--block", type=shape_type(4), default="768,12,128,8",
                   help="GPT block hidden,heads,seq,batch (default 768,12,128,8)")
    p.add_argument("--mlp", type=shape_type(3), default="1024,512,2048",
                   help="column -> row MLP tokens,hidden,ffn (default 1024,512,2048)")
    p.add_argument("--parts", type=comma_list(choices=PARTS), default=",".join(PARTS),
                   help="which parts to run, a comma list of " + ",".join(PARTS) + " (default all)")
    p.add_argument("--reps", type=at_least(1), default=15, help="timed repetitions per block variant, >= 5 for a claim")
    p.add_argument("--op-reps", type=at_least(1), default=45,
                   help="timed repetitions per row-op variant (cheap, and its k = 1 vs auto comparison is a few %%)")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed repetitions of every variant first")
    p.add_argument("--gemm-check", type=shape_type(3), metavar="M,K,N", default=None,
                   help="only measure what splitting one GEMM into 2, 4, 8 row chunks costs on this process's "
                        "device (CUDA: bf16, events, L2 flushed; CPU: fp32), e.g. 8192,8192,8192")


def check_against(reference: Sequence[torch.Tensor], outputs: dict[str, Sequence[torch.Tensor]]) -> dict[str, float]:
    """{name: largest relative error over the ranks} of each variant's tensors against the reference's (the same
    tuple of tensors: output, then input gradient); raises on every rank when one is off by more than
    CHECK_TOLERANCE."""
    mine = {n: max(relative_error(g, w) for g, w in zip(out, reference)) for n, out in outputs.items()}
    return worst_errors(mine, CHECK_TOLERANCE, "tp outputs differ from the unsharded module's")


def _op_variants(config, model, mesh):
    from fastdist.tp import RowParallelLinear, chunk_bounds

    m, k_full, n = config["op_shape"]
    torch.manual_seed(0)
    full = torch.nn.Linear(k_full, n)
    layers = {k: RowParallelLinear.from_linear(full, None, overlap_chunks=k,
                                               cost_model=model if k == "auto" else None) for k in OP_KS}
    x = torch.randn(m, layers[1].in_per_rank)  # the same on every rank: the full input is it repeated t times
    peer = peers.dtensor_parallel(copy.deepcopy(full), {"": "rowwise"}, mesh)

    def forward_of(layer):
        def call():
            with torch.no_grad():
                return peers.ready(layer(x))
        return call

    out = torch.empty(m, n)
    weight_t = layers[1].weight.detach().t()

    def gemm_only(k):
        # The same chunked GEMMs into the preallocated output, no collective: what chunking does to the GEMM alone.
        def call():
            for start, stop in chunk_bounds(m, k):
                torch.matmul(x[start:stop], weight_t, out=out[start:stop])
        return call

    variants = {str(k): forward_of(layer) for k, layer in layers.items()}
    variants[OP_PEER] = forward_of(peer)
    with torch.no_grad():
        reference = (full(x.repeat(1, dist.get_world_size())),)
    errors = check_against(reference, {name: (call(),) for name, call in variants.items()})
    variants.update({f"gemm k={k}": gemm_only(k) for k in GEMM_ONLY_KS})
    return variants, layers["auto"].chunks_for(m), errors


def training_step(module: torch.nn.Module, x: torch.Tensor, checkpointed: bool = False) -> Callable[[], tuple]:
    """One training step of `module` on `x` (fresh gradients); returns (output, input gradient)."""
    def call():
        module.zero_grad(set_to_none=True)
        xs = x.detach().requires_grad_()
        y = peers.checkpointed(module, xs) if checkpointed else module(xs)
        y.sum().backward()
        return y, peers.ready(xs.grad)
    return call


class _MLP(torch.nn.Module):
    """fc1, GeLU (tanh), fc2: the MLP of a GPT block, as a user writes it."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x), approximate="tanh"))


class _FastdistMLP(torch.nn.Module):
    """`_MLP` as fastdist's column -> row linears (the GeLU fused into the column layer's epilogue)."""

    def __init__(self, mlp, chunks, model):
        super().__init__()
        from fastdist.tp import ColumnParallelLinear, RowParallelLinear

        cost = model if chunks == "auto" else None
        self.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, None, activation="gelu_tanh", overlap_chunks=chunks,
                                                    cost_model=cost)
        self.fc2 = RowParallelLinear.from_linear(mlp.fc2, None, input_is_parallel=True, overlap_chunks=chunks,
                                                 cost_model=cost)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _mlp_variants(config, model, mesh):
    tokens, hidden, ffn = config["mlp"]
    torch.manual_seed(2)
    ref = _MLP(hidden, ffn)
    x = torch.randn(tokens, hidden)
    modules = {"megatron": _FastdistMLP(ref, 1, model), "chunked": _FastdistMLP(ref, "auto", model),
               "dtensor": peers.dtensor_parallel(copy.deepcopy(ref), {"fc1": "colwise", "fc2": "rowwise"}, mesh)}
    variants = {name: training_step(modules[name], x) for name in MLP_VARIANTS}
    errors = check_against(training_step(ref, x)(), {name: call() for name, call in variants.items()})
    return variants, errors, {name: chosen_chunks(modules[name]) for name in ("megatron", "chunked")}


def block_variants(config: dict, model: Any, mesh: Any) -> tuple[dict[str, Callable], dict[str, float], dict]:
    """The GPT-block variants (fastdist.tp's Megatron-style, chunked and Oases, torch DTensor; each also with
    recompute) as step functions on the same weights and input, their errors against the unsharded block, and the
    chunk counts fastdist's layers chose."""
    from fastdist.tp import GPTBlock, OverlappedTransformerBlock, parallelize

    hidden, heads, seq, batch = config["block"]
    torch.manual_seed(1)
    ref = GPTBlock(hidden, heads)
    x = torch.randn(batch, seq, hidden)
    megatron = parallelize(copy.deepcopy(ref), None, overlap_chunks=1)
    chunked = parallelize(copy.deepcopy(ref), None, overlap_chunks="auto", cost_model=model)
    oases = OverlappedTransformerBlock.from_block(ref, None, recompute=False)
    oases_recompute = OverlappedTransformerBlock.from_block(ref, None, recompute=True)
    peer = peers.dtensor_parallel(copy.deepcopy(ref), peers.DTENSOR_GPT_BLOCK_PLAN, mesh)
    variants = {"megatron": training_step(megatron, x), "chunked": training_step(chunked, x),
                "oases": training_step(oases, x), "dtensor": training_step(peer, x),
                "megatron+recompute": training_step(megatron, x, True),
                "chunked+recompute": training_step(chunked, x, True),
                "oases+recompute": training_step(oases_recompute, x), "dtensor+recompute": training_step(peer, x, True)}
    errors = check_against(training_step(ref, x)(), {name: call() for name, call in variants.items()})
    return variants, errors, {"megatron": chosen_chunks(megatron), "chunked": chosen_chunks(chunked)}


def part_shape(config: dict) -> tuple[int, int, int]:
    """The (M, K / t, N) row-parallel GEMM the part's cost model is calibrated on: the row op's, the MLP's fc2 or
    the block's fc2."""
    world = dist.get_world_size()
    if config["part"] == "mlp":
        tokens, hidden, ffn = config["mlp"]
        return tokens, ffn // world, hidden
    if config["part"] == "block":
        hidden, _, seq, batch = config["block"]
        return batch * seq, 4 * hidden // world, hidden
    m, k_full, n = config["op_shape"]
    return m, k_full // world, n


def chosen_chunks(module: torch.nn.Module) -> list[int]:
    """The chunk counts fastdist's linears in `module` used (each layer's, by its row count), in module order."""
    from fastdist.tp import ColumnParallelLinear, RowParallelLinear

    linears = [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    return [k for m in linears for k in m._chunks_by_rows.values()]


def timing_rows(samples: dict[str, list[float]], names: Sequence[str], key: str, errors: dict[str, float],
                chunks: dict | None = None) -> list[dict]:
    """One table row per variant: raw samples and median in ms, its error, its chunk counts."""
    return [{key: name, "samples_ms": [s * 1e3 for s in samples[name]],
             "time_ms": statistics.median(samples[name]) * 1e3, "max_error": errors[name],
             "chunks": (chunks or {}).get(name.split("+")[0])} for name in names]


def bench_rank(config: dict) -> Any:
    """Runs the suite's measurements on this rank (a collective); returns the results on rank 0, None elsewhere."""
    from torch.distributed.device_mesh import init_device_mesh

    from fastdist.tp import CostModel, TPOp

    rank, world = dist.get_rank(), dist.get_world_size()
    core = pin_to_core(rank)
    part = config["part"]
    shape = part_shape(config)
    model = CostModel.calibrate(None, shapes=(shape,), reps=5)
    mesh = init_device_mesh("cpu", (world,))  # over the run's (default, gloo) group, for torch's DTensor TP
    reps = config["op_reps"] if part == "op" else config["reps"]
    op_rows, mlp_rows, block_rows, gemm_rows = [], [], [], []
    if part == "op":
        variants, auto_k, errors = _op_variants(config, model, mesh)
    elif part == "mlp":
        variants, errors, chunks = _mlp_variants(config, model, mesh)
    else:
        variants, errors, chunks = block_variants(config, model, mesh)
    samples = time_interleaved(variants, config["warmup"], reps, f"tp {part} {config['label']}", shuffle=True)
    m, k_local, n = shape
    if part == "op":
        chunks = {str(k): auto_k if k == "auto" else k for k in OP_KS}
        op = TPOp("row", m, k_local, n, world)
        op_rows = [{**r, "predicted_ms": model.predict(op, r["chunks"]) * 1e3 if r["chunks"] else None}
                   for r in timing_rows(samples, [*chunks, OP_PEER], "k", errors, chunks)]
        gemm_rows = [{"k": k, "samples_ms": [s * 1e3 for s in samples[f"gemm k={k}"]],
                      "time_ms": statistics.median(samples[f"gemm k={k}"]) * 1e3} for k in GEMM_ONLY_KS]
    elif part == "mlp":
        mlp_rows = timing_rows(samples, MLP_VARIANTS, "variant", errors, chunks)
    else:
        block_rows = timing_rows(samples, BLOCK_VARIANTS, "variant", errors, chunks)
    result = {"op_rows": op_rows, "gemm_rows": gemm_rows, "mlp_rows": mlp_rows, "block_rows": block_rows,
              "core": core, "calibration_shape": list(shape), "cost_model": model.state_dict(),
              "cost_model_repr": repr(model), "gemm_ms": model.gemm_time(m, k_local, n) * 1e3,
              "allreduce_ms": model.allreduce_time(m * n * 4, world) * 1e3, "calibration": model.samples}
    return result if rank == 0 else None


BALANCED_REDUCES = {"mlp": 2, "block": 4}
"""All-reduces of the float32 activation per training step: the MLP's fc2 output and fc1 input gradient; the
block's two of each."""


def balanced_rate(part: str, shape: Sequence[int], world: int) -> tuple[float, float]:
    """(bit/s, compute s): the link rate at which a part's ring all-reduces take as long as its compute on one core.

    Args:
        part: "op": the all-reduce of the row op's float32 [M, N] output against its GEMM (`shape` M,K,N, full K);
            "mlp" (tokens,hidden,ffn) or "block" (hidden,heads,seq,batch): BALANCED_REDUCES all-reduces of the
            float32 activation against the single-process module's forward + backward over t.
        world: t, the ranks.
    """
    from fastdist.tp import GPTBlock

    if part == "op":
        m, k_full, n = shape
        x, w = torch.randn(m, k_full // world), torch.randn(n, k_full // world)
        step, share, reduced_bytes, reps = (lambda: x @ w.t()), 1, m * n * 4, 5
    else:
        torch.manual_seed(0)
        if part == "mlp":
            tokens, hidden, ffn = shape
            module, x = _MLP(hidden, ffn), torch.randn(tokens, hidden)
        else:
            hidden, heads, seq, batch = shape
            module, x = GPTBlock(hidden, heads), torch.randn(batch, seq, hidden)
        step = lambda: module(x.requires_grad_()).sum().backward()  # noqa: E731
        share, reduced_bytes, reps = 1 / world, BALANCED_REDUCES[part] * x.numel() * 4, 3
    with report.torch_threads(1):
        seconds = time_fn(step, reps=reps, warmup=2).median * share
    return 8 * ring_allreduce_bytes(reduced_bytes, world) / seconds, seconds


def chunked_gemm_cost(shape: Sequence[int], reps: int = 7, warmup: int = 2,
                      device: torch.device | str | None = None) -> dict:
    """Median time of one [M, K] x [K, N] GEMM and of the same GEMM as k = 2, 4, 8 row chunks written into one
    preallocated output (the chunked linears' GEMMs), on `device` (default: CUDA when available, bf16 there;
    CPU fp32 otherwise), timed by `fastdist-bench kernels`' timer (CUDA: events, L2 flushed between samples).
    Rows: k, ms, overhead."""
    from fastdist.bench.kernels import kernel_timer
    from fastdist.tp import chunk_bounds

    m, k_in, n = shape
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k_in, generator=g).to(device, dtype)
    w = torch.randn(k_in, n, generator=g).to(device, dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)

    def gemm(chunks):
        for start, stop in chunk_bounds(m, chunks):
            torch.matmul(x[start:stop], w, out=out[start:stop])

    ks = [1, 2, 4, 8]
    samples = dict(zip(ks, kernel_timer(device.type)[0]([lambda k=k: gemm(k) for k in ks], reps, warmup)))
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
        print(report.text_table([col("chunks", "k", integer), col("time(ms)", "time_ms", fixed(2)),
                                 col("vs one GEMM", "overhead_pct", lambda v: f"{v:+.1f}%", numeric=True)],
                                result["rows"]))
        return {"suite": "tp", "gemm_check": result, "runs": []}
    op_shape, block, mlp, world = args.op_shape, args.block, args.mlp, args.ranks
    if op_shape[1] % world or block[1] % world or block[0] % block[1] or block[3] < 2 or mlp[2] % world:
        raise SystemExit("fastdist-bench tp: K, heads and the MLP's ffn must divide by --ranks; hidden by heads; "
                         "block batch >= 2")
    parts = [p for p in PARTS if p in args.parts]
    plan = [(part, args.net, args.net) for part in parts]  # (part, label, net)
    if args.net == "auto":
        op_rate, gemm_s = balanced_rate("op", op_shape, world)
        print(f"# op balanced rate {netsim.format_rate(op_rate)}: the all-reduce of the {op_shape[0]}x{op_shape[2]} "
              f"float32 output takes as long as its GEMM ({gemm_s * 1e3:.2f} ms on one core)")
        rates = {"op": op_rate}
        for part, name, shape in (("mlp", "MLP", mlp), ("block", "block", block)):
            if part in parts:
                rates[part], compute_s = balanced_rate(part, shape, world)
                print(f"# {name} balanced rate {netsim.format_rate(rates[part])}: {BALANCED_REDUCES[part]} all-reduces "
                      f"of the {name}'s activation take as long as its compute ({compute_s * 1e3:.1f} ms fwd+bwd per "
                      "rank on one core)")
        plan = [(part, f"{mult:g}x balanced", f"{max(int(rates[part] * mult / 1e6), 1)}mbit")
                for part in parts for mult in args.rate_multipliers]
    runs = []
    env = None
    for part, label, net in plan:
        config = {"op_shape": op_shape, "block": block, "mlp": mlp, "reps": args.reps, "op_reps": args.op_reps,
                  "warmup": args.warmup, "part": part, "label": label}
        launch = run_ranks(bench_rank, config, ranks=world, net=net, delay=args.delay, timeout=args.timeout,
                           backend="gloo")
        if launch.result is None:
            return None
        env = env or report.environment(backend=launch.backend, device="cpu", ranks=launch.world,
                                        network=launch.network)
        runs.append({"part": part, "label": label, "net": net, "network": launch.network,
                     "link_gbps": launch.link_gbps, "load_average": list(os.getloadavg()), **launch.result})
    env["network"] = "; ".join(sorted({r["network"] for r in runs}))
    print(report.format_environment(env))
    print(f"# ranks pinned to one core each, 1 torch thread; medians of {args.op_reps} (row op) and {args.reps} "
          f"(MLP, block) interleaved repetitions; every variant's output checked against the unsharded module")
    result = {"suite": "tp", "env": env, "op_shape": op_shape, "block": block, "mlp": mlp, "reps": args.reps,
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


def _against(rows: list[dict], key: str, name: str):
    """r -> the time of the row whose `key` is `name` (for a +recompute variant: name+recompute) over r's; None
    when the recording has no such row."""
    def ratio(r: dict) -> float | None:
        base = next((b["time_ms"] for b in rows if b[key] == name + ("+recompute" if "+" in r[key] else "")), None)
        return None if base is None else base / r["time_ms"]
    return ratio


ERROR_COLUMN = col("error vs unsharded", lambda r: r.get("max_error"), report.scientific(1))
"""Each variant's largest deviation from the unsharded module, relative to its largest value (checked before
timing)."""


def _variant_name(r: dict) -> str:
    """The variant, with the chunk counts its linears chose when "auto" chose them (e.g. chunked (k 1,2))."""
    chunks = r.get("chunks")
    if r["variant"].startswith("chunked") and chunks:
        return f"{r['variant']} (k {','.join(map(str, chunks))})"
    return r["variant"]


def _where(run: dict) -> str:
    load = run.get("load_average")
    rate = _network_rate(run["network"])
    return ((rate if run["label"] == run["net"] else f"{run['label']}, {rate}")
            + (f", load average {load[0]:.1f} at the end" if load else ""))


def tables(result: dict) -> list[report.Part]:
    """The row op's, the MLP's and the GPT block's table per network of `result` (its JSON payload), printed by
    `run` and shown in the docs."""
    parts = []
    for run in result["runs"]:
        where = _where(run)
        if run.get("op_rows"):
            rows = run["op_rows"]

            def chunks(r: dict) -> str:
                return {"auto": f"auto ({r['chunks']})", OP_PEER: "DTensor (torch)"}.get(r["k"], r["k"])

            columns = [col("chunks k", chunks, numeric=False), col("time (ms)", "time_ms", fixed(1)),
                       col("vs k=1", _against(rows, "k", "1"), times(2)),
                       col("vs DTensor", _against(rows, "k", OP_PEER), times(2)),
                       col("predicted (ms)", "predicted_ms", fixed(1)),
                       col("model error (%)", lambda r: None if r["predicted_ms"] is None
                           else r["predicted_ms"] / r["time_ms"] - 1, percent(0, signed=True)),
                       ERROR_COLUMN]
            gemm = ", ".join(f"k={g['k']} {g['time_ms']:.1f} ms" for g in run.get("gemm_rows") or [])
            shape = "x".join(map(str, result["op_shape"]))
            parts.append(report.Part(f"op-{run['net']}", columns, rows,
                                     f"Row-parallel op {shape}, {where}; median of {result['op_reps']}.",
                                     [f"the GEMMs alone (no collective): {gemm}"] if gemm else []))
        for part in ("mlp", "block"):
            rows = run.get(f"{part}_rows")
            if not rows:
                continue
            median = f"median of {result['reps']}"
            if part == "mlp":
                tokens, hidden, ffn = result["mlp"]
                what = "column -> row MLP"
                caption = f"Column -> row MLP ({tokens} tokens, hidden {hidden}, ffn {ffn}, GeLU), {where}; {median}."
            else:
                shape = ", ".join(f"{k} {v}" for k, v in zip(("hidden", "heads", "seq", "batch"), result["block"]))
                peer = " (DTensor)" if any(r["variant"] == "dtensor" for r in rows) else ""
                what = "GPT block"
                caption = (f"GPT block ({shape}), {where}; {median}; +recompute rows against Megatron{peer} with "
                           "checkpointing.")
            columns = [col(what, _variant_name), col("fwd+bwd (ms)", "time_ms", fixed(1)),
                       col("vs Megatron", _against(rows, "variant", "megatron"), times(2)),
                       col("vs DTensor", _against(rows, "variant", "dtensor"), times(2)), ERROR_COLUMN]
            parts.append(report.Part(f"{part}-{run['net']}", columns, rows, caption))
    return parts


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    if not result["runs"]:
        raise SystemExit("fastdist-bench tp: --gemm-check has no plot; use --json")
    (m, k, n), (tokens, hidden, ffn), (h, heads, seq, batch) = result["op_shape"], result["mlp"], result["block"]
    panels = {"op_rows": ("k", "row-parallel forward", f"row op {m}x{k}x{n} fp32 (k, or DTensor)"),
              "mlp_rows": ("variant", "MLP fwd+bwd", f"column -> row MLP, {tokens} tokens, hidden {hidden}, ffn {ffn}"),
              "block_rows": ("variant", "GPT block fwd+bwd",
                             f"block hidden {h}, {heads} heads, seq {seq}, batch {batch}")}
    panels = {key: panel for key, panel in panels.items() if any(r.get(key) for r in result["runs"])}
    _, fig, axes = report.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (key, (label_key, what, title)) in zip(axes[0], panels.items()):
        runs = [r for r in result["runs"] if r.get(key)]  # one bar per variant and run, the runs side by side
        series = {f"{r['label']} ({r['net']})": [row["time_ms"] for row in r[key]] for r in runs}
        positions = report.grouped_bars(ax, [row[label_key] for row in runs[0][key]], series,
                                        f"{what} (ms, median)", title, rotation=20)
        if key == "op_rows":  # the cost model's predictions on the row op's bars
            for i, (r, xs) in enumerate(zip(runs, positions)):
                predicted = [(x, row["predicted_ms"]) for x, row in zip(xs, r[key]) if row.get("predicted_ms")]
                ax.scatter([p[0] for p in predicted], [p[1] for p in predicted], color="black", marker="_", s=200,
                           label="predicted" if i == 0 else None, zorder=3)
            ax.legend(fontsize=8)
    kind = "simulated links" if any(r["link_gbps"] for r in result["runs"]) else "loopback"
    report.save_figure(fig, path, f"fastdist-bench tp: {result['env']['ranks']} ranks, one core each, {kind}; DTensor: "
                       "torch's TP")
