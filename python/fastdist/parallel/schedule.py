"""Pipeline schedules for fastdist.parallel: torch's GPipe, 1F1B and interleaved 1F1B, and Merak's shifted
critical path.

`build_schedule` is the one way the engine makes a schedule for a stage. "gpipe", "1f1b" and "interleaved" are
torch's own `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleaved1F1B` (several stages per rank);
"shifted_critical_path" is `ScheduleShiftedCriticalPath`, a `Schedule1F1B`
whose stages recompute microbatch i's activations after posting the receive of i's gradient and before waiting
for it, so the recompute runs while the stage would otherwise wait (it leaves the critical path), and whose last
stage, which runs each backward right after its forward, does not recompute at all.

Recompute itself is the stage's business (`fastdist.parallel.recompute.RecomputeStageMixin`): a schedule only
sets each stage's ratio (`recompute=`) and, for the shifted schedule, says when to recompute.

Stage-aware recompute (Merak): under 1F1B the stage s of S (counted from 1) keeps S - s microbatches' activations
stashed while it works on one more, so with the same memory per stage the later stages can recompute less:
r_s = 1 - (1 - r0)(S - 1)/(S - s), so that (S - s)(1 - r_s) = (S - 1)(1 - r0) for every s, and the last stage,
which stashes nothing, recomputes nothing.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _batch_p2p, _PipelineSchedule, _wait_batch_p2p

from fastdist.distributed import check_same

__all__ = ["SCHEDULES", "RECOMPUTE_MODES", "ScheduleShiftedCriticalPath", "build_schedule", "resolve_recompute",
           "stage_recompute_ratios"]

RECOMPUTE_MODES = ("none", "full", "stage_aware")


def stage_recompute_ratios(r0: float, num_stages: int) -> list[float]:
    """Merak's stage-aware recompute ratios: stage s (0-based) of S recomputes r_s, the last stage 0.

    With s counted from 1, r_s = 1 - (1 - r0)(S - 1)/(S - s): every stage then stashes as many activations as
    the first does at ratio r0 under 1F1B. A stage that would need a negative ratio for that recomputes nothing.

    Args:
        r0: The first stage's recompute ratio, in [0, 1].
        num_stages: Pipeline stages S (>= 1).

    Returns:
        S ratios in [0, 1]; the first is r0 (unless S == 1, where it is the last stage's 0), the last is 0.
    """
    if isinstance(r0, bool) or not isinstance(r0, (int, float)) or not 0.0 <= float(r0) <= 1.0 or math.isnan(r0):
        raise ValueError(f"stage_recompute_ratios: r0 must be a number in [0, 1], got {r0!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"stage_recompute_ratios: num_stages must be an int >= 1, got {num_stages!r}")
    S = num_stages
    ratios = []
    for s in range(1, S + 1):  # 1-based, as the paper counts
        r = 0.0 if s == S else 1.0 - (1.0 - float(r0)) * (S - 1) / (S - s)
        ratios.append(min(1.0, max(0.0, r)))
    return ratios


def resolve_recompute(recompute: str | float, recompute_ratio: float, stage_index: int, num_stages: int,
                      schedule: str = "1f1b") -> float:
    """The recompute ratio of stage `stage_index` for a schedule's `recompute=` / `recompute_ratio=` arguments.

    Args:
        recompute: "none" (0), "full" (1 on every stage), "stage_aware" (`stage_recompute_ratios(recompute_ratio,
            num_stages)`), or a float in [0, 1] used on every stage.
        recompute_ratio: r0 for "stage_aware"; ignored otherwise.
        stage_index: This stage (0-based).
        num_stages: Pipeline stages.
        schedule: The schedule's name: under "shifted_critical_path" the last stage never recomputes.

    Returns:
        The ratio in [0, 1].
    """
    if isinstance(recompute, str):
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES} or a float in [0, 1], got {recompute!r}")
        if recompute == "none":
            ratio = 0.0
        elif recompute == "full":
            ratio = 1.0
        else:
            ratio = stage_recompute_ratios(recompute_ratio, num_stages)[stage_index]
    elif isinstance(recompute, (int, float)) and not isinstance(recompute, bool):
        if not 0.0 <= float(recompute) <= 1.0 or math.isnan(recompute):
            raise ValueError(f"recompute as a ratio must be in [0, 1], got {recompute!r}")
        ratio = float(recompute)
    else:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES} or a float in [0, 1], got {recompute!r}")
    if schedule == "shifted_critical_path" and stage_index == num_stages - 1:
        ratio = 0.0
    return ratio


class ScheduleShiftedCriticalPath(Schedule1F1B):
    """Merak's shifted critical path: 1F1B where each backward's recompute runs before its gradient arrives.

    For every backward of microbatch i on a stage that recomputes, the stage posts the receive of i's gradient
    (together with the pending activation send, as torch's 1F1B does), recomputes i's checkpointed activations,
    and only then waits for the gradient. The last stage never recomputes (`build_schedule` sets its ratio to 0).
    A stage without `RecomputeStageMixin` (or at ratio 0) runs exactly torch's 1F1B.
    """

    def _recompute(self, mb_index: int) -> None:
        recompute = getattr(self._stage, "recompute_chunk", None)
        if recompute is not None:
            recompute(mb_index)

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                           target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                           loss_kwargs: dict[str, Any] | None = None) -> None:
        # torch's Schedule1F1B._step_microbatches, with `_recompute` between posting and waiting for a gradient
        stage, n = self._stage, self._n_microbatches
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        warmup_chunks = min(n, self._num_stages - stage.stage_index)
        fwd_mb = bwd_mb = 0
        send_work: list = []
        fwd_sends: list = []

        def forward(i: int) -> None:
            output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
            self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)

        def backward(i: int) -> None:
            stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == n - 1)

        for _ in range(warmup_chunks):
            _wait_batch_p2p(_batch_p2p(stage.get_fwd_recv_ops(fwd_mb), desc="fwd_recv"))
            forward(fwd_mb)
            _wait_batch_p2p(send_work)
            fwd_sends = stage.get_fwd_send_ops(fwd_mb)
            if fwd_mb != warmup_chunks - 1:
                send_work = _batch_p2p(fwd_sends, desc="fwd_send")
            fwd_mb += 1

        while True:
            works = _batch_p2p(fwd_sends + stage.get_bwd_recv_ops(bwd_mb), desc="fwd_send_bwd_recv")
            self._recompute(bwd_mb)  # off the critical path: the gradient is on its way
            _wait_batch_p2p(works)
            backward(bwd_mb)
            bwd_sends = stage.get_bwd_send_ops(bwd_mb)
            bwd_mb += 1
            if fwd_mb == n:
                break
            _wait_batch_p2p(_batch_p2p(bwd_sends + stage.get_fwd_recv_ops(fwd_mb), desc="bwd_send_fwd_recv"))
            forward(fwd_mb)
            fwd_sends = stage.get_fwd_send_ops(fwd_mb)
            fwd_mb += 1

        send_work = _batch_p2p(bwd_sends, desc="bwd_send")
        while bwd_mb < n:
            works = _batch_p2p(stage.get_bwd_recv_ops(bwd_mb), desc="bwd_recv")
            self._recompute(bwd_mb)
            _wait_batch_p2p(works)
            backward(bwd_mb)
            _wait_batch_p2p(send_work)
            send_work = _batch_p2p(stage.get_bwd_send_ops(bwd_mb), desc="bwd_send")
            bwd_mb += 1
        _wait_batch_p2p(send_work)

        self._update_losses(stage, losses)
        stage.perform_reduce_grad(n if self.scale_grads else 1)


SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "shifted_critical_path": ScheduleShiftedCriticalPath,
}


def build_schedule(name: str, stage: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                   loss_fn: Callable[..., torch.Tensor] | None, *, recompute: str | float = "none",
                   recompute_ratio: float = 0.5, **schedule_kwargs: Any) -> _PipelineSchedule:
    """A pipeline schedule driving `stage`, with `.step(*args, target=None, losses=None)` as torch's.

    Args:
        name: One of `SCHEDULES`: "gpipe", "1f1b", "interleaved" (torch's own) or "shifted_critical_path".
        stage: This rank's stage: a torch `PipelineStage`; for "interleaved", this rank's stages (a list; torch
            places stage i on rank i % ranks). Recompute other than "none" needs stages with
            `RecomputeStageMixin` (`fastdist.parallel.recompute.make_stage`).
        n_microbatches: Microbatches per step (1F1B-type schedules need at least as many as stages).
        loss_fn: `loss_fn(output, target)` on the last stage; None: forward only.
        recompute: "none", "full", "stage_aware" or a ratio in [0, 1] for every stage (see `resolve_recompute`;
            under "interleaved", stage-aware ratios go by the stage's index among all stages).
        recompute_ratio: The first stage's ratio r0 under "stage_aware".
        **schedule_kwargs: Passed on to the torch schedule (`scale_grads`, `args_chunk_spec`, ...).

    Returns:
        The schedule.

    Raises:
        MismatchError: the stage group's ranks differ in schedule, microbatches, stages or stages per rank (on
            every rank: this is a collective over the stage's group, once per schedule built).
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
    stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    if not stages or (name != "interleaved" and len(stages) != 1):
        raise ValueError(f"schedule {name!r} drives one stage per rank, got {len(stages)} (several: 'interleaved')")
    num_stages = stages[0].num_stages
    if name != "gpipe" and n_microbatches < num_stages // len(stages):
        raise ValueError(f"schedule {name!r} needs n_microbatches >= the number of ranks' stages "
                         f"({num_stages // len(stages)}), got {n_microbatches}")
    ratios = [resolve_recompute(recompute, recompute_ratio, st.stage_index, num_stages, name) for st in stages]
    check_same("pipeline schedule", {"schedule": name, "n_microbatches": n_microbatches, "num_stages": num_stages,
                                     "stages_per_rank": len(stages)}, stages[0].group)
    for st, ratio in zip(stages, ratios):
        if hasattr(st, "set_recompute_ratio"):
            st.set_recompute_ratio(ratio)
        elif ratio > 0:
            raise ValueError(f"recompute={recompute!r} gives stage {st.stage_index} the ratio {ratio:g}, but its "
                             f"stage ({type(st).__name__}) cannot recompute: build it with "
                             "fastdist.parallel.recompute.make_stage (RecomputeStageMixin)")
    if name == "interleaved":
        return SCHEDULES[name](stages, n_microbatches, loss_fn=loss_fn, **schedule_kwargs)
    return SCHEDULES[name](stages[0], n_microbatches, loss_fn=loss_fn, **schedule_kwargs)
