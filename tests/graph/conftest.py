"""The graph tests run single-threaded: their tensors are tiny, and on a loaded machine a second intra-op thread
only adds waiting (the thread-count test sets its own)."""
import pytest

from fastdist.bench.report import torch_threads


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield
