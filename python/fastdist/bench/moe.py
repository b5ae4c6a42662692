"""`fastdist-bench moe`: one MoE layer under five load-balancing policies, same model, same routing, same run.

Expert popularity follows Zipf(--zipf), heaviest experts first, stable with a slow drift (every --drift-every
steps two experts adjacent in popularity swap places); the gate makes that routing (feature 0 of every token is 1,
gate column 0 holds log popularity, the others add per-token noise), so every method routes the same tokens to the
same experts. Methods (all MoELayer, interleaved per step, warm-up first so that the planners have seen the load):

  static      capacity factor --capacity-factor with token dropping, no balancing (DeepSpeed-MoE semantics)
  dropless    no capacity, no balancing (MegaBlocks semantics)
  shadow      dropless + FasterMoE-style shadowing (heaviest experts broadcast to all ranks while the model says so)
  topk-all    dropless + the --max-replicas heaviest experts replicated on every rank, always
  prophet     dropless + fastdist's planner (Pro-Prophet greedy placement, cost model from calibrate())

and the peer a user would pick instead, as an equivalent (Tutel's own code is not installable here):

  tutel-padded  Tutel's dropless mode (capacity_factor=0) on torch ops (`peers.PaddedDroplessMoE`): every expert's
              buffer padded to the largest count of any rank, two equal-split all-to-alls, batched GEMMs over every
              row; the same weights, its output checked against dropless's before timing.

On CPU each rank is pinned to a core of its own (one torch thread) when the machine has cores enough; otherwise the
ranks share the cores, and calibrate() tells the cost model so.

fwd+bwd is the median of the slowest rank's layer forward + backward; max/mean is the busiest rank's tokens (or
all-to-all bytes) over the mean; std before/after is that of tokens per rank without and with the replicas;
err(medians) compares the cost model's median prediction with the median step, err(per step) averages per step.
Then the projection: the calibrated cost model evaluated on synthetic Zipf count matrices for 8 to 64 ranks, with
the popularity over a random expert order (labelled as a projection; nothing there is measured). The layout kernel
(moe_layout) is timed by `fastdist-bench kernels --family moe`.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastdist.bench import report
from fastdist.bench.report import col, fixed, integer, percent, scientific, times
from fastdist.bench.launch import add_launch_arguments, pin_local_rank, run_suite
from fastdist.bench.peers import PaddedDroplessMoE
from fastdist.bench.toolkit import (all_max, at_least, comma_list, rank_device, relative_error, rounds, together,
                                     worst_errors)

METHODS = {
    "static": {"balance": "none", "dropless": False},
    "dropless": {"balance": "none", "dropless": True},
    "shadow": {"balance": "shadow", "dropless": True},
    "topk-all": {"balance": "replicate_topk", "dropless": True},
    "prophet": {"balance": "prophet", "dropless": True},
}
PEERS = ("tutel-padded",)
"""Methods that are not MoELayer: the peer's equivalent, PaddedDroplessMoE."""
CHECK_TOLERANCE = 1e-4
"""Largest |peer - dropless| over dropless's largest |value| that the peer may show (float32)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=1800.0)
    p.set_defaults(ranks=2)
    p.add_argument("--methods", type=comma_list(choices=[*METHODS, *PEERS]), default=",".join([*METHODS, *PEERS]),
                   help="comma-separated subset of " + ",".join([*METHODS, *PEERS]))
    p.add_argument("--d-model", type=int, default=256, help="token width (default 256)")
    p.add_argument("--d-ff", type=int, default=1024, help="expert hidden width (default 1024)")
    p.add_argument("--experts-per-rank", type=at_least(1), default=4, help="experts owned by each rank (default 4)")
    p.add_argument("--k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--tokens", type=at_least(0), default=1024, help="tokens per rank per step (default 1024)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="for the static method (default 1.25)")
    p.add_argument("--max-replicas", type=int, default=2, help="replicas one rank may hold (default 2)")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of expert popularity (default 1.2)")
    p.add_argument("--drift-every", type=at_least(1), default=4, help="steps between popularity swaps (default 4)")
    p.add_argument("--steps", type=at_least(1), default=8, help="timed steps per method, >= 5 for a claim (default 8)")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps per method first (default 2)")
    p.add_argument("--project", type=comma_list(at_least(1)), default="8,16,32,64",
                   help="rank counts for the cost-model projection")
    p.add_argument("--seed", type=int, default=0)


CONFIG = ("methods", "d_model", "d_ff", "experts_per_rank", "k", "tokens", "capacity_factor", "max_replicas", "zipf",
          "drift_every", "steps", "warmup", "seed", "project")
"""The options the ranks are given (the payload's config)."""


# ---- the routing every method sees ----

def popularity_order(num_experts: int, step: int, config: dict) -> list[int]:
    """Expert ids from most to least popular at `step`: expert 0 first (so the heaviest experts share an owner, the
    case balancing exists for), then one adjacent swap per drift period, walking down the order."""
    order = list(range(num_experts))
    if num_experts > 1:
        for i in range(step // config["drift_every"]):
            j = i % (num_experts - 1)
            order[j], order[j + 1] = order[j + 1], order[j]
    return order


def gate_column(num_experts: int, step: int, config: dict) -> torch.Tensor:
    """Gate column 0 (feature 0 of every token is 1): log Zipf popularity. The other columns add per-token noise
    of std ~1 to the logits, so tokens spread over the experts in roughly Zipf proportions."""
    col = torch.empty(num_experts)
    for rank_of_popularity, e in enumerate(popularity_order(num_experts, step, config)):
        col[e] = -config["zipf"] * math.log(rank_of_popularity + 1)
    return col


def tokens_for(step: int, rank: int, config: dict, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s tokens at `step`: [tokens, d_model] normal, feature 0 set to 1 (the gate's popularity column)."""
    g = torch.Generator().manual_seed(config["seed"] * 1_000_003 + 7919 * step + rank)
    x = torch.randn(config["tokens"], config["d_model"], generator=g)
    x[:, 0] = 1.0
    return x.to(device)


# ---- the ranks ----

def _init_weights(layer, gate, config):
    torch.manual_seed(config["seed"] + 2)  # the same expert weights for every method
    with torch.no_grad():
        for p in (layer.w1, layer.w2):
            p.normal_(std=1.0 / math.sqrt(p.shape[1]))
        layer.gate.weight.copy_(gate)


def _build_layers(config, world, cost, device):
    from fastdist.moe import MoELayer

    num_experts = config["experts_per_rank"] * world
    g = torch.Generator().manual_seed(config["seed"] + 1)
    gate = torch.randn(num_experts, config["d_model"], generator=g) / math.sqrt(config["d_model"])
    layers = {}
    for name in config["methods"]:
        if name in PEERS:
            layer = PaddedDroplessMoE(config["d_model"], config["d_ff"], num_experts, k=config["k"]).to(device)
        else:
            m = METHODS[name]
            layer = MoELayer(config["d_model"], config["d_ff"], num_experts, k=config["k"],
                             capacity_factor=config["capacity_factor"], dropless=m["dropless"], balance=m["balance"],
                             max_replicas_per_rank=config["max_replicas"], cost_model=cost).to(device)
        _init_weights(layer, gate, config)
        layers[name] = layer
    return layers


def _check_peer(layers, config, device):
    """The peer's largest deviation from dropless MoELayer on step 0's tokens (relative to dropless's largest
    value, the worst rank's), after undoing the gates' normalization: each token's output times the sum of its
    top-k gate probabilities. Raises on every rank when it exceeds CHECK_TOLERANCE; None without a peer."""
    from fastdist.moe import MoELayer

    peers = [n for n in config["methods"] if n in PEERS]
    if not peers:
        return None
    world = dist.get_world_size()
    num_experts = config["experts_per_rank"] * world
    reference = MoELayer(config["d_model"], config["d_ff"], num_experts, k=config["k"], dropless=True,
                         balance="none").to(device)
    _init_weights(reference, layers[peers[0]].gate.weight.detach(), config)
    x = tokens_for(0, dist.get_rank(), config, device)
    errors = {}
    with torch.no_grad():
        reference.gate.weight[:, 0] = gate_column(num_experts, 0, config).to(device)
        want = reference(x)
        for name in peers:
            peer = layers[name]
            peer.gate.weight.copy_(reference.gate.weight)
            top = torch.topk(torch.softmax(peer.gate(x).float(), dim=-1), config["k"], dim=1).values
            got = peer(x) * top.sum(dim=1, keepdim=True).to(x.dtype)
            errors[name] = relative_error(got, want)
    return worst_errors(errors, CHECK_TOLERANCE, "moe: the peer's output differs from dropless MoELayer's", device)


def _time_step(layer, x, device):
    with together(device) as watch:
        layer(x).float().pow(2).mean().backward()
    layer.zero_grad(set_to_none=True)
    return all_max([watch.seconds], device)[0]


def bench_rank(config: dict) -> Any:
    """Runs the suite's measurements on this rank (a collective); returns the results on rank 0, None elsewhere."""
    from fastdist.moe import calibrate

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    pin_local_rank(device)  # a core per rank; with more ranks than cores they share them (and the model knows)
    cost = calibrate(None, config["d_model"], config["d_ff"], device=device, tokens=config["tokens"],
                     num_experts=config["experts_per_rank"] * world, k=config["k"])
    layers = _build_layers(config, world, cost, device)
    peer_errors = _check_peer(layers, config, device)
    num_experts = config["experts_per_rank"] * world
    samples = {name: [] for name in config["methods"]}
    for step, name, timed in rounds(config["methods"], config["warmup"], config["steps"], "moe", enabled=rank == 0):
        layer = layers[name]
        with torch.no_grad():  # every method routes this step's tokens with this step's popularity
            layer.gate.weight[:, 0] = gate_column(num_experts, step, config).to(device)
        seconds = _time_step(layer, tokens_for(step, rank, config, device), device)
        if timed:
            samples[name].append({"seconds": seconds, **layer.stats()})
    if rank != 0:
        return None
    return {"samples": samples, "cost_model": dict(vars(cost)), "num_experts": num_experts, "peer_errors": peer_errors}


# ---- summary ----

def _computed_over_routed(s):
    """Expert rows computed over assignments routed, all ranks: 1 for dropless, below 1 when tokens are dropped,
    above 1 with padding."""
    if "rows_computed_over_routed" in s:
        return s["rows_computed_over_routed"]
    kept = sum(s["tokens_per_rank"])
    return kept / max(kept + s["dropped"], 1)


def _summarise(samples, method):
    times = [s["seconds"] for s in samples]
    median_time = statistics.median(times)
    a2a = [max(s["a2a_bytes_per_rank"]) / max(np.mean(s["a2a_bytes_per_rank"]), 1e-12) for s in samples]
    predicted = [s["predicted_s"] for s in samples]
    modelled = all(p is not None for p in predicted)
    median_predicted = statistics.median(predicted) if modelled else None
    before = [s["std_tokens_per_rank_before"] for s in samples]
    after = [s["std_tokens_per_rank_after"] for s in samples]
    median = statistics.median
    return {
        "method": method, "time_ms": median_time * 1e3, "samples_ms": [t * 1e3 for t in times],
        "tokens_max_over_mean": median(s["tokens_max_over_mean"] for s in samples),
        "tokens_max_over_mean_unbalanced": median(s["tokens_max_over_mean_unbalanced"] for s in samples),
        "a2a_bytes_max": median(max(s["a2a_bytes_per_rank"]) for s in samples), "a2a_max_over_mean": median(a2a),
        "std_before": median(before), "std_after": median(after),
        "std_ratio": median(b / a if a > 0 else float("inf") for b, a in zip(before, after)),
        "dropped": int(sum(s["dropped"] for s in samples)), "replicas": median(len(s["replicas"]) for s in samples),
        "planner_searches": samples[-1].get("planner_searches"),  # over all its steps, warm-up included
        "rows_computed_over_routed": median(_computed_over_routed(s) for s in samples),
        "predicted_ms": median_predicted * 1e3 if modelled else None,
        "model_error": statistics.mean(abs(p - t) / t for p, t in zip(predicted, times)) if modelled else None,
        # the configuration's typical step: the median prediction against the median measurement
        "model_error_of_medians": abs(median_predicted - median_time) / median_time if modelled else None,
    }


def projection(cost_model: dict, config: dict) -> list[dict]:
    """Predicted layer time per policy on Zipf count matrices for larger rank counts (no measurement)."""
    from fastdist.moe import CostModel, Plan, loads, plan_prophet, plan_shadow

    # a projection to one device per rank: no sharing of cores, whatever the measured run had
    cost = CostModel(**{**cost_model, "rank_hosts": (), "host_slots": ()})
    rows = []
    for world in config["project"]:
        experts = world * config["experts_per_rank"]
        rng = np.random.default_rng(config["seed"])
        pop = 1.0 / np.arange(1, experts + 1) ** config["zipf"]
        pop = pop[rng.permutation(experts)]
        counts = np.stack([rng.multinomial(config["tokens"] * config["k"], pop / pop.sum()) for _ in range(world)])
        plans = {"dropless": Plan(), "shadow": plan_shadow(counts, cost, config["max_replicas"]),
                 "prophet": plan_prophet(counts, cost, config["max_replicas"])[0]}
        times = {name: cost.time(counts, plan)[0] for name, plan in plans.items()}
        balance = {name: float(loads(counts, plan)[0].max() / loads(counts, plan)[0].mean())
                   for name, plan in plans.items()}
        rows.append({"ranks": world, "experts": experts, "predicted_ms": {k: v * 1e3 for k, v in times.items()},
                     "tokens_max_over_mean": balance, "prophet_vs_dropless": times["dropless"] / times["prophet"],
                     "prophet_vs_shadow": times["shadow"] / times["prophet"]})
    return rows


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and tables on the printing rank; returns the JSON payload (None on the
    other torchrun ranks)."""
    config = {k: getattr(args, k) for k in CONFIG}
    result = run_suite("moe", args, bench_rank, config, _collect, tables)
    if result is not None:
        cost_model = result["cost_model"]
        print("# cost model compute: " + (f"ranks share cores: hosts {list(cost_model['rank_hosts'])}, "
                                          f"{list(cost_model['host_slots'])} running at once per host"
                                          if cost_model["rank_hosts"] else "a core (or device) per rank"))
    return result


def _collect(out: dict, config: dict, launch: Any) -> dict:
    rows = [_summarise(out["samples"][m], m) for m in config["methods"]]
    report.set_speedups(rows, "dropless", "speedup_vs_dropless")
    return {"rows": rows, "cost_model": out["cost_model"], "projection": projection(out["cost_model"], config),
            "peer_check": out["peer_errors"], "load_average": list(os.getloadavg())}


PROJECTED = ("dropless", "shadow", "prophet")
"""The methods the cost model's projection compares."""


def tables(result: dict) -> list[report.Part]:
    """The layer's table and the cost model's projection of `result` (its JSON payload), printed by `run` and
    shown in the docs."""
    c, rows = result["config"], result["rows"]
    ranks = result["env"].get("ranks")
    caption = (f"d_model {c['d_model']}, d_ff {c['d_ff']}, {c['experts_per_rank'] * ranks} experts "
               f"({c['experts_per_rank']}/rank), top-{c['k']}, {c['tokens']} tokens/rank, Zipf {c['zipf']} drifting "
               f"every {c['drift_every']} steps; median of {c['steps']} steps after {c['warmup']} warm-up.")
    columns = [col("method", "method"), col("fwd+bwd (ms)", "time_ms", fixed(1)),
               col("vs dropless", "speedup_vs_dropless", times(2)),
               col("tokens/rank max/mean", "tokens_max_over_mean", fixed(2)),
               col("a2a bytes max/mean", "a2a_max_over_mean", fixed(2)),
               col("std tokens/rank before", "std_before", fixed(0)), col("after", "std_after", fixed(0)),
               col("dropped", "dropped", integer), col("replicas", "replicas", integer),
               col("rows computed / routed", lambda r: r.get("rows_computed_over_routed"), fixed(2)),
               col("predicted (ms)", "predicted_ms", fixed(1)),
               col("model error, medians (%)", "model_error_of_medians", percent(1)),
               col("model error, per step (%)", "model_error", percent(1))]
    modelled = [r for r in rows if r.get("predicted_ms") is not None]
    notes = [f"cost model: mean error {100 * statistics.mean(r['model_error_of_medians'] for r in modelled):.1f}% "
             f"over the {len(modelled)} methods it predicts (median predicted vs median measured), "
             f"{100 * statistics.mean(r['model_error'] for r in modelled):.1f}% per step."] if modelled else []
    for name, error in (result.get("peer_check") or {}).items():
        notes.append(f"{name}: an equivalent of Tutel's dropless mode (capacity_factor=0: every expert padded to "
                     "the largest per-expert count of any rank, padded all-to-alls, batched experts, top-k gates "
                     "normalized), not Tutel's code; its output matched dropless MoELayer's, the normalization undone, "
                     f"to {scientific(1)(error)} (relative) before timing.")
    load = result.get("load_average")
    if load:
        caption += f" Load average {load[0]:.1f} (1 min) at the end of the run."
    layout = result.get("layout")  # recordings from before moe_layout moved to the kernels suite
    if layout:
        notes.append(f"moe_layout, {layout['assignments']} assignments, {layout['threads']} threads "
                     f"({layout['device']}): fastdist {layout['fastdist']['median_ms']:.2f} ms, torch sort/bincount "
                     f"{layout['torch']['median_ms']:.2f} ms ({layout['speedup']:.1f}x).")
    parts = [report.Part("layer", columns, rows, caption, notes)]
    if result.get("projection"):
        proj = [col("ranks", "ranks", integer), col("experts", "experts", integer)]
        proj += [col(f"{m} (ms)", lambda r, m=m: r["predicted_ms"][m], fixed(1)) for m in PROJECTED]
        proj += [col("prophet vs dropless", "prophet_vs_dropless", times(2)),
                 col("prophet vs shadow", "prophet_vs_shadow", times(2)),
                 col("tokens max/mean, dropless", lambda r: r["tokens_max_over_mean"]["dropless"], fixed(2)),
                 col("tokens max/mean, prophet", lambda r: r["tokens_max_over_mean"]["prophet"], fixed(2))]
        parts.append(report.Part("projection", proj, result["projection"],
                                 "Projection from the calibrated cost model (not measured): Zipf popularity over a "
                                 "random expert order."))
    return parts


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    rows, env = result["rows"], result["env"]
    _, fig, (ax_t, ax_b, ax_p) = report.subplots(1, 3, figsize=(15, 4.5))
    names = [r["method"] for r in rows]
    report.grouped_bars(ax_t, names, {None: [r["time_ms"] for r in rows]}, "layer fwd+bwd (ms, median)", "measured",
                        rotation=20, color="tab:blue")
    report.grouped_bars(ax_b, names, {None: [r["tokens_max_over_mean"] for r in rows]}, "tokens per rank, max / mean",
                        "balance", rotation=20, color="tab:orange")
    ax_b.axhline(1.10, color="gray", ls="--", lw=1)
    proj = result["projection"]
    for name in PROJECTED:
        ax_p.plot([p["ranks"] for p in proj], [p["predicted_ms"][name] for p in proj], marker="o", label=name)
    ax_p.set_xscale("log", base=2)
    ax_p.set(xlabel="ranks", ylabel="predicted fwd+bwd (ms)", title="PROJECTION (cost model, not measured)")
    ax_p.legend()
    report.save_figure(fig, path, f"fastdist-bench moe: {env['ranks']} ranks, {env['backend']}, {env['network']}",
                       dpi=110)
