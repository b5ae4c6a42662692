"""fastdist.comm.baselines: the reductions sketch_allreduce is measured against do what they claim.

Every multi-rank check runs in one spawn per world size (a module-scoped fixture); the tests assert on
its results, one property each.
"""
import pytest
import torch
import torch.distributed as dist

from fastdist.comm import baselines as bl
from fastdist.testing import synthetic
from fastdist.distributed import MismatchError, spawn

VOCAB, DIM = 96, 12


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


def _low_rank_grad(rank, n=64, m=48):
    """Rank 6 with decaying singular values (rank-4 PowerSGD misses the last two) plus a little noise."""
    shared = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(n, 6, generator=shared))[0]
    v = torch.linalg.qr(torch.randn(m, 6, generator=shared))[0]
    s = torch.tensor([8.0, 6.0, 4.0, 3.0, 2.0, 1.5])
    own = torch.Generator().manual_seed(50 + rank)
    return (u * s) @ v.t() * (1 + 0.1 * rank) + 0.01 * torch.randn(n, m, generator=own)


def _rel(x, ref):
    return float((x - ref).norm() / ref.norm())


def _all_checks():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"world": world}

    # --- lossless: dense, agsparse (row and element), on integer data with uneven / zero nnz
    ref = _ref(lambda r: _int_grad(r, _nnz_rows(r)), world)
    x = _int_grad(rank, _nnz_rows(rank))
    bl.dense_allreduce(x)
    out["dense_equal"] = torch.equal(x, ref)
    out["dense_stats"] = bl.last_baseline_stats()
    x = _int_grad(rank, _nnz_rows(rank))
    res = bl.agsparse_allreduce(x)
    out["agsparse_row_equal"] = torch.equal(x, ref) and res is x
    out["agsparse_row_stats"] = bl.last_baseline_stats()
    x = _int_grad(rank, _nnz_rows(rank))
    bl.agsparse_allreduce(x, granularity="element")
    out["agsparse_element_equal"] = torch.equal(x, ref)
    out["agsparse_element_stats"] = bl.last_baseline_stats()
    out["agsparse_local_elements"] = int((_int_grad(rank, _nnz_rows(rank)) != 0).sum())
    x = _int_grad(rank, _nnz_rows(rank))
    bl.agsparse_allreduce(x, op="avg")
    out["agsparse_avg_equal"] = torch.equal(x, ref / world)
    # a non-contiguous input is reduced and written back through the view
    base = _int_grad(rank, _nnz_rows(rank)).t()
    bl.agsparse_allreduce(base)
    out["agsparse_noncontig_equal"] = torch.equal(base, ref.t())
    base = _int_grad(rank, _nnz_rows(rank)).t()
    bl.dense_allreduce(base)
    out["dense_noncontig_equal"] = torch.equal(base, ref.t())
    # every rank all-zero: nothing but the counts goes on the wire, the result stays zero
    z = torch.zeros(VOCAB, DIM)
    bl.agsparse_allreduce(z)
    out["agsparse_zero"] = bool((z == 0).all())
    out["agsparse_zero_stats"] = bl.last_baseline_stats()
    # the synthetic Zipf gradients: lossless means bit-exact against the locally computed exact sum
    spec = synthetic.GradientSpec(rows=256, dim=8, density=0.1)
    g, _ = synthetic.zipf_embedding_grad(spec, rank)
    bl.agsparse_allreduce(g)
    out["agsparse_zipf_equal"] = torch.equal(g, synthetic.exact_sum(spec, world))
    g, _ = synthetic.zipf_embedding_grad(spec, rank)
    bl.dense_allreduce(g)
    out["dense_zipf_equal"] = torch.equal(g, synthetic.exact_sum(spec, world))

    # --- topk: exactly the k largest magnitudes per rank survive
    k = 37
    ref_topk = _ref(lambda r: _topk_local(_distinct_grad(r), k), world)
    x = _distinct_grad(rank)
    bl.topk_allgather(x, k=k)
    out["topk_equal"] = torch.equal(x, ref_topk)
    out["topk_stats"] = bl.last_baseline_stats()
    out["topk_err"] = _rel(x, _ref(_distinct_grad, world))
    x = _distinct_grad(rank)
    bl.topk_allgather(x, ratio=0.01)
    out["topk_ratio_k"] = bl.last_baseline_stats().local_nnz
    # k at least the non-zeros: lossless
    x = _int_grad(rank, _nnz_rows(rank))
    bl.topk_allgather(x, k=VOCAB * DIM)
    out["topk_full_equal"] = torch.equal(x, ref)

    # --- 16-bit casts: within their rounding
    # error relative to the sum of magnitudes (values of opposite sign may cancel in the sum)
    fref, scale = _ref(_distinct_grad, world), _ref(lambda r: _distinct_grad(r).abs(), world)
    for name, fn in (("fp16", bl.fp16_allreduce), ("bf16", bl.bf16_allreduce)):
        x = _distinct_grad(rank)
        fn(x)
        out[f"{name}_maxrel"] = float(((x - fref).abs() / scale).max())
        out[f"{name}_stats"] = bl.last_baseline_stats()
        x = _distinct_grad(rank)
        fn(x, op="avg")
        out[f"{name}_avg_maxrel"] = float(((x - fref / world).abs() / (scale / world)).max())

    # --- PowerSGD (torch's hook): warm-up calls are dense, then low-rank with error feedback
    lr_ref = _ref(_low_rank_grad, world)
    runs = {}
    for ef in (True, False):
        state = bl.make_powersgd_state(rank=4, start_iter=2, error_feedback=ef, warm_start=True)
        methods, errs, wires, total, compressed = [], [], [], torch.zeros_like(lr_ref), 0
        for _ in range(14):
            x = _low_rank_grad(rank)
            bl.powersgd_allreduce(state, x)
            s = bl.last_baseline_stats()
            methods.append(s.method)
            wires.append(s.wire_bytes)
            if s.method == "powersgd":
                compressed += 1
                total += x
                errs.append((_rel(x, lr_ref), _rel(total / compressed, lr_ref)))
        runs[ef] = {"methods": methods, "errs": errs, "wires": wires}
    out["powersgd"] = runs
    x = _low_rank_grad(rank)
    state = bl.make_powersgd_state(rank=4, start_iter=2)
    for _ in range(3):
        x = _low_rank_grad(rank)
        bl.powersgd_allreduce(state, x, op="avg")
    out["powersgd_avg_err"] = _rel(x, lr_ref / world)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request):
    return spawn(_all_checks, request.param, timeout=240)


def _ring(nbytes, world):
    return 2 * (world - 1) * nbytes // world


def test_dense_and_agsparse_equal_the_exact_sum_with_uneven_and_zero_nnz_ranks(results):
    for rank, out in enumerate(results):
        for key in ("dense_equal", "agsparse_row_equal", "agsparse_element_equal", "agsparse_avg_equal",
                    "agsparse_noncontig_equal", "dense_noncontig_equal", "agsparse_zipf_equal",
                    "dense_zipf_equal"):
            assert out[key], (rank, key)


def test_agsparse_sends_lists_padded_to_the_largest_count(results):
    for rank, out in enumerate(results):
        world = out["world"]
        s = out["agsparse_row_stats"]
        counts = [_nnz_rows(r) for r in range(world)]
        assert s.method == "agsparse" and s.local_nnz == counts[rank] and s.max_nnz == max(counts)
        assert s.detail["counts"] == counts
        # counts (int64) + padded rows of (int32 index + DIM float32 values)
        assert s.wire_bytes == (world - 1) * (8 + max(counts) * (4 + DIM * 4))
        assert s.dense_wire_bytes == _ring(VOCAB * DIM * 4, world)
        e = out["agsparse_element_stats"]
        assert e.local_nnz == out["agsparse_local_elements"]
        assert e.wire_bytes == (world - 1) * (8 + e.max_nnz * (4 + 4))
        z = out["agsparse_zero_stats"]
        assert out["agsparse_zero"] and z.max_nnz == 0 and z.wire_bytes == (world - 1) * 8


def test_dense_and_16bit_wire_models_are_the_ring_all_reduce_of_the_payload(results):
    for out in results:
        world = out["world"]
        assert out["dense_stats"].wire_bytes == _ring(VOCAB * DIM * 4, world)
        assert out["fp16_stats"].wire_bytes == out["bf16_stats"].wire_bytes == _ring(VOCAB * DIM * 2, world)
        assert out["fp16_stats"].method == "fp16" and out["bf16_stats"].method == "bf16"


def test_topk_keeps_exactly_the_k_largest_magnitudes_of_each_rank(results):
    for out in results:
        world = out["world"]
        assert out["topk_equal"]
        s = out["topk_stats"]
        assert s.local_nnz == 37 and s.wire_bytes == (world - 1) * 37 * (4 + 4)
        assert 0 < out["topk_err"] < 1  # lossy
        assert out["topk_ratio_k"] == -(-VOCAB * DIM // 100)  # ceil(0.01 x numel)
        assert out["topk_full_equal"]


def test_16bit_casts_are_within_their_rounding_error(results):
    for out in results:
        world = out["world"]
        # each rank's value is rounded once, the sum a few more times: a few half-ulps
        assert out["fp16_maxrel"] < (world + 1) * 2 ** -11, out["fp16_maxrel"]
        assert out["fp16_avg_maxrel"] < (world + 2) * 2 ** -11, out["fp16_avg_maxrel"]
        assert out["bf16_maxrel"] < (world + 1) * 2 ** -8, out["bf16_maxrel"]
        assert out["bf16_avg_maxrel"] < (world + 2) * 2 ** -8, out["bf16_avg_maxrel"]
        assert out["fp16_maxrel"] > 0  # it really went through 16 bits


def test_powersgd_is_torch_hook_dense_while_warming_up_then_low_rank_with_p_and_q_on_the_wire(results):
    n, m, r = 64, 48, 4
    for out in results:
        world = out["world"]
        run = out["powersgd"][True]
        assert run["methods"][:2] == ["powersgd-warmup"] * 2
        assert set(run["methods"][2:]) == {"powersgd"}
        assert run["wires"][0] == _ring(n * m * 4, world)
        assert run["wires"][2] == _ring(n * r * 4, world) + _ring(m * r * 4, world)


def test_powersgd_approximates_a_low_rank_sum_and_error_feedback_drives_the_running_mean_to_it(results):
    for out in results:
        ef, no_ef = out["powersgd"][True]["errs"], out["powersgd"][False]["errs"]
        assert ef[0][0] < 1.0, ef[0]  # one compressed call: a useful approximation
        running = [e[1] for e in ef]
        assert running[-1] < 0.5 * running[0], running  # error feedback: the mean converges
        # plain PowerSGD stalls at the rank-4 truncation error
        assert running[-1] < 0.6 * no_ef[-1][1], (running[-1], no_ef[-1][1])
        assert out["powersgd_avg_err"] < 1.0


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
    assert all(r.numel() == spec.local_rows == 82 for r in rows)
    g, r0 = synthetic.zipf_embedding_grad(spec, 0)
    assert torch.equal(r0, rows[0]) and torch.equal((g != 0).any(1).nonzero().flatten(), r0)
    g2, _ = synthetic.zipf_embedding_grad(spec, 0)
    assert torch.equal(g, g2)  # seeded per (seed, rank, step)
    assert not torch.equal(synthetic.zipf_rows(spec, 0, step=1), r0)
    union = synthetic.union_rows(spec, 4)
    # frequent tokens are shared: fewer union rows than 4 disjoint sets, more than one set
    assert spec.local_rows < union.numel() < 4 * spec.local_rows
    # and more overlap than independent uniform rows would give (expected 1 - (1 - d)^4 of the rows)
    assert union.numel() < 0.95 * (1 - (1 - spec.density) ** 4) * spec.rows
    total = synthetic.exact_sum(spec, 4)
    assert torch.equal(total, sum(synthetic.zipf_embedding_grad(spec, r)[0] for r in range(4)))
    assert torch.equal((total != 0).any(1).nonzero().flatten(), union)
