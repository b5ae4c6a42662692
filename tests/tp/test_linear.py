"""fastdist.tp Column/RowParallelLinear: outputs and gradients equal the single-process layers (weights sharded
from the same full weights) for every chunk count, ragged token counts, with and without sequence parallelism,
on 2 and 4 ranks; the collectives issued are the ones the overlap schedule says; bad shapes raise clearly.
What runs on the ranks is in tp_on_ranks.py."""
import pytest
import torch
import torch.nn.functional as F
from fastdist.tp import chunk_bounds
from fastdist.tp.cost import UNCALIBRATED_CHUNKS
from fastdist.tp.linear import UNCALIBRATED_AUTO_WARNING
from helpers import assert_close
from tp_on_ranks import (CHUNKS, COLLECTIVES_FEATURES, COLLECTIVES_ROWS, TOLERANCE, gather_split_case, mlp_case,
                         shard)


def test_chunk_bounds_cover_the_rows_with_sizes_differing_by_at_most_one():
    for n in (1, 7, 8, 37, 100):
        for k in range(1, min(n, 9) + 1):
            bounds = chunk_bounds(n, k)
            sizes = [b - a for a, b in bounds]
            assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _single_process_mlp(world, sequence_parallel):
    fc1, fc2, x, residual, weight_out = mlp_case(world, sequence_parallel)
    x, residual = x.requires_grad_(), residual.requires_grad_()
    out = fc2(F.gelu(fc1(x), approximate="tanh")) + residual
    (out * weight_out).sum().backward()
    return {"output": out.detach(), "input_grad": x.grad, "residual_grad": residual.grad,
            "column_weight_grad": fc1.weight.grad, "column_bias_grad": fc1.bias.grad,
            "row_weight_grad": fc2.weight.grad, "row_bias_grad": fc2.bias.grad}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
def test_column_then_row_parallel_equal_the_single_process_mlp_for_k_1_2_3_4_8_and_ragged_tokens(tp_ranks, world,
                                                                                                 sequence_parallel):
    want = _single_process_mlp(world, sequence_parallel)
    rows = 0 if sequence_parallel else None  # sequence parallelism: each rank holds its share of the tokens
    # the dimension along which each rank holds its part (None: all of it)
    held = {"output": rows, "input_grad": rows, "residual_grad": rows, "column_weight_grad": 0,
            "column_bias_grad": 0, "row_weight_grad": 1, "row_bias_grad": None}
    for rank, by_chunks in enumerate(tp_ranks(world, "mlp_sp" if sequence_parallel else "mlp")):
        assert list(by_chunks) == CHUNKS
        for k, got in by_chunks.items():
            for name, dim in held.items():
                assert_close(got[name], shard(want[name], world, rank, dim), f"rank {rank} of {world}, k={k}, {name}",
                             **TOLERANCE)


@pytest.mark.parametrize("world", [2, 4])
def test_gather_output_and_replicated_row_input_equal_the_single_process_layers(tp_ranks, world):
    a, b, x = gather_split_case(world)
    x.requires_grad_()
    gathered = a(x)
    out = b(gathered)
    out.square().sum().backward()
    want = {"gathered": gathered.detach(), "output": out.detach(), "input_grad": x.grad,
            "column_weight_grad": a.weight.grad, "row_weight_grad": b.weight.grad}
    held = {"gathered": None, "output": None, "input_grad": None, "column_weight_grad": 0, "row_weight_grad": 1}
    for rank, got in enumerate(tp_ranks(world, "gather_split")):
        for name, dim in held.items():
            assert_close(got[name], shard(want[name], world, rank, dim), f"rank {rank} of {world}, {name}", **TOLERANCE)


def test_chunked_linears_issue_one_collective_per_chunk_in_the_right_phase(tp_ranks):
    logs = tp_ranks(2, "collectives")[0]
    # Each linear's forward exchanges its row count once (8 bytes per rank, not a tensor-parallel collective).
    for sp in (False, True):
        for k in (1, 3):
            checks = [(phase, numel) for kind, phase, _, numel in logs[sp, k][0] if kind == "token_count"]
            assert checks == [("forward", 2), ("forward", 2)]
    logs = {key: ([r for r in records if r[0] != "token_count"], in_flight)
            for key, (records, in_flight) in logs.items()}
    # No sequence parallelism: row forward all-reduces its output [rows, features] in k chunks (all in flight at
    # once), column backward all-reduces the input gradient [rows, features] in k chunks; nothing else.
    activation = COLLECTIVES_ROWS * COLLECTIVES_FEATURES
    for k in (1, 3):
        records, in_flight = logs[False, k]
        assert [(kind, phase, site) for kind, phase, site, _ in records] == \
            [("all_reduce", "forward", "row.forward")] * k + [("all_reduce", "backward", "column.backward")] * k
        assert sum(n for *_, n in records[:k]) == activation and sum(n for *_, n in records[k:]) == activation
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
    m = tp_ranks(2, "bad_shapes")[0]
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
    for r in tp_ranks(2, "auto_chunks"):
        assert r["uncalibrated"] == UNCALIBRATED_CHUNKS and r["few_rows"] == 3  # never more chunks than rows
        # the unmeasured default is said, once, with what to do instead
        assert r["uncalibrated_warnings"] == [UNCALIBRATED_AUTO_WARNING]
        assert "no calibrated cost model" in UNCALIBRATED_AUTO_WARNING and "cache=" in UNCALIBRATED_AUTO_WARNING
        assert r["mismatch"] is not None and "overlap_chunks for 64 rows" in r["mismatch"]


def test_ranks_given_different_token_counts_raise_on_every_rank_instead_of_aborting(tp_ranks):
    ranks = tp_ranks(2, "token_mismatch")
    # rank r passes 10 + 2r rows: every rank raises MismatchError naming each rank's count, before any collective of
    # mismatched size, whether the chunk count is fixed or automatic, for either linear, under sequence parallelism
    # (rows 20 and 24), and when the other rank's row count was already seen
    counts = {"row_fixed_chunks": "rank 0: 10; rank 1: 12", "row_auto_chunks": "rank 0: 10; rank 1: 12",
              "column": "rank 0: 10; rank 1: 12", "row_sequence_parallel": "rank 0: 20; rank 1: 24",
              "after_a_matching_call": "rank 0: 10; rank 1: 12"}
    for rank, got in enumerate(ranks):
        for case, shown in counts.items():
            kind, message = got[case]
            assert kind == "MismatchError", (rank, case, message)
            assert "input rows (tokens" in message and f"({shown})" in message, (rank, case, message)
    # a wrong width on rank 1 alone: rank 1 says what is wrong with its input, rank 0 that rank 1's was invalid
    assert ranks[0]["bad_input_on_one_rank"] == (
        "MismatchError", "fastdist: 'RowParallelLinear input rows (tokens; every rank must pass the same number)' "
        "differs across ranks (rank 0: 10; rank 1: invalid input)")
    assert ranks[1]["bad_input_on_one_rank"] == (
        "ValueError", "fastdist: RowParallelLinear input must have 4 input features per rank in its last dimension, "
                      "got shape [10, 5]")
    # the group is still usable: a matching call afterwards gives both ranks the same reduced output
    torch.testing.assert_close(ranks[0]["matching_output"], ranks[1]["matching_output"])


@pytest.mark.slow
def test_linears_under_torch_compile_fullgraph_give_the_eager_outputs_and_gradients(tp_ranks):
    # torch.compile(fullgraph=True) of Column -> Row (2 chunks) and of the sequence-parallel pair, forward and
    # backward, on gloo: the functional collectives give what the eager asynchronous ones give
    for rank, got in enumerate(tp_ranks(2, "compiled")):
        assert set(got["compiled"]) == set(got["eager"])
        for name, eager in got["eager"].items():
            assert_close(got["compiled"][name], eager, f"rank {rank}: {name}", **TOLERANCE)
