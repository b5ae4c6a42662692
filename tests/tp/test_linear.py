"""fastdist.tp Column/RowParallelLinear: outputs and gradients equal the single-process layers (weights sharded
from the same full weights) for every chunk count, ragged token counts, with and without sequence parallelism,
on 2 and 4 ranks; the collectives issued are the ones the overlap schedule says; bad shapes raise clearly.
The rank-side halves of these tests are in _checks.py."""
import pytest
from conftest import outcome
from fastdist.tp import chunk_bounds


def test_chunk_bounds_cover_the_rows_with_sizes_differing_by_at_most_one():
    for n in (1, 7, 8, 37, 100):
        for k in range(1, min(n, 9) + 1):
            bounds = chunk_bounds(n, k)
            sizes = [b - a for a, b in bounds]
            assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("check", ["mlp", "mlp_sp"], ids=["no-sp", "sp"])
def test_column_then_row_parallel_equal_the_single_process_mlp_for_k_1_2_3_4_8_and_ragged_tokens(tp_ranks, world,
                                                                                                 check):
    assert outcome(tp_ranks(world), check) == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_gather_output_and_replicated_row_input_equal_the_single_process_layers(tp_ranks, world):
    assert outcome(tp_ranks(world), "gather_split") == [True] * world


def test_chunked_linears_issue_one_collective_per_chunk_in_the_right_phase(tp_ranks):
    logs = outcome(tp_ranks(2), "collectives")[0]
    # No sequence parallelism: row forward all-reduces [6, 8] in k chunks (all in flight at once), column
    # backward all-reduces the input gradient [6, 8] in k chunks; nothing else.
    for k in (1, 3):
        records, in_flight = logs[False, k]
        assert [(kind, phase, site) for kind, phase, site, _ in records] == \
            [("all_reduce", "forward", "row.forward")] * k + [("all_reduce", "backward", "column.backward")] * k
        assert sum(n for *_, n in records[:k]) == 6 * 8 and sum(n for *_, n in records[k:]) == 6 * 8
        assert in_flight == k
    # Sequence parallelism: column forward all-gathers the input as a ring (t - 1 = 1 exchange on 2 ranks), row
    # forward reduce-scatters, row backward all-gathers the output gradient (and all-reduces its bias gradient),
    # column backward reduce-scatters the input gradient; k chunks each.
    for k in (1, 3):
        records, _ = logs[True, k]
        sites = [(kind, site) for kind, _, site, _ in records]
        assert sites == [("ring_exchange", "column.forward")] + [("reduce_scatter", "row.forward")] * k + \
            [("all_reduce", "row.bias_grad")] + [("all_gather", "row.backward")] * k + \
            [("reduce_scatter", "column.backward")] * k


def test_bad_shapes_raise_clear_errors(tp_ranks):
    m = outcome(tp_ranks(2), "bad_shapes")[0]
    assert m["column_out"] == ("fastdist: ColumnParallelLinear: out_features=5 is not divisible by the "
                               "tensor-parallel world size 2")
    assert m["row_in"] == ("fastdist: RowParallelLinear: in_features=7 is not divisible by the tensor-parallel "
                           "world size 2")
    assert "overlap_chunks must be 'auto' or an int >= 1, got 0" in m["bad_chunks"]
    assert "gather_output and sequence_parallel exclude each other" in m["gather_and_sp"]
    assert m["m_below_k"] == ("fastdist: RowParallelLinear: overlap_chunks=4 needs at least 4 rows (tokens) to "
                              "split, got 3")
    assert "input must have 4 input features per rank in its last dimension, got shape [5, 3]" in m["features"]
    assert "sequence_parallel needs the 3 rows (tokens) to be divisible by the tensor-parallel world size 2" \
        in m["sp_rows"]


def test_auto_chunks_default_to_four_and_a_cross_rank_disagreement_raises_on_every_rank(tp_ranks):
    for r in outcome(tp_ranks(2), "auto_chunks"):
        assert r["uncalibrated"] == 4 and r["few_rows"] == 3
        assert r["mismatch"] is not None and "overlap_chunks for 64 rows" in r["mismatch"]
