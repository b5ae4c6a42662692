"""fastdist.comm.wire: the byte model every wire figure uses is what a chunked ring sends."""
import pytest

from fastdist.comm import baselines
from fastdist.comm.wire import ring_allgather_bytes, ring_allreduce_bytes


def _chunked_ring_sends(count, element_bytes, world):
    """Bytes each rank sends in a ring all-reduce of `count` elements cut into `world` chunks of whole elements
    (the last ones short or empty): reduce-scatter, then all-gather, P - 1 chunks each."""
    chunk = -(-count // world)
    sizes = [max(0, min(chunk, count - i * chunk)) * element_bytes for i in range(world)]
    return [sum(sizes[(rank - step) % world] for step in range(world - 1)) +
            sum(sizes[(rank + 1 - step) % world] for step in range(world - 1)) for rank in range(world)]


@pytest.mark.parametrize("count, element_bytes", [(1, 4), (7, 2), (96 * 12, 4), (1001, 8), (3, 1)])
@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_ring_all_reduce_bytes_are_the_mean_of_what_the_ranks_of_a_chunked_ring_send(count, element_bytes, world):
    sends = _chunked_ring_sends(count, element_bytes, world)
    assert sum(sends) == 2 * (world - 1) * count * element_bytes  # every byte crosses P - 1 links, twice
    assert ring_allreduce_bytes(count * element_bytes, world) == sum(sends) // world
    assert max(sends) - min(sends) <= 2 * -(-count // world) * element_bytes  # a rank's share: within a chunk


def test_ring_all_reduce_bytes_stay_exact_beyond_float_precision_and_are_zero_for_one_rank():
    nbytes = 2**53 + 1  # a float64 product would round it away
    assert ring_allreduce_bytes(nbytes, 2) == nbytes
    assert ring_allreduce_bytes(3 * nbytes, 3) == 4 * nbytes
    assert ring_allreduce_bytes(10**6, 1) == 0


def test_ring_all_gather_bytes_forward_every_other_ranks_block():
    assert ring_allgather_bytes(40, 4) == 3 * 40
    assert ring_allgather_bytes(40, 1) == 0


def test_the_baselines_module_still_exports_the_one_byte_model():
    assert baselines.ring_allreduce_bytes is ring_allreduce_bytes
    assert baselines.ring_allgather_bytes is ring_allgather_bytes
