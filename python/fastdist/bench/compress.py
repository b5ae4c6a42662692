"""`fastdist-bench compress`: a 4-stage pipeline, one rank per stage, with compressed stage boundaries.

Each rank holds one stage: a two-layer MLP block (hidden -> expand x hidden -> hidden, GELU, residual) applied to
activations [batch, seq, hidden] float32. The defaults (2 MiB of activation per boundary, a light block) put the
pipeline in the regime the compressors are for, where the links and not the arithmetic bound the step: on a small
CPU a heavier block makes the step compute-bound whatever the network (raise --expand / --hidden to see it).
A training step sends the activation forward through the three boundaries (fastdist.compress.StageBoundary over
torch.distributed P2P) and the gradient back, then every stage steps SGD. Methods (activation compressor /
gradient compressor):

  none        uncompressed both ways
  topk10+q8   TopK 10% per sample forward; backward the gradient at the forward's kept positions (mask reuse),
              8-bit minmax per row
  aqsgd4      AQ-SGD with 4-bit minmax deltas forward (the first visit of a sample is sent in full, outside the
              timed steps), gradient 8-bit minmax per row
  quant4      4-bit minmax per row forward, gradient 8-bit minmax per row

All methods run interleaved (order rotated), warm-up first. Step time is stage 0's, from a barrier until its
backward is done (the whole pipeline's latency); wire bytes are what send_packet put on the wire per boundary (frame
prefix, header, padding and tensors), tx what the interfaces really sent (simulated network only); link(ms,model)
is the time those bytes need on the shaped links, boundary after boundary, both ways, so step time minus it is what
compute, compression and the transport stack cost. With --net 1gbit (default) the links are shaped (needs root);
otherwise it runs on loopback and says so.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastdist.bench import report
from fastdist.bench.report import col, fixed, integer, times
from fastdist.bench.launch import add_launch_arguments, run_suite, tx_counter
from fastdist.bench.toolkit import all_sum, at_least, comma_list, rounds, together

METHODS = ["none", "topk10+q8", "aqsgd4", "quant4"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=1800.0)
    p.set_defaults(net="1gbit")
    p.add_argument("--batch", type=at_least(1), default=8, help="samples per step (default 8)")
    p.add_argument("--seq", type=at_least(1), default=4096, help="tokens per sample (default 4096)")
    p.add_argument("--hidden", type=at_least(1), default=16,
                   help="hidden size (default 16); activation = batch x seq x hidden float32 per boundary")
    p.add_argument("--expand", type=at_least(1), default=1, help="MLP expansion factor of each stage (default 1)")
    p.add_argument("--steps", type=at_least(1), default=5, help="timed steps per method, >= 5 for a claim (default 5)")
    p.add_argument("--warmup", type=at_least(1), default=2, help="untimed steps per method first (default 2)")
    p.add_argument("--methods", type=comma_list(choices=METHODS), default=METHODS,
                   help="comma-separated subset of " + ",".join(METHODS))


def _config_from(args):
    if "aqsgd4" in args.methods and args.warmup < 2:
        raise SystemExit("fastdist-bench compress: aqsgd4 needs --warmup >= 2 (the two alternating batches' first "
                         "visits are sent in full and must not be timed)")
    if args.ranks < 2:
        raise SystemExit("fastdist-bench compress: a pipeline needs --ranks >= 2 (one stage per rank)")
    return {"methods": args.methods, "batch": args.batch, "seq": args.seq, "hidden": args.hidden,
            "expand": args.expand, "steps": args.steps, "warmup": args.warmup, "measure_tx": False}


def _compressors(method, samples):
    """(activation compressor, gradient compressor) of `method`."""
    from fastdist.compress import AQSGD, MemoryStore, Quantize, TopK

    return {"none": lambda: (None, None), "topk10+q8": lambda: (TopK(0.1), Quantize(8)),
            "aqsgd4": lambda: (AQSGD(Quantize(4), MemoryStore(samples), warmup_epochs=0), Quantize(8)),
            "quant4": lambda: (Quantize(4), Quantize(8))}[method]()


class _Stage(nn.Module):
    def __init__(self, hidden, expand):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, expand * hidden), nn.Linear(expand * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class _Pipeline:
    """This rank's stage and its links to the neighbouring stages for one method."""

    def __init__(self, method, config, rank, world):
        from fastdist.compress import StageBoundary

        torch.manual_seed(rank)
        self.method = method
        self.stage = _Stage(config["hidden"], config["expand"])
        self.opt = torch.optim.SGD(self.stage.parameters(), lr=1e-3)
        self.samples = 2 * config["batch"]
        self.links = {}
        for s in range(world - 1):  # every rank walks the links in the same order: the handshakes pair up
            if rank in (s, s + 1):
                fwd, bwd = _compressors(method, self.samples)
                self.links[s] = StageBoundary(s, s + 1, fwd=fwd, bwd=bwd, backward_mask="reuse")
        self.rank, self.world = rank, world
        self.step_count = 0
        self.shape = (config["batch"], config["seq"], config["hidden"])

    def step(self) -> tuple[int, int]:
        """One training step; returns this rank's (fwd wire bytes sent, bwd wire bytes sent)."""
        b = self.shape[0]
        first = (self.step_count % 2) * b
        ids = torch.arange(first, first + b)  # two batches alternate: AQ-SGD sees each sample again
        self.step_count += 1
        self.opt.zero_grad()
        if self.rank == 0:
            h = torch.randn(self.shape, generator=torch.Generator().manual_seed(first))
        else:
            h = self.links[self.rank - 1].recv()
        h = self.stage(h)
        if self.rank < self.world - 1:
            self.links[self.rank].send(h, sample_ids=ids).backward()
        else:
            h.float().pow(2).mean().backward()
        self.opt.step()
        fwd = self.links[self.rank].stats.get("fwd_wire_bytes", 0) if self.rank < self.world - 1 else 0
        bwd = self.links[self.rank - 1].stats.get("bwd_wire_bytes", 0) if self.rank > 0 else 0
        return fwd, bwd


def bench_rank(config: dict) -> Any:
    """Runs the suite's measurements on this rank (a collective); returns the results on rank 0, None elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = config["methods"]
    pipes = {m: _Pipeline(m, config, rank, world) for m in methods}
    times = {m: [] for m in methods}
    wire = {m: [] for m in methods}
    tx = {m: [] for m in methods}
    for _, m, timed in rounds(methods, config["warmup"], config["steps"], "compress", enabled=rank == 0):
        with together() as watch:
            tx0 = tx_counter(config["measure_tx"])
            fwd_bytes, bwd_bytes = pipes[m].step()
        dist.barrier()  # every rank's sends are done: the counters hold the whole step
        sent = tx_counter(config["measure_tx"]) - tx0
        totals = all_sum([fwd_bytes, bwd_bytes, sent])
        if timed:
            times[m].append(watch.seconds)
            wire[m].append(totals[:2])
            tx[m].append(totals[2])
    if rank != 0:
        return None
    boundaries = world - 1
    dense = config["batch"] * config["seq"] * config["hidden"] * 4
    rows = []
    for m in methods:
        t = statistics.median(times[m])
        rows.append({"method": m, "time_ms": t * 1e3, "samples_ms": [s * 1e3 for s in times[m]],
                     "fwd_wire_bytes": statistics.median(w[0] for w in wire[m]) / boundaries,
                     "bwd_wire_bytes": statistics.median(w[1] for w in wire[m]) / boundaries,
                     "tx_bytes": statistics.median(tx[m]) / boundaries if config["measure_tx"] else None,
                     "dense_bytes": dense})
    rate = config.get("link_bps")
    for r in rows:  # the time the bytes alone need on the shaped links, one boundary after another, both ways
        r["link_ms_model"] = boundaries * (r["fwd_wire_bytes"] + r["bwd_wire_bytes"]) * 8 / rate * 1e3 if rate \
            else None
    report.set_speedups(rows, "none")
    return rows


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and tables on the printing rank; returns the JSON payload (None on the
    other torchrun ranks)."""
    config = _config_from(args)
    if args.net != "loopback":
        from fastdist import netsim
        config["link_bps"] = netsim.parse_rate(args.net)
    return run_suite("compress", args, bench_rank, config, lambda rows, *_: {"rows": rows}, tables, backend="gloo")


def tables(result: dict) -> list[report.Part]:
    """The suite's table of `result` (its JSON payload), printed by `run` and shown in the docs."""
    c = result["config"]
    caption = (f"{result['env'].get('ranks')} stages (one rank each), activation [{c['batch']}, {c['seq']}, "
               f"{c['hidden']}] float32 per boundary; median of {c['steps']} steps after {c['warmup']} warm-up.")
    columns = [col("method", "method"), col("step (ms)", "time_ms", fixed(1)), col("vs none", "speedup", times(2)),
               col("link, model (ms)", "link_ms_model", fixed(1)),
               col("fwd (B/boundary)", "fwd_wire_bytes", integer), col("bwd (B/boundary)", "bwd_wire_bytes", integer),
               col("tx (B/boundary)", "tx_bytes", integer),
               col("fwd ratio", lambda r: r["dense_bytes"] / max(r["fwd_wire_bytes"], 1), times(1))]
    return [report.Part("pipeline", columns, result["rows"], caption)]


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    rows, env = result["rows"], result["env"]
    names = [r["method"] for r in rows]
    _, fig, (ax_t, ax_b) = report.subplots(1, 2, figsize=(11, 4))
    report.grouped_bars(ax_t, names, {None: [r["time_ms"] for r in rows]}, "step time (ms, median)", color="tab:blue")
    for i, r in enumerate(rows):
        if r["speedup"]:
            ax_t.text(i, r["time_ms"], f"{r['speedup']:.1f}x", ha="center", va="bottom", fontsize=8)
    report.grouped_bars(ax_b, names, {"forward (activation)": [r["fwd_wire_bytes"] / 1e6 for r in rows],
                                      "backward (gradient)": [r["bwd_wire_bytes"] / 1e6 for r in rows]},
                        "wire MB per boundary per step")
    c = result["config"]
    report.save_figure(fig, path, f"fastdist-bench compress: {env['ranks']}-stage pipeline, activation "
                       f"[{c['batch']}, {c['seq']}, {c['hidden']}], {env['network']}")
