"""How the chunked tensor-parallel schedules split ``M`` rows: shared by the linears that run the chunks and the
cost model that times them, so it sits below both."""

__all__ = ["chunk_bounds"]


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """Splits ``range(n)`` into ``k`` consecutive ranges whose sizes differ by at most one.

    Args:
        n: the number of rows.
        k: the number of chunks (the first ``n % k`` chunks get one row more).

    Returns:
        ``k`` ``(start, stop)`` pairs, the first starting at 0 and the last stopping at ``n``.
    """
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
