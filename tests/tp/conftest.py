"""One spawned gloo job per world size runs every rank-side check of tests/tp (see _checks.py)."""
import pytest
from _checks import run_checks
from fastdist.distributed import spawn

WORLD_2 = ["mlp", "mlp_sp", "gather_split", "collectives", "bad_shapes", "auto_chunks", "oases_block",
           "parallelized_block", "block_counts", "oases_order", "calibrate"]
WORLD_4 = ["mlp", "mlp_sp", "gather_split", "oases_block", "parallelized_block"]


@pytest.fixture(scope="session")
def tp_ranks():
    """world size -> the per-rank result dicts of run_checks (each job run once, on first use)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = spawn(run_checks, world, WORLD_2 if world == 2 else WORLD_4, backend="gloo", timeout=300)
        return cache[world]

    return get


def outcome(ranks, name):
    """Every rank's value of check `name`; fails the test with the first failing rank's traceback."""
    values = []
    for rank, results in enumerate(ranks):
        status, value = results[name]
        if status != "ok":
            pytest.fail(f"check {name!r} failed on rank {rank} of {len(ranks)}:\n{value}", pytrace=False)
        values.append(value)
    return values
