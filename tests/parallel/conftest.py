"""Spawned gloo jobs run the rank side of the engine's tests (engine_ranks.py): one job per world size, so the suite
pays a multi-process start-up twice rather than once per test (a bad configuration raises on every rank, so the
cases after it still run in step)."""
import functools

import pytest
from engine_ranks import run_on_ranks

from fastdist.distributed import spawn

JOBS = {
    2: [["train:transformer_lm:1,1,2", "train:transformer_lm:1,2,1", "train:transformer_lm:2,1,1",
         "train:nanogpt:1,1,2", "train:gpt2:1,2,1", "train:llama:1,2,1",
         "bad:mesh_product", "bad:more_stages_than_blocks", "bad:microbatches", "bad:no_blocks",
         "bad:different_models", "bad:different_plans", "bad:step_batch",
         "bad:tp_plan_matches_nothing", "bad:moe_not_on_dp_group", "bad:meta_unset", "bad:compile_option",
         "bad:init_allocated",
         "meta:meta_ready_gpt:1,1,2", "meta:meta_ready_gpt:1,2,1", "meta:nanogpt:1,1,2",
         "optimizer:1,2,1->1,1,2",
         "compose:recompute_compress", "compose:sketch_hook", "compose:swap",
         "dcp:transformer_lm:1,2,1->1,1,2", "dcp:gpt2:1,1,2->1,2,1",
         "checkpoint:transformer_lm", "checkpoint:gpt2",
         "device_mesh"],
        ["compile:1,1,2", "compile:1,2,1"]],
    4: [["train:transformer_lm:1,2,2", "train:transformer_lm:2,1,2", "train:transformer_lm:2,2,1", "resume:2,1,2",
         "gather_to:1,2,2:3", "gather_to:2,1,2:1", "compose:moe:2,1,2",
         "dcp:transformer_lm:1,2,2->2,2,1", "dcp:moe_gpt:2,1,2->4,1,1"]],
    8: [["train:transformer_lm:2,2,2"]],  # slow: 8 gloo ranks
}


@functools.cache
def _job(world, names):
    return spawn(run_on_ranks, world, list(names), backend="gloo", timeout=600)


@pytest.fixture(scope="session")
def engine_ranks():
    """``engine_ranks(world, name)``: every rank's value of case ``name`` on ``world`` ranks, in rank order; a rank
    on which it raised fails the test with that rank's traceback. The job holding ``name`` runs once, on first use."""
    def values(world, name):
        ranks = _job(world, next(tuple(job) for job in JOBS[world] if name in job))
        failed = [(rank, by_name[name][1]) for rank, by_name in enumerate(ranks) if by_name[name][0] != "ok"]
        if failed:
            pytest.fail(f"{name!r} raised on rank {failed[0][0]} of {world}:\n{failed[0][1]}", pytrace=False)
        return [by_name[name][1] for by_name in ranks]

    return values
