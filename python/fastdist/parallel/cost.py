"""A cost model of the pipeline schedules: each stage's action timeline simulated from per-stage times.

`simulate(schedule, stages, n_microbatches, ...)` replays what `fastdist.parallel.schedule`'s schedules do on
every stage (torch's GPipe and 1F1B, Merak's shifted critical path; recompute none, full, stage-aware or a ratio):
each stage runs its actions in the schedule's order, an action starts when the stage is free and the data it
waits for has arrived, a boundary's activation or gradient arrives latency + bytes / bandwidth after the action
that produced it, and where torch's schedules wait for a send together with a receive the stage waits for that
send too. A recompute at ratio r costs the time of the stage's first ceil(r L) blocks' forward (r of the
stage's forward when its blocks are not given); where it runs is the schedule's: inside the backward (GPipe,
1F1B: on the critical path) or before waiting for the gradient (shifted critical path). Memory follows the
same timeline: a microbatch's activations are kept from its forward to its backward, (1 - r) of them plus the
stage input at ratio r, and the recomputed part from the recompute to the backward.

Stage times come from measurement (`measure_stage`: one stage alone on one microbatch; `measure_schedules`:
inside a pipeline's steps) or are made up (`StageTimes(...)`), so the model extrapolates the bubble and recompute terms to
pipelines far larger than the machine (pp 4..64, 8..64 microbatches).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastdist.parallel.schedule import resolve_recompute

SIMULATED = ("gpipe", "1f1b", "shifted_critical_path")
"""The schedules `simulate` replays (one stage per rank)."""

__all__ = ["BASELINE", "SIMULATED", "MEASURED_VARIANTS", "LMStage", "Link", "SimResult", "StageTimes", "measure_link", "measure_schedules",
           "measure_stage", "simulate", "sweep"]


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """What one stage costs per microbatch.

    Args:
        forward: Seconds of the stage's forward (last stage: with the loss).
        backward: Seconds of its backward, without recompute.
        recompute: Seconds to recompute the whole stage (default: `forward`).
        blocks: The stage's blocks L: a ratio r recomputes ceil(r L) / L of it (0: r of it exactly).
        activation_bytes: Bytes autograd keeps for one microbatch without recompute (0: memory counted in
            microbatches, 1 per microbatch).
        input_bytes: Bytes one microbatch keeps at full recompute (its input).
        send_bytes: Bytes of the activation sent to the next stage (the gradient coming back is as large).
    """

    forward: float
    backward: float
    recompute: float | None = None
    blocks: int = 0
    activation_bytes: float = 0.0
    input_bytes: float = 0.0
    send_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "activation_bytes", "input_bytes", "send_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"StageTimes.{name} must be a finite number >= 0, got {value!r}")
        if self.recompute is not None and (not math.isfinite(self.recompute) or self.recompute < 0):
            raise ValueError(f"StageTimes.recompute must be a finite number >= 0 or None, got {self.recompute!r}")
        if not isinstance(self.blocks, int) or self.blocks < 0:
            raise ValueError(f"StageTimes.blocks must be an int >= 0, got {self.blocks!r}")

    def share(self, ratio: float) -> float:
        """The part of the stage recomputed at `ratio` (ceil(ratio L) / L with L blocks)."""
        if self.blocks:
            return math.ceil(ratio * self.blocks - 1e-9) / self.blocks
        return ratio

    def recompute_time(self, ratio: float) -> float:
        """Seconds to recompute the stage at `ratio`."""
        return self.share(ratio) * (self.forward if self.recompute is None else self.recompute)

    def kept(self, ratio: float) -> float:
        """Bytes (or microbatches) one microbatch keeps from its forward to its backward at `ratio`."""
        full = self.activation_bytes or 1.0
        share = self.share(ratio)
        return (1.0 - share) * full + (self.input_bytes if share > 0 else 0.0)


@dataclasses.dataclass(frozen=True)
class Link:
    """A pipeline boundary: seconds per message and bytes per second."""

    latency: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        if not self.latency >= 0 or not self.bandwidth > 0:
            raise ValueError(f"Link needs latency >= 0 and bandwidth > 0, got {self.latency!r}, {self.bandwidth!r}")

    def transfer(self, nbytes: float) -> float:
        """Seconds for a message of `nbytes`."""
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


@dataclasses.dataclass
class SimResult:
    """What `simulate` predicts.

    Attributes:
        step_time: Seconds from the first forward's start to the last backward's end.
        busy: Per stage, seconds computing (forward, backward, recompute).
        recompute: Per stage, seconds recomputing.
        exposed_recompute: Per stage, recompute seconds that lengthened the step (recompute run inside a
            backward, or run early but past the moment the gradient arrived).
        bubble: Per stage, step_time - busy.
        peak_memory: Per stage, the most activation bytes kept at once (microbatches when bytes are not given).
        peak_in_flight: Per stage, the most microbatches forwarded and not yet backwarded at once.
        ratios: Per stage, the recompute ratio used.
        timeline: (stage, kind "F"/"R"/"B", microbatch, start, end) for every action.
    """

    step_time: float
    busy: list[float]
    recompute: list[float]
    exposed_recompute: list[float]
    bubble: list[float]
    peak_memory: list[float]
    peak_in_flight: list[int]
    ratios: list[float]
    timeline: list[tuple[int, str, int, float, float]]


def _program(schedule: str, s: int, S: int, n: int, recompute: float, backward: float, forward: float) -> list:
    """Stage s's program, op by op, as torch's schedule code (and ours) runs it: ("C", kind, mb, seconds) computes,
    ("P", messages) posts sends, ("W", messages) waits for messages to arrive (receives) or to leave (own sends).
    A message is ("act", sender, mb) or ("grad", sender, mb)."""
    early = schedule == "shifted_critical_path"

    def recv_act(i: int) -> list:
        return [("act", s - 1, i)] if s > 0 else []

    def recv_grad(i: int) -> list:
        return [("grad", s + 1, i)] if s < S - 1 else []

    def send_act(i: int) -> list:
        return [("act", s, i)] if s < S - 1 else []

    def send_grad(i: int) -> list:
        return [("grad", s, i)] if s > 0 else []

    def backward_of(i: int, waits: list) -> list:
        rc = [("C", "R", i, recompute)] if recompute else []
        return [*(rc if early else []), ("W", waits), *([] if early else rc), ("C", "B", i, backward)]

    prog: list = []
    if schedule == "gpipe":
        for i in range(n):
            prog += [("W", recv_act(i)), ("C", "F", i, forward), ("P", send_act(i))]
        prog.append(("W", [m for i in range(n) for m in send_act(i)]))
        for i in range(n):
            prog += [*backward_of(i, recv_grad(i)), ("P", send_grad(i))]
        prog.append(("W", [m for i in range(n) for m in send_grad(i)]))
        return prog
    warmup = min(n, S - s)
    previous: list = []
    pending: list = []
    for k in range(warmup):
        prog += [("W", recv_act(k)), ("C", "F", k, forward), ("W", previous)]
        if k != warmup - 1:
            prog.append(("P", send_act(k)))
            previous = send_act(k)
        else:
            pending = send_act(k)  # posted with the first backward's receive
    f, b = warmup, 0
    while True:
        prog += [("P", pending), *backward_of(b, pending + recv_grad(b))]
        pending = send_grad(b)
        b += 1
        if f == n:
            break
        prog += [("P", pending), ("W", pending + recv_act(f)), ("C", "F", f, forward)]
        pending = send_act(f)
        f += 1
    prog.append(("P", pending))
    previous = pending
    while b < n:
        prog += [*backward_of(b, recv_grad(b)), ("W", previous), ("P", send_grad(b))]
        previous = send_grad(b)
        b += 1
    prog.append(("W", previous))
    return prog


def simulate(schedule: str, stages: Sequence[StageTimes] | StageTimes, n_microbatches: int, *,
             num_stages: int | None = None, recompute: str | float = "none", recompute_ratio: float = 0.5,
             link: Link | Sequence[Link] = Link()) -> SimResult:
    """Simulates one step of `schedule` on a pipeline whose stage s costs `stages[s]`.

    Args:
        schedule: "gpipe", "1f1b" or "shifted_critical_path".
        stages: One StageTimes per stage, or one for every stage (then `num_stages` says how many).
        n_microbatches: Microbatches per step.
        num_stages: Stages, when `stages` is one StageTimes.
        recompute: "none", "full", "stage_aware" or a ratio for every stage, as `build_schedule` takes it.
        recompute_ratio: The first stage's ratio under "stage_aware".
        link: The boundaries' link (one for all, or one per boundary).

    Returns:
        The predicted SimResult.
    """
    if schedule not in SIMULATED:
        raise ValueError(f"schedule must be one of {list(SIMULATED)}, got {schedule!r}")
    if isinstance(stages, StageTimes):
        if num_stages is None or num_stages < 1:
            raise ValueError(f"simulate: one StageTimes for every stage needs num_stages >= 1, got {num_stages!r}")
        stages = [stages] * num_stages
    stages = list(stages)
    S, n = len(stages), n_microbatches
    if S < 1 or (num_stages is not None and num_stages != S):
        raise ValueError(f"simulate: {S} stage times for num_stages={num_stages}")
    if not isinstance(n, int) or n < 1 or (schedule != "gpipe" and n < S):
        raise ValueError(f"simulate: {schedule} on {S} stages needs n_microbatches >= {1 if schedule == 'gpipe' else S}"
                         f", got {n!r}")
    links = [link] * (S - 1) if isinstance(link, Link) else list(link)
    if len(links) != S - 1:
        raise ValueError(f"simulate: {len(links)} links for {S - 1} boundaries")
    ratios = [resolve_recompute(recompute, recompute_ratio, s, S, schedule) for s in range(S)]

    def transfer(message: tuple) -> float:
        kind, sender, _ = message
        boundary = sender if kind == "act" else sender - 1
        return links[boundary].transfer(stages[boundary].send_bytes)

    programs = [_program(schedule, s, S, n, t.recompute_time(ratios[s]), t.backward, t.forward)
                for s, t in enumerate(stages)]
    arrive: dict[tuple, float] = {}
    clock, pc = [0.0] * S, [0] * S
    exposed = [0.0] * S
    early_rc: list[tuple[float, float] | None] = [None] * S  # a recompute run ahead, until its wait
    timeline: list[tuple[int, str, int, float, float]] = []
    events: list[list[tuple[float, float, int]]] = [[] for _ in range(S)]  # (time, memory delta, in-flight delta)
    sweeps, left = 0, sum(len(p) for p in programs)
    while left:
        progressed = False
        sweeps += 1
        for s in range(S) if sweeps % 2 else range(S - 1, -1, -1):  # activations flow up, gradients down
            t, prog = stages[s], programs[s]
            share, full, kept = t.share(ratios[s]), t.activation_bytes or 1.0, t.kept(ratios[s])
            recomputed = share * full if t.recompute_time(ratios[s]) else 0.0
            while pc[s] < len(prog):
                op = prog[pc[s]]
                if op[0] == "W":
                    times = [arrive.get(m) for m in op[1]]
                    if None in times:
                        break
                    ready = max(times, default=0.0)
                    if early_rc[s] is not None:
                        start, end = early_rc[s]
                        exposed[s] += max(0.0, end - max(start, ready))
                        early_rc[s] = None
                    clock[s] = max(clock[s], ready)
                elif op[0] == "P":
                    for m in op[1]:
                        arrive[m] = clock[s] + transfer(m)
                else:
                    _, kind, i, seconds = op
                    start, clock[s] = clock[s], clock[s] + seconds
                    timeline.append((s, kind, i, start, clock[s]))
                    if kind == "F":
                        events[s].append((clock[s], kept, 1))
                    elif kind == "R":
                        events[s].append((clock[s], share * full, 0))
                        if schedule == "shifted_critical_path":
                            early_rc[s] = (start, clock[s])
                        else:
                            exposed[s] += seconds
                    else:
                        events[s].append((clock[s], -(kept + recomputed), -1))
                pc[s] += 1
                left -= 1
                progressed = True
        if not progressed:  # cannot happen for these schedules; a guard against a silent endless loop
            raise RuntimeError(f"simulate: {schedule} deadlocked at ops {pc}")

    step = max(clock)
    busy, rec = [0.0] * S, [0.0] * S
    for s, kind, _, start, end in timeline:
        busy[s] += end - start
        rec[s] += (end - start) * (kind == "R")
    peaks, in_flight = [], []
    for s in range(S):
        held = count = peak = peak_n = 0.0
        for _, delta, dn in sorted(events[s], key=lambda e: (e[0], e[1] < 0)):
            held += delta
            count += dn
            peak, peak_n = max(peak, held), max(peak_n, count)
        peaks.append(peak)
        in_flight.append(int(peak_n))
    return SimResult(step_time=step, busy=busy, recompute=rec, exposed_recompute=exposed,
                     bubble=[step - b for b in busy], peak_memory=peaks, peak_in_flight=in_flight, ratios=ratios,
                     timeline=sorted(timeline, key=lambda a: (a[3], a[0])))


def sweep(stage: StageTimes, stages: Sequence[int] = (4, 8, 16, 32, 64),
          microbatches: Sequence[int] = (8, 16, 32, 64), link: Link = Link(),
          configs: Sequence[tuple[str, str | float, float]] = (
              ("gpipe", "full", 0.0), ("1f1b", "none", 0.0), ("1f1b", "full", 0.0),
              ("1f1b", "stage_aware", 0.5), ("shifted_critical_path", "stage_aware", 0.5),
              ("shifted_critical_path", "full", 0.0))) -> list[dict[str, Any]]:
    """Simulates every (pp, microbatches, config) with `stage` on every stage: the paper's scale on one box.

    Args:
        stage: Every stage's times (a transformer's stages are alike but for the ends).
        stages: Pipeline depths.
        microbatches: Microbatches per step (1F1B-type configs skip counts below the depth).
        link: Every boundary's link.
        configs: (schedule, recompute, recompute_ratio) triples.

    Returns:
        One row per simulated point: pp, microbatches, schedule, recompute, r0, step_time, bubble_fraction (of
        the step, on the first stage), recompute_exposed (seconds on the first stage), peak_memory (the largest
        stage's), ideal (the step with no bubble and no recompute: n (F + B)).
    """
    rows = []
    for pp in stages:
        for n in microbatches:
            for schedule, recompute, r0 in configs:
                if schedule != "gpipe" and n < pp:
                    continue
                r = simulate(schedule, stage, n, num_stages=pp, recompute=recompute, recompute_ratio=r0, link=link)
                rows.append({"pp": pp, "microbatches": n, "schedule": schedule, "recompute": recompute, "r0": r0,
                             "step_time": r.step_time, "bubble_fraction": r.bubble[0] / r.step_time,
                             "recompute_exposed": r.exposed_recompute[0], "peak_memory": max(r.peak_memory),
                             "ideal": n * (stage.forward + stage.backward)})
    return rows


def measure_stage(module: torch.nn.Module, inputs: Sequence[Any], *, loss_fn: Callable[..., torch.Tensor] |
                  None = None, target: Any = None, blocks: int = 0, reps: int = 5, warmup: int = 1) -> StageTimes:
    """Times one stage's forward and backward on one microbatch in this process (medians of `reps`), and measures
    the bytes autograd keeps for it, its input's and its output's bytes.

    Args:
        module: The stage's module.
        inputs: Its forward's positional inputs for one microbatch (floating ones get gradients, as in a pipeline).
        loss_fn: For the last stage: `loss_fn(output, target)` is timed with the forward and is what backward
            starts from; otherwise the backward starts from a gradient of ones.
        target: The loss's target.
        blocks: The stage's blocks (see `StageTimes.blocks`).
        reps: Timed repetitions (>= 1).
        warmup: Untimed repetitions first.

    Returns:
        The stage's StageTimes (recompute = forward).
    """
    from fastdist.parallel.recompute import SavedActivationMeter

    if reps < 1 or warmup < 0:
        raise ValueError(f"measure_stage: needs reps >= 1 and warmup >= 0, got {reps}, {warmup}")
    exclude = [*module.parameters(), *module.buffers()]
    fwd, bwd, saved = [], [], 0
    out_bytes = in_bytes = 0
    for rep in range(warmup + reps):
        xs = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs]
        with SavedActivationMeter(exclude=exclude) as meter:
            start = time.perf_counter()
            out = module(*xs)
            loss = loss_fn(out, target) if loss_fn is not None else None
            mid = time.perf_counter()
            saved = meter.peak
            if loss is not None:
                loss.backward()
            else:
                out.backward(torch.ones_like(out))
            end = time.perf_counter()
        module.zero_grad(set_to_none=True)
        if rep >= warmup:
            fwd.append(mid - start)
            bwd.append(end - mid)
        in_bytes = sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))
        out_bytes = out.numel() * out.element_size() if loss_fn is None else 0
    return StageTimes(forward=statistics.median(fwd), backward=statistics.median(bwd), blocks=blocks,
                      activation_bytes=float(saved), input_bytes=float(in_bytes), send_bytes=float(out_bytes))


# ---- calibration and the measured check (pp = ranks, one stage per rank) ----

MEASURED_VARIANTS = {
    # name: (schedule, recompute, torch's own stage with every block under torch.utils.checkpoint)
    "torch-1f1b": ("1f1b", "none", False),
    "torch-1f1b+ckpt": ("1f1b", "full", True),
    "torch-gpipe+ckpt": ("gpipe", "full", True),
    "1f1b+stage-aware": ("1f1b", "stage_aware", False),
    "scp+stage-aware": ("shifted_critical_path", "stage_aware", False),
}
"""The schedules `measure_schedules` times: torch's own stages and schedules (no recompute; full activation
checkpointing of every block, as a torch user turns it on), and fastdist's recompute stage under torch's 1F1B and
under the shifted critical path, with stage-aware recompute at the r0 the memory cap allows."""
BASELINE = "torch-1f1b+ckpt"


class LMStage(torch.nn.Module):
    """Blocks [first, last) of a `fastdist.testing.models.TransformerLM` GPT (sharing its parameters); the first
    stage embeds (with positions), the last norms and projects to logits."""

    def __init__(self, lm: torch.nn.Module, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.embed, self.pos = (lm.embed, lm.pos) if is_first else (None, None)
        self.blocks = torch.nn.ModuleList(lm.blocks[first:last])
        self.norm, self.head = (lm.norm, lm.head) if is_last else (None, None)
        self.register_buffer("causal", lm.causal.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.pos[:x.shape[1]]
        t = x.shape[1]
        for block in self.blocks:
            x = block(x, self.causal[:t, :t])
        return self.head(self.norm(x)) if self.head is not None else x


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _stage_bounds(layers: int, world: int, split: Sequence[int] | None) -> list[int]:
    split = list(split) if split else [layers // world + (s < layers % world) for s in range(world)]
    if len(split) != world or sum(split) != layers or min(split) < 1:
        raise ValueError(f"split {split} must give each of {world} stages >= 1 of the {layers} blocks")
    return [sum(split[:s]) for s in range(world + 1)]


def _ping_pong(nbytes: int, reps: int) -> float:
    """Median one-way seconds of a message of `nbytes` between ranks 0 and 1 (the others idle)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.zeros(max(1, nbytes // 4))
    samples = []
    for _ in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples[1:])


def measure_link(nbytes: int, reps: int = 9) -> Link:
    """The link between ranks 0 and 1 of the default group, from ping-pongs of 4 bytes and of `nbytes`. A
    collective (every rank calls it; all get the same Link)."""
    import torch.distributed as dist

    small, big = _ping_pong(4, reps), _ping_pong(nbytes, reps)
    both = torch.tensor([small, big] if dist.get_rank() == 0 else [0.0, 0.0], dtype=torch.float64)
    dist.broadcast(both, 0)
    small, big = both.tolist()
    return Link(latency=small, bandwidth=nbytes / (big - small) if big > small else math.inf)


def measure_schedules(config: dict) -> dict:
    """Times `MEASURED_VARIANTS` on a GPT pipelined over the default group's ranks (one stage each), at one
    per-stage memory cap, and checks `simulate` against every measured step. Runs on every rank.

    The memory measure is `SavedActivationMeter`'s: the most bytes autograd keeps for the backward on a stage
    during a step (parameters excluded). The cap lies between the least memory stage-aware recompute runs in (the
    largest stage's need at r0 = 1; the last stage never recomputes) and the most torch's 1F1B without recompute
    needs, at `cap_fraction` of the way (default 0.5: torch's 1F1B without recompute does not fit, the last
    stage without recompute does: the regime stage-aware recompute is for). Stage-aware recompute takes the
    smallest r0 (in steps of 1 / the first stage's blocks) at which every stage stays under the cap under the
    shifted critical path; every stage-aware row uses it. Every variant's stage actions are timed inside its
    timed steps. Two predictions per row: `predicted_ms`, a priori, from torch 1F1B's actions (forward with the
    loss, backward, and the span of the stage's blocks in a forward as the recompute at ratio 1), torch's
    checkpointed variants scaled by what torch's checkpoint adds to a stage's forward and backward on one
    microbatch alone; `predicted_own_ms`, the schedule simulation alone, from the variant's own actions. The link
    comes from a ping-pong (`measure_link`).

    Args:
        config: gpt (vocab, dim, heads, layers, seq), batch, microbatches, split (blocks per stage, or None:
            even), cap_fraction, reps, warmup, seed, variants (names of MEASURED_VARIANTS; default all), pin
            (each rank on its own core with one thread; default True).

    Returns:
        On every rank: rows (variant, schedule, recompute, r0, ratios, time_ms, samples_ms, predicted_ms, error,
        predicted_own_ms, error_own, stage_saved_bytes, fits_cap, speedup vs BASELINE), cap_bytes, cap_fraction,
        r0, r0_search, stage_times (the calibration), actions (every variant's per stage),
        torch_checkpoint_factors, link, bounds, config, load_average.
    """
    import contextlib
    import os

    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.pipelining import PipelineStage

    from fastdist.distributed.timing import all_max, together
    from fastdist.parallel.recompute import SavedActivationMeter, make_stage
    from fastdist.parallel.schedule import build_schedule, stage_recompute_ratios

    rank, world = dist.get_rank(), dist.get_world_size()
    if config.get("pin", True):
        from fastdist.bench.launch import pin_to_core
        pin_to_core(rank)
    from fastdist.testing.models import TransformerLM

    vocab, dim, heads, layers, seq = config["gpt"]
    n, batch = config["microbatches"], config["batch"]
    if batch % n:
        raise ValueError(f"batch {batch} is not divisible into {n} microbatches")
    bounds = _stage_bounds(layers, world, config.get("split"))
    first, last = bounds[rank], bounds[rank + 1]
    names = list(config.get("variants") or MEASURED_VARIANTS)
    names = names if "torch-1f1b" in names else ["torch-1f1b", *names]  # the calibration

    def build() -> LMStage:
        torch.manual_seed(config.get("seed", 0))
        lm = TransformerLM(vocab, dim, heads, layers, seq=seq)
        return LMStage(lm, first, last, rank == 0, rank == world - 1)

    g = torch.Generator().manual_seed(config.get("seed", 0) + 1)
    ids = torch.randint(vocab, (batch, seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def variant(name: str, r0: float):
        schedule, recompute, torch_ckpt = MEASURED_VARIANTS[name]
        module = build()
        if torch_ckpt:
            for i, block in enumerate(module.blocks):
                module.blocks[i] = checkpoint_wrapper(block)
            stage = PipelineStage(module, rank, world, torch.device("cpu"))
            sched = build_schedule(schedule, stage, n, _lm_loss)  # torch's schedule, torch's recompute
        else:
            stage = make_stage(module, rank, world, "cpu")
            sched = build_schedule(schedule, stage, n, _lm_loss, recompute=recompute, recompute_ratio=r0)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        meter = SavedActivationMeter(exclude=[*module.parameters(), *module.buffers()])

        def step(metered: bool = False) -> None:
            with meter if metered else contextlib.nullcontext():
                if rank == 0:
                    sched.step(x, target=y if world == 1 else None)
                else:
                    sched.step(target=y)
            opt.step()
            opt.zero_grad(set_to_none=True)
        step.meter, step.stage, step.module, step.schedule = meter, stage, module, sched
        # The first step sets the pipeline up; torch's shape inference keeps one microbatch's graph of it for
        # good, the same for every variant, so it runs outside the meter.
        step()
        return step

    def stage_peaks(step) -> list[float]:
        step.meter.reset_peak()
        step(metered=True)
        return all_max([step.meter.peak if r == rank else 0.0 for r in range(world)])

    # the cap: between what the stages need when only the first stages recompute and what torch's 1F1B needs
    # without recompute (fraction 0: the least memory stage-aware recompute can run in; 1: no recompute needed)
    plain_peaks = stage_peaks(variant("torch-1f1b", 0.0))
    first_blocks = bounds[1] - bounds[0]
    peaks = {k / first_blocks: stage_peaks(variant("scp+stage-aware", k / first_blocks))
             for k in range(first_blocks, -1, -1)}
    floor = max(peaks[1.0])
    cap = floor + config.get("cap_fraction", 0.5) * max(0.0, max(plain_peaks) - floor)
    r0 = min(r for r, p in peaks.items() if max(p) <= cap * (1 + 1e-9))

    steps = {name: variant(name, r0) for name in names}
    saved = {name: stage_peaks(steps[name]) for name in names}
    # every stage action timed inside the timed steps (the calibration: torch's 1F1B's)
    timers = {name: _ActionTimer(steps[name]) for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    reps, warmup = config.get("reps", 5), config.get("warmup", 1)
    for it in range(warmup + reps):
        shift = it % len(names)
        for name in names[shift:] + names[:shift]:
            timers[name].active = it >= warmup
            with together() as watch:
                steps[name]()
            timers[name].active = False
            if it >= warmup:
                seconds[name].append(watch.seconds)
    slowest = all_max([t for name in names for t in seconds[name]])
    every: list = [None] * world
    dist.all_gather_object(every, {name: timer.medians() for name, timer in timers.items()})
    mb = batch // n
    send = float(mb * seq * dim * 4)
    link = measure_link(int(send)) if world > 1 else Link()

    def stage_times(name: str, own: bool) -> list[StageTimes]:
        """Every stage's StageTimes from variant `name`'s actions; `own`: the backward as timed (a recompute
        inside it included), the early recompute as timed."""
        out = []
        for s, by_name in enumerate(every):
            m = by_name[name]
            ratio = resolve_recompute(MEASURED_VARIANTS[name][1], r0, s, world, MEASURED_VARIANTS[name][0])
            recompute = (m["early"] / ratio if ratio and m["early"] else 0.0) if own else m["span"]
            out.append(StageTimes(forward=m["forward"] + m["loss"], backward=m["backward"], recompute=recompute,
                                  blocks=0 if own else bounds[s + 1] - bounds[s],
                                  send_bytes=send if s < world - 1 else 0.0))
        return out

    times = stage_times("torch-1f1b", own=False)
    # torch's checkpoint costs more than a forward of the blocks: its stage's forward and backward against the plain
    # stage's, on one microbatch alone (alternated, 5 each), scale the calibration for its variants
    plain_module, ckpt_module = build(), build()
    for i, block in enumerate(ckpt_module.blocks):
        ckpt_module.blocks[i] = checkpoint_wrapper(block)
    one = (x[:mb],) if rank == 0 else (torch.randn(mb, seq, dim, generator=g),)
    alone = {"loss_fn": _lm_loss if rank == world - 1 else None, "target": y[:mb], "reps": 1, "warmup": 0}
    measure_stage(plain_module, one, **alone), measure_stage(ckpt_module, one, **alone)  # warm-up
    pairs = [(measure_stage(plain_module, one, **alone), measure_stage(ckpt_module, one, **alone)) for _ in range(5)]
    forward_factor = statistics.median(c.forward for _, c in pairs) / statistics.median(p.forward for p, _ in pairs)
    extra = statistics.median(c.backward for _, c in pairs) / statistics.median(p.backward for p, _ in pairs) - 1
    factors: list = [None] * world
    dist.all_gather_object(factors, (forward_factor, max(0.0, extra)))
    torch_times = [dataclasses.replace(t, forward=t.forward * f, recompute=t.backward * e)
                   for t, (f, e) in zip(times, factors)]

    rows = []
    base = statistics.median(slowest[names.index(BASELINE) * reps:(names.index(BASELINE) + 1) * reps]) \
        if BASELINE in names else math.nan
    for i, name in enumerate(names):
        schedule, recompute, torch_ckpt = MEASURED_VARIANTS[name]
        samples = slowest[i * reps:(i + 1) * reps]
        measured = statistics.median(samples)
        predicted = simulate(schedule, torch_times if torch_ckpt else times, n, recompute=recompute,
                             recompute_ratio=r0, link=link).step_time
        own = simulate(schedule, stage_times(name, own=True), n, link=link, recompute_ratio=r0,
                       recompute=recompute if schedule == "shifted_critical_path" else "none").step_time
        rows.append({"variant": name, "schedule": schedule, "recompute": recompute,
                     "r0": r0 if recompute == "stage_aware" else None,
                     "ratios": stage_recompute_ratios(r0, world) if recompute == "stage_aware" else None,
                     "time_ms": measured * 1e3, "samples_ms": [t * 1e3 for t in samples],
                     "predicted_ms": predicted * 1e3, "error": abs(predicted - measured) / measured,
                     "predicted_own_ms": own * 1e3, "error_own": abs(own - measured) / measured,
                     "stage_saved_bytes": saved[name], "fits_cap": max(saved[name]) <= cap,
                     "speedup": base / measured})
    return {"rows": rows, "cap_bytes": cap, "cap_fraction": config.get("cap_fraction", 0.5), "r0": r0,
            "r0_search": {str(k): v for k, v in peaks.items()},
            "stage_times": [dataclasses.asdict(t) for t in times], "actions": every,
            "torch_checkpoint_factors": factors,
            "link": dataclasses.asdict(link), "bounds": bounds, "config": {k: v for k, v in config.items()},
            "load_average": list(os.getloadavg())}


class _ActionTimer:
    """Times a pipeline step function's stage while `active`: each forward_one_chunk and backward_one_chunk, the
    loss (the last stage's), each early recompute (`recompute_chunk`), and the span from the first block's start
    to the last block's end inside each forward (what recompute at ratio 1 costs)."""

    def __init__(self, step: Callable[..., None]):
        stage, blocks = step.stage, step.module.blocks
        self.active = False
        self.samples: dict[str, list[float]] = {"forward": [], "backward": [], "loss": [], "early": [], "span": []}
        self._span_start = 0.0
        for kind in ("forward", "backward"):
            setattr(stage, f"{kind}_one_chunk", self._timed(kind, getattr(stage, f"{kind}_one_chunk")))
        if hasattr(stage, "recompute_chunk"):
            stage.recompute_chunk = self._timed("early", stage.recompute_chunk)
        step.schedule._compute_loss = self._timed("loss", step.schedule._compute_loss)

        def start(*_: Any) -> None:
            self._span_start = time.perf_counter()

        def end(*_: Any) -> None:
            if self.active:
                self.samples["span"].append(time.perf_counter() - self._span_start)

        blocks[0].register_forward_pre_hook(start)
        blocks[-1].register_forward_hook(end)

    def _timed(self, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if self.active:
                    self.samples[kind].append(time.perf_counter() - start)
        return timed

    def medians(self) -> dict[str, float]:
        """Seconds per action, the median of each kind (0 for a kind never timed)."""
        return {k: statistics.median(v) if v else 0.0 for k, v in self.samples.items()}
