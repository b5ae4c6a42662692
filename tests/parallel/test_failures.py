"""A rank that raises in the middle of a step (the user's loss_fn on the last stage, a block's forward on the first),
or whose process is killed there (SIGKILL, as the OOM killer does), does not leave its peers blocked until the
process group's timeout: every rank's step raises within seconds, naming the rank that failed. Each case is a job of
its own, since a failure aborts the job's process groups."""
import json

import pytest
from engine_ranks import failing_step

from fastdist.distributed import RankError, spawn

GLOO_TIMEOUT_S = 300  # the process group's timeout (spawn's): what the peers would wait without the engine's care
PROMPT_S = 30         # a bound for every rank's failing step, generous for a loaded 2-core machine


@pytest.mark.parametrize("where, mesh, failing", [
    ("loss_fn", (1, 1, 2), 1),   # the last stage's loss: the first stage waits for gradients
    ("forward", (1, 1, 2), 0),   # the first stage's block: the last stage waits for activations
    pytest.param("loss_fn", (2, 1, 2), 3, marks=pytest.mark.slow),  # the other replica waits in DDP's reduce
])
def test_a_rank_raising_mid_step_makes_every_rank_raise_promptly_naming_it(where, mesh, failing):
    world = mesh[0] * mesh[1] * mesh[2]
    ranks = spawn(failing_step, world, where, mesh, failing, backend="gloo", timeout=GLOO_TIMEOUT_S)
    for rank, got in enumerate(ranks):
        assert got["error"] is not None, f"rank {rank} finished its steps: {got}"
        assert got["steps_done"] == [1], f"rank {rank}: the first step trains, the second fails"
        assert got["seconds"] < PROMPT_S, f"rank {rank} raised after {got['seconds']:.1f} s"
        if rank == failing:  # the user's own exception, with a note
            # torch's PipelineStage wraps an exception of the forward in its own: the user's is its cause
            assert got["cause"].startswith(("ValueError: loss_fn", "RuntimeError: forward")), got["cause"]
            assert any(f"rank {failing}" in n for n in got["notes"]), got["notes"]
        else:
            assert got["error"].startswith(f"RankFailedError: fastdist.parallel: rank {failing} "), got["error"]
            assert "raised in step 2" in got["error"] and ("loss_fn" in got["error"] or "forward" in got["error"])
            assert got["rank_attr"] == failing
        assert got["again"] is not None and "cannot step again" in got["again"], f"rank {rank}: {got['again']}"


@pytest.mark.parametrize("victim, where, found_by", [
    (1, "loss_fn", "process table"),   # the last stage, killed in its loss: the first waits for gradients
    (1, "loss_fn", "heartbeat"),       # the same, found as it would be on another host
    (0, "forward", "store"),           # the first stage, which hosts the job's store (env:// rendezvous)
])
def test_a_rank_killed_mid_step_makes_every_other_rank_raise_promptly_naming_it(tmp_path, victim, where, found_by):
    with pytest.raises(RankError) as info:
        spawn(failing_step, 2, where, (1, 1, 2), victim, 2, "kill", str(tmp_path), found_by, backend="gloo",
              timeout=GLOO_TIMEOUT_S)
    # spawn names the killed rank, and shows what the other rank raised meanwhile instead of killing it first
    survivor = 1 - victim
    assert info.value.rank == victim and "killed by signal SIGKILL" in str(info.value), str(info.value)
    assert survivor in info.value.others and "RankFailedError" in info.value.others[survivor], str(info.value)
    got = json.loads((tmp_path / f"rank{survivor}.json").read_text())
    assert got["error"].startswith(f"RankFailedError: fastdist.parallel: rank {victim} "
                                   f"(mesh coordinate (dp, tp, pp) = (0, 0, {victim}))"), got["error"]
    assert "died during step 2 without raising" in got["error"], got["error"]
    assert got["rank_attr"] == victim and got["died"] is True and got["steps_done"] == [1]
    assert got["seconds"] < PROMPT_S, f"rank {survivor} raised after {got['seconds']:.1f} s"
    assert got["again"] is not None and "cannot step again" in got["again"]
