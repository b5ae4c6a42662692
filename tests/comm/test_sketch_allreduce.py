"""fastdist.comm.sketch_allreduce: exact where it says lossless, close where it sketches, same on every rank.

The ranks return what each call produced (and, where the reference needs the group, a dense all-reduce of the
same input); the tests compare them.
"""
import gc
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

from fastdist.comm import last_stats, sketch_allreduce
from fastdist.comm import sketch
from fastdist.comm.sketch import HEADER_BITMAP_BYTES, ExactTimings, default_exact_timings
from fastdist.distributed import MismatchError, spawn
from helpers import assert_close

SKETCH_RATIOS = (0.02, 0.1, 0.5)
EF_CALLS = 12
EF_WIDTHS = (1.0, 0.5)  # sketch width as a fraction of the union's values: error feedback applies from 1.0 up
NAN_ROW, NAN_COL, NAN_RANK = 3, 2, 1
EXACT = dict(rtol=0, atol=0)


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


def _exact_sum(world, **kwargs):
    """The sum over ranks of their integer gradients: exact in any order."""
    return sum(_embedding_grad(r, **kwargs) for r in range(world))


def _dense_sum(t):
    ref = t.clone()
    dist.all_reduce(ref)
    return ref


def _rel(x, ref):
    return float((x - ref).norm() / ref.norm())


def _modes_against_dense():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"world": world}
    g = _embedding_grad(rank)
    x = g.clone()
    sketch_allreduce(x, mode="exact")
    out["exact"], out["exact_stats"] = x, last_stats()

    x = g.clone()
    sketch_allreduce(x, mode="sketch", cols=64 * x.numel())  # far wider than the union: no collisions
    out["wide_sketch"] = x

    out["by_ratio"] = {}
    for ratio in SKETCH_RATIOS:
        x = _embedding_grad(rank, integer=False)
        out["float_ref"] = _dense_sum(x)
        sketch_allreduce(x, mode="sketch", ratio=ratio, seed=7)
        out["by_ratio"][ratio] = x

    x = g.clone()
    sketch_allreduce(x, mode="exact", op="avg")
    out["avg"] = x

    # element granularity, non-contiguous input: written back through the view
    base = _embedding_grad(rank).t()
    sketch_allreduce(base, mode="exact", granularity="element")
    out["noncontig"] = base

    # async: the payload reduce is in flight until wait(); the future resolves to the tensor
    x = g.clone()
    handle = sketch_allreduce(x, mode="exact", async_op=True)
    out["async"] = (handle.get_future().wait(), x, handle.is_completed())

    # row-sparse COO gradients come back as COO with the same values
    out["sparse"] = sketch_allreduce(g.to_sparse(1), mode="exact")

    # NaN propagates as in a dense all-reduce
    x = g.clone()
    if rank == NAN_RANK:
        x[NAN_ROW, NAN_COL] = float("nan")
    sketch_allreduce(x, mode="exact")
    out["nan"] = x

    # empty tensor and all-zero tensor
    e = torch.zeros(0, 4)
    sketch_allreduce(e, mode="auto")
    z = torch.zeros(64, 4)
    sketch_allreduce(z, mode="sketch")
    out["zeros"] = (e, z, last_stats().union_units)

    # error feedback: over repeated calls the summed estimates track the summed truth when the sketch is
    # as wide as the union; narrower, it is skipped (it would diverge) and changes nothing
    g = _embedding_grad(rank, integer=False)
    union_values = int((out["float_ref"] != 0).sum())
    out["ef_totals"], out["ef_applied"] = {}, {}
    for width in EF_WIDTHS:
        cols = int(width * union_values)
        for ef in (False, True):
            residual = torch.zeros(3, cols) if ef else None
            total = torch.zeros_like(g)
            for _ in range(EF_CALLS):
                x = g.clone()
                sketch_allreduce(x, mode="sketch", cols=cols, seed=11, residual=residual)
                total += x
            out["ef_totals"][width, ef] = total
            out["ef_applied"][width, ef] = last_stats().error_feedback
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_mode_reduces_like_a_dense_all_reduce_on_every_rank(world_size):
    exact = _exact_sum(world_size)
    for rank, out in enumerate(spawn(_modes_against_dense, world_size, timeout=240)):
        assert_close(out["exact"], exact, f"rank {rank}, exact", **EXACT)
        s = out["exact_stats"]
        assert s.method == "exact" and 0 < s.union_units < s.units, s
        assert s.wire_bytes < s.dense_wire_bytes, s
        assert _rel(out["wide_sketch"], exact) < 1e-5
        float_ref = out["float_ref"]
        errors = [_rel(out["by_ratio"][ratio], float_ref) for ratio in SKETCH_RATIOS]
        assert errors[0] > errors[1] > errors[2] > 0, errors  # lossy, and better as the sketch widens
        outside_union = float_ref.abs().sum(1) == 0
        for ratio, x in out["by_ratio"].items():
            assert_close(x[outside_union], torch.zeros_like(x[outside_union]), f"ratio {ratio}, outside U", **EXACT)
        torch.testing.assert_close(out["avg"], exact / world_size)
        assert_close(out["noncontig"], exact.t(), f"rank {rank}, element granularity, non-contiguous", **EXACT)
        future_value, x, completed = out["async"]
        assert_close(future_value, exact, "the future's value", **EXACT)
        assert_close(x, exact, "the tensor after the future", **EXACT)
        assert completed
        sparse = out["sparse"]
        assert (sparse.is_sparse, sparse.sparse_dim()) == (True, 1)
        assert_close(sparse.to_dense(), exact, "sparse input", **EXACT)
        with_nan = exact.clone()
        with_nan[NAN_ROW, NAN_COL] = float("nan")
        assert_close(out["nan"], with_nan, "NaN on one rank", equal_nan=True, **EXACT)
        empty, zeros, union_units = out["zeros"]
        assert_close(empty, torch.zeros(0, 4), "empty", **EXACT)
        assert_close(zeros, torch.zeros(64, 4), "all zeros", **EXACT)
        assert union_units == 0
        applied, totals = out["ef_applied"], out["ef_totals"]
        assert applied == {(1.0, False): False, (1.0, True): True, (0.5, False): False, (0.5, True): False}
        errors = {k: _rel(total, EF_CALLS * float_ref) for k, total in totals.items()}
        assert errors[1.0, True] < 0.6 * errors[1.0, False], errors
        assert_close(totals[0.5, True], totals[0.5, False], "a sketch too narrow for error feedback", **EXACT)


def _disjoint_rows(rank, units=16, vocab=1024, dim=8):
    """Rank-own rows only: the all-gather of own rows sends less than the union all-reduce."""
    x = torch.zeros(vocab, dim)
    x[rank * units:(rank + 1) * units] = torch.arange(1.0, units * dim + 1).view(units, dim) * (rank + 1)
    return x


def _shared_rows(rank, vocab=1024, dim=8):
    """The same 16 rows on every rank: the union all-reduce sends less."""
    x = torch.zeros(vocab, dim)
    x[0:64:4] = torch.arange(1.0, 16 * dim + 1).view(16, dim) - rank
    return x


def _large_support(rank):
    """Element granularity over more units than the header's bitmap holds."""
    x = torch.zeros(8 * HEADER_BITMAP_BYTES + 40)
    x[rank::97] = rank + 1.0
    return x


LOSSLESS_INPUTS = {"disjoint": _disjoint_rows, "shared": _shared_rows}


def _lossless_collectives():
    rank = dist.get_rank()
    out = {}
    for overlap, make in LOSSLESS_INPUTS.items():
        for op, async_op in (("sum", False), ("avg", True)):
            y = make(rank)
            handle = sketch_allreduce(y, mode="exact", op=op, async_op=async_op,
                                      timings=ExactTimings())  # nothing timed yet: the choice by bytes
            if async_op:
                handle.wait()
            out[overlap, op] = (y, last_stats().exact_collective, last_stats().union_method)
    x = _large_support(rank)
    sketch_allreduce(x, mode="exact", granularity="element")
    out["large"] = (x, last_stats().union_method)
    return out


def test_lossless_mode_gathers_own_rows_when_supports_are_disjoint_and_reduces_the_union_when_shared():
    world = 4
    outs = spawn(_lossless_collectives, world, timeout=120)
    collective = {"disjoint": "allgather-local", "shared": "allreduce-union"}
    for rank, out in enumerate(outs):
        for overlap, make in LOSSLESS_INPUTS.items():
            total = sum(make(r) for r in range(world))
            for op, want in (("sum", total), ("avg", total / world)):
                y, chosen, union_method = out[overlap, op]
                assert_close(y, want, f"rank {rank}, {overlap}, {op}", **EXACT)
                assert (chosen, union_method) == (collective[overlap], "header"), (rank, overlap, op)
                assert_close(y, outs[0][overlap, op][0], f"rank {rank} against rank 0, {overlap}, {op}", **EXACT)
        # a support bitmap too large for the header is exchanged by a collective of its own
        y, union_method = out["large"]
        assert_close(y, sum(_large_support(r) for r in range(world)), f"rank {rank}, large support", **EXACT)
        assert union_method in ("allgather-or", "allreduce-max")


def _timed_exact_choice():
    rank, world = dist.get_rank(), dist.get_world_size()
    timings = ExactTimings()
    steps = []

    def call():
        y = _disjoint_rows(rank)
        sketch_allreduce(y, mode="exact", timings=timings)
        steps.append((last_stats().exact_collective, last_stats().exact_by, y))

    for _ in range(sketch.EXACT_COUNTED_RUNS + 1):
        call()  # by bytes: the gather (its first run is a warm-up, not timed)
    for _ in range(sketch.EXACT_COUNTED_RUNS + 1):
        call()  # the union all-reduce, timed the same way
    call()  # both timed: either, the same on every rank
    for slow in ("allgather-local", "allreduce-union"):
        if rank == world - 1:  # one slow rank decides for all
            for rates in timings.by_class.values():
                rates.rate[slow] = 1.0
        call()
    for rates in timings.by_class.values():
        rates.timed_choices = sketch.EXACT_REPROBE_EVERY - 1
    call()  # the slower one is timed again now and then
    return steps


def test_auto_exact_collective_times_both_then_every_rank_takes_the_one_fastest_on_its_slowest_rank():
    world = 4
    outs = spawn(_timed_exact_choice, world, timeout=120)
    total = sum(_disjoint_rows(r) for r in range(world))
    runs = sketch.EXACT_COUNTED_RUNS + 1
    for rank, out in enumerate(outs):
        choices = [step[:2] for step in out]
        assert choices == [step[:2] for step in outs[0]]  # every rank chose alike
        for i, (_, _, y) in enumerate(out):
            assert_close(y, total, f"rank {rank}, call {i}", **EXACT)  # and every result is exact
        assert choices[:2 * runs] == [("allgather-local", "bytes")] * runs + [("allreduce-union", "explore")] * runs
        both_timed, gather_slow, union_slow, reprobe = choices[2 * runs:]
        assert both_timed[1] == "timed"
        assert gather_slow == ("allreduce-union", "timed") and union_slow == ("allgather-local", "timed")
        assert reprobe == ("allreduce-union", "explore")  # gather is the faster now: the union is re-timed


def _union_all_reduce_timings():
    """What each union all-reduce records into the timings, without and with a channel: (seconds, header_seconds)."""
    recorded = []
    record = sketch.CollectiveRates.record

    def spy(rates, collective, seconds, header_seconds, nbytes):
        recorded.append((collective, seconds, header_seconds))
        return record(rates, collective, seconds, header_seconds, nbytes)

    sketch.CollectiveRates.record = spy
    try:
        for channel in (None, sketch.Channel()):
            for step in range(2):
                sketch_allreduce(_disjoint_rows(dist.get_rank()), mode="exact", exact_collective="allreduce-union",
                                 timings=ExactTimings(), channel=channel, step=step)
    finally:
        sketch.CollectiveRates.record = record
    return recorded


def test_on_a_channel_the_union_all_reduce_is_timed_with_the_header_it_pays_every_call():
    # auto compares it with the folded gather, whose calls carry the header in their payload and are timed whole;
    # without a channel both collectives pay a header, and the header's time is taken as the collective's latency
    for out in spawn(_union_all_reduce_timings, 2, timeout=120):
        assert [c for c, _, _ in out] == ["allreduce-union"] * 4
        assert all(header > 0 for _, _, header in out[:2])
        assert all(header == 0.0 for _, _, header in out[2:])


def _timed_choice_per_size():
    rank = dist.get_rank()
    steps = []

    def call(units):  # `units` disjoint rows per rank: the gather sends less; sizes 16x apart are two classes
        x = _disjoint_rows(rank, units)
        sketch_allreduce(x, mode="exact")
        steps.append((last_stats().exact_collective, last_stats().exact_by, units, x))

    for _ in range(sketch.EXACT_EXPLORE_CALLS):
        call(4)
    for _ in range(sketch.EXACT_EXPLORE_CALLS):
        call(64)
    for _ in range(2):
        call(4)
    return steps


def test_auto_exact_collective_times_each_size_class_of_the_union_apart():
    world = 2
    outs = spawn(_timed_choice_per_size, world, timeout=120)
    runs = sketch.EXACT_COUNTED_RUNS + 1
    for rank, out in enumerate(outs):
        for i, (_, _, units, x) in enumerate(out):
            assert_close(x, sum(_disjoint_rows(r, units) for r in range(world)), f"rank {rank}, call {i}", **EXACT)
        choices = [step[:2] for step in out]
        assert choices == [step[:2] for step in outs[0]]
        small, large, back = choices[:2 * runs + 1], choices[2 * runs + 1:4 * runs + 2], choices[4 * runs + 2:]
        assert small[-1][1] == "timed"
        # the first larger call decides with the smaller size's figures, then the larger size is timed afresh:
        # the call just made counts as the first (untimed) run of the collective it chose
        assert large[0][1] == "timed"
        first = large[0][0]
        assert large[1:] == \
            [("allgather-local", "bytes")] * (runs - (first == "allgather-local")) + \
            [("allreduce-union", "explore")] * (runs - (first == "allreduce-union")) + \
            [(large[-1][0], "timed")]
        assert [by for _, by in back] == ["timed", "timed"]  # a size timed before is not explored again


def _timings_per_group():
    """Plain calls on two groups over the same ranks, then on the first after the second is destroyed."""
    world = dist.get_world_size()
    first, second = dist.new_group(list(range(world))), dist.new_group(list(range(world)))

    def runs(group):
        return sorted(tuple(sorted(rates.runs.items())) for rates in default_exact_timings(group).by_class.values())

    for _ in range(sketch.EXACT_COUNTED_RUNS + 1):
        sketch_allreduce(_disjoint_rows(dist.get_rank()), mode="exact", group=first)
    out = {"first": runs(first), "second_before": runs(second), "world_before": runs(None)}
    sketch_allreduce(_disjoint_rows(dist.get_rank()), mode="exact", group=second)
    out["second_after"], out["first_after"] = runs(second), runs(first)
    released = weakref.ref(default_exact_timings(second))
    dist.destroy_process_group(second)
    del second
    gc.collect()
    out["released"] = released() is None
    dist.destroy_process_group(first)
    return out


def test_plain_calls_on_two_groups_keep_separate_timings_released_with_their_group():
    runs = sketch.EXACT_COUNTED_RUNS + 1
    for out in spawn(_timings_per_group, 2, timeout=120):
        gathered = lambda k: (("allgather-local", k), ("allreduce-union", 0))  # noqa: E731
        # the header's lookup files an empty entry for the class before the first union: (0, 0)
        untouched = (("allgather-local", 0), ("allreduce-union", 0))
        assert out["first"] == sorted([untouched, gathered(runs)])
        assert out["second_before"] == [] and out["world_before"] == []
        assert out["second_after"] == sorted([untouched, gathered(1)])
        assert out["first_after"] == out["first"]
        assert out["released"]


class _StandInGroup:
    """Stands in for a ProcessGroup where only its identity matters (the default timings' key). One allocation per
    object (no __dict__), so that CPython hands a freed one's address to the next."""
    __slots__ = ("__weakref__",)


def test_a_group_at_a_freed_groups_address_starts_with_fresh_timings():
    group = _StandInGroup()
    default_exact_timings(group).for_union(("configuration",), 4096).runs["allgather-local"] = 3
    freed_id = id(group)
    del group
    gc.collect()
    later = [_StandInGroup() for _ in range(100)]  # kept alive, so that each takes a new address
    reused = [group for group in later if id(group) == freed_id]
    if not reused:
        pytest.skip("this interpreter did not reuse the freed object's address")
    assert default_exact_timings(reused[0]).by_class == {}


SPARSE_CASES = {"exact-union": dict(mode="exact", exact_collective="allreduce-union"),
                "exact-gather": dict(mode="exact", exact_collective="allgather-local"),
                "sketch": dict(mode="sketch", ratio=0.3, seed=5),
                "sketch-avg": dict(mode="sketch", ratio=0.3, seed=5, op="avg"),
                "dense": dict(mode="exact", dense_fraction=0.0)}


def _sparse_like_dense():
    rank = dist.get_rank()
    out = {}
    g = _embedding_grad(rank, vocab=700, dim=6, integer=False).view(700, 2, 3)
    with warnings.catch_warnings(record=True) as caught:  # a fresh process: torch warns once, at the first call
        warnings.simplefilter("always")
        for name, kw in SPARSE_CASES.items():
            dense = g.clone()
            sketch_allreduce(dense, **kw)
            got = sketch_allreduce(g.to_sparse(1), **kw)
            out[name] = (got, dense, last_stats().method)
    out["warnings"] = [str(w.message) for w in caught]
    cols = int((_dense_sum(g) != 0).sum())  # as wide as the union's values: error feedback applies
    r_dense, r_sparse = torch.zeros(3, cols), torch.zeros(3, cols)
    for _ in range(3):
        dense = g.clone()
        sketch_allreduce(dense, mode="sketch", cols=cols, seed=2, residual=r_dense)
        got = sketch_allreduce(g.to_sparse(1), mode="sketch", cols=cols, seed=2, residual=r_sparse)
    out["ef"] = (got, dense, r_sparse, r_dense, last_stats().error_feedback)
    return out


def test_sparse_coo_gradients_reduce_to_exactly_what_their_dense_form_reduces_to_in_every_mode():
    for rank, out in enumerate(spawn(_sparse_like_dense, 2, timeout=120)):
        assert out["warnings"] == [], out["warnings"]  # its sparse results are built valid: no invariant warning
        for name, kw in SPARSE_CASES.items():
            got, dense, method = out[name]
            assert (got.is_sparse, got.is_coalesced(), got.shape) == (True, True, dense.shape), name
            assert_close(got.to_dense(), dense, f"rank {rank}, {name}", **EXACT)
            assert method == ("dense" if kw.get("dense_fraction") == 0.0 else kw["mode"]), name
        got, dense, r_sparse, r_dense, error_feedback = out["ef"]
        assert_close(got.to_dense(), dense, f"rank {rank}, error feedback: result", **EXACT)
        assert_close(r_sparse, r_dense, f"rank {rank}, error feedback: residual", **EXACT)
        assert error_feedback


AUTO_CASES = {  # name: (density, ratio, max_sketch_load)
    "sparse": (0.02, 0.05, 1.0), "narrow-sketch": (0.2, 0.01, 1.0), "allowed-sketch": (0.2, 0.01, 50.0),
    "dense": (0.9, 0.05, 1.0)}


def _auto_choices():
    rank = dist.get_rank()
    picks = {}
    for name, (density, ratio, load) in AUTO_CASES.items():
        g = _embedding_grad(rank, vocab=1024, dim=8, density=density, integer=False, seed=3)
        ref = _dense_sum(g)
        sketch_allreduce(g, mode="auto", ratio=ratio, max_sketch_load=load)
        picks[name] = (last_stats().method, g, ref)
    return picks


def test_auto_chooses_identically_on_every_rank_and_never_picks_a_sketch_too_narrow_to_decode():
    results = spawn(_auto_choices, 4, timeout=240)
    methods = [{name: pick[0] for name, pick in r.items()} for r in results]
    assert methods == [methods[0]] * len(results)
    assert methods[0] == {"sparse": "exact", "dense": "dense",
                          "narrow-sketch": "exact",  # cheaper on the wire, but outside the error budget
                          "allowed-sketch": "sketch"}  # a looser budget lets auto take it
    for r in results:
        errors = {name: _rel(r[name][1], r[name][2]) for name in ("sparse", "dense", "narrow-sketch")}
        assert all(e < 1e-6 for e in errors.values()), errors


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


def _channel_calls():
    """Calls through one Channel, each against a dense all-reduce of the same input: (what each call used, results,
    references). The inputs: disjoint-enough supports (the gather of own rows is chosen), then one rank's support
    growing past the folded gather's capacity, then a new shape on every rank, then row-sparse COO tensors."""
    rank = dist.get_rank()
    channel = sketch.Channel()
    used, results, refs = [], [], []
    inputs = [_embedding_grad(rank, seed=s) for s in range(4)]
    inputs.append(_embedding_grad(rank, seed=4, density=0.05 + 0.25 * rank))  # rank 1: 4x its rows: past capacity
    inputs += [_embedding_grad(rank, vocab=600, seed=s) for s in (5, 6)]  # a new layout on every rank alike
    inputs += [_embedding_grad(rank, vocab=600, seed=s).to_sparse(1) for s in (7, 8)]
    for x in inputs:
        ref = _dense_sum(x.to_dense())
        y = sketch_allreduce(x.clone() if not x.is_sparse else x, mode="exact", channel=channel)
        s = last_stats()
        used.append((s.union_method, s.exact_collective, s.wire_bytes))
        results.append(y.to_dense())
        refs.append(ref)
    return used, results, refs


def test_a_channel_folds_the_header_into_the_gather_of_own_rows_and_stays_exact():
    for used, results, refs in spawn(_channel_calls, 2, timeout=120):
        for i, (y, ref) in enumerate(zip(results, refs)):
            assert_close(y, ref, f"call {i}", **EXACT)
        methods = [u[0] for u in used]
        assert [u[1] for u in used] == ["allgather-local"] * len(used)
        # first call: a header of its own; then one collective per call; a new layout (another shape, sparse
        # instead of dense) on every rank: a header again, then folded
        assert methods == ["header", "folded", "folded", "folded", "folded", "header", "folded", "header", "folded"]
        assert used[4][2] > used[3][2]  # rows past the capacity went in a second gather


def _channel_disagreement(kind):
    """Two folded calls, then one rank changes `kind` in the third: every rank must raise, never hang."""
    rank = dist.get_rank()
    channel = sketch.Channel()
    try:
        for call in range(4):
            kwargs = dict(mode="exact", ratio=0.1, channel=channel, step=call)
            x = _embedding_grad(rank, seed=call)
            if call >= 2 and rank == 1:
                if kind == "ratio":
                    kwargs["ratio"] = 0.2
                elif kind == "shape":
                    x = torch.cat([x, x[:3]])
                elif kind == "call number":
                    kwargs["step"] = call + 1
            sketch_allreduce(x, **kwargs)
            assert call < 2 or last_stats().union_method == "folded"
    except MismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["ratio", "shape", "call number"])
def test_a_folded_call_still_raises_on_every_rank_naming_what_one_rank_changed(kind):
    for msg in spawn(_channel_disagreement, 2, kind, timeout=120):
        assert msg is not None and kind in msg and "rank 1" in msg, msg
