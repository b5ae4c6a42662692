"""`fastdist-bench compress-findings`: the convergence table of Rudakov et al. on two tasks that run here.

(a) cnn: a 3-stage CNN (8/16/16 channels) on a project-generated image set (16x16 grey images of 8 shape
    classes: bars at four angles, box, disc, cross, ring, at random positions and sizes, with noise; fixed train
    and test splits), a Boundary after each of the 3 stages; metric: test accuracy.
(b) gpt: a 4-block GPT (dim 32, 2 heads, 32 tokens) on the project's Zipf-Markov corpus (vocab 256,
    fastdist.testing.corpus; a fixed set of training sequences so that AQ-SGD sees every sample once per epoch), a
    Boundary after each of the first 3 blocks; metric: held-out cross-entropy (nats per token).

Rows (activation compressor / gradient rule): none; TopK 5/10/30/50% (gradient masked with the forward's kept
positions); quant 2/4/8 bits both ways; quant 2 bits on activations only and on gradients only; TopK 10% + error
feedback; TopK 10% with an independent TopK 10% of the gradient; AQ-SGD with 4-bit deltas; AQ-SGD with TopK 30% and
10% deltas (AQ-SGD rows quantize gradients to 8 bits). Columns: the final metric with compressed inference (the
activation compressor also applied in eval mode; AQ-SGD and error feedback then use their inner compressor) and with
uncompressed inference. Every row trains from the same initial weights on the same batches (seeded).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

from fastdist.bench import report
from fastdist.bench.report import col, fixed
from fastdist.bench.toolkit import at_least, comma_list, progress
from fastdist.testing.corpus import ZipfMarkovCorpus
from fastdist.testing.models import StagedCNN, TransformerLM
from fastdist.testing.shapes import shapes_dataset
from fastdist.compress import AQSGD, Boundary, ErrorFeedback, MemoryStore, Quantize, TopK, batch

ROWS = ["none", "topk5", "topk10", "topk30", "topk50", "quant2", "quant4", "quant8", "quant2-act", "quant2-grad",
        "topk10+ef", "topk10-independent", "aqsgd-q4", "aqsgd-topk30", "aqsgd-topk10"]
TASKS = ["cnn", "gpt"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    p.add_argument("--tasks", type=comma_list(choices=TASKS), default=TASKS, help="comma-separated subset of cnn,gpt")
    p.add_argument("--rows", type=comma_list(choices=ROWS), default=ROWS,
                   help="comma-separated subset of " + ",".join(ROWS))
    p.add_argument("--epochs", type=at_least(2), default=5,
                   help="training epochs (default 5; AQ-SGD's first is uncompressed)")
    p.add_argument("--train", type=at_least(128), default=1536, help="training samples (default 1536)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's current)")


def boundary_for(row: str, samples: int) -> Boundary:
    """A fresh Boundary of a row (each boundary owns its compressors and their state)."""
    fixed = {"none": lambda: Boundary(), "quant2-act": lambda: Boundary(fwd=Quantize(2)),
             "quant2-grad": lambda: Boundary(bwd=Quantize(2)),
             "topk10+ef": lambda: Boundary(fwd=ErrorFeedback(TopK(0.1)), backward_mask="reuse"),
             "topk10-independent": lambda: Boundary(fwd=TopK(0.1), bwd=TopK(0.1), backward_mask="independent"),
             "aqsgd-q4": lambda: Boundary(fwd=AQSGD(Quantize(4), MemoryStore(samples)), bwd=Quantize(8))}
    if row in fixed:
        return fixed[row]()
    if row.startswith("topk") and row[4:].isdigit():
        return Boundary(fwd=TopK(int(row[4:]) / 100), backward_mask="reuse")
    if row in ("quant2", "quant4", "quant8"):
        return Boundary(fwd=Quantize(int(row[5:])), bwd=Quantize(int(row[5:])))
    if row.startswith("aqsgd-topk"):
        return Boundary(fwd=AQSGD(TopK(int(row[10:]) / 100), MemoryStore(samples)), bwd=Quantize(8))
    raise ValueError(f"unknown row {row!r}")


# ---- training ----

def _set_inference(model, compressed):
    for b in model.boundaries:
        b.at_inference = compressed


def _train(task, row, data, config):
    torch.manual_seed(config["seed"])
    samples = data["x_train"].shape[0]
    boundaries = [boundary_for(row, samples) for _ in range(3)]
    if task == "cnn":
        model = StagedCNN(boundaries)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        batch_size = 64
    else:
        model = TransformerLM(data["vocab"], 32, heads=2, layers=4, seq=data["x_train"].shape[1] - 1,
                              boundaries=boundaries)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        batch_size = 32
    order_gen = torch.Generator().manual_seed(config["seed"] + 1)
    losses = []
    for epoch in range(config["epochs"]):
        perm = torch.randperm(samples, generator=order_gen)
        batches = [perm[i:i + batch_size] for i in range(0, samples - batch_size + 1, batch_size)]
        model.train()
        for j, ids in enumerate(batches):
            nxt = batches[j + 1] if j + 1 < len(batches) else None
            opt.zero_grad()
            with batch(sample_ids=ids, next_sample_ids=nxt, epoch=epoch):
                loss = _loss(task, model, data["x_train"][ids], data.get("y_train", data["x_train"])[ids])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    model.eval()
    out = {}
    with torch.no_grad():
        for compressed in (True, False):
            _set_inference(model, compressed)
            out["compressed" if compressed else "uncompressed"] = _evaluate(task, model, data)
    out["train_loss_last_epoch"] = statistics.mean(losses[-len(batches):])
    out["diverged"] = not all(math.isfinite(v) for v in losses)
    return out


def _loss(task, model, x, y):
    if task == "cnn":
        return nn.functional.cross_entropy(model(x), y)
    logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _evaluate(task, model, data):
    if task == "cnn":
        return float((model(data["x_test"]).argmax(1) == data["y_test"]).float().mean())
    return float(_loss(task, model, data["x_test"], None))


def _data(task, config):
    if task == "cnn":
        x_train, y_train = shapes_dataset(config["train"], config["seed"])
        x_test, y_test = shapes_dataset(1024, config["seed"] + 10_000)
        return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    corpus = ZipfMarkovCorpus(vocab=256, seed=config["seed"])
    x_train = torch.cat([corpus.batch(0, step, batch=64, seq=32) for step in range(config["train"] // 64)])
    return {"x_train": x_train, "x_test": corpus.heldout(batch=256, seq=32), "vocab": 256}


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite in this process; prints the header and table; returns the JSON payload."""
    tasks, rows = args.tasks, args.rows
    config = {"tasks": tasks, "rows": rows, "epochs": args.epochs, "train": args.train, "seed": args.seed}
    with report.torch_threads(args.threads):
        env = report.environment(backend=f"one process, {torch.get_num_threads()} torch threads", device="cpu",
                                 ranks=1, network="- (in-process Boundary modules)")
        bar = progress(len(tasks) * len(rows), "compress-findings")
        results = []
        for task in tasks:
            data = _data(task, config)
            for row in rows:
                start = time.monotonic()
                r = _train(task, row, data, config)
                results.append({"task": task, "row": row, **r, "seconds": time.monotonic() - start})
                bar.step(f"{task} {row}")
    print(report.format_environment(env))
    result = {"suite": "compress-findings", "env": env, "config": config, "rows": results}
    print(report.text_parts(tables(result)))
    return result


def tables(result: dict) -> list[report.Part]:
    """One table per task of `result` (its JSON payload), printed by `run` and shown in the docs."""
    c = result["config"]
    parts = []
    for task in c["tasks"]:
        metric = "test accuracy" if task == "cnn" else "held-out loss (nats)"
        caption = (f"{task}: {c['epochs']} epochs, {c['train']} training samples, seed {c['seed']}; "
                   f"{'higher' if task == 'cnn' else 'lower'} is better.")
        columns = [col("row", "row"), col(f"{metric}, compressed inference", "compressed", fixed(3)),
                   col(f"{metric}, uncompressed inference", "uncompressed", fixed(3)),
                   col("train loss, last epoch", "train_loss_last_epoch", fixed(3)),
                   col("diverged", lambda r: report.yes_no(r["diverged"]), numeric=False),
                   col("time (s)", "seconds", fixed(1))]
        parts.append(report.Part(task, columns, [r for r in result["rows"] if r["task"] == task], caption))
    return parts


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    tasks = result["config"]["tasks"]
    _, fig, axes = report.subplots(len(tasks), 1, figsize=(12, 3.8 * len(tasks)), squeeze=False)
    for ax, task in zip(axes[:, 0], tasks):
        rows = [r for r in result["rows"] if r["task"] == task]
        what = "3-stage CNN on generated shapes" if task == "cnn" else "4-block GPT on the Zipf-Markov corpus"
        metric = "test accuracy" if task == "cnn" else "held-out loss (nats)"
        series = {f"{kind} inference": [r[kind] for r in rows] for kind in ("compressed", "uncompressed")}
        report.grouped_bars(ax, [r["row"] for r in rows], series, metric, f"{task}: {what}", rotation=30)
        base = next((r["uncompressed"] for r in rows if r["row"] == "none"), None)
        if base is not None:
            ax.axhline(base, color="gray", lw=0.8, ls="--")
        if task == "cnn":
            ax.set_ylim(0, 1)
    report.save_figure(fig, path)
