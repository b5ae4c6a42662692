"""fastdist.distributed.failure on plain collectives: a rank raising inside a FailureWatch's guard makes the other
rank's collective raise RankFailedError naming it (and where it sat) at once; errors every rank raises alike pass
through without aborting anything; and spawn, when a rank is killed, shows what the other ranks raised meanwhile
instead of killing them first."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from fastdist.distributed import MismatchError, RankError, RankFailedError, check_same, spawn
from fastdist.distributed.failure import FailureWatch, agreed

PROMPT_S = 30  # a bound for the other rank's error, generous for a loaded 2-core machine; gloo's timeout is 300 s


def _one_rank_raises_in_a_guarded_step():
    rank = dist.get_rank()
    watch = FailureWatch("fastdist.test", where=lambda r: f" (seat {r})")
    start = time.perf_counter()
    try:
        with watch.guard(7):
            if rank == 1:
                raise ValueError("rank one's step raised")
            dist.all_reduce(torch.ones(4))  # would wait for rank 1 until gloo's timeout
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start,
                "rank_attr": getattr(e, "rank", None), "step": getattr(e, "step", None),
                "notes": getattr(e, "__notes__", []), "is_rank_failed": isinstance(e, RankFailedError)}
    return {"error": None}


def test_a_rank_raising_in_a_guarded_step_makes_the_other_raise_at_once_naming_it_and_where_it_sat():
    own, other = spawn(_one_rank_raises_in_a_guarded_step, 2, backend="gloo", timeout=300)[::-1]
    assert own["error"] == "ValueError: rank one's step raised" and not own["is_rank_failed"]
    assert any("rank 1 (seat 1) raised in step 7" in note for note in own["notes"]), own["notes"]
    assert other["is_rank_failed"] and other["rank_attr"] == 1 and other["step"] == 7
    assert other["error"].startswith("RankFailedError: fastdist.test: rank 1 (seat 1) raised in step 7: "
                                     "ValueError: rank one's step raised"), other["error"]
    assert other["seconds"] < PROMPT_S


def _errors_every_rank_raises_pass_through():
    watch = FailureWatch("fastdist.test")
    seen = []
    for raise_it in (lambda: check_same("setting", dist.get_rank()),
                     lambda: (_ for _ in ()).throw(agreed(RuntimeError("every rank's check failed")))):
        try:
            with watch.guard(1):
                raise_it()
        except (MismatchError, RuntimeError) as e:
            seen.append(type(e).__name__)
    t = torch.ones(2)
    dist.all_reduce(t)  # the process groups still work: nothing was aborted
    return {"seen": seen, "sum": t.tolist(), "failure": watch.failure}


def test_errors_every_rank_raises_alike_pass_through_without_aborting_the_groups():
    for got in spawn(_errors_every_rank_raises_pass_through, 2, backend="gloo", timeout=120):
        assert got == {"seen": ["MismatchError", "RuntimeError"], "sum": [2.0, 2.0], "failure": None}


def _killed_while_the_other_raises():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # rank 1 is gone; this rank says so a moment later
    raise RuntimeError("rank 0 saw rank 1 go")


def test_spawn_names_a_killed_rank_and_shows_what_the_others_raised_meanwhile():
    with pytest.raises(RankError) as info:
        spawn(_killed_while_the_other_raises, 2, backend="gloo", timeout=120)
    assert info.value.rank == 1 and "killed by signal SIGKILL" in str(info.value)
    assert list(info.value.others) == [0] and "RuntimeError: rank 0 saw rank 1 go" in info.value.others[0]
    assert "rank 0 saw rank 1 go" in str(info.value)
