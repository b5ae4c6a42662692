"""FailureWatch's step watchdog: a rank that hangs without dying (here: it sleeps) inside its step, or before its
next step, is named in a RankFailedError on the rank waiting for it in a collective, about the step bound after that
rank began waiting, instead of after gloo's timeout; steps within the bound raise nothing and leave the process
groups' timeouts as they were."""
import time

import pytest
import torch
import torch.distributed as dist

from fastdist.distributed import RankFailedError, spawn
from fastdist.distributed.failure import FailureWatch

BOUND_S = 2.0
SLEEP_S = 8.0  # the hung rank's sleep: well past the bound, well short of the process group's own timeout (300 s)
SLACK_S = 4.0  # what a loaded 2-core machine may add to the bound


def _steps(hang_at: str):
    """Three guarded steps of one all-reduce each; rank 1 sleeps in step 2 ("in_step") or between steps 1 and 2
    ("between"). Returns what each rank raised, when, and the collectives' timeout after the steps."""
    rank = dist.get_rank()
    watch = FailureWatch("fastdist.test", where=lambda r: f" (seat {r})", step_timeout=BOUND_S)
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    for step in (1, 2, 3):
        if rank == 1 and step == 2 and hang_at == "between":
            time.sleep(SLEEP_S)
        start = time.perf_counter()
        try:
            with watch.guard(step):
                if rank == 1 and step == 2 and hang_at == "in_step":
                    time.sleep(SLEEP_S)
                elif hang_at == "none":
                    time.sleep(BOUND_S / 4)  # slow, within the bound
                dist.all_reduce(torch.ones(4))
        except Exception as e:  # noqa: BLE001 - the test reads it
            watch.close()
            seconds = time.perf_counter() - start
            if rank == 0:
                time.sleep(SLEEP_S)  # rank 0 hosts the store: keep it while rank 1 wakes and reads the record
            return {"error": f"{type(e).__name__}: {e}", "seconds": seconds, "step": step,
                    "rank_attr": getattr(e, "rank", None), "notes": getattr(e, "__notes__", []),
                    "is_rank_failed": isinstance(e, RankFailedError)}
    watch.close()
    return {"error": None, "timeout_s": backend.options._timeout.total_seconds()}


@pytest.mark.parametrize("hang_at,says", [
    ("in_step", "rank 1 (seat 1) hangs in step 2: its step 2 has run"),
    ("between", "rank 1 (seat 1) hangs in step 2: it has not begun the step after step 1 for")])
def test_a_rank_that_sleeps_is_named_on_the_rank_waiting_for_it_about_the_bound_after(hang_at, says):
    waiting, hung = spawn(_steps, 2, hang_at, backend="gloo", timeout=300)
    assert waiting["is_rank_failed"] and waiting["rank_attr"] == 1 and waiting["step"] == 2, waiting
    assert says in waiting["error"] and "test_step_watchdog.py:" in waiting["error"], waiting["error"]
    assert "not in a collective" in waiting["error"], waiting["error"]
    assert waiting["seconds"] < BOUND_S + SLACK_S, f"named after {waiting['seconds']:.1f} s"
    assert hung["error"] is not None and any("rank 1 (seat 1) hangs" in n for n in hung["notes"]), hung


def test_steps_within_the_bound_raise_nothing_and_keep_the_groups_timeouts():
    for got in spawn(_steps, 2, "none", backend="gloo", timeout=300):
        assert got["error"] is None, got
        assert got["timeout_s"] == 300, "outside a step the process group keeps its own timeout"


def test_a_step_bound_must_be_a_positive_number_of_seconds():
    for bad in (0, -1.0, "2s", float("inf")):
        with pytest.raises(ValueError, match="step_timeout must be a positive number of seconds"):
            FailureWatch("fastdist.test", step_timeout=bad)


def _engine_with_a_sleeping_loss():
    """fastdist.parallelize on a (2, 1, 1) mesh (DDP) with the default step bound set; rank 1's loss sleeps in
    step 2 (rank 0 waits in DDP's gradient all-reduce)."""
    import fastdist
    from fastdist.distributed.failure import set_default_step_timeout
    from fastdist.testing.models import TransformerLM

    rank = dist.get_rank()
    set_default_step_timeout(BOUND_S)
    torch.manual_seed(0)
    model = TransformerLM(64, 16, 2, 2, seq=8)
    steps = {"n": 0}

    def loss_fn(logits, target):
        if rank == 1 and steps["n"] == 2:
            time.sleep(SLEEP_S)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), target.reshape(-1))

    tokens = torch.randint(0, 64, (4, 9))
    engine = fastdist.parallelize(model, mesh=(2, 1, 1), example_inputs=(tokens[:, :-1],), loss_fn=loss_fn,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    set_default_step_timeout(None)
    for step in (1, 2):
        steps["n"] = step
        start = time.perf_counter()
        try:
            engine.step(tokens[:, :-1], tokens[:, 1:])
        except Exception as e:  # noqa: BLE001 - the test reads it
            seconds = time.perf_counter() - start
            if rank == 0:
                time.sleep(SLEEP_S)  # rank 0 hosts the store: keep it while rank 1 wakes and reads the record
            return {"error": f"{type(e).__name__}: {e}", "seconds": seconds, "rank_attr": getattr(e, "rank", None),
                    "notes": getattr(e, "__notes__", [])}
    return {"error": None}


def test_a_data_parallel_rank_whose_loss_sleeps_is_named_by_the_rank_waiting_in_the_gradient_all_reduce():
    waiting, hung = spawn(_engine_with_a_sleeping_loss, 2, backend="gloo", timeout=300)
    assert waiting["rank_attr"] == 1, waiting
    assert "fastdist.parallel: rank 1 (mesh coordinate (dp, tp, pp) = (1, 0, 0)) hangs in step" in waiting["error"], \
        waiting["error"]
    assert "in loss_fn, not in a collective" in waiting["error"], waiting["error"]
    assert waiting["seconds"] < BOUND_S + SLACK_S + 2, f"named after {waiting['seconds']:.1f} s"
    assert hung["error"] is not None, hung
