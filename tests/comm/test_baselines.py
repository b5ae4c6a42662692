"""fastdist.comm.baselines: the reductions sketch_allreduce is measured against do what they claim.

Every multi-rank run happens in one spawn per world size (a module-scoped fixture): the ranks return what each
reduction produced and recorded; the tests compute what it should be and compare, one property each.
"""
import gc
import math

import pytest
import torch
import torch.distributed as dist

from fastdist.comm import baselines as bl
from fastdist.testing import synthetic
from fastdist.distributed import MismatchError, spawn
from helpers import assert_close

VOCAB, DIM = 96, 12
TOPK_K = 37
TOPK_RATIO = 0.01
POWERSGD_RANK, POWERSGD_START_ITER, POWERSGD_CALLS = 4, 2, 14
LOW_RANK_SHAPE = (64, 48)
ZIPF_SPEC = dict(rows=256, dim=8, density=0.1)
INDEX_BYTES, VALUE_BYTES, COUNT_BYTES = 4, 4, 8  # int32 indices (fewer than 2^31 units), float32 values, int64 counts
EXACT = dict(rtol=0, atol=0)


def _int_grad(rank, nnz_rows, seed=0):
    """Integer-valued rows (exact in any summation order); rank-dependent count of non-zero rows."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    grad = torch.zeros(VOCAB, DIM)
    rows = torch.randperm(VOCAB, generator=g)[:nnz_rows]
    vals = torch.randint(-9, 10, (nnz_rows, DIM), generator=g).float()
    vals[vals == 0] = 1.0
    grad[rows] = vals
    return grad


def _nnz_rows(rank):
    return 5 * rank  # rank 0 has no non-zero row, every rank a different count


def _uneven_grad(rank):
    return _int_grad(rank, _nnz_rows(rank))


def _ref(fn, world):
    return sum(fn(r) for r in range(world))


def _topk_local(x, k):
    keep = torch.zeros_like(x).view(-1)
    idx = torch.topk(x.reshape(-1).abs(), k).indices
    keep[idx] = x.reshape(-1)[idx]
    return keep.view_as(x)


def _distinct_grad(rank):
    """Values with distinct magnitudes on every rank, so each rank's top-k is unique."""
    g = torch.Generator().manual_seed(77 + rank)
    mags = (torch.randperm(VOCAB * DIM, generator=g).float() + 1) / 64
    signs = torch.randint(0, 2, (VOCAB * DIM,), generator=g).float() * 2 - 1
    return (mags * signs).view(VOCAB, DIM)


def _low_rank_grad(rank):
    """Rank 6 with decaying singular values (rank-4 PowerSGD misses the last two) plus a little noise."""
    n, m = LOW_RANK_SHAPE
    shared = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(n, 6, generator=shared))[0]
    v = torch.linalg.qr(torch.randn(m, 6, generator=shared))[0]
    s = torch.tensor([8.0, 6.0, 4.0, 3.0, 2.0, 1.5])
    own = torch.Generator().manual_seed(50 + rank)
    return (u * s) @ v.t() * (1 + 0.1 * rank) + 0.01 * torch.randn(n, m, generator=own)


def _rel(x, ref):
    return float((x - ref).norm() / ref.norm())


def _reduced(fn, make, *args, **kwargs):
    """Runs the reduction `fn` on a fresh input; returns (the reduced tensor, the call's stats)."""
    x = make()
    fn(x, *args, **kwargs)
    return x, bl.last_baseline_stats()


def _all_reductions():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"world": world}
    uneven = lambda: _uneven_grad(rank)  # noqa: E731

    # lossless: dense, agsparse (row and element), on integer data with uneven / zero nnz
    out["dense"] = _reduced(bl.dense_allreduce, uneven)
    x = uneven()
    out["agsparse_returns_its_input"] = bl.agsparse_allreduce(x) is x
    out["agsparse_row"] = x, bl.last_baseline_stats()
    out["agsparse_element"] = _reduced(bl.agsparse_allreduce, uneven, granularity="element")
    out["agsparse_avg"] = _reduced(bl.agsparse_allreduce, uneven, op="avg")
    # a non-contiguous input is reduced and written back through the view
    out["agsparse_noncontig"] = _reduced(bl.agsparse_allreduce, lambda: uneven().t())
    out["dense_noncontig"] = _reduced(bl.dense_allreduce, lambda: uneven().t())
    # every rank all-zero: nothing but the counts goes on the wire
    out["agsparse_zero"] = _reduced(bl.agsparse_allreduce, lambda: torch.zeros(VOCAB, DIM))
    # the synthetic Zipf gradients
    spec = synthetic.GradientSpec(**ZIPF_SPEC)
    zipf = lambda: synthetic.zipf_embedding_grad(spec, rank)[0]  # noqa: E731
    out["agsparse_zipf"] = _reduced(bl.agsparse_allreduce, zipf)
    out["dense_zipf"] = _reduced(bl.dense_allreduce, zipf)

    # topk
    distinct = lambda: _distinct_grad(rank)  # noqa: E731
    out["topk"] = _reduced(bl.topk_allgather, distinct, k=TOPK_K)
    out["topk_ratio"] = _reduced(bl.topk_allgather, distinct, ratio=TOPK_RATIO)
    out["topk_full"] = _reduced(bl.topk_allgather, uneven, k=VOCAB * DIM)

    # 16-bit casts
    for name, fn in (("fp16", bl.fp16_allreduce), ("bf16", bl.bf16_allreduce)):
        out[name] = _reduced(fn, distinct)
        out[f"{name}_avg"] = _reduced(fn, distinct, op="avg")

    # PowerSGD (torch's hook), with and without error feedback: every call's result and stats
    for ef in (True, False):
        state = bl.make_powersgd_state(rank=POWERSGD_RANK, start_iter=POWERSGD_START_ITER, error_feedback=ef,
                                       warm_start=True)
        out["powersgd", ef] = [_reduced(lambda t: bl.powersgd_allreduce(state, t), lambda: _low_rank_grad(rank))
                               for _ in range(POWERSGD_CALLS)]
    state = bl.make_powersgd_state(rank=POWERSGD_RANK, start_iter=POWERSGD_START_ITER)
    for _ in range(POWERSGD_START_ITER + 1):
        out["powersgd_avg"] = _reduced(lambda t: bl.powersgd_allreduce(state, t, op="avg"),
                                       lambda: _low_rank_grad(rank))
    # torch's PowerSGD hook leaves reference cycles that hold the group's work: collected later by a gloo thread
    # (while this rank sends its results, after the group is destroyed) they abort the process. Collect them now.
    del state
    gc.collect()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request):
    return spawn(_all_reductions, request.param, timeout=240)


def _ring(nbytes, world):
    return 2 * (world - 1) * nbytes // world


def test_dense_and_agsparse_equal_the_exact_sum_with_uneven_and_zero_nnz_ranks(results):
    world = results[0]["world"]
    exact = _ref(_uneven_grad, world)
    zipf_exact = synthetic.exact_sum(synthetic.GradientSpec(**ZIPF_SPEC), world)
    expected = {"dense": exact, "agsparse_row": exact, "agsparse_element": exact, "agsparse_avg": exact / world,
                "agsparse_noncontig": exact.t(), "dense_noncontig": exact.t(), "agsparse_zero": torch.zeros_like(exact),
                "agsparse_zipf": zipf_exact, "dense_zipf": zipf_exact}
    for rank, out in enumerate(results):
        assert out["agsparse_returns_its_input"] is True, rank
        for name, want in expected.items():
            assert_close(out[name][0], want, f"rank {rank}, {name}", **EXACT)


def test_agsparse_sends_lists_padded_to_the_largest_count(results):
    world = results[0]["world"]
    counts = [_nnz_rows(r) for r in range(world)]
    row_entry = INDEX_BYTES + DIM * VALUE_BYTES
    for rank, out in enumerate(results):
        s = out["agsparse_row"][1]
        assert (s.method, s.local_nnz, s.max_nnz, s.detail["counts"]) == ("agsparse", counts[rank], max(counts), counts)
        assert s.wire_bytes == (world - 1) * (COUNT_BYTES + max(counts) * row_entry)
        assert s.dense_wire_bytes == _ring(VOCAB * DIM * VALUE_BYTES, world)
        e = out["agsparse_element"][1]
        assert e.local_nnz == int((_uneven_grad(rank) != 0).sum())
        assert e.wire_bytes == (world - 1) * (COUNT_BYTES + e.max_nnz * (INDEX_BYTES + VALUE_BYTES))
        z = out["agsparse_zero"][1]
        assert (z.max_nnz, z.wire_bytes) == (0, (world - 1) * COUNT_BYTES)


def test_dense_and_16bit_wire_models_are_the_ring_all_reduce_of_the_payload(results):
    for out in results:
        world = out["world"]
        assert out["dense"][1].wire_bytes == _ring(VOCAB * DIM * VALUE_BYTES, world)
        assert out["fp16"][1].wire_bytes == out["bf16"][1].wire_bytes == _ring(VOCAB * DIM * 2, world)
        assert (out["fp16"][1].method, out["bf16"][1].method) == ("fp16", "bf16")


def test_topk_keeps_exactly_the_k_largest_magnitudes_of_each_rank(results):
    world = results[0]["world"]
    exact = _ref(_distinct_grad, world)
    for rank, out in enumerate(results):
        x, s = out["topk"]
        assert_close(x, _ref(lambda r: _topk_local(_distinct_grad(r), TOPK_K), world), f"rank {rank}, topk", **EXACT)
        assert (s.local_nnz, s.wire_bytes) == (TOPK_K, (world - 1) * TOPK_K * (INDEX_BYTES + VALUE_BYTES))
        assert 0 < _rel(x, exact) < 1  # lossy
        assert out["topk_ratio"][1].local_nnz == math.ceil(TOPK_RATIO * VOCAB * DIM)
        assert_close(out["topk_full"][0], _ref(_uneven_grad, world), f"rank {rank}, k = numel", **EXACT)  # lossless


def test_16bit_casts_are_within_their_rounding_error(results):
    world = results[0]["world"]
    # error relative to the sum of magnitudes (values of opposite sign may cancel in the sum)
    exact, scale = _ref(_distinct_grad, world), _ref(lambda r: _distinct_grad(r).abs(), world)
    for out in results:
        for name, mantissa_bits in (("fp16", 11), ("bf16", 8)):
            max_rel = float(((out[name][0] - exact).abs() / scale).max())
            avg_max_rel = float(((out[f"{name}_avg"][0] - exact / world).abs() / (scale / world)).max())
            # each rank's value is rounded once, the sum a few more times: a few half-ulps
            assert max_rel < (world + 1) * 2 ** -mantissa_bits, (name, max_rel)
            assert avg_max_rel < (world + 2) * 2 ** -mantissa_bits, (name, avg_max_rel)
            assert max_rel > 0, name  # it really went through 16 bits


def test_powersgd_is_torch_hook_dense_while_warming_up_then_low_rank_with_p_and_q_on_the_wire(results):
    (n, m), r = LOW_RANK_SHAPE, POWERSGD_RANK
    for out in results:
        world = out["world"]
        stats = [s for _, s in out["powersgd", True]]
        methods = [s.method for s in stats]
        assert methods == ["powersgd-warmup"] * POWERSGD_START_ITER + \
            ["powersgd"] * (POWERSGD_CALLS - POWERSGD_START_ITER)
        assert stats[0].wire_bytes == _ring(n * m * VALUE_BYTES, world)
        assert stats[POWERSGD_START_ITER].wire_bytes == \
            _ring(n * r * VALUE_BYTES, world) + _ring(m * r * VALUE_BYTES, world)


def _running_errors(calls, exact):
    """Relative error of the mean of the compressed calls' results so far, after each one."""
    compressed = [x for x, s in calls if s.method == "powersgd"]
    return [_rel(sum(compressed[:i + 1]) / (i + 1), exact) for i in range(len(compressed))], compressed


def test_powersgd_approximates_a_low_rank_sum_and_error_feedback_drives_the_running_mean_to_it(results):
    world = results[0]["world"]
    exact = _ref(_low_rank_grad, world)
    for out in results:
        running, compressed = _running_errors(out["powersgd", True], exact)
        plain_running, _ = _running_errors(out["powersgd", False], exact)
        assert _rel(compressed[0], exact) < 1.0  # one compressed call: a useful approximation
        assert running[-1] < 0.5 * running[0], running  # error feedback: the mean converges
        # plain PowerSGD stalls at the rank-4 truncation error
        assert running[-1] < 0.6 * plain_running[-1], (running[-1], plain_running[-1])
        assert _rel(out["powersgd_avg"][0], exact / world) < 1.0


def _mismatched_agsparse():
    rank = dist.get_rank()
    x = torch.zeros(16 + rank, 4)
    x[1] = 1.0
    try:
        bl.agsparse_allreduce(x)
    except MismatchError as e:
        return str(e)
    return None


def test_agsparse_ranks_with_different_shapes_all_raise_without_hanging():
    for msg in spawn(_mismatched_agsparse, 2, timeout=120):
        assert msg is not None and "agsparse_allreduce configuration" in msg


@pytest.mark.parametrize("call, error, text", [
    (lambda: bl.dense_allreduce(torch.zeros(4, dtype=torch.int32)), TypeError, "float32"),
    (lambda: bl.agsparse_allreduce(torch.zeros(4), granularity="col"), ValueError, "granularity"),
    (lambda: bl.agsparse_allreduce(torch.zeros(4, 2).to_sparse()), TypeError, "dense"),
    (lambda: bl.fp16_allreduce(torch.zeros(4), op="max"), ValueError, "op must be"),
    (lambda: bl.topk_allgather(torch.zeros(4), ratio=0.0), ValueError, "ratio must be in"),
    (lambda: bl.topk_allgather(torch.zeros(4), k=0), ValueError, "k must be >= 1"),
    (lambda: bl.topk_allgather(torch.zeros(4), ratio=0.5, k=2), ValueError, "exactly one"),
])
def test_bad_arguments_are_rejected_before_any_communication(call, error, text):
    with pytest.raises(error, match=text):
        call()


def test_synthetic_gradients_have_the_asked_density_zipf_overlap_and_an_exact_sum():
    spec = synthetic.GradientSpec(rows=4096, dim=4, density=0.02)
    rows = [synthetic.zipf_rows(spec, r) for r in range(4)]
    assert [r.numel() for r in rows] == [spec.local_rows] * 4
    assert spec.local_rows == round(spec.density * spec.rows)
    g, r0 = synthetic.zipf_embedding_grad(spec, 0)
    assert_close(r0, rows[0], "rows of rank 0's gradient", **EXACT)
    assert_close((g != 0).any(1).nonzero().flatten(), r0, "non-zero rows of rank 0's gradient", **EXACT)
    # seeded per (seed, rank, step)
    assert_close(synthetic.zipf_embedding_grad(spec, 0)[0], g, "a second draw", **EXACT)
    assert not torch.equal(synthetic.zipf_rows(spec, 0, step=1), r0)
    union = synthetic.union_rows(spec, 4)
    # frequent tokens are shared: fewer union rows than 4 disjoint sets, more than one set
    assert spec.local_rows < union.numel() < 4 * spec.local_rows
    # and more overlap than independent uniform rows would give (expected 1 - (1 - d)^4 of the rows)
    assert union.numel() < 0.95 * (1 - (1 - spec.density) ** 4) * spec.rows
    total = synthetic.exact_sum(spec, 4)
    assert_close(total, sum(synthetic.zipf_embedding_grad(spec, r)[0] for r in range(4)), "exact_sum", **EXACT)
    assert_close((total != 0).any(1).nonzero().flatten(), union, "non-zero rows of exact_sum", **EXACT)
