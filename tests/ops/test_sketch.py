"""fastdist.ops.nonzero_bitmap / count_sketch / count_sketch_decode(_units) / sketch_hash / union_sum_rows: the spec,
checked against an independent pure-Python hash, numpy oracles (np.add.at sums in index order, in float32), torch's
index_add_ (the union sum) and the sketch's mathematical properties."""
import math

import numpy as np
import pytest
import torch
from fastdist.ops import (
    count_sketch,
    count_sketch_decode,
    count_sketch_decode_units,
    count_sketch_units,
    nonzero_bitmap,
    pack_bits,
    sketch_hash,
)
from fastdist.ops.sketch import union_sum_rows
from op_testing import DEVICES, bad_input_tests, huge

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

# ---- an independent implementation of the hash family (Python big ints), from the definition in the docs ----

P = (1 << 61) - 1
MASK64 = (1 << 64) - 1


def splitmix64(seed):
    state = seed
    while True:
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        yield z ^ (z >> 31)


def python_coefficients(seed, rows):
    draws, column_draws = splitmix64(seed), splitmix64(seed ^ 0x243F6A8885A308D3)
    coefficients = []
    for _ in range(rows):
        a = 1 + next(draws) % (P - 1)
        b = next(draws) % P
        c = 1 + next(draws) % (P - 1)
        d = next(draws) % P
        coefficients.append((a, b, c, d))
    return [(a, b, c, d, 1 + next(column_draws) % (P - 1)) for a, b, c, d in coefficients]


def python_hash(indices, rows, cols, seed, m=1):
    """(bucket, sign) lists of lists [rows][len] for flat indices of a tensor of units of m values, straight from the
    definition."""
    coefficients = python_coefficients(seed, rows)
    places = [divmod(i, m) for i in indices]
    buckets = [[(((a * u + b) % P) % cols + col) % cols for u, col in places] for a, b, _, _, _ in coefficients]
    signs = [[-1 if ((((c * u + d) % P) >> 30) ^ (((g * col) % P) >> 30)) & 1 else 1 for u, col in places]
             for _, _, c, d, g in coefficients]
    return buckets, signs


# ---- oracles ----

def units_of(x, granularity):
    if granularity == "row":
        return x.shape[0], (math.prod(x.shape[1:]) if x.dim() > 1 else 1)
    return x.numel(), 1


def unit_mask(support, n):
    return torch.from_numpy(np.unpackbits(support.cpu().numpy(), count=n, bitorder="little").astype(bool))


def sketched_indices(x, support, granularity):
    """The flat indices the sketch adds: the non-zeros of x, or every value of the supported units."""
    flat = x.detach().cpu().reshape(-1).float()
    if support is None:
        return (flat != 0).nonzero().flatten()
    n, m = units_of(x, granularity)
    return unit_mask(support, n).repeat_interleave(m).nonzero().flatten()


def oracle_sketch(x, rows, cols, seed, support=None, granularity="row"):
    """float32 table, each bucket summed in increasing index (np.add.at is unbuffered and in order)."""
    flat = x.detach().cpu().reshape(-1).float()
    idx = sketched_indices(x, support, granularity)
    bucket, sign = sketch_hash(idx, rows, cols, seed, max(units_of(x, granularity)[1], 1))
    table = np.zeros((rows, cols), dtype=np.float32)
    values = flat[idx].numpy()
    for j in range(rows):
        np.add.at(table[j], bucket[j].numpy(), sign[j].numpy().astype(np.float32) * values)
    return torch.from_numpy(table)


def median_over_rows(est):
    """sketch_median over dim 0: the middle value, the mean of the two middle ones for an even count, NaN if any."""
    rows = est.shape[0]
    ordered = est.sort(dim=0).values
    if rows % 2:
        med = ordered[rows // 2]
    else:
        med = 0.5 * ordered[rows // 2 - 1] + 0.5 * ordered[rows // 2]
    return torch.where(est.isnan().any(dim=0), torch.full_like(med, float("nan")), med)


def oracle_decode(table, support, n, m, seed):
    table = table.cpu()
    rows, cols = table.shape
    idx = unit_mask(support, n).repeat_interleave(m).nonzero().flatten()
    bucket, sign = sketch_hash(idx, rows, cols, seed, max(m, 1))
    est = torch.stack([sign[j].float() * table[j, bucket[j]] for j in range(rows)])
    out = torch.zeros(n * m, dtype=torch.float32)
    out[idx] = median_over_rows(est)
    return out.reshape(n, m)


def random_sparse(shape, density, granularity, seed=0, dtype=torch.float32):
    """Values in (-2, 2) with a fraction `density` of rows (or elements) non-zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) * 4 - 2
    if granularity == "row" and len(shape) >= 1:
        keep = torch.rand(shape[:1], generator=g) < density
        x = x * keep.reshape(-1, *([1] * (len(shape) - 1)))
    else:
        x = x * (torch.rand(shape, generator=g) < density)
    return x.to(dtype)


def assert_same(got, want):
    """Same shape, dtype and values; NaN where the other has NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    got, want = got.cpu(), want.cpu()
    if got.is_floating_point():
        assert torch.equal(got.isnan(), want.isnan())
        got, want = got.masked_fill(got.isnan(), 0), want.masked_fill(want.isnan(), 0)
    assert torch.equal(got, want), (got - want).abs().max()


def assert_sketch_close(got, x, rows, cols, seed, support=None, granularity="row"):
    """For CUDA's atomics: each bucket within (k - 1) * 2^-24 * sum|v| of the in-order sum, k values per bucket."""
    want = oracle_sketch(x, rows, cols, seed, support, granularity)
    abs_sum = oracle_sketch(x.abs(), rows, cols, seed, support if support is not None else
                            nonzero_bitmap(x.cpu(), granularity), granularity)
    idx = sketched_indices(x, support, granularity)
    bucket, _ = sketch_hash(idx, rows, cols, seed, max(units_of(x, granularity)[1], 1))
    counts = torch.zeros(rows, cols).scatter_add_(1, bucket, torch.ones(bucket.shape))
    bound = (counts - 1).clamp(min=0) * 2.0**-24 * abs_sum * 2 + 1e-30
    assert got.shape == want.shape and got.dtype == want.dtype
    assert ((got.cpu() - want).abs() <= bound).all(), ((got.cpu() - want).abs() - bound).max()


# ---- the hash ----

def hash_test_indices():
    g = torch.Generator().manual_seed(1)
    near = [0, 1, 2, 3, 7, 8, 1000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 - 2, 2**40 - 1, 2**40, 2**40 + 1,
            P - 1, P, P + 1, 2 * P, 2**62, 2**63 - 2, 2**63 - 1]
    random_small = torch.randint(0, 1 << 20, (100,), generator=g).tolist()
    random_near_2_40 = (2**40 + torch.randint(-(1 << 20), 1 << 20, (100,), generator=g)).tolist()
    random_large = torch.randint(0, 2**63 - 1, (100,), generator=g, dtype=torch.int64).tolist()
    return near + random_small + random_near_2_40 + random_large


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, cols, seed", [(1, 1, 0), (3, 7, 1), (5, 1000, 12345), (3, 2**31 - 1, 2**63 - 1),
                                              (15, 65_537, 2**40 + 3)])
@pytest.mark.parametrize("m", [1, 3, 1024, 2**40 + 7])
def test_sketch_hash_matches_an_independent_python_implementation(device, rows, cols, seed, m):
    indices = hash_test_indices()
    bucket, sign = sketch_hash(torch.tensor(indices, device=device), rows, cols, seed, m)
    want_bucket, want_sign = python_hash(indices, rows, cols, seed, m)
    assert bucket.dtype == torch.int64 and sign.dtype == torch.int8
    assert bucket.shape == sign.shape == (rows, len(indices))
    assert bucket.cpu().tolist() == want_bucket
    assert sign.cpu().tolist() == want_sign


def test_element_granularity_hash_is_the_textbook_per_index_hash():
    indices = hash_test_indices()
    bucket, sign = sketch_hash(torch.tensor(indices), 3, 1000, 9)
    for j, (a, b, c, d, _) in enumerate(python_coefficients(9, 3)):
        assert bucket[j].tolist() == [((a * i + b) % P) % 1000 for i in indices]
        assert sign[j].tolist() == [-1 if (((c * i + d) % P) >> 30) & 1 else 1 for i in indices]


def test_a_units_values_fill_consecutive_buckets_from_a_hashed_start_with_independent_signs():
    m, cols = 300, 1000
    units = torch.arange(2000)
    idx = (units[:, None] * m + torch.arange(m)).reshape(-1)
    bucket, sign = sketch_hash(idx, 3, cols, 4, m)
    bucket, sign = bucket.reshape(3, -1, m), sign.reshape(3, -1, m)
    assert torch.equal((bucket - bucket[:, :, :1]) % cols, torch.arange(m).expand_as(bucket))
    starts = bucket[:, :, 0].flatten()
    assert (torch.bincount(starts % 10, minlength=10).float() / 600 - 1).abs().max() < 0.2  # uniform starts
    # over seeds, two values' signs are uncorrelated, in one unit or in two
    pairs = torch.tensor([5 * m, 5 * m + 1, 5 * m + 299, 6 * m])
    signs = torch.stack([sketch_hash(pairs, 3, cols, seed, m)[1].float() for seed in range(400)])  # [seed, row, 4]
    for a, b in ((0, 1), (0, 2), (0, 3), (1, 3)):
        assert abs((signs[:, :, a] * signs[:, :, b]).mean().item()) < 0.15  # 1200 products: std 0.03


def test_sketch_hash_rows_do_not_depend_on_the_number_of_rows():
    idx = torch.arange(1000)
    b3, s3 = sketch_hash(idx, 3, 999, 5)
    b15, s15 = sketch_hash(idx, 15, 999, 5)
    assert_same(b15[:3], b3)
    assert_same(s15[:3], s3)


def test_sketch_hash_signs_are_balanced_and_buckets_uniform():
    bucket, sign = sketch_hash(torch.arange(200_000), 3, 16, 7)
    assert abs(sign.float().mean().item()) < 0.01  # 200k fair signs: std 0.0022
    counts = torch.bincount(bucket.flatten(), minlength=16).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.03


def test_different_seeds_give_different_hashes():
    idx = torch.arange(1000)
    assert not torch.equal(sketch_hash(idx, 3, 1000, 1)[0], sketch_hash(idx, 3, 1000, 2)[0])


# ---- nonzero_bitmap ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (9,), (1000,), (65, 33), (4, 0), (0, 5), (3, 4, 5)])
def test_nonzero_bitmap_matches_pack_bits_of_nonzero(device, dtype, shape):
    x = random_sparse(shape, 0.3, "element", seed=len(shape), dtype=dtype)
    flat = x.reshape(-1)
    assert_same(nonzero_bitmap(x.to(device), "element"), pack_bits(flat != 0))
    if x.dim() >= 1:
        n, m = units_of(x, "row")
        rows_nonzero = (x.reshape(n, m) != 0).any(dim=1)
        assert_same(nonzero_bitmap(x.to(device), "row"), pack_bits(rows_nonzero))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nonzero_bitmap_counts_nan_inf_subnormal_as_nonzero_and_negative_zero_as_zero(device, dtype):
    tiny = torch.finfo(dtype).smallest_normal / 4
    x = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), tiny, -tiny, 1.0, 0.0], dtype=dtype)
    assert unit_mask(nonzero_bitmap(x.to(device)), 9).tolist() == [False, False, True, True, True, True, True,
                                                                    True, False]
    rows = torch.zeros(9, 300, dtype=dtype)
    rows[:, 257] = x
    assert_same(nonzero_bitmap(rows.to(device), "row"), nonzero_bitmap(x))


@pytest.mark.parametrize("device", DEVICES)
def test_nonzero_bitmap_of_non_contiguous_input(device):
    x = random_sparse((40, 70), 0.2, "element", seed=3).to(device)
    for view in (x.t(), x[:, ::3], x[5:, 7:]):
        assert not view.is_contiguous()
        assert_same(nonzero_bitmap(view, "row"), nonzero_bitmap(view.contiguous(), "row"))
        assert_same(nonzero_bitmap(view, "element"), nonzero_bitmap(view.contiguous(), "element"))


# ---- count_sketch against the oracle ----

SKETCH_SHAPES = [(), (0,), (1,), (7,), (1000,), (5, 0), (0, 4), (37, 19), (64, 300), (3, 4, 5), (10_000,)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["row", "element"])
@pytest.mark.parametrize("shape", SKETCH_SHAPES, ids=str)
def test_count_sketch_matches_the_in_order_float32_oracle(device, granularity, shape):
    if granularity == "row" and len(shape) == 0:
        pytest.skip("row granularity needs a dimension")
    x = random_sparse(shape, 0.3, granularity, seed=sum(shape) + 1)
    for support in (None, nonzero_bitmap(x, granularity)):
        for rows, cols in ((3, 64), (1, 1), (4, 1001)):
            sup = None if support is None else support.to(device)
            got = count_sketch(x.to(device), rows, cols, 17, sup, granularity)
            if device == "cpu":
                assert_same(got, oracle_sketch(x, rows, cols, 17, support, granularity))
            else:
                assert_sketch_close(got, x, rows, cols, 17, support, granularity)


@pytest.mark.parametrize("granularity", ["row", "element"])
@pytest.mark.parametrize("density", [0.001, 0.02, 0.1, 0.5, 1.0])
def test_count_sketch_of_every_density_matches_the_oracle(granularity, density):
    # Sparse chunks hash each value directly, denser ones step lanes; the two must agree bit for bit.
    x = random_sparse((20_000,) if granularity == "element" else (500, 40), density, granularity, seed=7)
    support = nonzero_bitmap(x, granularity)
    for sup in (None, support):
        assert_same(count_sketch(x, 3, 1234, 3, sup, granularity), oracle_sketch(x, 3, 1234, 3, sup, granularity))
    n, m = units_of(x, granularity)
    table = torch.randn(3, 1234, generator=torch.Generator().manual_seed(1))
    assert_same(count_sketch_decode(table, support, n, m, 3), oracle_decode(table, support, n, m, 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["row", "element"])
def test_count_sketch_matches_a_torch_index_add_oracle(device, granularity):
    x = random_sparse((700, 48), 0.1, granularity, seed=21, dtype=torch.float64)
    support = nonzero_bitmap(x, granularity)
    idx = sketched_indices(x, support, granularity)
    bucket, sign = sketch_hash(idx, 5, 3000, 8, units_of(x, granularity)[1])
    want = torch.zeros(5, 3000, dtype=torch.float64)
    for j in range(5):
        want[j].index_add_(0, bucket[j], x.reshape(-1)[idx] * sign[j])  # float64: the exact sums, nearly
    got = count_sketch(x.to(device), 5, 3000, 8, support.to(device), granularity)
    torch.testing.assert_close(got.cpu(), want.float(), rtol=1e-6, atol=1e-6)


def test_count_sketch_of_a_small_case_equals_the_pure_python_definition():
    x = torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, 0.0], [-2.0, 0.25, 3.0], [0.0, 0.0, 0.5]])
    rows, cols, seed = 3, 5, 2024
    table = [[0.0] * cols for _ in range(rows)]
    flat = x.flatten().tolist()
    nonzero = [i for i, v in enumerate(flat) if v != 0]
    buckets, signs = python_hash(nonzero, rows, cols, seed, m=3)  # row granularity: 4 units of 3 values
    for t, i in enumerate(nonzero):
        for j in range(rows):
            table[j][buckets[j][t]] += signs[j][t] * flat[i]  # exact: a few dyadic values
    assert count_sketch(x, rows, cols, seed).tolist() == table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("granularity", ["row", "element"])
def test_count_sketch_of_low_and_high_precision_inputs_sums_their_float32_values(device, dtype, granularity):
    x = random_sparse((300, 40), 0.2, granularity, seed=5, dtype=dtype)
    x.view(-1)[::97] = torch.finfo(dtype).smallest_normal / 8  # subnormals
    support = nonzero_bitmap(x, granularity)
    for sup in (None, support):
        got = count_sketch(x.to(device), 3, 500, 9, None if sup is None else sup.to(device), granularity)
        if device == "cpu":
            assert_same(got, oracle_sketch(x, 3, 500, 9, sup, granularity))
            assert_same(got, count_sketch(x.float(), 3, 500, 9, sup, granularity))
        else:
            assert_sketch_close(got, x.float(), 3, 500, 9, sup, granularity)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["row", "element"])
def test_support_none_equals_the_nonzero_support(device, granularity):
    x = random_sparse((200, 64), 0.1, granularity, seed=2).to(device)
    without = count_sketch(x, 3, 2000, 4, None, granularity)
    with_support = count_sketch(x, 3, 2000, 4, nonzero_bitmap(x, granularity), granularity)
    if device == "cpu":
        assert_same(without, with_support)  # adding zeros never changes a float32 bucket
    else:
        torch.testing.assert_close(without, with_support, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["row", "element"])
@pytest.mark.parametrize("density", [0.005, 0.05, 0.5, 1.0])
def test_values_outside_the_support_are_ignored(device, granularity, density):
    # Dense values with a support that covers only some of them: sparse supports hash directly, dense ones step
    # lanes; both must match the oracle over the supported values only.
    n = 5000 if granularity == "element" else 300
    x = random_sparse((n, 1) if granularity == "element" else (n, 33), 1.0, "element", seed=int(density * 1000))
    g = torch.Generator().manual_seed(11)
    support = pack_bits(torch.rand(n, generator=g) < density)
    got = count_sketch(x.to(device), 3, 257, 21, support.to(device), granularity)
    if device == "cpu":
        assert_same(got, oracle_sketch(x, 3, 257, 21, support, granularity))
    else:
        assert_sketch_close(got, x, 3, 257, 21, support, granularity)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 31, 257, 1024])
def test_count_sketch_row_supports_of_every_row_length(m):
    # Short rows make short runs (direct hashing), long rows long runs (lane stepping), with gaps between them.
    n = max(2000 // m, 9)
    x = random_sparse((n, m), 0.9, "element", seed=m)
    g = torch.Generator().manual_seed(m)
    for density in (0.05, 0.5, 1.0):
        support = pack_bits(torch.rand(n, generator=g) < density)
        assert_same(count_sketch(x, 5, 333, m, support, "row"), oracle_sketch(x, 5, 333, m, support, "row"))


def assert_same_table(got, want, device):
    """CPU tables are the same bits every time; CUDA's atomics may round differently from run to run."""
    if device == "cpu":
        assert_same(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(500, 1), (300, 7), (64, 300), (40, 3, 5)], ids=str)
def test_count_sketch_of_listed_rows_is_the_dense_row_sketch_bit_for_bit(device, dtype, shape):
    x = random_sparse(shape, 0.1, "row", seed=shape[1], dtype=dtype)
    support = nonzero_bitmap(x, "row")
    units = unit_mask(support, shape[0]).nonzero().flatten()
    got = count_sketch_units(x[units].to(device), units.to(device), 3, 97, 4)
    assert_same_table(got, count_sketch(x, 3, 97, 4, support, "row"), device)


def test_count_sketch_of_listed_rows_in_any_order_sums_the_same_values():
    x = random_sparse((200, 9), 0.2, "row", seed=3)
    units = unit_mask(nonzero_bitmap(x, "row"), 200).nonzero().flatten()
    shuffled = units[torch.randperm(units.numel(), generator=torch.Generator().manual_seed(0))]
    want = count_sketch(x, 5, 41, 8, nonzero_bitmap(x, "row"), "row")
    torch.testing.assert_close(count_sketch_units(x[shuffled], shuffled, 5, 41, 8), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(count_sketch_units(torch.zeros(0, 9), torch.zeros(0, dtype=torch.int64), 3, 5, 1),
                       torch.zeros(3, 5))


@pytest.mark.parametrize("device", DEVICES)
def test_count_sketch_of_non_contiguous_input(device):
    x = random_sparse((50, 80), 0.3, "element", seed=8).to(device)
    for view in (x.t(), x[:, ::3], x[5:, 7:]):
        support = nonzero_bitmap(view, "row")
        assert_same_table(count_sketch(view, 3, 128, 1, support, "row"),
                          count_sketch(view.contiguous(), 3, 128, 1, support, "row"), device)
    strided_support = torch.stack([nonzero_bitmap(x, "row")] * 2, dim=1)[:, 0]
    assert not strided_support.is_contiguous()
    assert_same_table(count_sketch(x, 3, 128, 1, strided_support, "row"),
                      count_sketch(x, 3, 128, 1, strided_support.contiguous(), "row"), device)


def test_count_sketch_with_the_largest_number_of_rows():
    x = random_sparse((100, 10), 0.5, "row", seed=1)
    table = count_sketch(x, 15, 77, 3)
    assert table.shape == (15, 77)
    assert_same(table, oracle_sketch(x, 15, 77, 3))
    assert_same(table[:3], count_sketch(x, 3, 77, 3))


def test_count_sketch_of_zeros_and_of_nothing_is_zero():
    assert_same(count_sketch(torch.zeros(100, 7), 3, 10, 0), torch.zeros(3, 10))
    assert_same(count_sketch(torch.zeros(0, 7), 3, 10, 0), torch.zeros(3, 10))
    assert_same(count_sketch(torch.ones(100, 7), 3, 10, 0, torch.zeros(13, dtype=torch.uint8)), torch.zeros(3, 10))


# ---- sketch properties ----

@pytest.mark.parametrize("device", DEVICES)
def test_count_sketch_is_linear(device):
    a = random_sparse((500, 20), 0.1, "row", seed=1).to(device)
    b = random_sparse((500, 20), 0.1, "row", seed=2).to(device)
    lhs = count_sketch(a, 3, 300, 99) + count_sketch(b, 3, 300, 99)
    rhs = count_sketch(a + b, 3, 300, 99)
    torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["row", "element"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_decode_matches_the_median_oracle(device, granularity, rows):
    x = random_sparse((400, 12), 0.2, granularity, seed=rows)
    n, m = units_of(x, granularity)
    support = nonzero_bitmap(x, granularity)
    table = count_sketch(x, rows, 500, 31, support, granularity)
    got = count_sketch_decode(table.to(device), support.to(device), n, m, 31)
    assert_same(got, oracle_decode(table, support, n, m, 31))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 5, 64, 1000])
@pytest.mark.parametrize("density", [0.01, 0.3, 1.0])
def test_decode_of_every_row_length_and_support_density(device, m, density):
    n = max(20_000 // m, 9)
    g = torch.Generator().manual_seed(m)
    support = pack_bits(torch.rand(n, generator=g) < density)
    table = torch.randn(3, 777, generator=g)
    assert_same(count_sketch_decode(table.to(device), support.to(device), n, m, 5),
                oracle_decode(table, support, n, m, 5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 3, 64, 1000])
def test_decode_units_are_the_full_decode_rows_of_those_units_in_any_order_with_repeats(device, m):
    n = max(20_000 // m, 40)
    g = torch.Generator().manual_seed(m)
    table = torch.randn(3, 501, generator=g)
    table[1, 7] = float("nan")
    runs = torch.arange(5, 5 + min(n - 5, 600))  # consecutive units (lane-stepped for m = 1)
    scattered = torch.randperm(n, generator=g)[:300]
    units = torch.cat([runs, scattered, scattered[:10], torch.tensor([n - 1, 0])])
    full = count_sketch_decode(table, pack_bits(torch.ones(n, dtype=torch.bool)), n, m, 9)
    got = count_sketch_decode_units(table.to(device), units.to(device), m, 9)
    assert got.shape == (units.numel(), m)
    assert_same(got.cpu(), full[units])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_units_of_nothing_and_of_empty_units(device):
    table = torch.randn(3, 16, device=device)
    assert count_sketch_decode_units(table, torch.zeros(0, dtype=torch.int64, device=device), 5, 1).shape == (0, 5)
    assert count_sketch_decode_units(table, torch.arange(4, device=device), 0, 1).shape == (4, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_is_exact_when_no_values_collide(device):
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(100_000)
    where = torch.randperm(100_000, generator=g)[:10]
    x[where] = torch.randn(10, generator=g)
    support = nonzero_bitmap(x)
    table = count_sketch(x.to(device), 3, 4096, 7, support.to(device), "element")
    decoded = count_sketch_decode(table, support.to(device), 100_000, 1, 7).reshape(-1).cpu()
    assert_same(decoded, x)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_error_shrinks_as_cols_grow(device):
    nnz = 2000
    g = torch.Generator().manual_seed(3)
    x = torch.zeros(50_000)
    x[torch.randperm(50_000, generator=g)[:nnz]] = torch.randn(nnz, generator=g)
    support = nonzero_bitmap(x)
    errors = []
    for ratio in (0.1, 0.5, 2.0):
        cols = int(ratio * nnz)
        err = 0.0
        for seed in range(3):
            table = count_sketch(x.to(device), 3, cols, seed, support.to(device), "element")
            est = count_sketch_decode(table, support.to(device), 50_000, 1, seed).reshape(-1).cpu()
            err += ((est - x).norm() / x.norm()).item() / 3
        errors.append(err)
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.5, errors


def test_single_row_estimates_are_unbiased():
    # With one row the estimate is x_i + sum of +-x_k over colliding k, each sign fair: mean error 0 over seeds.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(200, generator=g)
    support = nonzero_bitmap(x)
    seeds = 300
    errors = torch.stack([count_sketch_decode(count_sketch(x, 1, 50, s, support, "element"), support, 200, 1, s)
                          .reshape(-1) - x for s in range(seeds)])
    z = errors.mean(0) / (errors.std(0) / math.sqrt(seeds))
    assert z.abs().max() < 4.5, z.abs().max()  # 200 coordinates, each ~N(0, 1) when unbiased
    assert errors.std(0).mean() > 0.5  # collisions are real: 200 values in 50 buckets


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates_into_its_buckets_and_its_decoded_value(device):
    x = random_sparse((1000,), 0.05, "element", seed=6)
    i_nan = 123
    x[i_nan] = float("nan")
    support = nonzero_bitmap(x)
    table = count_sketch(x.to(device), 3, 4096, 8, support.to(device), "element").cpu()
    bucket, _ = sketch_hash(torch.tensor([i_nan]), 3, 4096, 8)
    for j in range(3):
        assert table[j, bucket[j, 0]].isnan()
    assert table.isnan().sum() == 3  # only the NaN's own buckets (no other value shares them with this seed)
    decoded = count_sketch_decode(table.to(device), support.to(device), 1000, 1, 8).reshape(-1).cpu()
    assert decoded[i_nan].isnan()
    assert_same(decoded, oracle_decode(table, support, 1000, 1, 8).reshape(-1))


def test_decode_median_of_an_even_number_of_rows_is_the_mean_of_the_middle_two():
    table = torch.tensor([[1.0], [4.0], [2.0], [8.0]])  # one column: every index hits bucket 0 in each row
    support = pack_bits(torch.tensor([True]))
    _, sign = sketch_hash(torch.tensor([0]), 4, 1, 0)
    est = sorted((sign[:, 0].float() * table[:, 0]).tolist())
    assert count_sketch_decode(table, support, 1, 1, 0).item() == 0.5 * est[1] + 0.5 * est[2]


@pytest.mark.parametrize("granularity", ["row", "element"])
def test_results_do_not_depend_on_the_cpu_thread_count(granularity):
    x = random_sparse((4096, 256), 0.1 if granularity == "row" else 0.5, granularity, seed=9)
    support = nonzero_bitmap(x, granularity)
    n, m = units_of(x, granularity)
    units = unit_mask(support, n).nonzero().flatten()
    values = x.reshape(n, m)[units]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3, 1, 2):
            torch.set_num_threads(threads)
            table = count_sketch(x, 3, 100_003, 12, support, granularity)
            results.append((table, count_sketch_decode(table, support, n, m, 12), nonzero_bitmap(x, granularity),
                            count_sketch(x, 4, 5000, 12, None, granularity),
                            count_sketch_units(values, units, 3, 100_003, 12)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for one, two in zip(results[0], other):
            assert_same(one, two)


def test_a_freed_cpu_table_is_reused_by_the_next_sketch_of_its_size_and_a_live_one_never_is():
    x = random_sparse((500, 40), 0.1, "row", seed=3)
    support = nonzero_bitmap(x, "row")
    units = unit_mask(support, 500).nonzero().flatten()
    want = oracle_sketch(x, 3, 1234, 3, support, "row")
    first = count_sketch(x, 3, 1234, 3, support, "row")
    held = count_sketch(x, 3, 1234, 3, support, "row")
    assert held.data_ptr() != first.data_ptr()
    for sketch in (lambda: count_sketch(x, 3, 1234, 3, support, "row"), lambda: count_sketch_units(x[units], units,
                                                                                                   3, 1234, 3)):
        address = first.data_ptr()
        first.fill_(float("nan"))  # what the last user left in it must not leak into the next table
        del first
        first = sketch()
        assert first.data_ptr() == address
        assert_same(first, want)
    assert_same(held, want)


# ---- CUDA agreement ----

@pytest.mark.cuda
def test_cuda_hash_is_bit_identical_to_cpu():
    idx = torch.tensor(hash_test_indices() + list(range(100_000)))
    for rows, cols, seed, m in ((3, 1000, 1, 1), (15, 2**31 - 1, 2**63 - 1, 1), (3, 1000, 1, 1024), (5, 77, 2, 3)):
        cpu = sketch_hash(idx, rows, cols, seed, m)
        cuda = sketch_hash(idx.cuda(), rows, cols, seed, m)
        assert_same(cuda[0], cpu[0])
        assert_same(cuda[1], cpu[1])


@pytest.mark.cuda
@pytest.mark.parametrize("granularity", ["row", "element"])
@pytest.mark.parametrize("rows, cols, shape", [(3, 50_000, (8192, 128)), (15, 3001, (2048, 96))])
def test_cuda_tables_agree_with_cpu_and_decode_is_bit_identical(granularity, rows, cols, shape):
    x = random_sparse(shape, 0.05, granularity, seed=12)
    support = nonzero_bitmap(x, granularity)
    n, m = units_of(x, granularity)
    cpu = count_sketch(x, rows, cols, 5, support, granularity)
    cuda = count_sketch(x.cuda(), rows, cols, 5, support.cuda(), granularity)
    assert_sketch_close(cuda, x, rows, cols, 5, support, granularity)
    assert_same(count_sketch_decode(cpu.cuda(), support.cuda(), n, m, 5), count_sketch_decode(cpu, support, n, m, 5))
    assert_same(nonzero_bitmap(x.cuda(), granularity), support)


@pytest.mark.cuda
@pytest.mark.parametrize("n, m", [(1, 64), (33, 64), (1057, 100), (40_000, 64), (70, 4096), (50, 4097), (9, 5000)])
def test_cuda_row_sketch_and_decode_across_unit_tiles_and_the_column_sign_cache_agree_with_cpu(n, m):
    # tiles of 32-1024 units per block; column signs cached in shared memory up to 4096 values per unit
    x = random_sparse((n, m), 0.9, "element", seed=n + m)
    g = torch.Generator().manual_seed(n)
    for density in (0.01, 0.5, 1.0):
        support = pack_bits(torch.rand(n, generator=g) < density)
        assert_sketch_close(count_sketch(x.cuda(), 3, 5003, 7, support.cuda(), "row"), x, 3, 5003, 7, support, "row")
        table = count_sketch(x, 3, 5003, 7, support, "row")
        assert_same(count_sketch_decode(table.cuda(), support.cuda(), n, m, 7),
                    count_sketch_decode(table, support, n, m, 7))
        units = unit_mask(support, n).nonzero().flatten()
        assert_sketch_close(count_sketch_units(x[units].cuda(), units.cuda(), 3, 5003, 7), x, 3, 5003, 7, support,
                            "row")
    assert_sketch_close(count_sketch(x.cuda(), 3, 5003, 7, None, "row"), x, 3, 5003, 7, None, "row")


@pytest.mark.cuda
def test_cuda_sketch_ops_on_a_side_stream_agree_with_cpu():
    x = random_sparse((4096, 256), 0.02, "row", seed=14)
    support = nonzero_bitmap(x, "row")
    units = unit_mask(support, 4096).nonzero().flatten()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # inputs made on the side stream: ops on another stream would race them
        x_d, units_d = x.cuda() * 1, units.cuda() + 0
        support_d = nonzero_bitmap(x_d, "row")
        table_d = count_sketch(x_d, 3, 20_000, 2, support_d, "row")
        listed_d = count_sketch_units(x_d[units_d], units_d, 3, 20_000, 2)
        decoded_d = count_sketch_decode_units(table_d, units_d, 256, 2)
    stream.synchronize()
    assert_same(support_d, support)
    assert_sketch_close(table_d, x, 3, 20_000, 2, support, "row")
    assert_sketch_close(listed_d, x, 3, 20_000, 2, support, "row")
    assert_same(decoded_d, count_sketch_decode_units(table_d.cpu(), units, 256, 2))


# ---- torch integration ----

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_nonzero_bitmap(device):
    for x, granularity in ((random_sparse((5,), 0.5, "element"), "element"),
                           (random_sparse((9, 13), 0.3, "row"), "row"), (torch.zeros(0, 4), "row"),
                           (torch.tensor(1.0), "element"),
                           (random_sparse((9, 20), 0.3, "element", dtype=torch.float16).t(), "row")):
        torch.library.opcheck(torch.ops.fastdist.nonzero_bitmap.default, (x.to(device), granularity))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_count_sketch(device):
    x = random_sparse((30, 7), 0.3, "row", seed=1).to(device)
    for args in ((x, 3, 16, 1, None, "row"), (x, 1, 5, 0, nonzero_bitmap(x, "row"), "row"),
                 (x.t(), 5, 33, 2, nonzero_bitmap(x.t(), "element"), "element"),
                 (torch.zeros(0, 3, device=device), 3, 4, 1, None, "row")):
        torch.library.opcheck(torch.ops.fastdist.count_sketch.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_count_sketch_decode(device):
    table = torch.randn(3, 16, device=device)
    support = pack_bits(torch.rand(30) < 0.4).to(device)
    for args in ((table, support, 30, 7, 1), (table[:1], support, 30, 1, 0), (table.t().contiguous().t(), support,
                 30, 2, 5), (table, support[:0], 0, 4, 1)):
        torch.library.opcheck(torch.ops.fastdist.count_sketch_decode.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_count_sketch_units(device):
    v = torch.randn(6, 4, device=device)
    for args in ((v, torch.tensor([1, 4, 5, 9, 20, 21], device=device), 3, 16, 1),
                 (v.t(), torch.arange(4, device=device), 1, 5, 0),
                 (v[:0], torch.zeros(0, dtype=torch.int64, device=device), 3, 4, 2)):
        torch.library.opcheck(torch.ops.fastdist.count_sketch_units.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_count_sketch_decode_units(device):
    table = torch.randn(3, 16, device=device)
    for args in ((table, torch.tensor([4, 0, 9, 9], device=device), 7, 1), (table[:1], torch.arange(5, device=device),
                 1, 0), (table, torch.arange(20, device=device)[::3], 2, 5),
                 (table, torch.zeros(0, dtype=torch.int64, device=device), 4, 1)):
        torch.library.opcheck(torch.ops.fastdist.count_sketch_decode_units.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_sketch_hash(device):
    for idx in (torch.arange(10), torch.tensor([2**40, 2**62], dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                torch.arange(20)[::2]):
        torch.library.opcheck(torch.ops.fastdist.sketch_hash.default, (idx.to(device), 3, 100, 7))
        torch.library.opcheck(torch.ops.fastdist.sketch_hash.default, (idx.to(device), 3, 100, 7, 64))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_compile_with_fullgraph(device):
    def round_trip(x):
        support = nonzero_bitmap(x, "row")
        table = count_sketch(x, 3, 4096, 1, support, "row")
        return count_sketch_decode(table, support, x.shape[0], x.shape[1], 1)

    x = torch.zeros(300, 8, device=device)
    x[7] = torch.arange(8.0, device=device)
    x[250] = 1.0
    compiled = torch.compile(round_trip, fullgraph=True)
    assert_same_table(compiled(x), round_trip(x), device)


# ---- union_sum_rows: the union of every rank's support and the sum of their gathered rows ----

def gathered(p, n, m, density, dtype=torch.float32, extra_rows=2, seed=0):
    """(bitmaps [p, ceil(n / 8)], rows [p, k, m], masks [p, n]): p random supports and each one's rows in unit order,
    padded with garbage rows to a common k."""
    g = torch.Generator().manual_seed(seed)
    masks = torch.rand(p, n, generator=g) < density
    k = int(masks.sum(1).max()) + extra_rows if p else extra_rows
    rows = (torch.randn(p, k, m, generator=g) * 100).to(dtype)
    return pack_bits(masks), rows, masks


def index_add_oracle(masks, rows, divisor):
    """torch's own: index_add_ of each rank's rows into zeros at their places in the union, in rank order, then
    div_."""
    union = masks.any(0)
    units = union.nonzero().flatten()
    total = torch.zeros(units.numel(), rows.shape[2], dtype=rows.dtype)
    for r in range(masks.shape[0]):
        own = masks[r].nonzero().flatten()
        total.index_add_(0, torch.searchsorted(units, own), rows[r, :own.numel()])
    return units, total.div_(divisor) if divisor != 1 else total


def assert_same_bits(got, want):
    """Same shape, dtype and bits (+0.0 is not -0.0; NaN as NaN)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    got, want = got.cpu(), want.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    assert torch.equal(got.masked_fill(got.isnan(), 0).view(ints), want.masked_fill(want.isnan(), 0).view(ints))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("p, n, m, density", [(1, 100, 4, 0.3), (2, 65_536, 128, 0.04), (3, 1001, 7, 0.5),
                                              (4, 9, 1, 1.0), (5, 20_000, 16, 0.01), (2, 0, 4, 0.5), (0, 30, 3, 0.5)])
@pytest.mark.parametrize("divisor", [1, 2, 3])
def test_union_sum_rows_is_index_add_in_rank_order_then_div(device, dtype, p, n, m, density, divisor):
    bitmaps, rows, masks = gathered(p, n, m, density, dtype, seed=p * 7 + n)
    units, sums = union_sum_rows(bitmaps.to(device), rows.to(device), n, divisor)
    want_units, want_sums = index_add_oracle(masks, rows, divisor)
    assert_same(units, want_units)
    assert_same_bits(sums, want_sums)


@pytest.mark.parametrize("device", DEVICES)
def test_union_sum_rows_adds_signed_zeros_and_nan_as_index_add_does(device):
    masks = torch.tensor([[True, True, False], [True, True, True]])
    rows = torch.tensor([[[-0.0, 1.0], [math.nan, -0.0], [7.0, 7.0]],
                         [[-0.0, -1.0], [2.0, -0.0], [-0.0, math.inf]]])
    units, sums = union_sum_rows(pack_bits(masks).to(device), rows.to(device), 3)
    want_units, want_sums = index_add_oracle(masks, rows, 1)
    assert_same(units, want_units)
    assert_same_bits(sums, want_sums)  # -0 + -0 from a zero sum is +0; a unit of one rank's -0 stays +0


@pytest.mark.parametrize("device", DEVICES)
def test_union_sum_rows_reads_views_into_one_received_buffer_per_rank(device):
    # what the folded gather receives: per rank a header, a bitmap and rows, in one uint8 buffer
    bitmaps, rows, masks = gathered(3, 1000, 8, 0.2, seed=5)
    header, bitmap_bytes, row_bytes = 32, bitmaps.shape[1], rows[0].numel() * 4
    buffer = torch.randint(0, 256, (3, header + 128 + row_bytes), dtype=torch.uint8)
    buffer[:, header:header + bitmap_bytes] = bitmaps
    buffer[:, header + 128:] = rows.view(3, -1).view(torch.uint8)
    buffer = buffer.to(device)
    bitmap_view = buffer[:, header:header + bitmap_bytes]
    rows_view = buffer[:, header + 128:].view(torch.float32).view(3, rows.shape[1], 8)
    units, sums = union_sum_rows(bitmap_view, rows_view, 1000, 3)
    want_units, want_sums = index_add_oracle(masks, rows, 3)
    assert_same(units, want_units)
    assert_same_bits(sums, want_sums)
    transposed = rows.transpose(1, 2).contiguous().transpose(1, 2)  # blocks not contiguous: copied first
    assert_same_bits(union_sum_rows(bitmaps.to(device), transposed.to(device), 1000, 3)[1], want_sums)


@pytest.mark.parametrize("device", DEVICES)
def test_union_sum_rows_ignores_padding_bits_and_rows_past_each_count(device):
    bitmaps, rows, masks = gathered(2, 13, 3, 0.5, seed=2)
    padded = bitmaps.clone()
    padded[:, -1] |= 0xE0  # bits 13..15 of the last byte
    units, sums = union_sum_rows(padded.to(device), rows.to(device), 13)
    want_units, want_sums = index_add_oracle(masks, rows, 1)
    assert_same(units, want_units)
    assert_same_bits(sums, want_sums)


def test_union_sum_rows_does_not_depend_on_the_cpu_thread_count():
    bitmaps, rows, _ = gathered(4, 200_000, 32, 0.05, seed=4)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(union_sum_rows(bitmaps, rows, 200_000, 4))
    finally:
        torch.set_num_threads(before)
    for units, sums in results[1:]:
        assert_same(units, results[0][0])
        assert_same_bits(sums, results[0][1])


def test_union_sum_rows_rejects_a_support_with_more_units_than_its_rows():
    bitmaps = pack_bits(torch.tensor([[True, True, False, True], [True, False, False, False]]))
    with pytest.raises(RuntimeError, match=r"bitmap 0 of 'bitmaps' has 3 units, more than the rows 'rows' gives each "
                                           r"\(2\)"):
        union_sum_rows(bitmaps, torch.zeros(2, 2, 5), 4)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_union_sum_rows(device):
    for p, n, m, density, dtype in ((2, 100, 4, 0.3, torch.float32), (3, 17, 1, 0.6, torch.float16),
                                    (1, 0, 3, 0.5, torch.float64), (2, 64, 2, 0.0, torch.bfloat16)):
        bitmaps, rows, _ = gathered(p, n, m, density, dtype)
        torch.library.opcheck(torch.ops.fastdist.union_sum_rows.default, (bitmaps.to(device), rows.to(device), n, 2))


# ---- bad inputs ----

def _x(d):
    return torch.ones(20, 3, device=d)


def _sup(d, n=3):
    return torch.zeros(n, dtype=torch.uint8, device=d)


BAD_INPUTS = {
    "bitmap_int_x": (lambda d: nonzero_bitmap(torch.ones(3, dtype=torch.int64, device=d)),
                     r"'x' must have a floating dtype \(torch.float32, torch.float16, torch.bfloat16 or "
                     r"torch.float64\), got torch.int64"),
    "bitmap_bad_granularity": (lambda d: nonzero_bitmap(_x(d), "column"),
                               "'granularity' must be \"element\" or \"row\", got \"column\""),
    "bitmap_row_of_0d": (lambda d: nonzero_bitmap(torch.tensor(1.0, device=d), "row"),
                         r"'x' must have at least 1 dimension\(s\) for granularity \"row\", got shape \[\]"),
    "sketch_bool_x": (lambda d: count_sketch(torch.ones(3, dtype=torch.bool, device=d), 3, 8, 0),
                      "'x' must have a floating dtype .* got torch.bool"),
    "sketch_zero_rows": (lambda d: count_sketch(_x(d), 0, 8, 0), r"'rows' must be in \[1, 15\], got 0"),
    "sketch_too_many_rows": (lambda d: count_sketch(_x(d), 16, 8, 0), r"'rows' must be in \[1, 15\], got 16"),
    "sketch_zero_cols": (lambda d: count_sketch(_x(d), 3, 0, 0), r"'cols' must be in \[1, 2147483647\], got 0"),
    "sketch_huge_cols": (lambda d: count_sketch(_x(d), 3, 2**31, 0),
                         r"'cols' must be in \[1, 2147483647\], got 2147483648"),
    "sketch_negative_seed": (lambda d: count_sketch(_x(d), 3, 8, -1), r"'seed' must be in \[0, 2\^63\), got -1"),
    "sketch_seed_2_63": (lambda d: count_sketch(_x(d), 3, 8, 2**63),
                         r"'seed' must be in \[0, 2\^63\), got 9223372036854775808"),
    "sketch_support_int32": (lambda d: count_sketch(_x(d), 3, 8, 0, torch.zeros(3, dtype=torch.int32, device=d)),
                             "'support' must have dtype torch.uint8, got torch.int32"),
    "sketch_support_short": (lambda d: count_sketch(_x(d), 3, 8, 0, _sup(d, 2)),
                             r"'support' must have shape \[3\] \(ceil\(n / 8\) for n = 20 rows of x\), "
                             r"got shape \[2\]"),
    "sketch_support_element_length": (lambda d: count_sketch(_x(d), 3, 8, 0, _sup(d, 3), "element"),
                                      r"'support' must have shape \[8\] \(ceil\(n / 8\) for n = 60 elements of x\), "
                                      r"got shape \[3\]"),
    "sketch_support_2d": (lambda d: count_sketch(_x(d), 3, 8, 0, _sup(d).reshape(1, 3)),
                          r"'support' must have shape \[3\] .* got shape \[1, 3\]"),
    "sketch_bad_granularity": (lambda d: count_sketch(_x(d), 3, 8, 0, None, "rows"),
                               "'granularity' must be \"element\" or \"row\", got \"rows\""),
    "decode_float64_table": (lambda d: count_sketch_decode(torch.zeros(3, 8, dtype=torch.float64, device=d),
                                                           _sup(d), 20, 3, 0),
                             "'table' must have dtype torch.float32, got torch.float64"),
    "decode_1d_table": (lambda d: count_sketch_decode(torch.zeros(8, device=d), _sup(d), 20, 3, 0),
                        r"'table' must have 2 dimension\(s\), got shape \[8\]"),
    "decode_16_row_table": (lambda d: count_sketch_decode(torch.zeros(16, 8, device=d), _sup(d), 20, 3, 0),
                            r"'table' must have 1 to 15 rows, got shape \[16, 8\]"),
    "decode_no_cols": (lambda d: count_sketch_decode(torch.zeros(3, 0, device=d), _sup(d), 20, 3, 0),
                       r"'table' must have 1 to 2147483647 columns, got shape \[3, 0\]"),
    "decode_negative_n": (lambda d: count_sketch_decode(torch.zeros(3, 8, device=d), _sup(d), -1, 3, 0),
                          "'n' must be >= 0, got -1"),
    "decode_negative_m": (lambda d: count_sketch_decode(torch.zeros(3, 8, device=d), _sup(d), 20, -3, 0),
                          "'m' must be >= 0, got -3"),
    "decode_n_times_m_overflows": (lambda d: count_sketch_decode(torch.zeros(3, 8, device=d), _sup(d), 20, 2**62, 0),
                                   r"the output would have shape \[20, 4611686018427387904\] of torch.float32: its "
                                   r"strides or its size in bytes pass int64"),
    "decode_output_bytes_past_int64": (lambda d: count_sketch_decode(torch.zeros(3, 8, device=d),
                                                                     huge([2**58], torch.uint8, d), 2**61, 1, 0),
                                       r"the output would have shape \[2305843009213693952, 1\] of torch.float32"),
    "decode_support_length": (lambda d: count_sketch_decode(torch.zeros(3, 8, device=d), _sup(d, 4), 20, 3, 0),
                              r"'support' must have shape \[3\] \(ceil\(n / 8\) for n = 20 units\), got shape \[4\]"),
    "decode_bool_support": (lambda d: count_sketch_decode(torch.zeros(3, 8, device=d),
                                                          torch.zeros(3, dtype=torch.bool, device=d), 20, 3, 0),
                            "'support' must have dtype torch.uint8, got torch.bool"),
    "decode_negative_seed": (lambda d: count_sketch_decode(torch.zeros(3, 8, device=d), _sup(d), 20, 3, -5),
                             r"'seed' must be in \[0, 2\^63\), got -5"),
    "units_sketch_int_values": (lambda d: count_sketch_units(torch.ones(3, 2, dtype=torch.int32, device=d),
                                                             torch.arange(3, device=d), 3, 8, 0),
                                "'values' must have a floating dtype .* got torch.int32"),
    "units_sketch_0d_values": (lambda d: count_sketch_units(torch.tensor(1.0, device=d), torch.arange(1, device=d), 3,
                                                            8, 0),
                               r"'values' must have at least 1 dimension\(s\), got shape \[\]"),
    "units_sketch_length": (lambda d: count_sketch_units(torch.ones(3, 2, device=d), torch.arange(4, device=d), 3, 8, 0),
                            r"'units' must have one entry per row of 'values' \(3\), got shape \[4\]"),
    "units_sketch_int32_units": (lambda d: count_sketch_units(torch.ones(3, 2, device=d),
                                                              torch.arange(3, dtype=torch.int32, device=d), 3, 8, 0),
                                 "'units' must have dtype torch.int64, got torch.int32"),
    "units_sketch_zero_cols": (lambda d: count_sketch_units(torch.ones(3, 2, device=d), torch.arange(3, device=d), 3,
                                                            0, 0),
                               r"'cols' must be in \[1, 2147483647\], got 0"),
    "decode_units_int32": (lambda d: count_sketch_decode_units(torch.zeros(3, 8, device=d),
                                                               torch.zeros(3, dtype=torch.int32, device=d), 3, 0),
                           "'units' must have dtype torch.int64, got torch.int32"),
    "decode_units_2d": (lambda d: count_sketch_decode_units(torch.zeros(3, 8, device=d),
                                                            torch.zeros(1, 3, dtype=torch.int64, device=d), 3, 0),
                        r"'units' must have 1 dimension\(s\), got shape \[1, 3\]"),
    "decode_units_negative_m": (lambda d: count_sketch_decode_units(torch.zeros(3, 8, device=d),
                                                                    torch.zeros(3, dtype=torch.int64, device=d), -1, 0),
                                "'m' must be >= 0, got -1"),
    "decode_units_half_table": (lambda d: count_sketch_decode_units(torch.zeros(3, 8, dtype=torch.half, device=d),
                                                                    torch.zeros(3, dtype=torch.int64, device=d), 3, 0),
                                "'table' must have dtype torch.float32, got torch.float16"),
    "hash_int32_idx": (lambda d: sketch_hash(torch.zeros(3, dtype=torch.int32, device=d), 3, 8, 0),
                       "'idx' must have dtype torch.int64, got torch.int32"),
    "hash_2d_idx": (lambda d: sketch_hash(torch.zeros(2, 3, dtype=torch.int64, device=d), 3, 8, 0),
                    r"'idx' must have 1 dimension\(s\), got shape \[2, 3\]"),
    "hash_zero_cols": (lambda d: sketch_hash(torch.zeros(3, dtype=torch.int64, device=d), 3, 0, 0),
                       r"'cols' must be in \[1, 2147483647\], got 0"),
    "hash_zero_m": (lambda d: sketch_hash(torch.zeros(3, dtype=torch.int64, device=d), 3, 8, 0, 0),
                    "'m' must be >= 1, got 0"),
    "hash_output_past_int64": (lambda d: sketch_hash(huge([2**61], torch.int64, d), 15, 8, 0),
                               r"the output 'bucket' would have shape \[15, 2305843009213693952\] of torch.int64"),
    "decode_units_output_past_int64": (lambda d: count_sketch_decode_units(torch.zeros(3, 8, device=d),
                                                                           torch.zeros(4, dtype=torch.int64, device=d),
                                                                           2**62, 0),
                                       r"the output would have shape \[4, 4611686018427387904\] of torch.float32"),
    "row_units_past_int64": (lambda d: count_sketch(huge([0, 2**62, 4], device=d), 3, 8, 0),
                             r"the sizes of 'x' after the first \[4611686018427387904, 4\] multiply past int64"),
    "units_sketch_row_past_int64": (lambda d: count_sketch_units(huge([0, 2**62, 4], device=d),
                                                                 torch.zeros(0, dtype=torch.int64, device=d), 3, 8, 0),
                                    r"the sizes of 'values' after the first \[4611686018427387904, 4\] multiply past "
                                    r"int64"),
    "union_bitmaps_int32": (lambda d: union_sum_rows(torch.zeros(2, 1, dtype=torch.int32, device=d),
                                                     torch.zeros(2, 1, 3, device=d), 8),
                            "'bitmaps' must have dtype torch.uint8, got torch.int32"),
    "union_bitmaps_1d": (lambda d: union_sum_rows(torch.zeros(1, dtype=torch.uint8, device=d),
                                                  torch.zeros(1, 1, 3, device=d), 8),
                         r"'bitmaps' must have 2 dimension\(s\), got shape \[1\]"),
    "union_wrong_bitmap_bytes": (lambda d: union_sum_rows(torch.zeros(2, 2, dtype=torch.uint8, device=d),
                                                          torch.zeros(2, 1, 3, device=d), 20),
                                 r"'bitmaps' must have last dimension 3 \(ceil\(n / 8\) for n = 20\), got shape "
                                 r"\[2, 2\]"),
    "union_negative_n": (lambda d: union_sum_rows(torch.zeros(2, 0, dtype=torch.uint8, device=d),
                                                  torch.zeros(2, 1, 3, device=d), -1),
                         "'n' must be >= 0, got -1"),
    "union_int_rows": (lambda d: union_sum_rows(torch.zeros(2, 1, dtype=torch.uint8, device=d),
                                                torch.zeros(2, 1, 3, dtype=torch.int64, device=d), 8),
                       "'rows' must have a floating dtype .* got torch.int64"),
    "union_rows_2d": (lambda d: union_sum_rows(torch.zeros(2, 1, dtype=torch.uint8, device=d),
                                               torch.zeros(2, 3, device=d), 8),
                      r"'rows' must have 3 dimension\(s\), got shape \[2, 3\]"),
    "union_rows_per_bitmap": (lambda d: union_sum_rows(torch.zeros(2, 1, dtype=torch.uint8, device=d),
                                                       torch.zeros(3, 1, 3, device=d), 8),
                              r"'rows' must have one block of rows per bitmap \(2\), got shape \[3, 1, 3\]"),
    "union_zero_divisor": (lambda d: union_sum_rows(torch.zeros(2, 1, dtype=torch.uint8, device=d),
                                                    torch.zeros(2, 1, 3, device=d), 8, 0),
                           "'divisor' must be >= 1, got 0"),
}


test_bad_inputs_raise_a_clear_error, test_fake_kernels_reject_bad_inputs_like_the_real_ones = \
    bad_input_tests(BAD_INPUTS)


@pytest.mark.cuda
def test_support_on_another_device_is_rejected():
    with pytest.raises(RuntimeError, match="'support' and 'x' must be on the same device"):
        count_sketch(torch.ones(20, 3, device="cuda"), 3, 8, 0, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="'support' and 'table' must be on the same device"):
        count_sketch_decode(torch.zeros(3, 8), torch.zeros(3, dtype=torch.uint8, device="cuda"), 20, 3, 0)
