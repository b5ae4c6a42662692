"""fastdist.tp Column/RowParallelLinear: outputs and gradients equal the single-process layers (weights sharded
from the same full weights) for every chunk count, ragged token counts, with and without sequence parallelism,
on 2 and 4 ranks; the collectives issued are the ones the overlap schedule says; bad shapes raise clearly."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastdist.distributed import MismatchError, spawn
from fastdist.tp import ColumnParallelLinear, CostModel, RowParallelLinear, chunk_bounds, count_collectives

CHUNKS = [1, 2, 3, 4, 8]
TOL = {"atol": 2e-5, "rtol": 2e-5}


def test_chunk_bounds_cover_the_rows_with_sizes_differing_by_at_most_one():
    for n in (1, 7, 8, 37, 100):
        for k in range(1, min(n, 9) + 1):
            bounds = chunk_bounds(n, k)
            sizes = [b - a for a, b in bounds]
            assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _close(got, want, what):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {dist.get_rank()}: {what}: {m}")


def _shards(t, world, rank, dim):
    return t.chunk(world, dim=dim)[rank]


def _mlp_matches_reference(sequence_parallel):
    """Column(gelu fused) -> Row over every chunk count, ragged tokens; compares every output and gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, ffn = 12, 8 * world
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    # Ragged: 9 x 3 = 27 tokens (not a multiple of any chunk count > 1); under SP the sequence (dim 0) must split
    # over the ranks, so 9 * world rows of 3.
    seq = 9 * world if sequence_parallel else 9
    x = torch.randn(seq, 3, hidden)
    residual = torch.randn(seq, 3, hidden)
    weight_out = torch.randn(seq, 3, hidden)
    xr, rr = x.clone().requires_grad_(), residual.clone().requires_grad_()
    ref = F.gelu(fc1(xr), approximate="tanh")
    ref = fc2(ref) + rr
    (ref * weight_out).sum().backward()
    for k in CHUNKS:
        col = ColumnParallelLinear.from_linear(fc1, None, overlap_chunks=k, sequence_parallel=sequence_parallel,
                                               activation="gelu_tanh")
        row = RowParallelLinear.from_linear(fc2, None, overlap_chunks=k, sequence_parallel=sequence_parallel)
        xs = _shards(x, world, rank, 0) if sequence_parallel else x
        rs = _shards(residual, world, rank, 0) if sequence_parallel else residual
        xs, rs = xs.clone().requires_grad_(), rs.clone().requires_grad_()
        out = row(col(xs), residual=rs)
        want = _shards(ref.detach(), world, rank, 0) if sequence_parallel else ref.detach()
        _close(out, want, f"k={k} output")
        w = _shards(weight_out, world, rank, 0) if sequence_parallel else weight_out
        (out * w).sum().backward()
        want_gx = _shards(xr.grad, world, rank, 0) if sequence_parallel else xr.grad
        want_gr = _shards(rr.grad, world, rank, 0) if sequence_parallel else rr.grad
        _close(xs.grad, want_gx, f"k={k} input grad")
        _close(rs.grad, want_gr, f"k={k} residual grad")
        _close(col.weight.grad, _shards(fc1.weight.grad, world, rank, 0), f"k={k} column weight grad")
        _close(col.bias.grad, _shards(fc1.bias.grad, world, rank, 0), f"k={k} column bias grad")
        _close(row.weight.grad, _shards(fc2.weight.grad, world, rank, 1), f"k={k} row weight grad")
        _close(row.bias.grad, fc2.bias.grad, f"k={k} row bias grad")
    return True


def _gather_and_split_match_reference():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    a, b = torch.nn.Linear(10, 4 * world), torch.nn.Linear(4 * world, 6)
    x = torch.randn(11, 10)
    xr = x.clone().requires_grad_()
    ref = b(a(xr))
    ref.square().sum().backward()
    col = ColumnParallelLinear.from_linear(a, None, gather_output=True, overlap_chunks=3)
    row = RowParallelLinear.from_linear(b, None, input_is_parallel=False, overlap_chunks=2)
    xs = x.clone().requires_grad_()
    mid = col(xs)
    assert mid.shape == (11, 4 * world)
    out = row(mid)
    _close(out, ref.detach(), "output")
    out.square().sum().backward()
    _close(xs.grad, xr.grad, "input grad")
    _close(col.weight.grad, _shards(a.weight.grad, world, rank, 0), "column weight grad")
    _close(row.weight.grad, _shards(b.weight.grad, world, rank, 1), "row weight grad")
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
def test_column_then_row_parallel_equal_the_single_process_mlp_for_every_chunk_count(world, sequence_parallel):
    assert spawn(_mlp_matches_reference, world, sequence_parallel, backend="gloo", timeout=120) == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_gather_output_and_replicated_row_input_equal_the_single_process_layers(world):
    assert spawn(_gather_and_split_match_reference, world, backend="gloo", timeout=120) == [True] * world


def _collectives_issued():
    world = dist.get_world_size()
    out = {}
    torch.manual_seed(2)
    for sp in (False, True):
        for k in (1, 3):
            col = ColumnParallelLinear(8, 4 * world, None, overlap_chunks=k, sequence_parallel=sp)
            row = RowParallelLinear(4 * world, 8, None, overlap_chunks=k, sequence_parallel=sp)
            x = torch.randn(6, 8, requires_grad=True)
            with count_collectives() as log:
                row(col(x)).sum().backward()
            out[sp, k] = [(r.kind, r.phase, r.site, r.numel) for r in log.records], log.max_in_flight
    return out


def test_chunked_linears_issue_one_collective_per_chunk_in_the_right_phase():
    logs = spawn(_collectives_issued, 2, backend="gloo", timeout=120)[0]
    # No sequence parallelism: row forward all-reduces [6, 8] in k chunks (all in flight at once), column
    # backward all-reduces the input gradient [6, 8] in k chunks; nothing else.
    for k in (1, 3):
        records, in_flight = logs[False, k]
        assert [(kind, phase, site) for kind, phase, site, _ in records] == \
            [("all_reduce", "forward", "row.forward")] * k + [("all_reduce", "backward", "column.backward")] * k
        assert sum(n for *_, n in records[:k]) == 6 * 8 and sum(n for *_, n in records[k:]) == 6 * 8
        assert in_flight == k
    # Sequence parallelism: column forward all-gathers the [12, 8] input, row forward reduce-scatters,
    # row backward all-gathers the output gradient (and all-reduces its bias gradient), column backward
    # reduce-scatters the input gradient; k chunks each.
    for k in (1, 3):
        records, _ = logs[True, k]
        sites = [(kind, site) for kind, _, site, _ in records]
        assert sites == [("all_gather", "column.forward")] * k + [("reduce_scatter", "row.forward")] * k + \
            [("all_reduce", "row.bias_grad")] + [("all_gather", "row.backward")] * k + \
            [("reduce_scatter", "column.backward")] * k


def _bad_shapes():
    world = dist.get_world_size()
    messages = {}
    for name, make in {
        "column_out": lambda: ColumnParallelLinear(8, 5, None),
        "row_in": lambda: RowParallelLinear(7, 8, None),
        "bad_chunks": lambda: RowParallelLinear(8, 8, None, overlap_chunks=0),
        "gather_and_sp": lambda: ColumnParallelLinear(8, 8, None, gather_output=True, sequence_parallel=True),
    }.items():
        with pytest.raises(ValueError) as e:
            make()
        messages[name] = str(e.value)
    row = RowParallelLinear(8, 8, None, overlap_chunks=4)
    with pytest.raises(ValueError) as e:
        row(torch.randn(3, 8 // world))
    messages["m_below_k"] = str(e.value)
    with pytest.raises(ValueError) as e:
        row(torch.randn(5, 3))
    messages["features"] = str(e.value)
    sp = RowParallelLinear(8, 8, None, overlap_chunks=1, sequence_parallel=True)
    with pytest.raises(ValueError) as e:
        sp(torch.randn(3, 8 // world))
    messages["sp_rows"] = str(e.value)
    return messages


def test_bad_shapes_raise_clear_errors():
    m = spawn(_bad_shapes, 2, backend="gloo", timeout=60)[0]
    assert m["column_out"] == ("fastdist: ColumnParallelLinear: out_features=5 is not divisible by the "
                               "tensor-parallel world size 2")
    assert m["row_in"] == "fastdist: RowParallelLinear: in_features=7 is not divisible by the tensor-parallel world size 2"
    assert "overlap_chunks must be 'auto' or an int >= 1, got 0" in m["bad_chunks"]
    assert "gather_output and sequence_parallel exclude each other" in m["gather_and_sp"]
    assert m["m_below_k"] == ("fastdist: RowParallelLinear: overlap_chunks=4 needs at least 4 rows (tokens) to "
                              "split, got 3")
    assert "input must have 4 input features per rank in its last dimension, got shape [5, 3]" in m["features"]
    assert "sequence_parallel needs the 3 rows (tokens) to be divisible by the tensor-parallel world size 2" \
        in m["sp_rows"]


def _auto_chunks():
    rank = dist.get_rank()
    out = {}
    row = RowParallelLinear(8, 8, None, overlap_chunks="auto")  # the uncalibrated default model: 4 chunks
    row(torch.randn(10, 4))
    out["uncalibrated"] = row.chunks_for(10)
    row(torch.randn(3, 4))
    out["few_rows"] = row.chunks_for(3)
    # Ranks whose calibrations differ must not silently issue different collectives.
    mine = CostModel(alpha=1e-6 if rank == 0 else 1.0, beta=1e9, gemm_rate=1e9, world_size=2)
    odd = RowParallelLinear(8, 8, None, overlap_chunks="auto", cost_model=mine)
    try:
        odd(torch.randn(64, 4))
        out["mismatch"] = None
    except MismatchError as e:
        out["mismatch"] = str(e)
    return out


def test_auto_chunks_default_to_four_and_a_cross_rank_disagreement_raises_on_every_rank():
    results = spawn(_auto_chunks, 2, backend="gloo", timeout=60)
    for r in results:
        assert r["uncalibrated"] == 4 and r["few_rows"] == 3
        assert r["mismatch"] is not None and "overlap_chunks for 64 rows" in r["mismatch"]
