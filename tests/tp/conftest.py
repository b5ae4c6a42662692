"""One spawned gloo job per world size runs every rank-side part of tests/tp (tp_on_ranks.py)."""
import pytest
from fastdist.distributed import spawn
from tp_on_ranks import run_on_ranks

WORLD_2 = ["mlp", "mlp_sp", "gather_split", "collectives", "bad_shapes", "auto_chunks", "oases_block",
           "parallelized_block", "block_counts", "oases_order", "calibrate"]
WORLD_4 = ["mlp", "mlp_sp", "gather_split", "oases_block", "parallelized_block"]


@pytest.fixture(scope="session")
def tp_ranks():
    """``tp_ranks(world, name)``: every rank's return value of tp_on_ranks' function ``name`` on ``world`` ranks,
    in rank order; a rank on which it raised fails the test with that rank's traceback. Each world size's job runs
    once, on first use."""
    jobs = {}

    def values(world, name):
        if world not in jobs:
            jobs[world] = spawn(run_on_ranks, world, WORLD_2 if world == 2 else WORLD_4, backend="gloo", timeout=300)
        per_rank = []
        for rank, results in enumerate(jobs[world]):
            status, value = results[name]
            if status != "ok":
                pytest.fail(f"{name!r} raised on rank {rank} of {world}:\n{value}", pytrace=False)
            per_rank.append(value)
        return per_rank

    return values
