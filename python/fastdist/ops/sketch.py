"""Count-sketch: support bitmaps, sketching a tensor into a small table, decoding it back.

A tensor ``x`` is viewed as ``n`` units (rows) of ``m`` values: ``granularity="row"`` gives ``n = x.shape[0]`` and
``m = x.numel() // n`` (an embedding gradient ``[vocab, dim]`` is ``vocab`` units of ``dim`` values);
``granularity="element"`` gives ``n = x.numel()`` and ``m = 1`` (a 0-d tensor is one element). Value ``col`` of unit
``r`` has the flat index ``i = r * m + col``. A *support* is a packed bitmap of units, uint8 ``[ceil(n / 8)]``, in
:func:`fastdist.ops.pack_bits` order (bit ``j`` of byte ``k`` is unit ``8 k + j``).

The hash family (defined once, in csrc/kernels/sketch.h, and reimplemented independently in
tests/ops/test_sketch.py): with ``p = 2**61 - 1``, sketch row ``j`` draws ``a_j, b_j, c_j, d_j`` from a splitmix64
stream seeded with ``seed`` and ``g_j`` from one seeded with ``seed ^ 0x243F6A8885A308D3`` (``a_j, c_j, g_j`` in
``[1, p-1]``, ``b_j, d_j`` in ``[0, p-1]``; row ``j``'s coefficients do not depend on ``rows`` or ``cols``), and value
``col`` of unit ``u`` goes to

* bucket ``h_j(u, col) = (((a_j * u + b_j) mod p) mod cols + col) mod cols``
* with sign ``s_j(u, col) = -1`` if bit 30 of ``(c_j * u + d_j) mod p`` differs from bit 30 of ``(g_j * col) mod p``,
  else ``+1``.

For element granularity (``m = 1``, ``col = 0``) that is the textbook count-sketch hash of the index,
``((a_j i + b_j) mod p) mod cols`` with the sign from ``(c_j i + d_j) mod p``. For units of ``m > 1`` values a unit
fills consecutive buckets (cyclically) from a hashed start, each value with its own sign: values of different units
collide with probability ``1 / cols`` with independent signs, as in the per-value hash, so each estimate has the same
variance; the kernels stream whole units into the table instead of scattering every value. :func:`sketch_hash`
evaluates the hash for given indices. The ops are ``torch.ops.fastdist.{nonzero_bitmap, count_sketch,
count_sketch_units, count_sketch_decode, count_sketch_decode_units, sketch_hash, union_sum_rows}`` with CPU and CUDA kernels and fake kernels for
``torch.compile``. Inputs may be non-contiguous (they are made contiguous first); outputs are contiguous and on the
input's device.

Determinism: on CPU a table is the float32 sum of each bucket's values in increasing index, whatever the thread
count, bit for bit. On CUDA, count_sketch accumulates with atomic adds: the same sums in an unspecified order, so
they match the CPU's to rounding (at most ``(k - 1) * 2**-24 * sum |x|`` for a bucket of ``k`` values) and may
vary run to run in the last bits. Hashes, supports and decoding are exact on both.
"""

import torch

from fastdist.ops._checks import (FLOATING_DTYPES, check_allocatable, check_dim, check_dim_at_least, check_dtype,
                                  check_dtype_in, check_last_dim, check_nonnegative, check_same_device, check_seed,
                                  checked_product, packed_bytes)

__all__ = ["MAX_COLS", "MAX_ROWS", "count_sketch", "count_sketch_decode", "count_sketch_decode_units",
           "count_sketch_units", "nonzero_bitmap", "sketch_hash"]

MAX_ROWS = 15
MAX_COLS = 2**31 - 1


def nonzero_bitmap(x: torch.Tensor, granularity: str = "element") -> torch.Tensor:
    """The support of ``x``: which units hold a non-zero value, packed 8 per byte.

    Args:
        x: float32, float16, bfloat16 or float64 tensor of any shape (``numel >= 0``; row granularity needs at least
            1 dimension).
        granularity: ``"element"`` (one bit per value) or ``"row"`` (one bit per ``x[r]``: set when any value of the
            row is non-zero).

    Returns:
        uint8 tensor ``[ceil(n / 8)]``; padding bits are zero. NaN, infinities and subnormals count as non-zero,
        ``-0.0`` as zero.

    Raises:
        RuntimeError: ``x`` is not floating point, ``granularity`` is neither ``"element"`` nor ``"row"``, or
            ``granularity="row"`` with a 0-d ``x``.
    """
    return torch.ops.fastdist.nonzero_bitmap.default(x, granularity)


def count_sketch(x: torch.Tensor, rows: int, cols: int, seed: int, support: torch.Tensor | None = None,
                 granularity: str = "row") -> torch.Tensor:
    """Count-sketch of ``x``: ``table[j, h_j(i)] += s_j(i) * x_i`` for every sketch row ``j < rows``.

    The sum runs over the non-zero values of ``x`` when ``support`` is None, or over every value of the units whose
    bit is set in ``support`` (values outside it are ignored, zero or not). The granularity sets the units, and so
    the hash (module docstring): decode with the same ``m``.
    Accumulation is in float32; float16 and bfloat16 values are exact in it, float64 values are rounded to float32
    first. The sketch is linear: ``count_sketch(a) + count_sketch(b)`` equals ``count_sketch(a + b)`` up to float32
    rounding, which is why ranks can SUM-all-reduce their tables.

    Args:
        x: float32, float16, bfloat16 or float64 tensor, viewed as ``n`` units of ``m`` values (module docstring).
        rows: sketch rows, ``1 <= rows <= 15`` (odd recommended: the decode takes a median over rows).
        cols: buckets per row, ``1 <= cols <= 2**31 - 1``.
        seed: hash seed, ``0 <= seed < 2**63``; every rank must use the same one.
        support: optional uint8 ``[ceil(n / 8)]`` packed unit bitmap on ``x``'s device (e.g. from
            :func:`nonzero_bitmap` with the same granularity, OR-ed over ranks).
        granularity: ``"row"`` or ``"element"``: how ``support`` maps to values.

    Returns:
        float32 tensor ``[rows, cols]`` on ``x``'s device.

    Raises:
        RuntimeError: ``x`` not floating point; ``rows``, ``cols`` or ``seed`` out of range; ``support`` not uint8,
            not of shape ``[ceil(n / 8)]`` or on another device; ``granularity`` invalid (or ``"row"`` with 0-d ``x``).
    """
    return torch.ops.fastdist.count_sketch.default(x, rows, cols, check_seed(seed), support, granularity)


def count_sketch_units(values: torch.Tensor, units: torch.Tensor, rows: int, cols: int, seed: int) -> torch.Tensor:
    """The count-sketch of a row-sparse tensor given as its rows: ``values[t]`` is unit ``units[t]`` of the tensor
    (e.g. the ``indices()[0]`` and ``values()`` of a coalesced ``sparse_coo`` gradient), so nothing dense is built.

    With strictly increasing ``units`` the table equals, bit for bit, :func:`count_sketch` of the dense tensor with
    the units' support at row granularity (values are added in the order listed; zeros are skipped).

    Args:
        values: float32, float16, bfloat16 or float64 ``[k, ...]``: k units of ``m = prod(shape[1:])`` values.
        units: int64 ``[k]`` unit indices on ``values``' device; flat index ``units[t] * m + col`` (unsigned 64-bit).
        rows, cols, seed: as for :func:`count_sketch`.

    Returns:
        float32 tensor ``[rows, cols]`` on ``values``' device.

    Raises:
        RuntimeError: ``values`` not floating point or 0-d; ``units`` not int64 1-D of length ``k`` or on another
            device; ``rows``, ``cols`` or ``seed`` out of range.
    """
    return torch.ops.fastdist.count_sketch_units.default(values, units, rows, cols, check_seed(seed))


def count_sketch_decode(table: torch.Tensor, support: torch.Tensor, n: int, m: int, seed: int) -> torch.Tensor:
    """Estimates the sketched values on a support: ``out[r, col] = median_j s_j(i) * table[j, h_j(i)]``.

    ``i = r * m + col``, for every unit ``r`` whose bit is set in ``support``; every other unit is zero. The median
    of an even number of rows is the mean of the two middle values. When any of the ``rows`` estimates is NaN, the
    result is NaN. Exact for a value whose bucket holds no other value in more than half of the rows; otherwise an
    estimate (unbiased for one row, symmetric noise for more) whose error shrinks as ``cols`` grows relative to the
    number of sketched values.

    Args:
        table: float32 ``[rows, cols]`` (from :func:`count_sketch`, usually summed over ranks), ``1 <= rows <= 15``.
        support: uint8 ``[ceil(n / 8)]`` packed unit bitmap, on ``table``'s device.
        n, m: the units and values per unit that were sketched (``m = 1`` for element granularity), ``>= 0``.
        seed: the seed the table was built with.

    Returns:
        float32 tensor ``[n, m]`` on ``table``'s device (reshape it to the original shape).

    Raises:
        RuntimeError: ``table`` not float32 2-D or with an invalid number of rows or columns; ``support`` not uint8
            ``[ceil(n / 8)]`` or on another device; ``n`` or ``m`` negative or ``n * m`` past int64; ``seed`` out of
            range.
    """
    return torch.ops.fastdist.count_sketch_decode.default(table, support, n, m, check_seed(seed))


def count_sketch_decode_units(table: torch.Tensor, units: torch.Tensor, m: int, seed: int) -> torch.Tensor:
    """The estimates of the listed units only: ``out[t] = count_sketch_decode(table, support, n, m, seed)[units[t]]``
    for a support holding ``units[t]``, without materializing (or zeroing) the other units — what a sparse
    all-reduce needs when the union is a few percent of a large embedding.

    Args:
        table: float32 ``[rows, cols]``, as for :func:`count_sketch_decode`.
        units: int64 ``[k]`` unit indices on ``table``'s device, any order, repeats allowed; the flat index
            ``units[t] * m + col`` is formed in unsigned 64-bit arithmetic.
        m: values per unit, ``>= 0``.
        seed: the seed the table was built with.

    Returns:
        float32 tensor ``[k, m]`` on ``table``'s device.

    Raises:
        RuntimeError: ``table`` invalid as for :func:`count_sketch_decode`; ``units`` not int64 1-D or on another
            device; ``m`` negative or ``k * m`` past int64; ``seed`` out of range.
    """
    return torch.ops.fastdist.count_sketch_decode_units.default(table, units, m, check_seed(seed))


def sketch_hash(idx: torch.Tensor, rows: int, cols: int, seed: int, m: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The sketch's hash functions at the flat indices ``idx`` of a tensor of units of ``m`` values, for oracles and
    tests.

    Args:
        idx: int64 ``[len]`` flat indices ``u * m + col`` (taken as unsigned 64-bit).
        rows, cols, seed: as for :func:`count_sketch`.
        m: values per unit, ``>= 1`` (``1``: element granularity).

    Returns:
        ``(bucket, sign)``: int64 ``[rows, len]`` with ``bucket[j, t] = h_j(u, col)`` and int8 ``[rows, len]`` with
        ``sign[j, t] = s_j(u, col)`` (+1 or -1).

    Raises:
        RuntimeError: ``idx`` not int64 1-D; ``rows``, ``cols``, ``seed`` or ``m`` out of range.
    """
    return torch.ops.fastdist.sketch_hash.default(idx, rows, cols, check_seed(seed), m)


def union_sum_rows(bitmaps: torch.Tensor, rows: torch.Tensor, n: int, divisor: int = 1) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """The union of ``p`` supports and the sum of their rows: the local step of an all-gather of each rank's own rows
    (sketch_allreduce's lossless gather), in one pass, without a dense mask or an index per row.

    Args:
        bitmaps: uint8 ``[p, ceil(n / 8)]``, support ``r`` (padding bits ignored).
        rows: ``[p, k, m]`` of a floating dtype, on the device of ``bitmaps``: ``rows[r, i]`` is the row of the
            ``i``-th unit of support ``r`` in increasing order (rows past its count are not read). Blocks ``rows[r]``
            and ``bitmaps[r]`` may lie apart (views into one received buffer per rank); each must be contiguous, or
            it is copied.
        n: units per support, ``>= 0``.
        divisor: divide each sum by this (``>= 1``; 1: no division), as an average over the ranks does.

    Returns:
        ``(units, sums)``: int64 ``[U]``, the union's units in increasing order, and ``[U, m]`` of ``rows``' dtype,
        ``sums[t]`` the sum over ``r = 0, 1, ...`` of the rows of the supports holding ``units[t]``: bit for bit
        ``torch.zeros(U, m).index_add_(0, position_r, rows_r)`` in rank order, then ``div_(divisor)`` (for 16-bit
        dtypes each add is rounded to the dtype), on CPU and CUDA alike, for any thread count.

    Raises:
        RuntimeError: bad dtype, shape or device; ``n`` or ``divisor`` out of range; a support with more units than
            ``k``; on CUDA, more than 4096 supports.
    """
    return torch.ops.fastdist.union_sum_rows.default(bitmaps, rows, n, divisor)


# Fake kernels: output metadata for torch.compile / FakeTensor, with the checks the shapes depend on and the same
# messages as the C++ kernels (csrc/ops/sketch.h).

def _check_granularity(granularity):
    if granularity not in ("row", "element"):
        raise RuntimeError(f"fastdist: 'granularity' must be \"element\" or \"row\", got \"{granularity}\"")


def _units(x, granularity, name="x"):
    _check_granularity(granularity)
    if granularity == "row":
        if x.dim() < 1:
            raise RuntimeError(f"fastdist: '{name}' must have at least 1 dimension(s) for granularity \"row\", "
                               f"got shape {list(x.shape)}")
        return x.shape[0], checked_product(x.shape[1:], f"the sizes of '{name}' after the first")
    return x.numel(), 1


def _check_rows_cols_seed(rows, cols, seed):
    if not 1 <= rows <= MAX_ROWS:
        raise RuntimeError(f"fastdist: 'rows' must be in [1, {MAX_ROWS}], got {rows}")
    if not 1 <= cols <= MAX_COLS:
        raise RuntimeError(f"fastdist: 'cols' must be in [1, {MAX_COLS}], got {cols}")
    check_seed(seed)


def _check_support(support, other, other_name, n, units_name):
    check_dtype("support", support, torch.uint8)
    check_same_device("support", support, other_name, other)
    expected = packed_bytes(n)
    torch._check(support.dim() == 1 and support.shape[0] == expected,
                 lambda: f"fastdist: 'support' must have shape [{expected}] (ceil(n / 8) for n = {n} {units_name}), "
                         f"got shape {list(support.shape)}")


def _check_units(units, other_name, other):
    check_dtype("units", units, torch.int64)
    check_dim("units", units, 1)
    check_same_device("units", units, other_name, other)


@torch.library.register_fake("fastdist::nonzero_bitmap")
def _nonzero_bitmap_fake(x, granularity):
    check_dtype_in("x", x, FLOATING_DTYPES)
    n, _ = _units(x, granularity)
    return x.new_empty((packed_bytes(n),), dtype=torch.uint8)


@torch.library.register_fake("fastdist::count_sketch")
def _count_sketch_fake(x, rows, cols, seed, support, granularity):
    check_dtype_in("x", x, FLOATING_DTYPES)
    _check_rows_cols_seed(rows, cols, seed)
    n, _ = _units(x, granularity)
    if support is not None:
        _check_support(support, x, "x", n, "rows of x" if granularity == "row" else "elements of x")
    return x.new_empty((rows, cols), dtype=torch.float32)


def _check_table(table):
    check_dtype("table", table, torch.float32)
    check_dim("table", table, 2)
    torch._check(1 <= table.shape[0] <= MAX_ROWS,
                 lambda: f"fastdist: 'table' must have 1 to {MAX_ROWS} rows, got shape {list(table.shape)}")
    torch._check(1 <= table.shape[1] <= MAX_COLS,
                 lambda: f"fastdist: 'table' must have 1 to {MAX_COLS} columns, got shape {list(table.shape)}")


@torch.library.register_fake("fastdist::count_sketch_decode")
def _count_sketch_decode_fake(table, support, n, m, seed):
    _check_table(table)
    check_nonnegative("n", n)
    check_nonnegative("m", m)
    check_allocatable((n, m), torch.float32, "the output")
    check_seed(seed)
    _check_support(support, table, "table", n, "units")
    return table.new_empty((n, m))


@torch.library.register_fake("fastdist::count_sketch_units")
def _count_sketch_units_fake(values, units, rows, cols, seed):
    check_dim_at_least("values", values, 1)
    check_dtype_in("values", values, FLOATING_DTYPES)
    _check_rows_cols_seed(rows, cols, seed)
    _check_units(units, "values", values)
    torch._check(units.shape[0] == values.shape[0],
                 lambda: f"fastdist: 'units' must have one entry per row of 'values' ({values.shape[0]}), got shape "
                         f"{list(units.shape)}")
    _units(values, "row", "values")
    return values.new_empty((rows, cols), dtype=torch.float32)


@torch.library.register_fake("fastdist::count_sketch_decode_units")
def _count_sketch_decode_units_fake(table, units, m, seed):
    _check_table(table)
    check_nonnegative("m", m)
    check_seed(seed)
    _check_units(units, "table", table)
    check_allocatable((units.shape[0], m), torch.float32, "the output")
    return table.new_empty((units.shape[0], m))


@torch.library.register_fake("fastdist::sketch_hash")
def _sketch_hash_fake(idx, rows, cols, seed, m=1):
    check_dtype("idx", idx, torch.int64)
    check_dim("idx", idx, 1)
    _check_rows_cols_seed(rows, cols, seed)
    if m < 1:
        raise RuntimeError(f"fastdist: 'm' must be >= 1, got {m}")
    check_allocatable((rows, idx.shape[0]), torch.int64, "the output 'bucket'")
    return idx.new_empty((rows, idx.shape[0])), idx.new_empty((rows, idx.shape[0]), dtype=torch.int8)


@torch.library.register_fake("fastdist::union_sum_rows")
def _union_sum_rows_fake(bitmaps, rows, n, divisor=1):
    check_dtype("bitmaps", bitmaps, torch.uint8)
    check_dim("bitmaps", bitmaps, 2)
    check_nonnegative("n", n)
    check_last_dim("bitmaps", bitmaps, packed_bytes(n), f"ceil(n / 8) for n = {n}")
    check_dtype_in("rows", rows, FLOATING_DTYPES)
    check_dim("rows", rows, 3)
    check_same_device("rows", rows, "bitmaps", bitmaps)
    torch._check(rows.shape[0] == bitmaps.shape[0],
                 lambda: f"fastdist: 'rows' must have one block of rows per bitmap ({bitmaps.shape[0]}), got shape "
                         f"{list(rows.shape)}")
    if divisor < 1:
        raise RuntimeError(f"fastdist: 'divisor' must be >= 1, got {divisor}")
    units = torch.library.get_ctx().new_dynamic_size()  # how many the union holds is known once summed
    return bitmaps.new_empty((units,), dtype=torch.int64), rows.new_empty((units, rows.shape[2]))
