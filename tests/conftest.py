"""What every test directory shares: the `cuda` and `netsim` markers skip, with the reason, a test this machine
cannot run (the markers are declared in pyproject.toml; a test asks for the hardware by carrying the marker)."""
import pytest

import fastdist
from fastdist import netsim


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not fastdist.cuda_kernels_available():
        pytest.skip("needs a CUDA device and fastdist built with CUDA kernels")
    if item.get_closest_marker("netsim") is not None:
        ok, why = netsim.available()
        if not ok:
            pytest.skip(f"netsim unavailable: {why}")
