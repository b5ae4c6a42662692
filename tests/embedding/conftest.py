"""One job per world size runs every multi-rank case of this folder (ranks.suite); the tests compare its results."""
import pytest
from fastdist.distributed import spawn

import ranks


@pytest.fixture(scope="session")
def checkpoint_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("embedding") / "checkpoint")


@pytest.fixture(scope="session")
def two_ranks(checkpoint_path) -> list:
    return spawn(ranks.suite, 2, 2, checkpoint_path, backend="gloo", timeout=240)


@pytest.fixture(scope="session")
def four_ranks(two_ranks, checkpoint_path) -> list:  # after the 2-rank job: it loads that job's checkpoint
    return spawn(ranks.suite, 4, 4, checkpoint_path, backend="gloo", timeout=240)
