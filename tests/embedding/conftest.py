"""One job per world size runs every multi-rank case of this folder (ranks.suite); the tests compare its results."""
import pytest
from fastdist.distributed import spawn

import ranks


@pytest.fixture(scope="session")
def two_ranks() -> list:
    return spawn(ranks.suite, 2, 2, backend="gloo", timeout=240)


@pytest.fixture(scope="session")
def four_ranks() -> list:
    return spawn(ranks.suite, 4, 4, backend="gloo", timeout=240)
