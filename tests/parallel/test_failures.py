"""A rank that raises in the middle of a step (the user's loss_fn on the last stage, a block's forward on the first)
does not leave its peers blocked until the process group's timeout: every rank's step raises within seconds, naming
the rank that failed. Each case is a job of its own, since a failure aborts the job's process groups."""
import pytest
from engine_ranks import failing_step

from fastdist.distributed import spawn

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
