"""`fastdist-bench sparse-lm`: convergence of a large-vocabulary language model under each gradient reducer.

Trains the same model from the same initialization on the same data for the same number of steps on N ranks
(default 4; `--net 1gbit` for the simulated cluster), once per method, the methods interleaved step by step so
that machine noise hits all of them alike:

  dense        plain DDP all-reduce                       lossless
  fp16         torch's fp16_compress_hook
  agsparse     nn.Embedding(sparse=True): gloo's sparse all-reduce (all-gather of index/value lists)  lossless
  powersgd     torch's powerSGD_hook, rank 4, error feedback, start_iter 2
  omnireduce   fastdist sketch_hook, mode "exact": union bitmap + all-reduce of the union's rows          lossless
  auto         fastdist sketch_hook, mode "auto": dense, exact or sketch, chosen per call from |U|
  auto-bg      the same with SketchState(background=True): buckets reduced on the hook's own thread and group
  sketch-Fx    fastdist sketch_hook, mode "sketch", table of F x the union's non-zeros (F = 0.1, 0.2, 0.5, 1)
  sketch-Fx+ef the same with sketch-space error feedback
agsparse and every sketch_hook method train on nn.Embedding(sparse=True) gradients (the hook reduces them
sparse, without a dense copy); dense, fp16 and powersgd on dense gradients, as those hooks need.

The model is `fastdist.testing.models.SparseLM` (`--embed-dim` widens its input embedding), trained with a sampled
softmax whose negatives are drawn per step from the unigram^0.75 distribution, identically on every rank, so both
V-row matrices get row-sparse gradients; the reported loss is the full-softmax cross-entropy on a fixed held-out
batch, on rank 0. Every parameter has its own DDP bucket (so the hook reduces each V-row matrix alone, per row),
except under PowerSGD: torch's hook issues collectives from future callbacks, which with several buckets in
flight on gloo can run in different orders on different ranks and deadlock. Adagrad updates only the rows whose
reduced gradient is non-zero (`row_sparse`: the same update; `--dense-update` turns it off).

A sketch of size F has r x c = F x |U| x row width values, |U| the union of the rows each matrix touches across
ranks over the first `--calibration-steps` steps (from the data alone): F = 1 sends as many values as the
lossless union all-reduce. Wire bytes: ours as sketch_hook reports them, the baselines' from a ring / all-gather
model of the busiest rank; tx is what each rank's interface really sent (simulated cluster). The second table
orders the methods by wire bytes: the Pareto front of bytes against final loss.
"""
import argparse
import math
import statistics
import types
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastdist.bench import report
from fastdist.bench.report import KIB, col, fixed, percent, scaled, times
from fastdist.bench.launch import add_launch_arguments, run_suite, tx_counter
from fastdist.bench.peers import ddp_sparse, ddp_sparse_wire_bytes
from fastdist.testing.corpus import ZipfMarkovCorpus
from fastdist.testing.models import NegativeSampler, SparseLM, make_data, step_batch
from fastdist.bench.toolkit import at_least, comma_list, progress, together, up_to
from fastdist.comm.baselines import ring_allreduce_bytes

BASELINES = ["dense", "fp16", "agsparse", "powersgd"]
OURS = ["omnireduce", "auto", "auto-bg"]
SKETCH_SIZES = (0.1, 0.2, 0.5, 1.0)
LOSSLESS = {"dense", "agsparse", "omnireduce"}  # auto is lossless when it chooses exact/dense (reported)
POWERSGD_RANK = 4
POWERSGD_START = 2  # torch requires > 1 with error feedback
LOSS_TIE = 1e-4  # final losses closer than this are equal for the Pareto front


# --- the optimizer's view of a gradient ------------------------------------------------------------------------

def row_sparse(grad: torch.Tensor) -> torch.Tensor:
    """The rows of a dense [n, m] gradient that hold a non-zero, as a coalesced sparse_coo tensor: the same
    gradient, but Adagrad then updates only those rows. Exact: Adagrad leaves a row whose gradient is zero
    unchanged (state += 0, parameter += -lr * 0 / std), so the sparse and dense updates agree."""
    from fastdist import ops

    rows = ops.unpack_bits(ops.nonzero_bitmap(grad, "row"), grad.shape[0]).nonzero().flatten()
    return torch.sparse_coo_tensor(rows.unsqueeze(0), grad.index_select(0, rows), grad.shape,
                                   is_coalesced=True, check_invariants=False)


# --- the union sizes that set the sketch sizes -----------------------------------------------------------------

def calibrate(corpus: ZipfMarkovCorpus, sampler: NegativeSampler, config: dict, world: int) -> dict:
    """Union sizes (rows) of (embed, out) over the first calibration steps, from the data alone."""
    unions, locals_ = {"embed": [], "out": []}, {"embed": [], "out": []}
    for step in range(config["calibration_steps"]):
        per_rank = [SparseLM.touched_rows(*step_batch(corpus, sampler, r, step, config)) for r in range(world)]
        for i, name in enumerate(("embed", "out")):
            unions[name].append(int(torch.cat([rows[i] for rows in per_rank]).unique().numel()))
            locals_[name].append(statistics.mean(int(rows[i].numel()) for rows in per_rank))
    return {name: {"union_rows": statistics.median(unions[name]), "union_rows_samples": unions[name],
                   "local_rows": statistics.mean(locals_[name]),
                   "union_fraction": statistics.median(unions[name]) / config["vocab"]}
            for name in ("embed", "out")}


# --- routing DDP buckets to sketch_hook ---------------------------------------------------------------------

def _not_last(bucket: dist.GradBucket) -> types.SimpleNamespace:
    """`bucket` seen through sketch_hook without advancing its step counter (the router does that)."""
    return types.SimpleNamespace(buffer=bucket.buffer, index=bucket.index, parameters=bucket.parameters,
                                 is_last=lambda: False)


class SketchRouter:
    """State of `routed_sketch_hook`: each V-row matrix alone in its bucket goes through sketch_hook with its
    own SketchState (its own sketch size); every other bucket takes a plain averaged all-reduce. Counts the
    bytes of both."""

    def __init__(self, states: dict, process_group: dist.ProcessGroup | None = None) -> None:
        self.states = states  # {parameter: SketchState}
        self.process_group = process_group
        self.plain_wire_bytes = 0
        self.index_of = {}  # id(state) -> the bucket index it was last used for

    def state_for(self, bucket: Any) -> Any:
        """The SketchState of the V-row matrix alone in `bucket`, or None for any other bucket."""
        params = bucket.parameters()
        if len(params) != 1:
            return None
        for param, state in self.states.items():
            if params[0].data_ptr() == param.data_ptr():
                return state
        return None

    def sparse_wire_bytes(self) -> int:
        """Bytes of the V-row matrices' buckets (what sketch_hook sent for them)."""
        return sum(b.wire_bytes for s in self.states.values() for b in s.buckets.values())

    def wire_bytes(self) -> int:
        """Bytes of every bucket so far (the plain ones' ring model and what sketch_hook sent)."""
        return self.plain_wire_bytes + self.sparse_wire_bytes()

    def last_methods(self) -> dict[str, str]:
        """How each V-row matrix was reduced in the last step, by name (embed, out)."""
        out = {}
        for name, state in zip(("embed", "out"), self.states.values()):
            b = state.buckets.get(self.index_of.get(id(state)))
            out[name] = b.last_method if b is not None else "dense"
        return out


def routed_sketch_hook(router: SketchRouter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: V-row matrices through sketch_hook, other buckets all-reduced."""
    from fastdist.comm.hooks import sketch_hook

    state = router.state_for(bucket)
    if state is None:
        buffer = bucket.buffer()
        world = dist.get_world_size(router.process_group)
        router.plain_wire_bytes += ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world)
        fut = dist.all_reduce(buffer.div_(world), group=router.process_group, async_op=True).get_future()
        fut = fut.then(lambda f: f.value()[0])
    else:
        router.index_of[id(state)] = bucket.index()
        fut = sketch_hook(state, _not_last(bucket))
    if bucket.is_last():
        for s in router.states.values():
            s.iter += 1
    return fut


def sketch_methods(sizes: Sequence[float]) -> list[str]:
    """The sketch method names for the sizes, each with and without error feedback."""
    return [f"sketch-{f:g}x{ef}" for f in sizes for ef in ("", "+ef")]


def uses_sketch_hook(name: str) -> bool:
    """Whether method `name` reduces through fastdist's sketch_hook."""
    return name in OURS or name.startswith("sketch-")


def all_methods(sizes: Sequence[float] = SKETCH_SIZES) -> list[str]:
    """Every method name, baselines first."""
    return BASELINES + OURS + sketch_methods(sizes)


def parse_methods(text: str, sizes: Sequence[float]) -> list[str]:
    """The methods named by `text` (names or groups, comma-separated), in order, without repeats."""
    known = all_methods(sizes)
    groups = {"all": known, "baselines": BASELINES, "ours": OURS + sketch_methods(sizes),
              "sketch": sketch_methods(sizes)}
    names = [name for item in (x.strip() for x in text.split(",")) if item for name in groups.get(item, [item])]
    for name in names:
        if name not in known:
            raise SystemExit(f"fastdist-bench sparse-lm: unknown method {name!r}; choose from "
                             f"{', '.join(known)} or a group ({', '.join(groups)})")
    if not names:
        raise SystemExit("fastdist-bench sparse-lm: no methods given")
    return list(dict.fromkeys(names))


class Method:
    """One training run: its DDP model, optimizer, communication hook, and how it counts wire bytes."""

    def __init__(self, name: str, config: dict, calib: dict, world: int) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.name, self.world, self.config = name, world, config
        self.lossless = name in LOSSLESS
        torch.manual_seed(config["seed"])  # the same initialization for every method
        self.model = SparseLM(config["vocab"], config["dim"], sparse=name == "agsparse" or uses_sketch_hook(name),
                              embed_dim=config["embed_dim"])
        # one bucket per parameter, but one for PowerSGD (see the module's docstring)
        self.ddp = (ddp_sparse if name == "agsparse" else DDP)(self.model,
                                                                bucket_cap_mb=1 << 16 if name == "powersgd" else 1e-6)
        self.opt = torch.optim.Adagrad(self.model.parameters(), lr=config["lr"])
        self.router = self.powersgd = self.ratios = None
        if name == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
            self.ddp.register_comm_hook(None, fp16_compress_hook)
        elif name == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            self.powersgd = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                               start_powerSGD_iter=POWERSGD_START, use_error_feedback=True,
                                               warm_start=True, random_seed=config["seed"])
            self.ddp.register_comm_hook(self.powersgd, psgd.powerSGD_hook)
        elif uses_sketch_hook(name):
            from fastdist.comm.hooks import SketchState

            kwargs = {"rows": config["sketch_rows"], "seed": config["seed"]}
            if name == "omnireduce":
                kwargs.update(mode="exact", exact_collective="allreduce-union")
            elif name in ("auto", "auto-bg"):
                kwargs.update(mode="auto", ratio=config["auto_ratio"], background=name == "auto-bg")
            else:
                size = float(name[len("sketch-"):].split("x")[0])
                kwargs.update(mode="sketch", error_feedback=name.endswith("+ef"))
                self.ratios = {m: min(1.0, size * calib[m]["union_rows"] / (config["vocab"] * config["sketch_rows"]))
                               for m in ("embed", "out")}
            states = {}
            for i, (mname, param) in enumerate((("embed", self.model.embed.weight), ("out", self.model.out.weight))):
                kw = dict(kwargs, seed=kwargs["seed"] * 2 + i)
                if self.ratios is not None:
                    kw["ratio"] = self.ratios[mname]
                states[param] = SketchState(**kw)
            self.router = SketchRouter(states)
            self.ddp.register_comm_hook(self.router, routed_sketch_hook)
        elif name not in ("dense", "agsparse"):
            raise ValueError(f"unknown method {name!r}")
        self.numels = [p.numel() for p in self.model.parameters()]
        self.shapes = [tuple(p.shape) for p in self.model.parameters()]

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor,
                   log_expected: torch.Tensor) -> float:
        """One training step of this method; returns its loss."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.ddp(inputs, targets, negatives, log_expected)
        loss.backward()
        if self.config["sparse_update"]:
            for p in (self.model.embed.weight, self.model.out.weight):
                if p.grad is not None and not p.grad.is_sparse:
                    p.grad = row_sparse(p.grad)
        self.opt.step()
        return float(loss.detach())

    def wire_counter(self) -> tuple[int, int]:
        """Running totals of bytes sent, all and for the V-row matrices, for methods that report them (ours)."""
        if self.router is None:
            return 0, 0
        return self.router.wire_bytes(), self.router.sparse_wire_bytes()

    def modelled_wire(self, step: int, local_rows: torch.Tensor) -> tuple[int, int]:
        """(all, V-row matrices') bytes the busiest rank must send in `step`, for the baselines. local_rows:
        [world, 2] unique rows of (embed, out) on each rank at this step."""
        w, esize = self.world, 4
        vrow_shapes = (tuple(self.model.embed.weight.shape), tuple(self.model.out.weight.shape))
        vrow = [math.prod(shape) for shape in vrow_shapes]
        if self.name in ("dense", "fp16"):
            size = esize if self.name == "dense" else 2
            return ring_allreduce_bytes(sum(self.numels) * size, w), ring_allreduce_bytes(sum(vrow) * size, w)
        if self.name == "agsparse":
            widths = (self.config["embed_dim"], self.config["dim"] + 1)
            sparse = sum(ddp_sparse_wire_bytes(local_rows[:, i].tolist(), width) for i, width in enumerate(widths))
            return ring_allreduce_bytes((sum(self.numels) - sum(vrow)) * esize, w) + sparse, sparse
        if self.name == "powersgd":
            if step < POWERSGD_START:  # torch's hook all-reduces densely until start_powerSGD_iter
                return ring_allreduce_bytes(sum(self.numels) * esize, w), ring_allreduce_bytes(sum(vrow) * esize, w)
            values = sparse = 0
            for shape in self.shapes:
                n = shape[0]
                m = math.prod(shape[1:]) if len(shape) > 1 else 1
                r = min(n, m, POWERSGD_RANK)
                compress = (n + m) * r * 2 < n * m  # torch's _should_compress, min_compression_rate 2
                v = (n + m) * r if compress else n * m
                values += v
                sparse += v if shape in vrow_shapes else 0
            return ring_allreduce_bytes(values * esize, w), ring_allreduce_bytes(sparse * esize, w)
        raise AssertionError(self.name)


def train_rank(config: dict) -> dict | None:
    """Trains every method on this rank, interleaved per step; returns the results on rank 0, else None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # Adagrad's sparse path builds sparse tensors without invariant checks and says so once per process
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    corpus, sampler = make_data(config)
    calib = calibrate(corpus, sampler, config, world)
    methods = [Method(name, config, calib, world) for name in config["methods"]]
    held = corpus.heldout(config["eval_batch"], config["seq"])
    held_in, held_tgt = held[:, :-1], held[:, 1:]
    steps, k = config["steps"], len(methods)
    measured = torch.zeros(4, k, steps, dtype=torch.float64)  # step seconds, wire, tx and V-row wire bytes
    train_loss = [[] for _ in methods]
    curves = [[] for _ in methods]
    chosen = [[] for _ in methods]
    local_rows = torch.zeros(steps, 2, dtype=torch.int64)
    eval_steps = set(range(0, steps + 1, max(1, config["eval_every"]))) | {steps}

    def evaluate(step):
        if rank == 0:
            for i, m in enumerate(methods):
                curves[i].append((step, m.model.full_loss(held_in, held_tgt)))
        dist.barrier()

    bar = progress(steps, "sparse-lm", enabled=rank == 0)
    evaluate(0)
    for step in range(steps):
        inputs, targets, negatives = step_batch(corpus, sampler, rank, step, config)
        rows = SparseLM.touched_rows(inputs, targets, negatives)
        local_rows[step] = torch.tensor([rows[0].numel(), rows[1].numel()])
        for i, m in enumerate(methods):
            with together() as watch:
                tx0, (w0, s0) = tx_counter(config["measure_tx"]), m.wire_counter()
                train_loss[i].append(m.train_step(inputs, targets, negatives, sampler.log_expected))
            sent = tx_counter(config["measure_tx"]) - tx0
            w1, s1 = m.wire_counter()
            measured[:, i, step] = torch.tensor([watch.seconds, w1 - w0, sent, s1 - s0], dtype=torch.float64)
            if m.router is not None:
                chosen[i].append(m.router.last_methods())
        if step + 1 in eval_steps:
            evaluate(step + 1)
        if rank == 0:
            last = " ".join(f"{m.name}={c[-1][1]:.3f}" for m, c in zip(methods, curves) if c)
            bar.step(f"held-out loss at step {curves[0][-1][0] if curves[0] else 0}: {last}")

    # every rank's samples -> per step, the busiest rank (slowest, most bytes)
    gathered = [torch.zeros_like(measured) for _ in range(world)]
    dist.all_gather(gathered, measured)
    rows_all = [torch.zeros_like(local_rows) for _ in range(world)]
    dist.all_gather(rows_all, local_rows)
    if rank != 0:
        return None
    per_rank = torch.stack(gathered)                 # [world, 4, k, steps]
    busiest = per_rank.max(0).values
    rows_all = torch.stack(rows_all, 1)              # [steps, world, 2]
    results = []
    for i, m in enumerate(methods):
        if m.router is not None:
            wire_steps, sparse_steps = busiest[1, i].tolist(), busiest[3, i].tolist()
        else:
            wire_steps, sparse_steps = (list(v) for v in zip(*(m.modelled_wire(s, rows_all[s]) for s in range(steps))))
        results.append({
            "method": m.name, "lossless": m.lossless, "ratios": m.ratios,
            "curve": curves[i], "final_loss": curves[i][-1][1], "train_loss": train_loss[i],
            "step_s": busiest[0, i].tolist(), "step_s_per_rank": per_rank[:, 0, i].tolist(),
            "wire_bytes": wire_steps, "sparse_wire_bytes": sparse_steps,
            "wire_source": "sketch_hook stats" if m.router is not None else "model",
            "tx_bytes": busiest[2, i].tolist() if config["measure_tx"] else None, "chosen": chosen[i],
        })
    return {"calibration": calib, "methods": results, "local_rows": rows_all.tolist()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=7200.0)
    p.add_argument("--steps", type=at_least(1), default=300, help="training steps per method (default 300)")
    p.add_argument("--methods", default="all",
                   help="comma-separated methods or groups (all, baselines, ours, sketch); default all: "
                        + ", ".join(all_methods()))
    p.add_argument("--sketch-sizes", type=comma_list(up_to(10)), default=list(SKETCH_SIZES),
                   help="sketch sizes as multiples of the union's non-zeros (default 0.1,0.2,0.5,1)")
    p.add_argument("--vocab", type=at_least(2), default=32768, help="vocabulary size V (default 32768)")
    p.add_argument("--dim", type=at_least(1), default=64, help="embedding and LSTM width d (default 64)")
    p.add_argument("--embed-dim", type=at_least(1), default=None,
                   help="input embedding width D, if not d: 1024 makes a 128 MiB embedding gradient at V 32768, "
                        "the size the sketch is built for, with the compute of the d-wide model (default d)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--negatives", type=int, default=1024, help="sampled-softmax negatives per step (default 1024)")
    p.add_argument("--exponent", type=float, default=1.1, help="Zipf exponent of the corpus (default 1.1)")
    p.add_argument("--lr", type=float, default=0.1, help="Adagrad learning rate (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus, the init, negatives and hashes")
    p.add_argument("--eval-every", type=int, default=None, help="held-out evaluation period (default steps/20)")
    p.add_argument("--eval-batch", type=int, default=16, help="held-out sequences (default 16)")
    p.add_argument("--sketch-rows", type=int, default=3, help="count-sketch rows r (default 3)")
    p.add_argument("--auto-ratio", type=float, default=0.05,
                   help="sketch ratio that 'auto' weighs against the lossless union (default 0.05, SketchState's)")
    p.add_argument("--calibration-steps", type=int, default=8, help="steps whose union sizes set the sketch sizes")
    p.add_argument("--dense-update", action="store_true",
                   help="let Adagrad update the whole V-row matrices every step (default: only the rows whose "
                        "reduced gradient is non-zero, the same update; agsparse is always row-sparse)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the step-time median (default 3)")


CONFIG = ("steps", "vocab", "dim", "seq", "batch", "negatives", "exponent", "lr", "seed", "eval_batch", "sketch_rows",
          "auto_ratio", "calibration_steps", "warmup")
"""The options the ranks are given as they are (the payload's config has them and those make_config derives)."""


def make_config(args: argparse.Namespace) -> dict:
    """The run's config from the parsed options."""
    sizes = tuple(args.sketch_sizes)
    embed_dim = args.dim if args.embed_dim is None else args.embed_dim
    return {"methods": parse_methods(args.methods, sizes), "sketch_sizes": sizes, "embed_dim": embed_dim,
            "optimizer": "adagrad", "eval_every": args.eval_every or max(1, args.steps // 20), "measure_tx": False,
            "sparse_update": not args.dense_update, **{k: getattr(args, k) for k in CONFIG}}


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and tables on the printing rank; returns the JSON payload."""
    return run_suite("sparse-lm", args, train_rank, make_config(args), _collect, tables, backend="gloo")


def _collect(out: dict, config: dict, launch: Any) -> dict:
    for name, cal in out["calibration"].items():
        print(f"# union {name:<7} {cal['union_rows']:.0f} rows of {config['vocab']} "
              f"({100 * cal['union_fraction']:.2f}%), {cal['local_rows']:.0f} per rank")
    fields = summarize({"config": config, **out})
    del fields["config"]
    return fields


# --- summary and tables ----------------------------------------------------------------------------------------

def summarize(result: dict) -> dict:
    """Adds per-method medians, speed-ups, Pareto flags and notes to `result` (in place)."""
    warm = result["config"]["warmup"]
    methods = result["methods"]
    for m in methods:
        for key in ("step_s", "wire_bytes", "sparse_wire_bytes", "tx_bytes"):  # tx_bytes is None without netsim
            m[f"median_{key}"] = statistics.median(m[key][warm:] or m[key]) if m[key] else None
        picks = {}  # {matrix: {how it was reduced: timed steps}}, in the order first seen
        for c in m["chosen"][warm:]:
            for k, v in c.items():
                picks.setdefault(k, Counter())[v] += 1
        m["chosen_counts"] = picks
        if m["method"] in ("auto", "auto-bg") and picks:
            m["lossless"] = all(v in ("exact", "dense") for p in picks.values() for v in p)
    dense = next((m for m in methods if m["method"] == "dense"), None)
    for m in methods:
        m["speedup_vs_dense"] = dense["median_step_s"] / m["median_step_s"] if dense else None
        m["loss_vs_dense"] = (m["final_loss"] / dense["final_loss"] - 1) if dense else None
    def dominates(o, m):  # losses closer than LOSS_TIE count as equal (lossless runs differ by rounding)
        no_worse = o["median_wire_bytes"] <= m["median_wire_bytes"] and o["final_loss"] <= m["final_loss"] + LOSS_TIE
        better = o["median_wire_bytes"] < m["median_wire_bytes"] or o["final_loss"] < m["final_loss"] - LOSS_TIE
        return no_worse and better

    for m in methods:
        m["pareto"] = not any(dominates(o, m) for o in methods if o is not m)
    notes = []
    sparse_lossless = [m for m in methods if m["method"] in ("agsparse", "omnireduce")]
    best = min(sparse_lossless, key=lambda m: m["median_wire_bytes"]) if sparse_lossless else None
    if best is not None:
        best_sparse = min(sparse_lossless, key=lambda m: m["median_sparse_wire_bytes"])
        for m in methods:
            m["bytes_vs_best_lossless_sparse"] = m["median_wire_bytes"] / best["median_wire_bytes"]
            m["sparse_bytes_vs_best_lossless_sparse"] = m["median_sparse_wire_bytes"] / \
                best_sparse["median_sparse_wire_bytes"]
        notes.append(f"best lossless sparse baseline: {best['method']} "
                     f"({report.human_bytes(best['median_wire_bytes'])} per rank per step; of it "
                     f"{report.human_bytes(best['median_sparse_wire_bytes'])} for the V-row matrices)")
    if dense is not None and best is not None:
        for label, key in (("all bytes", "bytes_vs_best_lossless_sparse"),
                           ("the V-row matrices' bytes (the paper's sparse-communication volume)",
                            "sparse_bytes_vs_best_lossless_sparse")):
            hits = [m["method"] for m in methods if m["method"].startswith("sketch-")
                    and m["loss_vs_dense"] <= 0.02 and m[key] <= 0.5]
            verdict = f"met by {', '.join(hits)}" if hits else "NOT met by any sketch configuration"
            notes.append(f"target (final loss within 2% of dense with <= 50% of the best lossless sparse baseline's "
                         f"{label}): {verdict}")
    auto = next((m for m in methods if m["method"] == "auto"), None)
    if auto is not None and auto["chosen_counts"]:
        notes.append("auto chose: " + "; ".join(f"{k}: " + ", ".join(f"{v} x{n}" for v, n in sorted(p.items()))
                                                for k, p in sorted(auto["chosen_counts"].items())))
    result["notes"] = notes
    return result


def _embed_dim(config):
    return config.get("embed_dim", config["dim"])  # runs recorded before --embed-dim have none


def _reduced_as(r):
    counts = r.get("chosen_counts") or {}
    return "; ".join(f"{m}: " + ", ".join(f"{how} x{n}" for how, n in c.items()) for m, c in counts.items()) or None


def tables(result: dict) -> list[report.Part]:
    """The per-method table and the methods by wire bytes (Pareto front of bytes against final loss marked) of
    `result` (its JSON payload), printed by `run` and shown in the docs."""
    c = result["config"]
    embed = _embed_dim(c)
    caption = (f"Embedding({c['vocab']}, {embed}) + LSTM({embed} -> {c['dim']}) + output embedding "
               f"({c['vocab']}, {c['dim'] + 1}), sampled softmax ({c['negatives']} negatives), {c['optimizer']} "
               f"lr {c['lr']}; {c['batch']} x {c['seq']} tokens per rank and step, {c['steps']} steps, "
               f"seed {c['seed']}.")
    lossless = col("lossless", lambda r: report.yes_no(r["lossless"]), numeric=False)
    wire = col("wire (KiB/rank/step)", "median_wire_bytes", scaled(KIB, 1))
    vs_dense = col("vs dense (%)", "loss_vs_dense", percent(2, signed=True))
    methods = [col("method", "method"), col("final loss", "final_loss", fixed(3)), vs_dense,
               col("step (ms)", lambda r: 1e3 * r["median_step_s"], fixed(1)),
               col("vs dense", "speedup_vs_dense", times(2)), wire,
               col("tx (KiB/rank/step)", "median_tx_bytes", scaled(KIB, 1)), lossless,
               col("reduced as (steps)", _reduced_as, numeric=False)]
    pareto = [col("method", "method"), wire,
              col("of best lossless sparse (%)", "bytes_vs_best_lossless_sparse", percent(1)),
              col("V-row matrices (KiB/rank/step)", "median_sparse_wire_bytes", scaled(KIB, 1)),
              col("of best lossless sparse (%)", "sparse_bytes_vs_best_lossless_sparse", percent(1)),
              col("final loss", "final_loss", fixed(3)), vs_dense, lossless,
              col("Pareto", lambda r: "*" if r["pareto"] else "", numeric=False)]
    by_bytes = sorted(result["methods"], key=lambda r: r["median_wire_bytes"])
    return [report.Part("methods", methods, result["methods"], caption),
            report.Part("pareto", pareto, by_bytes,
                        "Wire bytes against final loss, by bytes (V-row matrices: the two embeddings' bytes alone).",
                        result.get("notes", ()))]


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    methods = result["methods"]
    plt, fig, (ax1, ax2, ax3) = report.subplots(1, 3, figsize=(18, 5.5))
    colors = {m["method"]: plt.cm.tab20(i % 20) for i, m in enumerate(methods)}
    steps_total = result["config"]["steps"]
    for m in methods:
        steps, losses = zip(*m["curve"])
        style = "-" if m["lossless"] else "--"
        for ax in (ax1, ax2):
            ax.plot(steps, losses, style, color=colors[m["method"]], label=m["method"], linewidth=1.2)
    late = [loss for m in methods for step, loss in m["curve"] if step >= steps_total / 2]
    if late:
        ax2.set_xlim(steps_total / 2, steps_total)
        pad = 0.05 * (max(late) - min(late) or 1.0)
        ax2.set_ylim(min(late) - pad, max(late) + pad)
    ax1.set_title("held-out loss", fontsize=9)
    ax2.set_title("second half of training (zoom)", fontsize=9)
    for ax in (ax1, ax2):
        ax.set(xlabel="step", ylabel="held-out loss (full softmax, nats)")
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=7, ncol=2)
    for m in methods:
        c = colors[m["method"]]
        ax3.scatter(m["median_wire_bytes"], m["final_loss"], marker="s" if m["lossless"] else "o", s=45,
                    facecolors=c if m["pareto"] else "none", edgecolors=c, linewidths=1.5)
        ax3.annotate(m["method"], (m["median_wire_bytes"], m["final_loss"]), fontsize=7,
                     xytext=(4, 2), textcoords="offset points")
    front = sorted((m["median_wire_bytes"], m["final_loss"]) for m in methods if m["pareto"])
    if len(front) > 1:
        ax3.step(*zip(*front), where="post", color="grey", linewidth=0.8, alpha=0.6)
    ax3.set(xscale="log", xlabel="wire bytes per rank per step (median)", ylabel="final held-out loss")
    ax3.set_title("squares: lossless, circles: lossy; filled: on the Pareto front", fontsize=9)
    ax3.grid(True, which="both", alpha=0.3)
    env, c = result["env"], result["config"]
    embed_dim = _embed_dim(c)
    width = f"d={c['dim']}" if embed_dim == c["dim"] else f"D={embed_dim} (input embedding), d={c['dim']}"
    report.save_figure(fig, path, f"fastdist-bench sparse-lm: {env['ranks']} ranks, V={c['vocab']}, {width}, "
                       f"{c['steps']} steps\n{env['network']}")
