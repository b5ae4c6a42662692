"""fastdist.comm.sketch_allreduce: exact where it says lossless, close where it sketches, same on every rank."""
import pytest
import torch
import torch.distributed as dist

from fastdist.comm import last_stats, sketch_allreduce
from fastdist.comm import sketch
from fastdist.comm.sketch import HEADER_BITMAP_BYTES
from fastdist.distributed import MismatchError, spawn


def _embedding_grad(rank, vocab=512, dim=16, density=0.05, integer=True, seed=0):
    """A row-sparse gradient whose rows overlap across ranks (a shared hot set plus rank-own rows)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    hot = torch.arange(0, vocab, 37)[: max(1, int(vocab * density / 2))]
    own = torch.randperm(vocab, generator=g)[: max(1, int(vocab * density / 2))]
    rows = torch.unique(torch.cat([hot, own]))
    grad = torch.zeros(vocab, dim)
    values = torch.randint(-8, 9, (rows.numel(), dim), generator=g).float() if integer \
        else torch.randn(rows.numel(), dim, generator=g)
    grad[rows] = values
    return grad


def _dense_sum(t):
    ref = t.clone()
    dist.all_reduce(ref)
    return ref


def _modes_against_dense():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    g = _embedding_grad(rank)
    ref = _dense_sum(g)
    x = g.clone()
    sketch_allreduce(x, mode="exact")
    out["exact_equal"] = torch.equal(x, ref)
    out["exact_stats"] = last_stats()

    x = g.clone()
    sketch_allreduce(x, mode="sketch", cols=64 * x.numel())  # far wider than the union: no collisions
    out["wide_sketch_err"] = float((x - ref).norm() / ref.norm())

    errs = []
    for ratio in (0.02, 0.1, 0.5):
        x = _embedding_grad(rank, integer=False)
        r = _dense_sum(x)
        sketch_allreduce(x, mode="sketch", ratio=ratio, seed=7)
        errs.append(float((x - r).norm() / r.norm()))
        out.setdefault("sketch_zero_outside_union", True)
        out["sketch_zero_outside_union"] &= bool((x[r.abs().sum(1) == 0] == 0).all())
    out["sketch_errs"] = errs

    x = g.clone()
    sketch_allreduce(x, mode="exact", op="avg")
    out["avg_equal"] = torch.allclose(x, ref / world)

    # element granularity, non-contiguous input: written back through the view
    base = _embedding_grad(rank).t()
    r = _dense_sum(base.contiguous())
    sketch_allreduce(base, mode="exact", granularity="element")
    out["noncontig_equal"] = torch.equal(base, r)

    # async: the payload reduce is in flight until wait(); the future resolves to the tensor
    x = g.clone()
    handle = sketch_allreduce(x, mode="exact", async_op=True)
    fut = handle.get_future()
    out["async_equal"] = torch.equal(fut.wait(), ref) and torch.equal(x, ref) and handle.is_completed()

    # row-sparse COO gradients come back as COO with the same values
    sp = g.to_sparse(1)
    res = sketch_allreduce(sp, mode="exact")
    out["sparse_layout"] = res.is_sparse and res.sparse_dim() == 1
    out["sparse_equal"] = torch.equal(res.to_dense(), ref)

    # NaN propagates as in a dense all-reduce
    x = g.clone()
    if rank == 1:
        x[3, 2] = float("nan")
    sketch_allreduce(x, mode="exact")
    out["nan_propagated"] = bool(torch.isnan(x[3, 2])) and int(torch.isnan(x).sum()) == 1

    # empty tensor and all-zero tensor
    e = torch.zeros(0, 4)
    sketch_allreduce(e, mode="auto")
    z = torch.zeros(64, 4)
    sketch_allreduce(z, mode="sketch")
    out["zeros_stay_zero"] = bool((z == 0).all()) and last_stats().union_units == 0

    # error feedback: over repeated calls the summed estimates track the summed truth when the sketch is
    # as wide as the union; narrower, it is skipped (it would diverge) and changes nothing
    g = _embedding_grad(rank, integer=False)
    ref = _dense_sum(g)
    union_values = int((ref != 0).sum())
    out["ef_errs"], out["ef_applied"] = {}, {}
    for width in (1.0, 0.5):
        cols = int(width * union_values)
        for ef in (False, True):
            residual = torch.zeros(3, cols) if ef else None
            total = torch.zeros_like(g)
            for _ in range(12):
                x = g.clone()
                sketch_allreduce(x, mode="sketch", cols=cols, seed=11, residual=residual)
                total += x
            out["ef_errs"][width, ef] = float((total - 12 * ref).norm() / (12 * ref).norm())
            out["ef_applied"][width, ef] = last_stats().error_feedback
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_mode_reduces_like_a_dense_all_reduce_on_every_rank(world_size):
    for rank, out in enumerate(spawn(_modes_against_dense, world_size, timeout=240)):
        assert out["exact_equal"], rank
        s = out["exact_stats"]
        assert s.method == "exact" and 0 < s.union_units < s.units
        assert s.wire_bytes < s.dense_wire_bytes
        assert out["wide_sketch_err"] < 1e-5
        e = out["sketch_errs"]
        assert e[0] > e[1] > e[2] > 0, e  # lossy, and better as the sketch widens
        assert out["sketch_zero_outside_union"]
        assert out["avg_equal"] and out["noncontig_equal"] and out["async_equal"]
        assert out["sparse_layout"] and out["sparse_equal"]
        assert out["nan_propagated"]
        assert out["zeros_stay_zero"]
        e, applied = out["ef_errs"], out["ef_applied"]
        assert applied[1.0, True] and not applied[1.0, False] and not applied[0.5, True]
        assert e[1.0, True] < 0.6 * e[1.0, False], e
        assert e[0.5, True] == e[0.5, False], e


def _lossless_collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    vocab, dim = 1024, 8
    g = torch.Generator().manual_seed(rank)
    for overlap in ("disjoint", "shared"):
        rows = torch.arange(rank * 16, rank * 16 + 16) if overlap == "disjoint" else torch.arange(0, 64, 4)
        x = torch.zeros(vocab, dim)
        x[rows] = torch.randint(-8, 9, (rows.numel(), dim), generator=g).float()
        ref = _dense_sum(x)
        for op, async_op in (("sum", False), ("avg", True)):
            sketch._exact_timings.clear()  # nothing timed yet: the choice by bytes
            y = x.clone()
            handle = sketch_allreduce(y, mode="exact", op=op, async_op=async_op)
            if async_op:
                handle.wait()
            want = ref / world if op == "avg" else ref
            out[overlap, op] = (torch.equal(y, want), last_stats().exact_collective, last_stats().union_method,
                                y.sum().item())
    # a support bitmap too large for the header is exchanged by its own collective
    x = torch.zeros(8 * HEADER_BITMAP_BYTES + 40)
    x[rank::97] = rank + 1.0
    ref = _dense_sum(x)
    sketch_allreduce(x, mode="exact", granularity="element")
    out["large"] = (torch.equal(x, ref), last_stats().union_method)
    return out


def test_lossless_mode_gathers_own_rows_when_supports_are_disjoint_and_reduces_the_union_when_shared():
    outs = spawn(_lossless_collectives, 4, timeout=120)
    for rank, out in enumerate(outs):
        for op in ("sum", "avg"):
            equal, collective, union_method, _ = out["disjoint", op]
            assert equal and collective == "allgather-local" and union_method == "header", (rank, op)
            equal, collective, union_method, _ = out["shared", op]
            assert equal and collective == "allreduce-union" and union_method == "header", (rank, op)
        equal, union_method = out["large"]
        assert equal and union_method in ("allgather-or", "allreduce-max")
    sums = [[v[3] for k, v in out.items() if k != "large"] for out in outs]
    assert all(s == sums[0] for s in sums), sums  # every rank holds the same result


def _timed_exact_choice():
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.zeros(1024, 8)
    x[rank * 16:rank * 16 + 16] = torch.arange(1.0, 129.0).view(16, 8) * (rank + 1)  # disjoint: the gather sends less
    ref = _dense_sum(x)
    steps = []

    def call():
        y = x.clone()
        sketch_allreduce(y, mode="exact")
        steps.append((last_stats().exact_collective, last_stats().exact_by, torch.equal(y, ref)))

    for _ in range(sketch.EXACT_COUNTED_RUNS + 1):
        call()  # by bytes: the gather (its first run is a warm-up, not timed)
    for _ in range(sketch.EXACT_COUNTED_RUNS + 1):
        call()  # the union all-reduce, timed the same way
    call()  # both timed: either, the same on every rank
    for slow, forced in (("allgather-local", "allreduce-union"), ("allreduce-union", "allgather-local")):
        if rank == world - 1:  # one slow rank decides for all
            for timings in sketch._exact_timings.values():
                timings.rate[slow] = 1.0
        call()
        steps.append(forced)
    for timings in sketch._exact_timings.values():
        timings.timed_choices = sketch.EXACT_REPROBE_EVERY - 1
    call()  # the slower one is timed again now and then
    return steps


def test_auto_exact_collective_times_both_then_every_rank_takes_the_one_fastest_on_its_slowest_rank():
    outs = spawn(_timed_exact_choice, 4, timeout=120)
    for out in outs:
        assert out == outs[0]  # every rank chose alike
        assert all(step[2] for step in out if isinstance(step, tuple))  # and every result is exact
        runs = sketch.EXACT_COUNTED_RUNS + 1
        assert [step[:2] for step in out[:2 * runs]] == [("allgather-local", "bytes")] * runs + \
            [("allreduce-union", "explore")] * runs
        out = out[2 * runs:]
        assert out[0][1] == "timed"
        assert out[1][:2] == (out[2], "timed") and out[3][:2] == (out[4], "timed")
        assert out[5][:2] == ("allreduce-union", "explore")  # gather is the faster now: the union is re-timed


def _timed_choice_per_size():
    rank = dist.get_rank()
    steps = []

    def call(units):  # `units` disjoint rows per rank: the gather sends less; sizes 16x apart are two classes
        x = torch.zeros(1024, 8)
        x[rank * units:(rank + 1) * units] = 1.0 + rank
        ref = _dense_sum(x)
        sketch_allreduce(x, mode="exact")
        steps.append((last_stats().exact_collective, last_stats().exact_by, torch.equal(x, ref)))

    for _ in range(sketch.EXACT_EXPLORE_CALLS):
        call(4)
    for _ in range(sketch.EXACT_EXPLORE_CALLS):
        call(64)
    for _ in range(2):
        call(4)
    return steps


def test_auto_exact_collective_times_each_size_class_of_the_union_apart():
    outs = spawn(_timed_choice_per_size, 2, timeout=120)
    runs = sketch.EXACT_COUNTED_RUNS + 1
    for out in outs:
        assert out == outs[0] and all(step[2] for step in out)
        small, large, back = out[:2 * runs + 1], out[2 * runs + 1:4 * runs + 2], out[4 * runs + 2:]
        assert small[-1][1] == "timed"
        # the first larger call decides with the smaller size's figures, then the larger size is timed afresh:
        # the call just made counts as the first (untimed) run of the collective it chose
        assert large[0][1] == "timed"
        first = large[0][0]
        assert [s[:2] for s in large[1:]] == \
            [("allgather-local", "bytes")] * (runs - (first == "allgather-local")) + \
            [("allreduce-union", "explore")] * (runs - (first == "allreduce-union")) + \
            [(large[-1][0], "timed")]
        assert [s[1] for s in back] == ["timed", "timed"]  # a size timed before is not explored again


def _sparse_like_dense():
    rank = dist.get_rank()
    out = {}
    g = _embedding_grad(rank, vocab=700, dim=6, integer=False).view(700, 2, 3)
    for name, kw in {"exact-union": dict(mode="exact", exact_collective="allreduce-union"),
                     "exact-gather": dict(mode="exact", exact_collective="allgather-local"),
                     "sketch": dict(mode="sketch", ratio=0.3, seed=5),
                     "sketch-avg": dict(mode="sketch", ratio=0.3, seed=5, op="avg"),
                     "dense": dict(mode="exact", dense_fraction=0.0)}.items():
        dense = g.clone()
        sketch_allreduce(dense, **kw)
        got = sketch_allreduce(g.to_sparse(1), **kw)
        out[name] = (got.is_sparse and got.is_coalesced() and got.shape == g.shape, torch.equal(got.to_dense(), dense),
                     last_stats().method)
    cols = int((_dense_sum(g) != 0).sum())  # as wide as the union's values: error feedback applies
    r_dense, r_sparse = torch.zeros(3, cols), torch.zeros(3, cols)
    for _ in range(3):
        dense = g.clone()
        sketch_allreduce(dense, mode="sketch", cols=cols, seed=2, residual=r_dense)
        got = sketch_allreduce(g.to_sparse(1), mode="sketch", cols=cols, seed=2, residual=r_sparse)
    out["ef"] = (torch.equal(got.to_dense(), dense), torch.equal(r_dense, r_sparse), last_stats().error_feedback)
    return out


def test_sparse_coo_gradients_reduce_to_exactly_what_their_dense_form_reduces_to_in_every_mode():
    for out in spawn(_sparse_like_dense, 2, timeout=120):
        for name in ("exact-union", "exact-gather", "sketch", "sketch-avg", "dense"):
            layout_ok, equal, method = out[name]
            assert layout_ok and equal, name
            assert method == {"sketch": "sketch", "sketch-avg": "sketch", "dense": "dense"}.get(name, "exact")
        assert out["ef"] == (True, True, True)


def _auto_choices():
    rank = dist.get_rank()
    picks = {}
    cases = [("sparse", 0.02, 0.05, 1.0), ("narrow-sketch", 0.2, 0.01, 1.0), ("allowed-sketch", 0.2, 0.01, 50.0),
             ("dense", 0.9, 0.05, 1.0)]
    for name, density, ratio, load in cases:
        g = _embedding_grad(rank, vocab=1024, dim=8, density=density, integer=False, seed=3)
        ref = _dense_sum(g)
        sketch_allreduce(g, mode="auto", ratio=ratio, max_sketch_load=load)
        s = last_stats()
        picks[name] = (s.method, float((g - ref).norm() / ref.norm()))
    return picks


def test_auto_chooses_identically_on_every_rank_and_never_picks_a_sketch_too_narrow_to_decode():
    results = spawn(_auto_choices, 4, timeout=240)
    per_rank = [{k: v[0] for k, v in r.items()} for r in results]
    assert all(m == per_rank[0] for m in per_rank)
    methods = per_rank[0]
    assert methods["sparse"] == "exact" and methods["dense"] == "dense"
    assert methods["narrow-sketch"] == "exact"  # cheaper on the wire, but outside the error budget
    assert methods["allowed-sketch"] == "sketch"  # a looser budget lets auto take it
    for r in results:
        assert r["sparse"][1] < 1e-6 and r["dense"][1] < 1e-6 and r["narrow-sketch"][1] < 1e-6


def _mismatch(kind):
    rank = dist.get_rank()
    x = torch.zeros(64 + (kind == "shape" and rank == 1), 4)
    x[1] = 1.0
    try:
        sketch_allreduce(x, mode="sketch", seed=1 + (kind == "seed" and rank == 0), cols=32)
        return None
    except MismatchError as e:
        return str(e)


@pytest.mark.parametrize("kind", ["seed", "shape"])
def test_ranks_that_disagree_on_configuration_all_raise_naming_it_without_hanging(kind):
    for msg in spawn(_mismatch, 2, kind, timeout=120):
        assert msg is not None and "sketch_allreduce configuration" in msg and "rank 1" in msg


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(tensor=torch.zeros(4, dtype=torch.int64)), TypeError, "floating-point"),
    (dict(ratio=0.0), ValueError, "ratio must be in"),
    (dict(ratio=1.5), ValueError, "ratio must be in"),
    (dict(cols=0), ValueError, "cols must be >= 1"),
    (dict(ratio=0.1, cols=4), ValueError, "either ratio or cols"),
    (dict(rows=0), ValueError, "rows must be >= 1"),
    (dict(mode="fast"), ValueError, "mode must be one of"),
    (dict(op="max"), ValueError, "op must be"),
    (dict(granularity="col"), ValueError, "granularity must be one of"),
    (dict(exact_collective="ring"), ValueError, "exact_collective must be one of"),
    (dict(tensor=torch.sparse_coo_tensor([[-2, 1]], torch.ones(2, 2), (8, 2), check_invariants=False)), ValueError,
     r"row indices must be in \[0, 8\), got values in \[-2, 1\]"),
    (dict(tensor=torch.sparse_coo_tensor([[3, 8]], torch.ones(2, 2), (8, 2), check_invariants=False)), ValueError,
     r"row indices must be in \[0, 8\), got values in \[3, 8\]"),
])
def test_bad_arguments_are_rejected_before_any_communication(kwargs, error, text):
    args = {"tensor": torch.zeros(8, 2)}
    args.update(kwargs)
    with pytest.raises(error, match=text):
        sketch_allreduce(args.pop("tensor"), **args)
