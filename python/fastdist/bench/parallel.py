"""`fastdist-bench parallel`: a GPT trained pipeline-parallel (pp=2) by torch's and DeepSpeed's engines and by
fastdist.parallelize; partition balance; the tensor-parallel dimension against torch's DTensor; compressed stage
boundaries inside the schedules.

The model is fastdist.testing.models.TransformerLM as a GPT (--gpt vocab,dim,heads,layers,seq) whose large
vocabulary makes the embedding and the LM head heavy, cut into pieces the way every engine here sees it: the
embedding (+ positions), one piece per block, the final norm + head. Ranks are pinned to a core each (one torch
thread, gloo's threads included). Parts (--parts):

  pipeline    one optimizer step (AdamW) over --batch sequences in --microbatches microbatches, per variant, on
              the same weights and the same batches (batch i at every variant's i-th step):
                torch-1f1b+recompute  torch.distributed.pipelining Schedule1F1B over PipelineStage, every block
                                      under torch.utils.checkpoint (full activation checkpointing)
                torch-1f1b            the same without recompute
                deepspeed+recompute   DeepSpeed's PipelineModule + train_batch engine, activation checkpointing
                                      of every block (interval 1, checkpointable_layers), a torch AdamW
                deepspeed             the same without recompute
                fastdist-1f1b, fastdist-scp+stage-aware  fastdist.parallelize's engine (its partitioner balances
                                      the stages by profiled time), schedule 1f1b without recompute /
                                      shifted_critical_path with stage-aware recompute
              The peers split by layer count (DeepSpeed's "uniform"). Every variant's first loss is checked against
              the unpipelined model's on the same batch (CHECK_TOLERANCE) and every loss is kept. Interleaved (the
              order rotated every repetition), --warmup untimed steps first (at least one: the checked step),
              median of --reps of the slowest rank's step. Per stage: the peak bytes autograd keeps for the
              backward during a step (fastdist.parallel.recompute.SavedActivationMeter, parameters excluded), and
              the peak resident memory above that before the step (VmHWM reset before every step; glibc told to
              return large blocks). The memory cap is set as fastdist.parallel.cost sets it: --cap-fraction of the
              way from what fastdist's stage-aware recompute needs at r0 = 1 (the last stage never recomputes) to
              what torch's 1F1B without recompute needs; fastdist's r0 is the smallest that keeps every stage
              under it (--recompute-ratio auto); each row says whether its stages stay under it.
  balance     each stage's forward + backward on one microbatch, timed on its own rank at once (interleaved,
              median of --reps), for the uniform split and for fastdist's partitioner's: max/mean stage time.
  cost        fastdist.parallel.cost's measurement of its schedules on the same GPT (the peers' uniform stages:
              torch's 1F1B with and without checkpointing, GPipe with it, 1F1B and shifted critical path with
              stage-aware recompute, at its own memory cap) with the cost model's prediction and error for each,
              then the model's simulation of pp 4..64 and 8..64 microbatches (a projection, not measured).
  tp          forward + backward of one GPT block (--tp-block hidden,heads,seq,batch) on 2 ranks at each
              --tp-nets network (default: --net when it names a link, else loopback and 1gbit): bench/tp.py's
              variants (fastdist.tp's Megatron-style, chunked and Oases mappings, and torch's DTensor
              parallelize_module with Colwise/RowwiseParallel, each checked against the unsharded block) and the
              tp=2 modules fastdist.parallelize builds for the same block (tp_overlap "auto" and "oases").
  boundaries  fastdist.parallel.transport's comparison at --boundary-net: compressed activations and gradients
              inside torch's schedules against StageBoundary in a GPipe loop, TopK packing through Schedule1F1B,
              and uncompressed 1F1B.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import logging
import os
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdist.bench import report
from fastdist.bench.launch import add_launch_arguments, pin_to_core, run_ranks
from fastdist.bench.report import MIB, col, fixed, percent, scientific, times
from fastdist.bench.peers import checkpointed
from fastdist.bench.toolkit import (all_max, all_sum, at_least, comma_list, network, rounds, shape_type,
                                    time_interleaved, together)

PEERS = ["torch-1f1b+recompute", "torch-1f1b", "deepspeed+recompute", "deepspeed"]
"""The pipeline peers a user would pick instead, on the same model, data and microbatches."""
OURS = ["fastdist-1f1b", "fastdist-scp+stage-aware"]
"""fastdist.parallelize's engine (its partitioner, fastdist.parallel's schedules and recompute)."""
BASELINE = "torch-1f1b+recompute"
"""The row every speed-up is measured against: torch's Schedule1F1B with full recompute."""
TP_VARIANTS = ["megatron", "chunked", "oases", "dtensor"]
"""bench/tp.py's GPT-block variants this suite times (its +recompute variants are left to that suite)."""
PARALLELIZE_TP = "parallelize tp=2"
"""The tp row of fastdist.parallelize: the stage module its mesh (1, 2, 1) builds for the block."""
PARALLELIZE_TP_OASES = "parallelize tp=2 oases"
"""The same with ``tp_overlap="oases"``: the user's block under the Oases sub-batch schedule."""
PARTS = ["pipeline", "balance", "cost", "tp", "boundaries"]
SWEEP_STAGES = (4, 8, 16, 32, 64)
SWEEP_MICROBATCHES = (8, 16, 32, 64)
CHECK_TOLERANCE = 1e-4
"""Largest |first loss - unpipelined model's loss| / unpipelined loss a variant may show (float32)."""


def _ratio_or_auto(text: str) -> float | str:
    if text == "auto":
        return text
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a number in [0, 1]")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    add_launch_arguments(p, timeout=1800.0)
    p.set_defaults(ranks=2)
    p.add_argument("--parts", type=comma_list(choices=PARTS), default=",".join(PARTS),
                   help="which parts to run, a comma list of " + ",".join(PARTS) + " (default all)")
    p.add_argument("--variants", type=comma_list(choices=PEERS + OURS), default=",".join(PEERS + OURS),
                   help="pipeline rows, a comma list of " + ",".join(PEERS + OURS) + " (default all)")
    p.add_argument("--gpt", type=shape_type(5), default="16384,256,4,8,64",
                   help="GPT vocab,dim,heads,layers,seq (default 16384,256,4,8,64: the vocabulary makes the ends "
                        "heavy)")
    p.add_argument("--batch", type=at_least(1), default=16, help="sequences per optimizer step (default 16)")
    p.add_argument("--microbatches", type=at_least(1), default=4, help="microbatches per step (default 4)")
    p.add_argument("--recompute-ratio", type=_ratio_or_auto, default="auto",
                   help="r0 of stage-aware recompute for fastdist's shifted-critical-path row: a number in [0, 1], "
                        "or 'auto' (default): the smallest under the memory cap")
    p.add_argument("--tp-block", type=shape_type(4), default="256,4,64,8",
                   help="tp part: GPT block hidden,heads,seq,batch (default 256,4,64,8)")
    p.add_argument("--tp-nets", type=comma_list(network), default=None,
                   help="tp part: networks, 'loopback' or link rates (default: --net when it names a link, else "
                        "loopback,1gbit)")
    p.add_argument("--cap-fraction", type=float, default=0.5,
                   help="pipeline rows: the per-stage memory cap lies this fraction of the way from what "
                        "fastdist's stage-aware recompute needs at r0 = 1 to what torch's 1F1B without recompute "
                        "needs (default 0.5)")
    p.add_argument("--boundary-net", type=network, default="100mbit",
                   help="boundaries part: the link of fastdist.parallel.transport's comparison (default 100mbit)")
    p.add_argument("--reps", type=at_least(1), default=5, help="timed repetitions per variant, >= 5 for a claim")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed repetitions of every variant first")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of every variant (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)


# ---- the model, cut into the pieces every engine sees ----

class Embedding(nn.Module):
    """The GPT's token embedding plus learned positions: ids [B, T] -> [B, T, dim]."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.embed, self.pos = lm.embed, lm.pos

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.pos[:tokens.shape[1]]


class BlockLayer(nn.Module):
    """One transformer block with the causal mask it needs, as a one-tensor-in, one-tensor-out layer."""

    def __init__(self, block: nn.Module, causal: torch.Tensor):
        super().__init__()
        self.block = block
        self.register_buffer("causal", causal.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return self.block(x, self.causal[:t, :t])


class Head(nn.Module):
    """The final LayerNorm and the LM head: [B, T, dim] -> logits [B, T, vocab]."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.norm, self.head = lm.norm, lm.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


class Checkpointed(nn.Module):
    """`inner` under torch.utils.checkpoint (non-reentrant): its activations are recomputed in backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointed(self.inner, x)


def build_gpt(gpt: Sequence[int], seed: int) -> nn.Module:
    """The benchmark's GPT (TransformerLM with positions and a causal mask), seeded; the positions are drawn too,
    so that they take part in the check."""
    from fastdist.testing.models import TransformerLM

    vocab, dim, heads, layers, seq = gpt
    torch.manual_seed(seed)
    lm = TransformerLM(vocab, dim, heads, layers, seq=seq)
    with torch.no_grad():
        lm.pos.normal_(std=0.02)
    return lm


def pieces(lm: nn.Module) -> list[nn.Module]:
    """`lm` as a list of layers: the embedding, one BlockLayer per block, the head (sharing `lm`'s parameters)."""
    return [Embedding(lm), *(BlockLayer(b, lm.causal) for b in lm.blocks), Head(lm)]


def uniform_bounds(n: int, stages: int) -> list[int]:
    """Stage boundaries of `n` layers split by layer count, as DeepSpeed's partition_method="uniform" does: the
    first n % stages stages one layer more."""
    chunk, extra = divmod(n, stages)
    return [s * chunk + min(s, extra) for s in range(stages + 1)]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, T, vocab] against ids [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch_for(step: int, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of step `step`: [batch, seq] random ids, targets the inputs shifted by one."""
    vocab, _, _, _, seq = config["gpt"]
    g = torch.Generator().manual_seed(config["seed"] * 1_000_003 + step)
    ids = torch.randint(vocab, (config["batch"], seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ---- resident memory of a step ----

def reset_peak() -> int:
    """Frees what can be freed, sets the process's peak resident size (VmHWM) to its current one; returns that
    (bytes). Where /proc/self/clear_refs cannot be written the peak keeps earlier history (the caller sees a
    larger figure, never a smaller one)."""
    from fastdist.bench.memory import status_kib, trim_heap

    trim_heap()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return status_kib("VmRSS") * 1024


def peak_above(base: int) -> int:
    """Peak resident bytes since `reset_peak` above what was resident then."""
    from fastdist.bench.memory import status_kib

    return max(status_kib("VmHWM") * 1024 - base, 0)


@contextlib.contextmanager
def _large_blocks_returned() -> Iterator[None]:
    """Ranks started inside give freed blocks over 64 KiB back to the OS at once (glibc's mmap threshold), so
    their resident size follows the live tensors."""
    before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = before


# ---- the pipeline variants (one rank = one stage) ----

def _stage_module(lm: nn.Module, bounds: Sequence[int], stage: int, recompute: bool) -> nn.Sequential:
    layers = pieces(lm)[bounds[stage]:bounds[stage + 1]]
    return nn.Sequential(*(Checkpointed(m) if recompute and isinstance(m, BlockLayer) else m for m in layers))


def _stage_args(config: dict) -> dict:
    """PipelineStage's input_args/output_args for this rank's stage of the GPT (one microbatch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, dim, _, _, seq = config["gpt"]
    mb = config["batch"] // config["microbatches"]
    # Shapes given, not inferred (inference would run the first stage on uninitialized ids); the activations'
    # requires_grad is what tells the stages to exchange their gradients.
    inputs = torch.zeros(mb, seq, dtype=torch.long) if rank == 0 else torch.zeros(mb, seq, dim, requires_grad=True)
    outputs = torch.zeros(mb, seq, vocab if rank == world - 1 else dim, requires_grad=True)
    return {"input_args": (inputs,), "output_args": (outputs,)}


def _schedule_step(module: nn.Module, schedule: Any, config: dict):
    """One optimizer step (AdamW over `module`) driven by a torch-style pipeline schedule: a callable(step) ->
    loss (the mean over microbatches on the last stage, None elsewhere), with the tensors it owns as `.owned`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(module.parameters(), lr=config["lr"])

    def step(i: int) -> float | None:
        x, y = batch_for(i, config)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None
    step.owned = [*module.parameters(), *module.buffers()]
    return step


def _torch_variant(lm: nn.Module, config: dict, recompute: bool):
    """torch's Schedule1F1B over this rank's PipelineStage (uniform split), every block checkpointed when
    `recompute`."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    module = _stage_module(lm, uniform_bounds(len(lm.blocks) + 2, world), rank, recompute)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), **_stage_args(config))
    return _schedule_step(module, Schedule1F1B(stage, n_microbatches=config["microbatches"], loss_fn=lm_loss),
                          config)


def _deepspeed_variant(lm: nn.Module, config: dict, recompute: bool):
    """One optimizer step of DeepSpeed's pipeline engine (train_batch) on the same layers, split by layer count:
    a callable(step) -> loss (train_batch's mean over microbatches, on every rank)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    world = dist.get_world_size()
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    mb = config["batch"] // config["microbatches"]
    ds_config = {"train_batch_size": config["batch"], "train_micro_batch_size_per_gpu": mb,
                 "gradient_accumulation_steps": config["microbatches"], "steps_per_print": 1 << 30,
                 "gradient_clipping": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # its partition printout would land among the results
        module = PipelineModule(pieces(lm), num_stages=world, loss_fn=lm_loss, partition_method="uniform",
                                activation_checkpoint_interval=1 if recompute else 0,
                                checkpointable_layers=[BlockLayer.__name__])
        optimizer = torch.optim.AdamW(module.parameters(), lr=config["lr"])
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)

    def step(i: int) -> float:
        x, y = batch_for(i, config)
        data = iter([(x[j:j + mb], y[j:j + mb]) for j in range(0, config["batch"], mb)])
        return float(engine.train_batch(data_iter=data))
    step.owned = [*engine.module.parameters(), *engine.module.buffers()]
    return step


def _ours_variant(lm: nn.Module, config: dict, name: str, r0: float = 0.5,
                  split_points: Sequence[int] | None = None):
    """One optimizer step of fastdist.parallelize's engine on the whole GPT (pp = ranks; its partitioner balances
    the stages by profiled time unless `split_points` are given)."""
    from fastdist.parallel import parallelize

    schedule, recompute = ("1f1b", "none") if name == "fastdist-1f1b" else ("shifted_critical_path", "stage_aware")
    x, _ = batch_for(0, config)
    engine = parallelize(lm, mesh=(1, 1, dist.get_world_size()), example_inputs=(x,), loss_fn=lm_loss,
                         optimizer=lambda params: torch.optim.AdamW(params, lr=config["lr"]),
                         microbatches=config["microbatches"], schedule=schedule, recompute=recompute,
                         recompute_ratio=r0, split_points=split_points)

    def step(i: int) -> float:
        return float(engine.step(*batch_for(i, config)))
    step.plan = engine.plan
    step.owned = [*engine.module.parameters(), *engine.module.buffers()]
    return step


def _stage_peaks(step: Any) -> list[float]:
    """Every stage's saved-activation peak (bytes) over one step of `step` (a fresh variant: a first step sets
    the pipeline up, outside the meter, then one metered step). A collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step(0)
    meter = _meter(step.owned)
    with meter:
        step(1)
    return all_max([meter.peak if r == rank else 0.0 for r in range(world)])


def memory_cap(config: dict) -> dict:
    """The per-stage memory cap and fastdist's first-stage recompute ratio under it, as fastdist.parallel.cost
    sets them: the cap lies --cap-fraction of the way from the least memory fastdist's stage-aware recompute runs
    in (r0 = 1; the last stage never recomputes) to the most torch's 1F1B without recompute needs; r0 (with
    --recompute-ratio auto) is the smallest multiple of 1 / (the first stage's blocks) whose stages all stay
    under it. The partition is fixed by the first engine built (profiled once). A collective.

    Returns:
        cap_bytes, r0, split_points, plan (the profiled plan, as text), plain and floor per-stage peaks, and the
        peaks of every r0 tried.
    """
    plain = _stage_peaks(_torch_variant(build_gpt(config["gpt"], config["seed"]), config, recompute=False))
    scp = "fastdist-scp+stage-aware"
    probe = _ours_variant(build_gpt(config["gpt"], config["seed"]), config, scp, r0=1.0)
    plan, split = probe.plan, probe.plan.split_points
    floor = _stage_peaks(probe)
    cap = max(floor) + config["cap_fraction"] * max(0.0, max(plain) - max(floor))
    tried, r0 = {1.0: floor}, 1.0
    if config["recompute_ratio"] == "auto":
        first_blocks = plan.stages[0].last_block - plan.stages[0].first_block
        for k in range(first_blocks - 1, -1, -1):
            r = k / first_blocks
            tried[r] = _stage_peaks(_ours_variant(build_gpt(config["gpt"], config["seed"]), config, scp, r, split))
            if max(tried[r]) > cap * (1 + 1e-9):
                break
            r0 = r
    else:
        r0 = float(config["recompute_ratio"])
    return {"cap_bytes": cap, "r0": r0, "split_points": list(split), "plan": str(plan), "plain_peaks": plain,
            "floor_peaks": floor, "r0_tried": {str(k): v for k, v in tried.items()}}


def missing(variant: str) -> str | None:
    """Why pipeline row `variant` cannot run here (a package not installed), None when it can."""
    if variant.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed"
    return None


def _reference_loss(config: dict) -> float:
    lm = build_gpt(config["gpt"], config["seed"])
    x, y = batch_for(0, config)
    with torch.no_grad():
        return float(lm_loss(lm(x), y))


def _pipeline_rank(config: dict) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    core = pin_to_core(rank)
    ours = [n for n in config["variants"] if n in OURS]
    cap = memory_cap(config) if ours else None
    variants, plans = {}, {}
    for name in config["variants"]:
        lm = build_gpt(config["gpt"], config["seed"])  # every variant from the same weights
        if name.startswith("torch"):
            variants[name] = _torch_variant(lm, config, recompute=name.endswith("+recompute"))
        elif name.startswith("deepspeed"):
            variants[name] = _deepspeed_variant(lm, config, recompute=name.endswith("+recompute"))
        else:
            variants[name] = _ours_variant(lm, config, name, cap["r0"], cap["split_points"])
            plans[name] = str(variants[name].plan)
    names = list(variants)
    reps, warmup = config["reps"], max(config["warmup"], 1)  # step 0 is the checked one, never timed
    meters = {n: _meter(variants[n].owned) for n in names}
    seconds = {n: [] for n in names}
    saved = {n: [] for n in names}
    resident = {n: [] for n in names}
    losses = {n: [] for n in names}
    for it, name, timed in rounds(names, warmup, reps, "parallel pipeline", enabled=rank == 0):
        base = reset_peak()
        meter = meters[name]
        meter.reset_peak()
        with together() as watch, meter:
            loss = variants[name](it)
        losses[name].append(loss)
        if timed:
            seconds[name].append(watch.seconds)
            saved[name].append(meter.peak)
            resident[name].append(peak_above(base))
    # A step lasts until its slowest rank is done; every stage's memory is its own (one slot per rank).
    slowest = all_max([t for n in names for t in seconds[n]])
    per_stage = all_sum([v if r == rank else 0.0 for table in (saved, resident) for n in names for v in table[n]
                         for r in range(world)])
    losses_seen = all_sum([v if (v is not None and rank == world - 1) else 0.0 for n in names for v in losses[n]])
    if rank != 0:
        return None
    reference = _reference_loss(config)
    steps, width = warmup + reps, reps * world
    rows = []
    for i, n in enumerate(names):
        samples = slowest[i * reps:(i + 1) * reps]
        by_stage = {}
        for k, key in enumerate(("saved", "resident")):
            flat = per_stage[(k * len(names) + i) * width:(k * len(names) + i + 1) * width]
            by_stage[key] = [[flat[j * world + st] for j in range(reps)] for st in range(world)]
        trajectory = losses_seen[i * steps:(i + 1) * steps]
        rows.append({"variant": n, "time_ms": statistics.median(samples) * 1e3,
                     "samples_ms": [t * 1e3 for t in samples],
                     "stage_saved_bytes": [statistics.median(v) for v in by_stage["saved"]],
                     "stage_saved_samples": by_stage["saved"],
                     "stage_peak_bytes": [statistics.median(v) for v in by_stage["resident"]],
                     "stage_peak_samples": by_stage["resident"],
                     "losses": trajectory, "first_loss_error": abs(trajectory[0] - reference) / reference,
                     "plan": plans.get(n)})
    return {"rows": rows, "reference_loss": reference, "core": core, "cap": cap}


def _meter(owned: Sequence[torch.Tensor]) -> Any:
    """A meter of the activation bytes autograd keeps for the backward, not counting `owned` (the variant's
    parameters and buffers)."""
    from fastdist.parallel.recompute import SavedActivationMeter

    return SavedActivationMeter(exclude=owned)


def check_losses(rows: list[dict], tolerance: float = CHECK_TOLERANCE) -> None:
    """Raises RuntimeError naming every pipeline row whose first loss is off the unpipelined model's."""
    bad = {r["variant"]: r["first_loss_error"] for r in rows if not r["first_loss_error"] <= tolerance}
    if bad:
        raise RuntimeError(f"fastdist-bench parallel: first loss differs from the unpipelined model's by more than "
                           f"{tolerance:g} (relative): " + ", ".join(f"{n} {e:.2e}" for n, e in bad.items()))


# ---- partition balance ----

def _stage_step(module: nn.Module, x: torch.Tensor, target: torch.Tensor | None):
    def call():
        module.zero_grad(set_to_none=True)
        out = module(x)
        (lm_loss(out, target) if target is not None else out.float().pow(2).mean()).backward()
    return call


def balanced_bounds(lm: nn.Module, config: dict, stages: int) -> tuple[list[int], str]:
    """Stage boundaries over `pieces(lm)` from fastdist's partitioner (balanced by profiled time on one
    microbatch) and its plan as text."""
    from fastdist.parallel import plan_stages

    mb = config["batch"] // config["microbatches"]
    x, _ = batch_for(0, config)
    plan = plan_stages(lm, stages, (x[:mb],))
    n = len(lm.blocks)
    # the partitioner cuts between blocks; the embedding stays on the first stage, the head on the last
    return [0, *(b + 1 for b in plan.split_points), n + 2], str(plan)


def _balance_rank(config: dict) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    pin_to_core(rank)
    lm = build_gpt(config["gpt"], config["seed"])
    _, dim, _, _, seq = config["gpt"]
    mb = config["batch"] // config["microbatches"]
    x, y = (t[:mb] for t in batch_for(0, config))
    splits = {"uniform": uniform_bounds(len(lm.blocks) + 2, world)}
    # One rank profiles and plans; every rank then times its stage of that plan (profiles taken on two ranks
    # could disagree by their noise).
    shared = [balanced_bounds(copy.deepcopy(lm), config, world) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    splits["balanced"], plan = shared[0]
    calls = {}
    for name, bounds in splits.items():
        module = _stage_module(copy.deepcopy(lm), bounds, rank, recompute=False)
        inp = x if rank == 0 else torch.randn(mb, seq, dim, requires_grad=True)
        calls[name] = _stage_step(module, inp, y if rank == world - 1 else None)
    # the ranks time their own stage at once, as they would run in the pipeline
    samples = time_interleaved(calls, config["warmup"], config["reps"], "parallel balance", slowest_rank=False)
    mine = [statistics.median(samples[n]) for n in calls]
    every = all_sum([t if r == rank else 0.0 for t in mine for r in range(world)])
    if rank != 0:
        return None
    rows = []
    for i, (name, bounds) in enumerate(splits.items()):
        stage_s = every[i * world:(i + 1) * world]
        rows.append({"split": name, "bounds": bounds, "stage_ms": [t * 1e3 for t in stage_s],
                     "max_over_mean": max(stage_s) / statistics.mean(stage_s)})
    return {"rows": rows, "plan": plan}


# ---- the schedules' cost model: measured points, then the paper's scale ----

def _cost_rank(config: dict) -> dict | None:
    """fastdist.parallel.cost's measured schedules on this pipeline (its own variants, cap and r0, the model
    checked against every measured step), then its simulation of pp 4..64 and 8..64 microbatches with every stage
    costing what the measured first stage did, over the measured link."""
    from fastdist.parallel.cost import Link, StageTimes, measure_schedules, sweep

    measured = measure_schedules({"gpt": config["gpt"], "batch": config["batch"],
                                  "microbatches": config["microbatches"], "reps": config["reps"],
                                  "warmup": max(config["warmup"], 1), "seed": config["seed"],
                                  "cap_fraction": config["cap_fraction"]})
    if dist.get_rank() != 0:
        return None
    first = StageTimes(**measured["stage_times"][0])
    rows = sweep(first, stages=SWEEP_STAGES, microbatches=SWEEP_MICROBATCHES, link=Link(**measured["link"]))
    return {"measured": measured, "sweep": rows}


# ---- tensor parallel: bench/tp.py's block variants, and parallelize's tp dimension ----

class OneBlock(nn.Module):
    """A model whose blocks are one GPT block, as parallelize takes it: [B, T, hidden] -> [B, T, hidden]."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList([block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def _parallelized_block(config: dict, tp_overlap: int | str = "auto"):
    """(the tp=2 module fastdist.parallelize builds for bench/tp.py's GPT block, the block, its input): the same
    block and input as bench/tp.py's variants (its seeds)."""
    from fastdist.parallel import parallelize
    from fastdist.tp import GPTBlock

    hidden, heads, seq, batch = config["tp_block"]
    torch.manual_seed(1)
    ref = GPTBlock(hidden, heads)
    x = torch.randn(batch, seq, hidden)
    engine = parallelize(OneBlock(copy.deepcopy(ref)), mesh=(1, dist.get_world_size(), 1), example_inputs=(x,),
                         loss_fn=lambda out, target: out.float().pow(2).mean(),
                         optimizer=lambda params: torch.optim.AdamW(params), tp_overlap=tp_overlap)
    return engine.module, ref, x


def _tp_rank(config: dict) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh

    from fastdist.bench import tp
    from fastdist.tp import CostModel, set_default_cost_model

    rank, world = dist.get_rank(), dist.get_world_size()
    pin_to_core(rank)
    tp_config = {"block": config["tp_block"], "part": "block"}
    model = CostModel.calibrate(None, shapes=(tp.part_shape(tp_config),), reps=5)
    set_default_cost_model(model)  # parallelize's "auto" consults the same calibration as the tp variants' "auto"
    variants, errors, chunks = tp.block_variants(tp_config, model, init_device_mesh("cpu", (world,)))
    variants = {n: variants[n] for n in TP_VARIANTS if n in variants}
    module, ref, x = _parallelized_block(config)
    variants[PARALLELIZE_TP] = tp.training_step(module, x)
    errors.update(tp.check_against(tp.training_step(ref, x)(), {PARALLELIZE_TP: variants[PARALLELIZE_TP]()}))
    chunks[PARALLELIZE_TP] = tp.chosen_chunks(module)  # "auto" chooses at the first call
    if any(any(getattr(b.forward, "__self__", b).__dict__.get("chosen", {}).values()) for b in module.pipeline_blocks):
        chunks[PARALLELIZE_TP] = ["oases"]  # "auto" took the Oases schedule
    oases, _, _ = _parallelized_block(config, "oases")
    variants[PARALLELIZE_TP_OASES] = tp.training_step(oases, x)
    errors.update(tp.check_against(tp.training_step(ref, x)(),
                                   {PARALLELIZE_TP_OASES: variants[PARALLELIZE_TP_OASES]()}))
    names = list(variants)
    samples = time_interleaved(variants, config["warmup"], config["reps"], f"parallel tp {config['net']}")
    rows = tp.timing_rows(samples, names, "variant", errors, chunks)
    return {"rows": rows} if rank == 0 else None


# ---- driver ----

_PART_RANKS = {"pipeline": _pipeline_rank, "balance": _balance_rank, "cost": _cost_rank, "tp": _tp_rank}


def _parts_rank(config: dict) -> dict | None:
    """Runs config["run_parts"] on this rank, one after another; rank 0 returns {part: its result}, with the
    host's load average when the part ended."""
    out = {}
    for part in config["run_parts"]:
        got = _PART_RANKS[part](config)
        if got is not None:
            out[part] = {**got, "load_average": list(os.getloadavg())}
    return out if dist.get_rank() == 0 else None

def _config_from(args: argparse.Namespace) -> dict:
    return {"gpt": list(args.gpt), "batch": args.batch, "microbatches": args.microbatches,
            "recompute_ratio": args.recompute_ratio, "cap_fraction": args.cap_fraction,
            "tp_block": list(args.tp_block), "reps": args.reps,
            "warmup": args.warmup, "lr": args.lr, "seed": args.seed}


def _validate(args: argparse.Namespace) -> None:
    _, dim, heads, layers, _ = args.gpt
    if args.batch % args.microbatches:
        raise SystemExit(f"fastdist-bench parallel: --microbatches {args.microbatches} does not divide --batch "
                         f"{args.batch}")
    if dim % heads:
        raise SystemExit(f"fastdist-bench parallel: --gpt heads {heads} does not divide dim {dim}")
    if layers < args.ranks:
        raise SystemExit(f"fastdist-bench parallel: {layers} blocks cannot make {args.ranks} stages (fastdist's "
                         "partitioner cuts between blocks)")
    if args.microbatches < args.ranks:
        raise SystemExit(f"fastdist-bench parallel: 1F1B needs --microbatches >= the stages ({args.ranks}), got "
                         f"{args.microbatches}")
    if not 0 <= args.cap_fraction <= 1:
        raise SystemExit(f"fastdist-bench parallel: --cap-fraction must be in [0, 1], got {args.cap_fraction}")
    hidden, tp_heads, _, batch = args.tp_block
    if hidden % tp_heads or tp_heads % args.ranks or batch < 2:
        raise SystemExit("fastdist-bench parallel: --tp-block heads must divide hidden and divide by --ranks; "
                         "batch >= 2")


def _tp_nets(args: argparse.Namespace) -> list[str]:
    """The tp part's networks: --tp-nets, else --net when it names a link, else loopback and 1 Gbit/s."""
    if args.tp_nets is not None:
        return list(args.tp_nets)
    return [args.net] if args.net != "loopback" else ["loopback", "1gbit"]


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite; prints the header and tables on the printing rank; returns the JSON payload (None on the
    other torchrun ranks)."""
    _validate(args)
    config = _config_from(args)
    config["variants"] = [v for v in args.variants if missing(v) is None]
    skipped = {v: missing(v) for v in args.variants if missing(v) is not None}
    result: dict[str, Any] = {"suite": "parallel", "config": config, "not_run": skipped}
    launches: dict[str, list[str]] = {}  # network -> the parts run on it, in one launch
    for part in _PART_RANKS:
        if part in args.parts and part not in result["not_run"]:
            for net in (_tp_nets(args) if part == "tp" else [args.net]):
                launches.setdefault(net, []).append(part)
    env = None
    with _large_blocks_returned():
        for net, parts in launches.items():
            launch = run_ranks(_parts_rank, {**config, "net": net, "run_parts": parts}, ranks=args.ranks, net=net,
                               delay=args.delay, timeout=args.timeout, backend="gloo")
            if launch.result is None:
                return None
            env = env or report.environment(backend=launch.backend, device="cpu", ranks=launch.world,
                                            network=launch.network)
            where = {"network": launch.network, "link_gbps": launch.link_gbps}
            for part, out in launch.result.items():
                if part == "pipeline":
                    check_losses(out["rows"])
                if part == "tp":
                    result.setdefault("tp", []).append({"net": net, **where, **out})
                else:
                    result[part] = {**where, **out}
    if "boundaries" in args.parts:
        from fastdist.parallel.transport import compare_boundaries

        result["boundaries"] = compare_boundaries(net=args.boundary_net, steps=args.reps, warmup=args.warmup,
                                                  timeout=args.timeout)
        env = env or result["boundaries"]["env"]
    result["env"] = env
    print(report.format_environment(env))
    print(f"# ranks pinned to one core each, 1 torch thread; medians of {args.reps} interleaved repetitions after "
          f"{args.warmup} warm-up")
    print(report.text_parts(tables(result)))
    return result


SWEEP_CONFIGS = {"gpipe+full": ("gpipe", "full"), "1f1b": ("1f1b", "none"), "1f1b+full": ("1f1b", "full"),
                 "1f1b+stage-aware": ("1f1b", "stage_aware"),
                 "scp+stage-aware": ("shifted_critical_path", "stage_aware"),
                 "scp+full": ("shifted_critical_path", "full")}
"""The sweep's columns: (schedule, recompute) of fastdist.parallel.cost.sweep's configurations."""


def _cost_tables(result: dict) -> list[report.Part]:
    cost = result.get("cost")
    if not cost:
        return []
    m, c = cost["measured"], result["config"]
    columns = [col("schedule (measured)", "variant"), col("step (ms)", "time_ms", fixed(1)),
               col("predicted (ms)", "predicted_ms", fixed(1)), col("model error (%)", "error", percent(1)),
               col("predicted from its own action times (ms)", "predicted_own_ms", fixed(1)),
               col("error, own times (%)", "error_own", percent(1)),
               col("vs torch 1F1B+ckpt", "speedup", times(2)),
               col("saved act. per stage (MiB)", lambda r: ", ".join(f"{b / MIB:.1f}" for b in r["stage_saved_bytes"]),
                   numeric=False),
               col("under cap", lambda r: report.yes_no(r["fits_cap"]), numeric=False)]
    worst = max(r["error"] for r in m["rows"])
    own = [r["error_own"] for r in m["rows"] if r.get("error_own") is not None]
    link = m["link"]
    parts = [report.Part("cost-measured", columns, m["rows"],
                         f"fastdist.parallel.cost's measured schedules (the peers' uniform stages, SGD), median of "
                         f"{c['reps']}; memory cap {m['cap_bytes'] / MIB:.1f} MiB per stage, stage-aware r0 "
                         f"{m['r0']:g}; predicted: the cost model's simulation from the stage times and the link "
                         f"measured in the same run{_load(m)}.",
                         [f"largest model error {100 * worst:.1f}%"
                          + (f" ({100 * max(own):.1f}% from each schedule's own action times)" if own else "")
                          + f" (target <= 15%); link: latency {link['latency'] * 1e6:.0f} us, "
                          f"{link['bandwidth'] / 1e9:.2f} GB/s."])]
    by_point: dict[tuple[int, int], dict] = {}
    for r in cost["sweep"]:
        point = by_point.setdefault((r["pp"], r["microbatches"]), {"pp": r["pp"], "microbatches": r["microbatches"]})
        for name, (schedule, recompute) in SWEEP_CONFIGS.items():
            if (r["schedule"], r["recompute"]) == (schedule, recompute):
                point[name] = r["step_time"]
                point["ideal"] = r["ideal"]
                if name == "scp+stage-aware":
                    point["bubble"] = r["bubble_fraction"]
    rows = list(by_point.values())
    columns = [col("pp", "pp", report.integer), col("microbatches", "microbatches", report.integer)]
    columns += [col(f"{name} (x ideal)", lambda r, n=name: r[n] / r["ideal"] if n in r else None, fixed(2))
                for name in SWEEP_CONFIGS]
    columns += [col("scp+stage-aware vs 1f1b+full", lambda r: r["1f1b+full"] / r["scp+stage-aware"]
                    if "scp+stage-aware" in r and "1f1b+full" in r else None, times(2)),
                col("scp+stage-aware bubble (%)", "bubble", percent(1))]
    parts.append(report.Part("cost-sweep", columns, rows,
                             "Cost-model simulation (not measured): every stage costs what the measured first stage "
                             "did, over the measured link; step time over the ideal n (F + B); stage-aware at the "
                             "sweep's r0 = 0.5."))
    return parts


def _load(r: dict | None) -> str:
    load = (r or {}).get("load_average")
    return f"; load average {load[0]:.1f} at the end" if load else ""


def _stage_mib(stage: int, key: str):
    def value(r: dict) -> float | None:
        mem = r.get(key) or []
        return mem[stage] / MIB if stage < len(mem) else None
    return value


def tables(result: dict) -> list[report.Part]:
    """The pipeline, balance and tp tables of `result` (its JSON payload), printed by `run` and shown in the docs."""
    c = result["config"]
    parts = []
    pipe = result.get("pipeline")
    if pipe:
        rows = pipe["rows"]
        base = next((r["time_ms"] for r in rows if r["variant"] == BASELINE), None)
        stages = max(len(r["stage_peak_bytes"]) for r in rows)
        saved = any(any(r.get("stage_saved_bytes") or []) for r in rows)
        columns = [col("pipeline (pp=%d)" % stages, "variant"), col("step (ms)", "time_ms", fixed(1)),
                   col("vs torch 1F1B+recompute", lambda r: base / r["time_ms"] if base else None, times(2))]
        if saved:
            columns += [col(f"stage {s} saved act. (MiB)", _stage_mib(s, "stage_saved_bytes"), fixed(1))
                        for s in range(stages)]
        columns += [col(f"stage {s} RSS peak (MiB)", _stage_mib(s, "stage_peak_bytes"), fixed(1))
                    for s in range(stages)]
        cap = (pipe.get("cap") or {}).get("cap_bytes")
        if cap:
            columns.append(col(f"under cap ({cap / MIB:.1f} MiB)", lambda r: report.yes_no(
                max(r["stage_saved_bytes"]) <= cap), numeric=False))
        columns += [col("first loss vs unpipelined", "first_loss_error", scientific(1)),
                    col("last loss", lambda r: r["losses"][-1], fixed(4))]
        vocab, dim, heads, layers, seq = c["gpt"]
        caption = (f"GPT vocab {vocab}, dim {dim}, {heads} heads, {layers} blocks, seq {seq}; {c['batch']} sequences "
                   f"in {c['microbatches']} microbatches per AdamW step; {pipe['network']}; median of {c['reps']} "
                   f"steps{_load(pipe)}.")
        notes = ["saved act.: peak bytes autograd kept for the backward during a step (each storage once, "
                 "parameters not counted); RSS peak: resident memory during a step above that before it; per "
                 "stage, median over the timed steps."]
        if pipe.get("cap"):
            k = pipe["cap"]
            notes.append(f"memory cap {k['cap_bytes'] / MIB:.1f} MiB per stage: {c['cap_fraction']:g} of the way from "
                         f"fastdist's stage-aware recompute at r0 = 1 ({max(k['floor_peaks']) / MIB:.1f} MiB) to "
                         f"torch's 1F1B without recompute ({max(k['plain_peaks']) / MIB:.1f} MiB); fastdist's r0 "
                         f"{k['r0']:g} (the last stage never recomputes); its partition starts stage 1 at block "
                         f"{', '.join(map(str, k['split_points']))}.")
        if result.get("not_run"):
            notes.append("not run: " + ", ".join(f"{v} ({why})" for v, why in result["not_run"].items()))
        parts.append(report.Part("pipeline", columns, rows, caption, notes))
    bal = result.get("balance")
    if bal:
        columns = [col("partition", "split"), col("bounds", lambda r: ",".join(map(str, r["bounds"])), numeric=False),
                   col("stage times (ms)", lambda r: ", ".join(f"{t:.1f}" for t in r["stage_ms"]), numeric=False),
                   col("max/mean", "max_over_mean", fixed(2))]
        parts.append(report.Part("balance", columns, bal["rows"],
                                 "Stage forward + backward on one microbatch, each on its own pinned rank, median of "
                                 f"{c['reps']}; bounds over [embedding, blocks..., head]{_load(bal)}."))
    parts += _cost_tables(result)
    for run_ in result.get("tp") or []:
        rows = run_["rows"]
        peer = next((r["time_ms"] for r in rows if r["variant"] == "dtensor"), None)
        columns = [col("GPT block (tp=2)", "variant"),
                   col("chunks", lambda r: ",".join(map(str, r["chunks"])) if r.get("chunks") else None, numeric=False),
                   col("fwd+bwd (ms)", "time_ms", fixed(1)),
                   col("vs DTensor", lambda r, peer=peer: peer / r["time_ms"] if peer else None, times(2)),
                   col("error vs unsharded", "max_error", scientific(1))]
        hidden, heads, seq, batch = c["tp_block"]
        parts.append(report.Part(f"tp-{run_['net']}", columns, rows,
                                 f"GPT block hidden {hidden}, {heads} heads, seq {seq}, batch {batch}; "
                                 f"{run_['network']}; median of {c['reps']}{_load(run_)}."))
    if result.get("boundaries"):
        from fastdist.parallel.transport import boundary_tables

        parts += boundary_tables(result["boundaries"])
    return parts


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    panels = [k for k in ("pipeline", "balance", "cost", "tp", "boundaries") if result.get(k)]
    _, fig, axes = report.subplots(1, max(len(panels), 1), figsize=(5.5 * max(len(panels), 1), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "pipeline":
            rows = result["pipeline"]["rows"]
            ax.bar([r["variant"] for r in rows], [r["time_ms"] for r in rows], color="tab:blue")
            ax.set_ylabel("optimizer step (ms, median)")
            ax.set_title("pp=2 GPT step")
            ax.tick_params(axis="x", labelrotation=25, labelsize=7)
        elif key == "balance":
            rows = result["balance"]["rows"]
            width = 0.8 / len(rows)
            for i, r in enumerate(rows):
                ax.bar([s + i * width for s in range(len(r["stage_ms"]))], r["stage_ms"], width,
                       label=f"{r['split']} (max/mean {r['max_over_mean']:.2f})")
            ax.set_xlabel("stage")
            ax.set_ylabel("fwd+bwd per microbatch (ms)")
            ax.set_title("partition balance")
            ax.legend(fontsize=8)
        elif key == "cost":
            measured = result["cost"]["measured"]["rows"]
            ax.bar([r["variant"] for r in measured], [r["time_ms"] for r in measured], color="tab:blue",
                   label="measured")
            ax.scatter([r["variant"] for r in measured], [r["predicted_ms"] for r in measured], color="black",
                       marker="_", s=300, zorder=3, label="cost model")
            ax.set_ylabel("pp=2 step (ms, median)")
            ax.set_title("cost model vs measured")
            ax.tick_params(axis="x", labelrotation=25, labelsize=7)
            ax.legend(fontsize=8)
        elif key == "boundaries":
            rows = result["boundaries"]["rows"]
            ax.bar([r["method"] for r in rows], [r["time_ms"] for r in rows], color="tab:green")
            ax.set_ylabel("step (ms, median)")
            ax.set_title(f"compressed boundaries, {result['boundaries']['env'].get('network')}", fontsize=8)
            ax.tick_params(axis="x", labelrotation=25, labelsize=7)
        else:
            runs = result["tp"]
            width = 0.8 / len(runs)
            for i, r in enumerate(runs):
                ax.bar([j + i * width for j in range(len(r["rows"]))], [row["time_ms"] for row in r["rows"]], width,
                       label=r["net"])
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runs[0]["rows"]))])
            ax.set_xticklabels([row["variant"] for row in runs[0]["rows"]], fontsize=8, rotation=30, ha="right")
            ax.set_ylabel("block fwd+bwd (ms, median)")
            ax.set_title("tp=2 GPT block")
            ax.legend(fontsize=8)
    env = result["env"]
    fig.suptitle(f"fastdist-bench parallel: {env['ranks']} ranks, one core each, load {env['load_average']}",
                 fontsize=9)
    report.save_figure(fig, path)
