"""`fastdist-bench embedding`: a DLRM-style training step with large tables, sharded by fastdist against the ways a
user would otherwise train it.

Model: --tables EmbeddingBags (sum) of --rows x --dim, each sample pooling --pooling ids per table, a bottom MLP
over 13 dense features, DLRM's pairwise dot interactions and a top MLP to one logit (binary cross-entropy); the
tables hold almost all the parameters. Ids are Zipf(--zipf) draws over each table, the hot ids scattered over the
table by a fixed permutation (as hashed categorical features are). Every method trains its own copy of the model
from the same initial weights on the same batches with SGD(--lr), one step per repetition, interleaved (the order
rotated each repetition), warm-up steps first:

  fastdist      fastdist.embedding.hybrid_parallel: tables row-sharded (EmbeddingBag(sparse=True) -> ShardedEmbedding,
                AlltoAll lookups and gradient rows), the MLPs under DDP; the tables the model calls one by one are
                fused (LookupFusion): one exchange per step for all of them
  fastdist-unfused  the same with hybrid_parallel(fuse=False): one exchange per table
  fastdist-priority  fastdist-unfused with hybrid_parallel(prioritize=True): the 2D schedule's priority queue holds
                DDP's dense buckets while a table exchange of the backward is due or in flight
  fastdist-2d   the same with the 2D schedule's lookahead: after each forward, every table prefetches the next
                batch's ids (ShardedEmbedding.prefetch): the ids leave before the backward, the rows the update
                leaves alone when the backward reaches the table, and the next lookup waits only for the rest (the
                tables' prefetches fused into one exchange, as their lookups are)
  fastdist-2d-now  the same with prefetch(rows_ahead="now"): the rows the update leaves alone leave at the prefetch
                call, before the backward, and travel during all of it
  fastdist-2d-ids  the same with prefetch(rows_ahead=False): only the ids go ahead, the lookup fetches every row
                in one AlltoAll
  fastdist-collection  the same, with the model's tables written as one ShardedEmbeddingCollection (as TorchRec's
                users write one EmbeddingBagCollection): every table in one exchange per step
  ddp-sparse    fastdist.bench.peers.ddp_sparse: DDP over the whole model with EmbeddingBag(sparse=True), gloo's
                sparse all-reduce of the table gradients (a ring all-gather of every rank's rows: AGsparse)
  ddp-sketch-auto  the same with fastdist's sketch_hook (SketchState(mode="auto"): per call dense, the exact union
                or a count-sketch, lossless here as the union is small) as DDP's comm hook
  ddp-dense     DDP over the whole model with dense table gradients (ring all-reduce of the full tables)
  torchrec      TorchRec 1.8.0 EmbeddingBagCollection under DistributedModelParallel, --torchrec-sharding
                (table_wise, or row_wise through a sharder whose sharding_types() offers it), fused EXACT_SGD in the
                backward, the MLPs under TorchRec's DDP; its tables start from TorchRec's own initialization (same
                shapes, same batches, same MLP weights)
  local         the same step on one rank's batch without any communication: the compute share of a step

Columns: step is the median over repetitions of the slowest rank's fwd+bwd+optimizer step; samples/s is ranks x
--batch over it; vs ddp-sparse is ddp-sparse's median over the method's; wire model is what a rank sends per step
by the method's byte model, the busiest rank's (dense DDP: a ring all-reduce as fastdist.comm.wire; ddp-sparse:
peers.ddp_sparse_wire_bytes, gloo's ring all-gatherv of the ranks' (index, row) lists; fastdist's own count of the ids,
rows, gradient rows and a prefetch's flags its AlltoAlls sent to other ranks plus the dense all-reduce); tx is what
the busiest rank's interface really sent per step (simulated network only); tables/rank is the table weights a rank
holds (SGD keeps no state); final loss is rank 0's loss at the last step, and the loss diff the largest difference from
ddp-dense's loss over all steps (the methods that start from the same weights train the same model).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fastdist.bench import report
from fastdist.bench.launch import add_launch_arguments, pin_local_rank, run_suite, tx_counter
from fastdist.bench.report import MIB, col, fixed, scaled, scientific, times
from fastdist.bench.toolkit import all_max, at_least, comma_list, rounds, together
from fastdist.bench.peers import ddp_sparse, ddp_sparse_wire_bytes
from fastdist.comm.wire import ring_allreduce_bytes
from fastdist.testing.corpus import generator, zipf_probs

METHODS = ["fastdist", "fastdist-unfused", "fastdist-priority", "fastdist-2d", "fastdist-2d-now", "fastdist-2d-ids", "fastdist-collection",
           "ddp-sparse", "ddp-sketch-auto", "ddp-dense", "torchrec", "local"]
DENSE_IN = 13
HIDDEN = 64
BASELINE = "ddp-sparse"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=1800.0)
    p.add_argument("--methods", type=comma_list(choices=METHODS), default=",".join(METHODS),
                   help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--tables", type=at_least(1), default=2, help="embedding tables (default %(default)s)")
    p.add_argument("--rows", type=at_least(1), default=131072, help="rows per table (default %(default)s)")
    p.add_argument("--dim", type=at_least(1), default=64, help="row width (default %(default)s)")
    p.add_argument("--batch", type=at_least(1), default=256, help="samples per rank per step (default %(default)s)")
    p.add_argument("--pooling", type=at_least(1), default=8, help="ids per sample per table (default %(default)s)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default %(default)s)")
    p.add_argument("--torchrec-sharding", choices=["table_wise", "row_wise"], default="row_wise",
                   help="TorchRec's sharding type (default %(default)s)")
    p.add_argument("--steps", type=at_least(1), default=5, help="timed repetitions (default %(default)s)")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed repetitions first (default %(default)s)")


CONFIG = ("methods", "tables", "rows", "dim", "batch", "pooling", "zipf", "lr", "torchrec_sharding", "steps", "warmup")
"""The options the ranks are given (the payload's config)."""


# ---- the model ----

class DLRM(nn.Module):
    """Bottom MLP, EmbeddingBags (or an injected embedding module), dot interactions, top MLP."""

    def __init__(self, tables: int, rows: int, dim: int, sparse: bool) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, dim), nn.ReLU())
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for _ in range(tables))
        pairs = (tables + 1) * tables // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def pooled(self, batch: dict) -> list[torch.Tensor]:
        return [e(i, batch["offsets"]) for e, i in zip(self.embeddings, batch["ids"])]

    def forward(self, batch: dict) -> torch.Tensor:
        x = self.bottom(batch["dense"])
        feats = torch.stack([x] + self.pooled(batch), 1)
        dots = feats @ feats.transpose(1, 2)
        rows, cols = torch.triu_indices(feats.shape[1], feats.shape[1], offset=1)
        logits = self.top(torch.cat([x, dots[:, rows, cols]], 1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch["labels"])


class _TorchRecDLRM(DLRM):
    """The same model with its tables in one TorchRec EmbeddingBagCollection (on the meta device until DMP)."""

    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__(0, rows, dim, sparse=False)
        import torchrec
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        del self.embeddings
        pairs = (tables + 1) * tables // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
        self.keys = [f"f{t}" for t in range(tables)]
        self.ebc = torchrec.EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=rows, feature_names=[k],
                               pooling=PoolingType.SUM) for t, k in enumerate(self.keys)], device=torch.device("meta"))

    def pooled(self, batch: dict) -> list[torch.Tensor]:
        out = self.ebc(batch["kjt"]).to_dict()  # the sharded output's keys are permuted: read it by name
        return [out[k] for k in self.keys]


class _CollectionDLRM(DLRM):
    """The same model with its tables in one fastdist ShardedEmbeddingCollection, row-sharded."""

    def __init__(self, base: DLRM) -> None:
        from fastdist.embedding import ShardedEmbeddingCollection
        super().__init__(0, 1, base.bottom[-2].out_features, sparse=True)
        self.bottom, self.top = base.bottom, base.top
        del self.embeddings
        self.tables = ShardedEmbeddingCollection({f"t{t}": e for t, e in enumerate(base.embeddings)},
                                                 sharding="row", average_gradients=True,
                                                 group=dist.new_group())  # apart from DDP's traffic

    def pooled(self, batch: dict) -> list[torch.Tensor]:
        out = self.tables({f"t{t}": (ids, batch["offsets"]) for t, ids in enumerate(batch["ids"])})
        return [out[f"t{t}"] for t in range(len(batch["ids"]))]


def make_batch(config: dict, rank: int, step: int) -> dict:
    """Rank `rank`'s batch at `step`: dense features, Zipf ids per table (hot ids scattered), labels."""
    g = generator("embedding-bench", rank, step)
    b, pooling = config["batch"], config["pooling"]
    probs = zipf_probs(config["rows"], config["zipf"])
    scatter = torch.randperm(config["rows"], generator=generator("embedding-bench-permutation"))
    ids = [scatter[torch.multinomial(probs, b * pooling, replacement=True, generator=g)]
           for _ in range(config["tables"])]
    return {"dense": torch.randn(b, DENSE_IN, generator=g), "ids": ids,
            "offsets": torch.arange(0, b * pooling, pooling), "labels": torch.randint(0, 2, (b,), generator=g).float()}


def _kjt(batch: dict, tables: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    b = batch["offsets"].numel()
    lengths = torch.full((tables * b,), batch["ids"][0].numel() // b, dtype=torch.int64)
    return KeyedJaggedTensor(keys=[f"f{t}" for t in range(tables)], values=torch.cat(batch["ids"]), lengths=lengths)


# ---- the methods ----

def _torchrec(config, base):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    sharding = config["torchrec_sharding"]

    class Sharder(EmbeddingBagCollectionSharder):
        """Offers the requested sharding type (row-wise is not among the CPU defaults)."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [sharding]

    model = _TorchRecDLRM(config["tables"], config["rows"], config["dim"])
    model.bottom.load_state_dict(base.bottom.state_dict())
    model.top.load_state_dict(base.top.state_dict())
    sharder = Sharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": config["lr"]})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"))
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, [torch.optim.SGD(dense, lr=config["lr"])]


def build(name: str, config: dict):
    """(model, optimizers) of a method, every one from the same initial weights (seed 0)."""
    from fastdist.embedding import hybrid_parallel
    torch.manual_seed(0)
    dense_tables = name == "ddp-dense"
    model = DLRM(config["tables"], config["rows"], config["dim"], sparse=not dense_tables)
    if name.startswith("fastdist") and name != "fastdist-collection":
        model = hybrid_parallel(model, min_rows=2, fuse=name not in ("fastdist-unfused", "fastdist-priority"),
                                prioritize=name == "fastdist-priority")
    elif name == "fastdist-collection":
        model = hybrid_parallel(_CollectionDLRM(model))
    elif name == "ddp-dense":
        model = DistributedDataParallel(model)
    elif name in ("ddp-sparse", "ddp-sketch-auto"):
        model = ddp_sparse(model)
        if name == "ddp-sketch-auto":
            from fastdist.comm.hooks import SketchState, sketch_hook
            model.register_comm_hook(SketchState(mode="auto"), sketch_hook)
    elif name == "torchrec":
        return _torchrec(config, model)
    return model, [torch.optim.SGD(model.parameters(), lr=config["lr"])]


PHASES = ("forward", "prefetch", "backward", "optimizer", "drain")
"""A step's phases, timed on each rank: forward (the lookups included), the next batch's prefetch call, backward
(with the gradient exchanges and DDP's all-reduce it waits for), the optimizer step, the wait for rows sent ahead."""


def _step(model, opts, batch, ahead=None, rows_ahead=True):
    """One training step; returns (loss, the seconds of each of PHASES on this rank)."""
    marks = [time.perf_counter()]
    for o in opts:
        o.zero_grad(set_to_none=True)
    loss = model(batch)
    marks.append(time.perf_counter())
    if ahead is not None:  # the next batch's lookups start before this backward (fastdist-2d)
        for table, ids in zip(model.module.embeddings, ahead["ids"]):
            table.prefetch(ids, ahead["offsets"], rows_ahead=rows_ahead)
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    for o in opts:
        o.step()
    marks.append(time.perf_counter())
    if ahead is not None:  # the rows sent ahead belong to this step, not to the methods timed next
        for table in model.module.embeddings:
            table.wait_prefetch()
    value = loss.item()
    marks.append(time.perf_counter())
    return value, [b - a for a, b in zip(marks, marks[1:])]


def wire_model(name: str, config: dict, world: int, model: nn.Module, batch: dict) -> float | None:
    """Bytes a rank sends per step by the method's byte model (fastdist: its counted AlltoAll traffic)."""
    dim, tables, rows = config["dim"], config["tables"], config["rows"]
    dense_bytes = 4 * sum(p.numel() for n, p in DLRM(tables, 1, dim, False).named_parameters()
                          if "embeddings" not in n)
    if name == "ddp-dense":
        return ring_allreduce_bytes(dense_bytes + 4 * tables * rows * dim, world)
    if name == "ddp-sparse":  # gloo all-gathers each table's coalesced (index, row) lists in a ring (peers' model)
        mine = torch.tensor([int(torch.unique(i).numel()) for i in batch["ids"]])
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        rows = torch.stack(every)  # [rank, table]
        return ring_allreduce_bytes(dense_bytes, world) + sum(ddp_sparse_wire_bytes(rows[:, t].tolist(), dim)
                                                              for t in range(tables))
    return None


def bench_rank(config: dict) -> Any:
    """Runs the suite's measurements on this rank (a collective); returns the results on rank 0, None elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if pin_local_rank() is None:
        torch.set_num_threads(1)  # the ranks share the cores
    methods = config["methods"]
    built = {}
    for name in methods:
        built[name] = build(name, config) if name != "local" else None
    if "local" in methods:
        torch.manual_seed(0)
        local = DLRM(config["tables"], config["rows"], config["dim"], sparse=True)
        built["local"] = (local, [torch.optim.SGD(local.parameters(), lr=config["lr"])])
    samples = {m: {"ms": [], "tx": [], "loss": [], "wire": [], "phases_ms": []} for m in methods}
    for it, name, timed in rounds(methods, config["warmup"], config["steps"], "embedding", enabled=rank == 0):
        batch = make_batch(config, rank, it)
        if name == "torchrec":
            batch["kjt"] = _kjt(batch, config["tables"])
        model, opts = built[name]
        last = it + 1 == config["warmup"] + config["steps"]
        ahead = make_batch(config, rank, it + 1) if name.startswith("fastdist-2d") and not last else None
        before = _traffic(model)
        tx0 = tx_counter(config["measure_tx"])
        with together() as watch:
            rows_ahead = {"fastdist-2d": True, "fastdist-2d-now": "now"}.get(name, False)
            loss, phases = _step(model, opts, batch, ahead, rows_ahead=rows_ahead)
        tx = tx_counter(config["measure_tx"]) - tx0
        seconds, tx_max = all_max([watch.seconds, float(tx)])
        every = [None] * world
        dist.all_gather_object(every, [1e3 * p for p in phases])
        s = samples[name]
        s["loss"].append(loss)
        if timed:
            s["ms"].append(1e3 * seconds)
            s["phases_ms"].append(every)  # [rank][phase]
            s["tx"].append(tx_max)
            sent = _traffic(model) - before
            wire = wire_model(name, config, world, model, batch) if not name.startswith("fastdist") else sent + \
                ring_allreduce_bytes(4 * sum(p.numel() for n, p in model.named_parameters()
                                             if "embeddings" not in n and "tables" not in n), world)
            s["wire"].append(all_max([float(wire)])[0] if wire is not None else None)
    memory = {name: _table_bytes(name, built[name][0], config, world) for name in methods}
    for name in list(built):
        model, opts = built.pop(name)
        del model, opts
    gc.collect()  # DDP's and gloo's threads gone before the process group is destroyed
    return {"samples": samples, "table_bytes": memory} if rank == 0 else None


def _traffic(model) -> int:
    """Bytes fastdist's tables sent to other ranks so far (ids 8 B, rows and gradient rows 4 B per value, a
    prefetch's flags)."""
    from fastdist.embedding import ShardedEmbedding
    total = 0
    for m in model.modules():
        if isinstance(m, ShardedEmbedding):
            t = m.traffic
            total += 8 * t["ids"] + m.weight.element_size() * m.embedding_dim * (t["rows"] + t["grad_rows"]) + \
                t["control"]
    return total


def _table_bytes(name, model, config, world):
    full = 4 * config["tables"] * config["rows"] * config["dim"]
    if name == "torchrec" or name.startswith("fastdist"):
        return full / world  # row-wise (or table-wise, balanced when tables divide by ranks)
    return full * (2 if name == "ddp-dense" else 1)  # dense gradients are table-sized too


def _summarise(name, s, memory, reference_losses, world, config):
    ms = statistics.median(s["ms"])
    wire = [w for w in s["wire"] if w is not None]
    diff = None
    if reference_losses is not None and name not in ("torchrec", "local"):
        diff = max(abs(a - b) for a, b in zip(s["loss"], reference_losses))
    phases = {p: [statistics.median(step[r][i] for step in s["phases_ms"]) for r in range(world)]
              for i, p in enumerate(PHASES)} if s["phases_ms"] else None
    return {"method": name, "time_ms": ms, "samples_ms": s["ms"], "samples_per_s": world * config["batch"] / ms * 1e3,
            "phases_ms": phases, "samples_phases_ms": s["phases_ms"],
            "wire_bytes": statistics.median(wire) if wire else None,
            "tx_bytes": statistics.median(s["tx"]) if config["measure_tx"] else None, "table_bytes": memory,
            "final_loss": s["loss"][-1], "losses": s["loss"], "loss_diff_vs_ddp_dense": diff}


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and table on the printing rank; returns the JSON payload (None on the
    other torchrun ranks)."""
    return run_suite("embedding", args, bench_rank, {k: getattr(args, k) for k in CONFIG}, _collect, tables)


def _collect(out: dict, config: dict, launch: Any) -> dict:
    samples = out["samples"]
    reference = samples["ddp-dense"]["loss"] if "ddp-dense" in samples else None
    rows = [_summarise(m, samples[m], out["table_bytes"][m], reference, launch.world, config)
            for m in config["methods"]]
    if BASELINE in config["methods"]:
        report.set_speedups(rows, BASELINE, "speedup_vs_ddp_sparse")
    return {"rows": rows, "load_average": list(os.getloadavg())}


def tables(result: dict) -> list[report.Part]:
    """The suite's table of `result` (its JSON payload), printed by `run` and shown in the docs."""
    c, rows = result["config"], result["rows"]
    params = c["tables"] * c["rows"] * c["dim"]
    caption = (f"DLRM-style step: {c['tables']} tables x {c['rows']} rows x {c['dim']} ({params * 4 / MIB:.0f} MiB), "
               f"batch {c['batch']}/rank x {c['pooling']} ids/table, Zipf {c['zipf']}, SGD; "
               f"TorchRec {c['torchrec_sharding']}; median of {c['steps']} steps after {c['warmup']} warm-up, "
               f"{result['env']['ranks']} ranks, {result['env']['network']}.")
    load = result.get("load_average")
    if load:
        caption += f" Load average {load[0]:.1f} (1 min) at the end of the run."
    columns = [col("method", "method"), col("step (ms)", "time_ms", fixed(1)),
               col("samples/s", "samples_per_s", fixed(0)), col("vs ddp-sparse", "speedup_vs_ddp_sparse", times(2)),
               col("wire model (MiB/rank)", "wire_bytes", scaled(MIB, 2)),
               col("tx (MiB/rank)", "tx_bytes", scaled(MIB, 2)),
               col("tables/rank (MiB)", "table_bytes", scaled(MIB, 1)),
               col("final loss", "final_loss", fixed(4)),
               col("loss diff vs ddp-dense", "loss_diff_vs_ddp_dense", scientific(1))]
    notes = []
    by = {r["method"]: r for r in rows}
    if "local" in by and BASELINE in by:
        share = 1 - by["local"]["time_ms"] / by[BASELINE]["time_ms"]
        notes.append(f"communication share of ddp-sparse's step (1 - local / ddp-sparse): {100 * share:.0f}%.")
    for r in rows:
        if r.get("phases_ms") and r["method"] != "local":
            notes.append(f"{r['method']} phases (ms, median per rank, slowest rank): " + ", ".join(
                f"{p} {max(v):.1f}" for p, v in r["phases_ms"].items() if max(v) >= 0.05))
    if "torchrec" in by:
        notes.append("torchrec's tables start from TorchRec's own initialization, so its loss is not comparable.")
    return [report.Part("step", columns, rows, caption, notes)]


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    rows, env = result["rows"], result["env"]
    _, fig, (ax_t, ax_w) = report.subplots(1, 2, figsize=(11, 4.2))
    names = [r["method"] for r in rows]
    report.grouped_bars(ax_t, names, {None: [r["time_ms"] for r in rows]}, "step (ms, median, slowest rank)",
                        rotation=20, color="tab:blue")
    wire = [(r["tx_bytes"] if r["tx_bytes"] is not None else r["wire_bytes"]) or 0 for r in rows]
    measured = "measured tx" if rows[0]["tx_bytes"] is not None else "byte model"
    report.grouped_bars(ax_w, names, {None: [w / MIB for w in wire]}, f"MiB sent per rank per step ({measured})",
                        rotation=20, color="tab:orange")
    fig.suptitle(f"fastdist-bench embedding: {env['ranks']} ranks, {env['backend']}, {env['network']}", fontsize=9)
    report.save_figure(fig, path, dpi=110)
