"""Spawned gloo jobs run the rank side of the engine's tests (engine_ranks.py): one job per group of cases, so the
suite pays a multi-process start-up a few times rather than once per test."""
import pytest
from engine_ranks import run_on_ranks

from fastdist.distributed import spawn

JOBS = {
    2: [["train:transformer_lm:1,1,2", "train:transformer_lm:1,2,1", "train:transformer_lm:2,1,1",
         "train:nanogpt:1,1,2", "train:gpt2:1,2,1"],
        ["bad:mesh_product", "bad:more_stages_than_blocks", "bad:microbatches", "bad:no_blocks",
         "bad:different_models", "bad:different_plans"],
        ["compose:recompute_compress", "compose:sketch_hook"]],
    4: [["train:transformer_lm:1,2,2", "train:transformer_lm:2,1,2", "train:transformer_lm:2,2,1"]],
}


@pytest.fixture(scope="session")
def engine_ranks():
    """``engine_ranks(world, name)``: every rank's value of case ``name`` on ``world`` ranks, in rank order; a rank
    on which it raised fails the test with that rank's traceback. The job holding ``name`` runs once, on first use."""
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
