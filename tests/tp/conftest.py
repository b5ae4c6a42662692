"""Spawned gloo jobs run every rank-side part of tests/tp (tp_on_ranks.py): one job per world size for most of
it, so the suite pays the start-up of a multi-process job a few times instead of once per test; compiling and
the cross-rank failure cases get jobs of their own (slow, or able to take a job down when they regress)."""
import pytest
from fastdist.distributed import spawn
from tp_on_ranks import run_on_ranks
from user_models_on_ranks import USER_MODELS

JOBS = {
    2: [["mlp", "mlp_sp", "gather_split", "collectives", "bad_shapes", "auto_chunks", "oases_block",
         "parallelized_block", "block_counts", "oases_order", "calibrate", "calibration_cache", "refusals", "oases_state_dict",
         *(f"user_model:{name}" for name in USER_MODELS)], ["token_mismatch"], ["compiled"]],
    4: [["mlp", "mlp_sp", "gather_split", "oases_block", "parallelized_block", "user_model:nanogpt"]],
}


@pytest.fixture(scope="session")
def tp_ranks():
    """``tp_ranks(world, name)``: every rank's return value of tp_on_ranks' function ``name`` on ``world`` ranks,
    in rank order; a rank on which it raised fails the test with that rank's traceback. The job that runs ``name``
    runs once, on first use."""
    results = {}

    def values(world, name):
        job = next(tuple(names) for names in JOBS[world] if name in names)
        if (world, job) not in results:
            results[world, job] = spawn(run_on_ranks, world, list(job), backend="gloo", timeout=600)
        per_rank = []
        for rank, by_name in enumerate(results[world, job]):
            status, value = by_name[name]
            if status != "ok":
                pytest.fail(f"{name!r} raised on rank {rank} of {world}:\n{value}", pytrace=False)
            per_rank.append(value)
        return per_rank

    return values
