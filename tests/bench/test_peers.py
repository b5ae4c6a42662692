"""The peers the suites run beside fastdist: each computes what the peer computes, and refuses what it cannot run."""
import pytest
import torch
from torch import nn

from fastdist.bench import peers
from fastdist.distributed import spawn


def test_ddp_sparse_refuses_a_model_whose_embeddings_give_dense_gradients():
    with pytest.raises(ValueError, match="Sequential has no embedding with sparse=True"):
        peers.ddp_sparse(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)))


def test_ddp_sparse_bytes_are_a_ring_all_gatherv_of_index_and_row_lists_the_busiest_rank_forwards():
    rows, width = [3, 5, 4], 2
    per_list = [r * (8 + 4 * width) for r in rows]  # int64 index + float32 row
    # the busiest rank sends its own list and forwards every list it receives but the one it receives last
    assert peers.ddp_sparse_wire_bytes(rows, width) == sum(per_list) - min(per_list) == 144


def _padded_moe_on_ranks(num_experts):
    torch.manual_seed(0)
    layer = peers.PaddedDroplessMoE(8, 16, num_experts, k=2)
    for p in (layer.w1, layer.w2, layer.b1, layer.b2):
        nn.init.normal_(p, std=0.3)
    x = torch.randn(6, 8)
    idx, gates = layer.gates(x)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):  # every token through its top-k experts, weighted by its normalized gates
        for e, g in zip(idx[t].tolist(), gates[t]):
            hidden = nn.functional.gelu(x[t] @ layer.w1[e] + layer.b1[e])
            want[t] += g * (hidden @ layer.w2[e] + layer.b2[e])
    return layer(x), want, layer.stats()["rows_computed_over_routed"]


def test_padded_dropless_moe_on_one_rank_is_every_tokens_gated_sum_of_its_experts():
    [(got, want, computed_over_routed)] = spawn(_padded_moe_on_ranks, 1, 4, backend="gloo", timeout=120)
    assert torch.allclose(got, want, atol=1e-5)
    assert computed_over_routed >= 1  # padded to the largest expert's count


def _padded_moe_construction(num_experts):
    try:
        peers.PaddedDroplessMoE(8, 16, num_experts)
    except ValueError as e:
        return str(e)
    return None


def test_padded_dropless_moe_needs_experts_divisible_by_the_ranks():
    errors = spawn(_padded_moe_construction, 2, 3, backend="gloo", timeout=120)
    assert errors == ["PaddedDroplessMoE: num_experts=3 is not a multiple of the group size 2"] * 2
