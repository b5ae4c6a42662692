"""`fastdist-bench collectives`: nccl-tests style sweep of torch.distributed collectives.

all_reduce, all_gather, reduce_scatter, all_to_all (even and uneven splits) and broadcast over a size sweep on N
ranks, every result checked against its exact value (#wrong). Columns follow nccl-tests (size is the per-rank
buffer: all_gather's output, reduce_scatter's input). "wire B/rank" is what a bandwidth-optimal algorithm must send
from its busiest rank, "tx B/rank" what that rank's interface really sent (netsim only; barriers included): side by
side they show where a backend exceeds the optimum (gloo's reduce_scatter is an all-reduce and sends twice it).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.distributed as dist

from fastdist.bench import report
from fastdist.bench.report import col, fixed, integer
from fastdist.bench.launch import add_launch_arguments, run_suite, tx_counter
from fastdist.bench.toolkit import (all_max, all_sum, at_least, comma_list, parse_size, progress, rank_device, together)
from fastdist.comm.wire import ring_allgather_bytes, ring_allreduce_bytes
from fastdist.distributed import compat

COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven", "broadcast"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=1800.0)
    p.add_argument("--min-size", type=parse_size, default="1K", help="smallest per-rank buffer (default 1K)")
    p.add_argument("--max-size", type=parse_size, default="64M", help="largest per-rank buffer (default 64M)")
    p.add_argument("--factor", type=at_least(2), default=4, help="size step factor (default 4)")
    p.add_argument("--ops", type=comma_list(choices=COLLECTIVES), default=COLLECTIVES,
                   help="comma-separated subset of " + ",".join(COLLECTIVES))
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--iters", type=int, default=5, help="minimum timed repetitions per size (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size (default 2)")
    p.add_argument("--min-time", type=float, default=0.25,
                   help="keep repeating small sizes until this many seconds are timed (default 0.25)")


def sizes_from(args: argparse.Namespace) -> list[int]:
    """The per-rank buffer sizes of the sweep: --min-size, times --factor, up to --max-size."""
    lo, hi = args.min_size, args.max_size
    if lo <= 0 or hi < lo:
        raise ValueError(f"bad size sweep: min {lo}, max {hi}, factor {args.factor}")
    sizes = []
    while lo <= hi:
        sizes.append(lo)
        lo *= args.factor
    return sizes


# --- one collective: its buffers, the call, the exact check, and its traffic model -------------------

class Case:
    """Buffers and expected results of one collective at one size on this rank."""

    def __init__(self, name: str, size_bytes: int, dtype: torch.dtype, device: torch.device) -> None:
        n, r = dist.get_world_size(), dist.get_rank()
        esize = torch.empty((), dtype=dtype).element_size()
        count = max(n, size_bytes // esize // n * n)  # divisible by n for the scattered/gathered ones
        idx = torch.arange(count, device=device)
        self.name, self.count, self.dtype, self.n = name, count, dtype, n
        self.bus_factor = (n - 1) / n
        self.bytes = count * esize
        if name == "all_reduce":
            self.src = ((r + 1) + idx % 7).to(dtype)
            self.buf = self.src.clone()
            self.expected = (n * (n + 1) // 2 + n * (idx % 7)).to(dtype)
            self.bus_factor = 2 * (n - 1) / n
            self.wire = ring_allreduce_bytes(self.bytes, n)
            self.call = lambda: dist.all_reduce(self.buf)
        elif name == "all_gather":
            chunk = count // n
            self.src = (r * 16 + torch.arange(chunk, device=device) % 13).to(dtype)
            self.buf = torch.empty(count, dtype=dtype, device=device)
            self.expected = ((idx // chunk) * 16 + (idx % chunk) % 13).to(dtype)
            self.wire = ring_allgather_bytes(self.bytes // n, n)
            self.call = lambda: compat.all_gather_single(self.buf, self.src)
        elif name == "reduce_scatter":
            chunk = count // n
            self.src = ((r + 1) + idx % 5).to(dtype)
            self.buf = torch.empty(chunk, dtype=dtype, device=device)
            own = r * chunk + torch.arange(chunk, device=device)
            self.expected = (n * (n + 1) // 2 + n * (own % 5)).to(dtype)
            self.wire = ring_allgather_bytes(self.bytes // n, n)
            self.call = lambda: compat.reduce_scatter_single(self.buf, self.src)
        elif name in ("all_to_all", "all_to_all_uneven"):
            # uneven: rank s sends weight(s, d) units to rank d, weights 1..n: every rank still sends and
            # receives n(n+1)/2 units in all, but no two of its chunks to distinct peers are equal.
            uneven = name == "all_to_all_uneven"

            def weight(s, d):
                return 1 + (s + d) % n if uneven else 1

            total_w = sum(weight(r, d) for d in range(n))
            unit = max(1, count // total_w)
            send = [weight(r, d) * unit for d in range(n)]
            recv = [weight(s, r) * unit for s in range(n)]
            self.src = torch.cat([((r * 8 + d) % 251 + torch.arange(c, device=device) % 3).to(dtype)
                                  for d, c in enumerate(send)])
            self.expected = torch.cat([((s * 8 + r) % 251 + torch.arange(c, device=device) % 3).to(dtype)
                                       for s, c in enumerate(recv)])
            self.buf = torch.empty_like(self.expected)
            self.count, self.bytes = sum(send), sum(send) * esize
            self.wire = (sum(send) - send[r]) * esize
            splits = None if name == "all_to_all" else (recv, send)
            self.call = lambda: dist.all_to_all_single(self.buf, self.src, *(splits or ()))
        elif name == "broadcast":
            self.src = (7 + idx % 11).to(dtype) if r == 0 else torch.zeros(count, dtype=dtype, device=device)
            self.buf = self.src.clone()
            self.expected = (7 + idx % 11).to(dtype)
            self.bus_factor = 1.0
            self.wire = self.bytes if r == 0 else 0  # a pipelined chain: the root sends the buffer once
            self.call = lambda: dist.broadcast(self.buf, 0)
        else:
            raise ValueError(f"unknown collective {name!r}; choose from {COLLECTIVES}")

    def reset(self) -> None:
        """Restores the input buffers before a call."""
        if self.name in ("all_reduce", "broadcast"):
            self.buf.copy_(self.src)
        else:
            self.buf.zero_()

    def wrong(self) -> int:
        """How many elements of the result differ from the expected ones."""
        return int((self.buf != self.expected).sum().item())


def _timed_iterations(case, count, device):
    """Runs the collective `count` times from fresh inputs; returns (seconds per call, #wrong elements)."""
    samples, wrong = [], 0
    for _ in range(count):
        case.reset()
        with together(device) as watch:
            case.call()
        samples.append(watch.seconds)
        wrong += case.wrong()
    return samples, wrong


def bench_rank(config: dict) -> Any:
    """Runs the sweep on this rank; returns the rows on rank 0 (None elsewhere). A collective."""
    rank = dist.get_rank()
    device = rank_device()
    dtype = DTYPES[config["dtype"]]
    plan = [(op, size) for op in config["ops"] for size in config["sizes"]]
    bar = progress(len(plan), "collectives", enabled=rank == 0)
    rows = []
    for op, size in plan:
        case = Case(op, size, dtype, device)
        warm, wrong = _timed_iterations(case, config["warmup"], device)
        estimate = all_max([max(warm) if warm else 1e-3], device)[0]
        reps = int(min(config["max_iters"], max(config["iters"], config["min_time"] / max(estimate, 1e-9))))
        tx0 = tx_counter(config["measure_tx"])
        samples, wrong_timed = _timed_iterations(case, reps, device)
        wrong += wrong_timed
        tx = (tx_counter(config["measure_tx"]) - tx0) / reps
        times = all_max(samples, device)  # an iteration lasts until its slowest rank is done
        wire_max, tx_max = all_max([case.wire, tx], device)
        wrong_total = int(all_sum([wrong], device)[0])
        if rank == 0:
            t = statistics.median(times)
            algbw = case.bytes / t / 1e9
            rows.append({
                "collective": op, "size": case.bytes, "count": case.count, "dtype": config["dtype"],
                "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * case.bus_factor,
                "wire_bytes": wire_max, "tx_bytes": tx_max if config["measure_tx"] else None,
                "wrong": wrong_total, "reps": reps, "samples_us": [s * 1e6 for s in times],
            })
            bar.step(f"{op} {report.human_bytes(case.bytes)}")
        del case
    return rows if rank == 0 else None


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and table on the printing rank; returns the JSON payload."""
    config = {"ops": args.ops, "sizes": sizes_from(args), "dtype": args.dtype, "iters": args.iters,
              "warmup": args.warmup, "min_time": args.min_time, "max_iters": 200}
    result = run_suite("collectives", args, bench_rank, config, lambda rows, *_: {"rows": rows}, tables)
    if result is not None:
        wrong = sum(r["wrong"] for r in result["rows"])
        print(f"# checked every result of every iteration: {'all correct' if wrong == 0 else f'{wrong} WRONG'}")
    return result


def tables(result: dict) -> list[report.Part]:
    """The suite's table of `result` (its JSON payload), printed by `run` and shown in the docs."""
    columns = [col("collective", "collective"), col("size (B)", "size", integer), col("count", "count", integer),
               col("dtype", "dtype"), col("time (us)", "time_us", fixed(1)), col("algbw (GB/s)", "algbw", fixed(4)),
               col("busbw (GB/s)", "busbw", fixed(4)), col("wire (B/rank)", "wire_bytes", integer),
               col("tx (B/rank)", "tx_bytes", integer), col("wrong", "wrong", integer)]
    return [report.Part("collectives", columns, result["rows"])]


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    _, fig, ax = report.subplots(figsize=(8, 5))
    for op in result["config"]["ops"]:
        rows = [r for r in result["rows"] if r["collective"] == op]
        ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows], marker="o", label=op)
    if result.get("link_gbps"):
        ax.axhline(result["link_gbps"], color="k", linestyle="--", linewidth=1,
                   label=f"link rate {result['link_gbps']:.3g} GB/s")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="size per rank (bytes)", ylabel="busbw (GB/s)")
    env = result["env"]
    ax.set_title(f"fastdist-bench collectives: {env['ranks']} ranks, {env['backend']}\n{env['network']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    report.save_figure(fig, path)
