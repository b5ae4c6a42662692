"""fastdist.tp.OverlappedTransformerBlock (the Oases schedule) and parallelize(GPTBlock): the same function and
gradients as the single-process GPTBlock on 2 and 4 ranks, with and without recompute; the collectives per layer
per step are the ones the schedule promises. What runs on the ranks is in tp_on_ranks.py."""
import pytest
import torch
from fastdist.tp import GPTBlock
from helpers import assert_close
from tp_on_ranks import TOLERANCE, oases_case, parallelize_case, reference_block, shard


def _single_process_block(x, weight):
    """The reference block after one step on ``x``: (block with its gradients, output, input gradient)."""
    block = reference_block()
    x = x.clone().requires_grad_()
    out = block(x)
    (out * weight).sum().backward()
    return block, out.detach(), x.grad


@pytest.mark.parametrize("world", [2, 4])
def test_oases_block_equals_the_single_process_block_with_and_without_recompute(tp_ranks, world):
    ref, out, input_grad = _single_process_block(*oases_case())
    # each Oases parameter's gradient: the reference's, and the dimension along which a rank holds its part
    # (column-parallel qkv and fc1 by rows, row-parallel proj and fc2 by columns; None: replicated)
    held = {"attn.qkv.weight": 0, "attn.qkv.bias": 0, "attn.proj.weight": 1, "mlp.fc1.weight": 0, "mlp.fc1.bias": 0,
            "mlp.fc2.weight": 1}
    want = {"output": (out, None), "input_grad": (input_grad, None),
            **{name: (p.grad, held.get(name)) for name, p in ref.named_parameters()}}
    for rank, by_recompute in enumerate(tp_ranks(world, "oases_block")):
        for recompute, got in by_recompute.items():
            assert set(got) == set(want)
            for name, (full, dim) in want.items():
                assert_close(got[name], shard(full, world, rank, dim),
                             f"rank {rank} of {world}, recompute={recompute}, {name}", **TOLERANCE)


@pytest.mark.parametrize("world", [2, 4])
def test_parallelize_turns_a_gpt_block_into_an_equivalent_tensor_parallel_one(tp_ranks, world):
    ref, out, input_grad = _single_process_block(*parallelize_case())
    want = {"output": (out, None), "input_grad": (input_grad, None), "fc1_weight_grad": (ref.mlp.fc1.weight.grad, 0),
            "proj_weight_grad": (ref.attn.proj.weight.grad, 1), "ln1_weight_grad": (ref.ln1.weight.grad, None)}
    for rank, by_chunks in enumerate(tp_ranks(world, "parallelized_block")):
        for k, got in by_chunks.items():
            assert (got["qkv_type"], got["fc2_type"]) == ("ColumnParallelLinear", "RowParallelLinear")
            for name, (full, dim) in want.items():
                assert_close(got[name], shard(full, world, rank, dim), f"rank {rank} of {world}, k={k}, {name}",
                             **TOLERANCE)


@pytest.mark.parametrize("world", [2])
def test_oases_block_loads_a_gpt_block_state_dict_and_gathers_one_back(tp_ranks, world):
    ref = reference_block()
    x, _ = oases_case()
    with torch.no_grad():
        out = ref(x)
    for rank, got in enumerate(tp_ranks(world, "oases_state_dict")):
        assert got["keys"] == sorted(ref.state_dict())  # the same names: ln1.weight, attn.qkv.weight, ...
        assert_close(got["output"], out, f"rank {rank}: output after load_state_dict(GPTBlock's)", **TOLERANCE)
        for name, value in ref.state_dict().items():
            assert torch.equal(got["gathered"][name], value), f"rank {rank}: {name} gathered by full_state_dict"


def test_megatron_checkpointing_all_reduces_5_activations_per_layer_and_oases_recompute_4_and_recomputation_checks_no_row_counts(tp_ranks):
    counts = tp_ranks(2, "block_counts")[0]
    assert counts["megatron"] == {"forward": 2, "backward": 2, "recompute": 0}
    # torch's checkpoint stops recomputing once the MLP's GEMM has saved its input again: nothing saved needs the
    # MLP's all-reduced output, so recomputation all-reduces the attention's output only.
    assert counts["megatron_checkpoint"] == {"forward": 2, "backward": 2, "recompute": 1}
    assert sum(counts["megatron_checkpoint"].values()) == 5
    # Each of the 4 linears checks its row count once per forward; the recomputed forward repeats checked rows.
    assert counts["megatron_token_counts"] == {"forward": 4, "backward": 0, "recompute": 0}
    assert counts["megatron_checkpoint_token_counts"] == {"forward": 4, "backward": 0, "recompute": 0}
    for recompute in (False, True):
        assert counts[f"oases_recompute={recompute}"] == {"forward": 2, "backward": 2, "recompute": 0}
        # Two sub-batches: each logical all-reduce is two calls, 8 per layer, never two in flight.
        assert counts[f"oases_recompute={recompute}_calls"] == 2 * 8
        assert counts[f"oases_recompute={recompute}_max_in_flight"] == 1


def test_oases_issues_its_all_reduces_in_the_schedule_order(tp_ranks):
    # Forward: A then B attention, A then B MLP; backward: B then A for fc1's input gradient, then B then A
    # for qkv's. A is the first 2 sequences of the batch of 3, B the last one.
    assert tp_ranks(2, "oases_order")[0] == [
        ("oases.forward.attn", 2), ("oases.forward.attn", 1), ("oases.forward.mlp", 2), ("oases.forward.mlp", 1),
        ("oases.backward.mlp", 1), ("oases.backward.mlp", 2), ("oases.backward.attn", 1), ("oases.backward.attn", 2)]


def test_gpt_block_is_causal_and_pre_layernorm():
    torch.manual_seed(0)
    block = GPTBlock(16, 4)
    x = torch.randn(2, 6, 16)
    y = block(x)
    x2 = x.clone()
    x2[:, 4:] += 1.0  # changing later tokens leaves earlier outputs alone
    torch.testing.assert_close(block(x2)[:, :4], y[:, :4])
    with pytest.raises(ValueError, match="hidden=10 is not divisible by heads=4"):
        GPTBlock(10, 4)


def test_high_priority_nccl_options_exist_exactly_where_torch_has_nccl():
    import torch.distributed as dist

    from fastdist.tp import high_priority_nccl_options

    options = high_priority_nccl_options()
    if dist.is_nccl_available():
        assert options.is_high_priority_stream
    else:
        assert options is None
