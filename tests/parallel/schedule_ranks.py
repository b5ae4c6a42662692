"""What runs on the ranks for tests/parallel/test_schedule*.py: a small GPT with dropout cut into pipeline stages
the way a user cuts it (embedding and first blocks, last blocks and head), trained a few steps under each schedule
and recompute setting; every rank returns its losses, its stage's gradients and parameters, and what its stage did
in which order."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from fastdist.distributed import MismatchError
from fastdist.parallel.cost import measure_schedules
from fastdist.parallel.recompute import SavedActivationMeter, make_stage
from fastdist.parallel.schedule import build_schedule
from fastdist.testing.models import Block

VOCAB, DIM, HEADS, SEQ, BATCH, LAYERS = 64, 32, 2, 16, 8, 4


class DropBlock(nn.Module):
    """A transformer block followed by dropout, as nanoGPT's residual dropout."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.block, self.drop = Block(DIM, HEADS), nn.Dropout(p)

    def forward(self, x, mask):
        return self.drop(self.block(x, mask))


class GPTStage(nn.Module):
    """Blocks [first, last) of a GPT; the first stage also embeds, the last also norms and projects to logits."""

    def __init__(self, first: int, last: int, embed: bool, head: bool, dropout: float = 0.1):
        super().__init__()
        torch.manual_seed(0)
        every = [DropBlock(dropout) for _ in range(LAYERS)]  # the whole model's blocks, so every cut holds the same ones
        self.embed = nn.Embedding(VOCAB, DIM) if embed else None
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, DIM)) if embed else None
        self.blocks = nn.ModuleList(every[first:last])
        self.norm, self.head = (nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)) if head else (None, None)
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1))

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x) + self.pos
        for block in self.blocks:
            x = block(x, self.mask)
            x *= 1.0  # an in-place op on a block's output, as users' code may have
        return self.head(self.norm(x)) if self.head is not None else x


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, 1)


def stage_module(rank: int, world: int, dropout: float = 0.1) -> GPTStage:
    per = LAYERS // world
    return GPTStage(rank * per, (rank + 1) * per, embed=rank == 0, head=rank == world - 1, dropout=dropout)


def global_grads(module: GPTStage, first: int) -> dict:
    """The stage's gradients named as in the whole model (its blocks numbered from `first`)."""
    out = {}
    for name, p in module.named_parameters():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            name = f"blocks.{first + int(i)}.{rest}"
        out[name] = p.grad.clone()
    return out


def interleaved(recompute) -> dict:
    """One step of the GPT (no dropout) in 4 stages of one block, 2 per rank, under torch's interleaved 1F1B
    through `build_schedule`, and in 2 stages under torch's 1F1B: losses and gradients named as in the whole
    model, each way."""
    rank = torch.distributed.get_rank()
    tokens, target = batch(0)
    out = {}
    for way in ("interleaved", "torch"):
        count = 4 if way == "interleaved" else 2
        indices = [rank, rank + 2] if way == "interleaved" else [rank]
        modules = [stage_module(i, count, dropout=0.0) for i in indices]
        if way == "interleaved":
            stages = [make_stage(m, i, count, "cpu") for m, i in zip(modules, indices)]
            sched = build_schedule("interleaved", stages, 4, loss_fn, recompute=recompute)
        else:
            sched = Schedule1F1B(PipelineStage(modules[0], rank, 2, torch.device("cpu")), 4, loss_fn=loss_fn)
        losses: list = []
        if rank == 0:
            sched.step(tokens)
        else:
            sched.step(target=target, losses=losses)
        grads = {}
        for m, i in zip(modules, indices):
            grads.update(global_grads(m, i * LAYERS // count))
        out[way] = {"losses": [x.item() for x in losses], "grads": grads}
    return out


class LoggedStage:
    """Wraps a stage's methods to log ("F"|"R"|"B", microbatch) in the order they ran; "R" is a recompute of the
    head's first block, seen by a hook that counts its calls outside the forward."""

    def __init__(self, stage):
        self.log: list[tuple[str, int]] = []
        self.stage = stage
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        state = {"in_forward": False, "mb": -1}

        def forward_one_chunk(i, *a, **k):
            self.log.append(("F", i))
            state["in_forward"] = True
            try:
                return fwd(i, *a, **k)
            finally:
                state["in_forward"] = False

        def backward_one_chunk(i, *a, **k):
            self.log.append(("B", i))
            return bwd(i, *a, **k)

        def first_block_ran(module, args):
            if not state["in_forward"]:
                self.log.append(("R", -1))

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.submod.blocks[0].register_forward_pre_hook(first_block_ran)


def train(schedule: str, recompute, r0: float, microbatches: int, steps: int = 2, torch_reference: bool = False,
          group=None):
    """`steps` SGD steps of the GPT pipelined over `group` (default: all ranks) on this rank: losses (last
    stage), gradients of the first step, parameters after, the stage's F/R/B log of the last step, and its
    recompute ratio."""
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    module = stage_module(rank, world)
    if torch_reference:
        stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
        sched = Schedule1F1B(stage, microbatches, loss_fn=loss_fn)
    else:
        stage = make_stage(module, rank, world, "cpu", group)
        sched = build_schedule(schedule, stage, microbatches, loss_fn, recompute=recompute, recompute_ratio=r0)
    logged = LoggedStage(stage)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses, grads = [], None
    for step in range(steps):
        tokens, target = batch(step)
        torch.manual_seed(1000 * step + rank)  # each rank's dropout stream, the same in every configuration
        logged.log.clear()
        mb_losses: list = []
        if rank == 0:
            sched.step(tokens, target=target if world == 1 else None, losses=mb_losses)
        else:
            sched.step(target=target, losses=mb_losses)
        if rank == world - 1:
            losses.append(torch.stack(mb_losses).mean().item())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "log": logged.log, "ratio": getattr(stage, "recompute_ratio", 0.0)}


CASES = {
    "torch": ("1f1b", "none", 0.0, 4, True),
    "1f1b": ("1f1b", "none", 0.0, 4, False),
    "1f1b_full": ("1f1b", "full", 0.0, 4, False),
    "gpipe_full": ("gpipe", "full", 0.0, 4, False),
    "gpipe_half": ("gpipe", 0.5, 0.0, 4, False),
    "scp_stage_aware": ("shifted_critical_path", "stage_aware", 0.5, 4, False),
    "scp_full": ("shifted_critical_path", "full", 0.0, 4, False),
}


def run_cases(names: list[str]) -> dict:
    """Every case in `names` on this rank (see CASES): name -> `train`'s result; then a tiny
    `measure_schedules` under "measure", a schedule mismatch's message under "mismatch", `ddp_stage` without and
    with recompute under "ddp", and, on rank 0 alone (a group of its own), `single_stage` under "single"."""
    out = {}
    for name in names:
        schedule, recompute, r0, microbatches, reference = CASES[name]
        out[name] = train(schedule, recompute, r0, microbatches, torch_reference=reference)
    out["measure"] = measure_schedules({"gpt": (64, 16, 2, 4, 8), "batch": 4, "microbatches": 2, "reps": 1,
                                        "warmup": 0, "calibration_reps": 1, "pin": False})
    try:  # the ranks disagree on the schedule
        rank = torch.distributed.get_rank()
        build_schedule("gpipe" if rank == 0 else "1f1b", make_stage(stage_module(rank, 2), rank, 2, "cpu"), 4,
                       loss_fn)
        out["mismatch"] = None
    except MismatchError as e:
        out["mismatch"] = str(e)
    out["ddp"] = {ratio: ddp_stage(ratio) for ratio in (0.0, 1.0)}
    out["interleaved"] = interleaved("full")
    alone = torch.distributed.new_group([0])
    if torch.distributed.get_rank() == 0:
        out["single"] = single_stage(alone)
    return out


def single_stage(group) -> dict:
    """One rank, one stage (the degenerate pipeline, over `group` of one rank): each schedule's losses and
    gradients, the saved-activation peak at ratios 0, 0.5 and 1, and the errors for bad arguments."""
    out = {name: train(*CASES[name][:4], steps=2, torch_reference=CASES[name][4], group=group)
           for name in ("torch", "1f1b_full", "gpipe_half", "scp_full")}
    out["peaks"] = {}
    for ratio in (0.0, 0.5, 1.0):
        module = stage_module(0, 1)
        stage = make_stage(module, 0, 1, "cpu", group, recompute_ratio=ratio)
        sched = build_schedule("gpipe", stage, 4, loss_fn, recompute=ratio)
        tokens, target = batch(0)
        with SavedActivationMeter(exclude=[*module.parameters(), *module.buffers()]) as meter:
            sched.step(tokens, target=target)
        out["peaks"][ratio] = (meter.peak, meter.current)
    errors = {}
    module = stage_module(0, 1)
    plain = PipelineStage(module, 0, 1, torch.device("cpu"), group=group)
    ours = make_stage(module, 0, 1, "cpu", group)
    bad = {"name": lambda: build_schedule("zero_bubble", ours, 4, loss_fn),
           "microbatches": lambda: build_schedule("1f1b", ours, 0, loss_fn),
           "recompute_mode": lambda: build_schedule("1f1b", ours, 4, loss_fn, recompute="some"),
           "recompute_float": lambda: build_schedule("1f1b", ours, 4, loss_fn, recompute=1.5),
           "stage_aware_r0": lambda: build_schedule("1f1b", ours, 4, loss_fn, recompute="stage_aware",
                                                    recompute_ratio=-0.1),
           "plain_stage": lambda: build_schedule("1f1b", plain, 4, loss_fn, recompute="full"),
           "stage_ratio": lambda: make_stage(module, 0, 1, "cpu", group, recompute_ratio=float("nan"))}
    for what, call in bad.items():
        try:
            call()
            errors[what] = None
        except (ValueError, TypeError) as e:
            errors[what] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    out["plain_ok"] = type(build_schedule("1f1b", plain, 4, loss_fn)).__name__
    return out


def ddp_stage(ratio: float) -> dict:
    """Data parallel over both ranks, each rank a one-stage pipeline (a group of its own) over its DDP-wrapped
    GPT: the gradients after one step on this rank's own batch, with the stage recomputing `ratio` of its
    blocks."""
    rank = torch.distributed.get_rank()
    alone = [torch.distributed.new_group([r]) for r in range(2)][rank]
    module = stage_module(0, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    stage = make_stage(ddp, 0, 1, "cpu", alone, blocks=list(module.blocks))
    sched = build_schedule("1f1b", stage, 2, loss_fn, recompute=ratio)
    tokens, target = batch(rank)
    torch.manual_seed(rank)
    sched.step(tokens, target=target)
    return {n: p.grad.clone() for n, p in module.named_parameters()}
