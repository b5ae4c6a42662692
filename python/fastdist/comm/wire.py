"""Bytes each rank sends in a collective: the one model every wire-byte figure in fastdist uses.

Ring algorithms, as gloo and NCCL run them between hosts: an all-reduce is a reduce-scatter then an all-gather
around the ring, an all-gather forwards every rank's block around it.
"""


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `nbytes`.

    Args:
        nbytes: size of the reduced buffer in bytes.
        world: ranks in the ring.

    Returns:
        2 (P - 1) / P x nbytes, rounded down to a whole byte (0 for a single rank).
    """
    # Every byte crosses P-1 links in each phase, so the ranks send 2(P-1)*nbytes together; gloo and NCCL cut the
    # chunks at whole elements (the last ranks' run short), so one rank's share is this mean to within a chunk:
    # integer arithmetic, floored, without a float's rounding.
    return int(2 * (world - 1) * nbytes // world) if world > 1 else 0


def ring_allgather_bytes(block_bytes: int, world: int) -> int:
    """Bytes each rank sends in a ring all-gather of one `block_bytes` block per rank.

    Args:
        block_bytes: the size of each rank's block in bytes.
        world: ranks in the ring.

    Returns:
        (P - 1) x block_bytes: a rank sends its own block and forwards every block it receives but the last.
    """
    return int((world - 1) * block_bytes)
