"""What each rank runs in the transport tests (spawned ranks import their functions from this file), and the
single-process reference the tests compare with: the same GPT cut in two, with a fastdist.compress.Boundary where
the pipeline's stages meet, microbatch by microbatch as the schedules run them."""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from fastdist.compress import AQSGD, Boundary, Chain, Identity, MemoryStore, Quantize, TopK, batch
from fastdist.distributed import MismatchError
from fastdist.parallel.recompute import RecomputeStageMixin
from fastdist.parallel.schedule import build_schedule
from fastdist.parallel import transport
from fastdist.parallel.transport import CompressedTransportMixin, _exact_sizes, make_stage
from fastdist.testing.models import TransformerLM

VOCAB, DIM, HEADS, LAYERS, SEQ = 32, 16, 2, 4, 8
BATCH, MICROBATCHES, SAMPLES = 8, 4, 16
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def compressors(name: str) -> tuple:
    """(fwd, bwd, backward_mask) of a named configuration (fresh objects: each end and the reference own theirs)."""
    if name == "identity":
        return Identity(), Identity(), "reuse"
    if name == "topk+quant":
        return Chain(TopK(0.25), Quantize(8)), Quantize(8), "reuse"
    if name == "topk-independent":
        return TopK(0.25), Quantize(8), "independent"
    if name == "aqsgd":
        return AQSGD(Quantize(4), MemoryStore(SAMPLES), warmup_epochs=1), Quantize(8), "reuse"
    raise ValueError(name)


class Head(nn.Module):
    """The first stage: embedding, positions, the first half of the blocks (named as in the whole model)."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        self.embed, self.pos, self.causal = model.embed, model.pos, model.causal
        self.blocks = nn.ModuleList(model.blocks[:LAYERS // 2])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.causal)
        return x


class Tail(nn.Module):
    """The last stage: the second half of the blocks, the norm, the head."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        self.causal = model.causal
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(LAYERS // 2, LAYERS)})
        self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x, self.causal)
        return self.head(self.norm(x))


def gpt(boundary: nn.Module | None = None) -> TransformerLM:
    """The model every rank and the reference start from (seeded); ``boundary`` after the first half's blocks."""
    torch.manual_seed(0)
    boundaries = [nn.Identity()] * (LAYERS // 2 - 1) + [boundary] if boundary is not None else ()
    return TransformerLM(VOCAB, DIM, HEADS, LAYERS, seq=SEQ, boundaries=boundaries)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batches(epochs: int) -> list:
    """(epoch, sample ids, tokens, targets) of each step: two batches per epoch, the same samples every epoch."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    out = []
    for epoch in range(epochs):
        for first in range(0, SAMPLES, BATCH):
            ids = torch.arange(first, first + BATCH)
            out.append((epoch, ids, data[ids, :-1], data[ids, 1:]))
    return out


def _params(module: nn.Module) -> dict:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def reference(config: str, epochs: int = 1) -> dict:
    """One process: the whole model with a Boundary of the same compressors, microbatch after microbatch, gradients
    summed then divided by the microbatch count (as the schedules do); SGD steps."""
    fwd, bwd, mask = compressors(config)
    model = gpt(Boundary(fwd, bwd, mask))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads, evaluated = [], [], []
    for epoch, ids, tokens, target in batches(epochs):
        opt.zero_grad()
        for mb, (x, y, i) in enumerate(zip(tokens.tensor_split(MICROBATCHES), target.tensor_split(MICROBATCHES),
                                           ids.tensor_split(MICROBATCHES))):
            with batch(sample_ids=i, epoch=epoch):
                loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        for p in model.parameters():
            p.grad.div_(MICROBATCHES)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        opt.step()
        if epochs > 1 and len(grads) == SAMPLES // BATCH:  # the end of epoch 0: an evaluation
            model.eval()
            with torch.no_grad():
                evaluated = [loss_fn(model(x), y) for x, y in zip(tokens.tensor_split(MICROBATCHES),
                                                                  target.tensor_split(MICROBATCHES))]
            model.train()
    return {"losses": losses, "grads": grads, "params": _params(model), "eval_losses": evaluated}


def _build(config: str, schedule: str) -> tuple:
    """This rank's (stage module, stage, schedule, optimizer), fresh from the seeded model."""
    rank = dist.get_rank()
    fwd, bwd, mask = compressors(config)
    part = Head(gpt()) if rank == 0 else Tail(gpt())
    if schedule == "shifted+recompute":  # composed with fastdist.parallel's recompute, as the engine composes them
        blocks = list(part.blocks) if rank == 0 else list(part.blocks.values())
        stage_class = type("Stage", (RecomputeStageMixin, CompressedTransportMixin, PipelineStage), {})
        stage = stage_class(part, rank, 2, torch.device("cpu"), blocks=blocks, fwd=fwd, bwd=bwd, backward_mask=mask)
        sched = build_schedule("shifted_critical_path", stage, MICROBATCHES, loss_fn, recompute="full")
    else:
        stage = make_stage(part, rank, 2, "cpu", fwd=fwd, bwd=bwd, backward_mask=mask)
        sched = SCHEDULES[schedule.split("-")[0]](stage, MICROBATCHES, loss_fn=loss_fn)
    return part, stage, sched, torch.optim.SGD(part.parameters(), lr=0.5)


def pipeline(config: str, schedule: str, epochs: int = 1) -> dict:
    """Two ranks, one stage each, through torch's schedule with compressed boundaries; SGD steps. Returns this
    rank's part: the losses (last stage), the gradients of each step and the final parameters, named as in the
    whole model.

    Schedules: "gpipe", "1f1b", "shifted+recompute" (fastdist.parallel's, with RecomputeStageMixin), and
    "1f1b-exact" (frames padded to the agreed size, as on NCCL), "1f1b-resumed" (at the second epoch every rank
    rebuilds its stage, model and optimizer and loads the state dicts saved just before)."""
    rank = dist.get_rank()
    transport._exact_sizes = (lambda device: True) if schedule == "1f1b-exact" else _exact_sizes
    part, stage, sched, opt = _build(config, schedule)
    losses, grads, wire, evaluated = [], [], [], []
    for step, (epoch, ids, tokens, target) in enumerate(batches(epochs)):
        if schedule == "1f1b-resumed" and step == SAMPLES // BATCH:
            saved = (part.state_dict(), stage.transport_state_dict(), opt.state_dict())
            part, stage, sched, opt = _build(config, schedule)
            part.load_state_dict(saved[0])
            stage.load_transport_state_dict(saved[1])
            opt.load_state_dict(saved[2])
        opt.zero_grad()
        step_losses = []
        before = dict(stage.wire_bytes)
        with batch(sample_ids=ids, epoch=epoch):
            if rank == 0:
                sched.step(tokens)
            else:
                sched.step(target=target, losses=step_losses)
        losses += [loss.detach() for loss in step_losses]
        grads.append({name: p.grad.clone() for name, p in part.named_parameters()})
        wire.append({d: stage.wire_bytes[d] - before[d] for d in before})
        opt.step()
        if epochs > 1 and step + 1 == SAMPLES // BATCH:  # forward only (dense frames), then training goes on
            sched.eval(tokens) if rank == 0 else sched.eval(target=target, losses=evaluated)
    transport._exact_sizes = _exact_sizes
    return {"losses": losses, "grads": grads, "params": _params(part), "wire_bytes": wire,
            "eval_losses": evaluated}


def cases(runs: list, ratio_by_rank: tuple) -> dict:
    """pipeline(*run) for each run in turn, then mismatched(ratio_by_rank), two_stages_per_rank(), a tiny boundary
    comparison and diverged(), in one process group (one spawn for many cases)."""
    torch.set_num_threads(1)  # the reference runs on one thread too: equal float sums
    transport.MISMATCH_SEND_WAIT_S = 1.0  # the wait for frames the other end never sends, shortened for the test
    return {"runs": [pipeline(*run) for run in runs], "mismatch": mismatched(ratio_by_rank),
            "two_stages_per_rank": two_stages_per_rank(),
            "bench": transport.boundary_bench_rank({"batch": 4, "seq": 64, "hidden": 8, "expand": 1, "microbatches": 2,
                                                    "ratio": 0.1, "steps": 1, "warmup": 1,
                                                    "methods": transport.BOUNDARY_METHODS}),
            "diverged": diverged()}  # last: it leaves receives posted that the other rank never matches


def two_stages_per_rank() -> str:
    """The error of a stage of a 4-stage pipeline on 2 ranks (or "no error")."""
    try:
        make_stage(nn.Linear(DIM, DIM), dist.get_rank(), 4, "cpu", fwd=TopK(0.5))
    except NotImplementedError as e:
        return str(e)
    return "no error"


def mismatched(ratio_by_rank: tuple) -> str:
    """Each rank builds its stage with its own TopK ratio; returns the MismatchError's message (or "no error")."""
    rank = dist.get_rank()
    model = gpt()
    part = Head(model) if rank == 0 else Tail(model)
    stage = make_stage(part, rank, 2, "cpu", fwd=TopK(ratio_by_rank[rank]), bwd=Quantize(8))
    sched = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    epoch, ids, tokens, target = batches(1)[0]
    try:
        sched.step(tokens) if rank == 0 else sched.step(target=target)
    except MismatchError as e:
        return str(e)
    return "no error"


def diverged() -> tuple:
    """After one step, rank 1 restores its transport state from before that step (as a resume of one rank only
    would): its activation count goes back by a step's microbatches. Returns what each rank raised in the next
    step: (exception type, message)."""
    rank = dist.get_rank()
    fwd, bwd, mask = compressors("topk+quant")
    part = Head(gpt()) if rank == 0 else Tail(gpt())
    stage = make_stage(part, rank, 2, "cpu", fwd=fwd, bwd=bwd, backward_mask=mask)
    sched = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    state = stage.transport_state_dict()
    for step, (epoch, ids, tokens, target) in enumerate(batches(1)):
        if step == 1 and rank == 1:
            stage.load_transport_state_dict(state)
        try:
            sched.step(tokens) if rank == 0 else sched.step(target=target)
        except Exception as e:  # noqa: BLE001 -- the test reads which error each rank saw
            return type(e).__name__, str(e), isinstance(e, MismatchError)
    return "no error", "", False
