"""tp.parallelize on transformer blocks written as nanoGPT, Hugging Face GPT-2 (Conv1D, fused [q|k|v]) and
Hugging Face LLaMA (separate q/k/v with grouped-query heads, rotary embeddings, SwiGLU MLP) write them, and on a
user's fused-qkv attention named in a dict plan: one training step's output, input gradient and every parameter's
gradient, gathered from the ranks back to the full shapes, equal the single-process model's. Attentions that cannot
be split into whole heads are refused with a message saying why. What runs on the ranks is in
user_models_on_ranks.py."""
import pytest
import torch
from helpers import assert_close
from user_models_on_ranks import USER_MODELS, user_model_case

TOLERANCE = {"atol": 5e-5, "rtol": 5e-5}
# How the ranks hold each parameter, by the end of its name: ("rows", p): the output features of a column-parallel
# linear whose output is p blocks, each rank holding its slice of every block (a fused [q | k | v] is 3: each rank
# has its own heads' q, k and v); ("cols",): the input features of a row-parallel linear; anything else: replicated.
LAYOUTS = {
    ("attn.c_attn.weight", "attn.c_attn.bias", "attention.qkv.weight", "attention.qkv.bias"): ("rows", 3),
    ("mlp.c_fc.weight", "mlp.c_fc.bias", "q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
     "up_proj.weight"): ("rows", 1),
    ("c_proj.weight", "o_proj.weight", "down_proj.weight", "attention.out.weight"): ("cols",),
}


def _layout(name):
    return next((layout for ends, layout in LAYOUTS.items() if name.endswith(ends)), ("replicated",))


def _gathered(per_rank, layout):
    """The full tensor from every rank's part of it."""
    if layout[0] == "cols":
        return torch.cat(per_rank, dim=1)
    parts = layout[1]
    return torch.cat([torch.cat([t.chunk(parts)[b] for t in per_rank]) for b in range(parts)])


def _single_process_step(name):
    model, x, weight = user_model_case(name)
    x.requires_grad_()
    out = model(x)
    (out * weight).sum().backward()
    return model, out.detach(), x.grad


@pytest.mark.parametrize("name", USER_MODELS)
def test_parallelized_user_model_step_equals_the_single_process_step_on_2_ranks(tp_ranks, name):
    _assert_parallel_step_equals_single_process(tp_ranks, 2, name)


def test_parallelized_nanogpt_step_equals_the_single_process_step_on_4_ranks_one_head_each(tp_ranks):
    _assert_parallel_step_equals_single_process(tp_ranks, 4, "nanogpt")


def _assert_parallel_step_equals_single_process(tp_ranks, world, name):
    ref, out, input_grad = _single_process_step(name)
    ranks = tp_ranks(world, f"user_model:{name}")
    for rank, got in enumerate(ranks):
        assert_close(got["output"], out, f"{name}, rank {rank}: output", **TOLERANCE)
        assert_close(got["input_grad"], input_grad, f"{name}, rank {rank}: input gradient", **TOLERANCE)
    # every column-parallel/row-parallel pair of the model was sharded (nothing left replicated by accident)
    column_rows = [n for n, layout in ((n, _layout(n + ".weight")) for n in ranks[0]["parallel"]) if layout[0] == "rows"]
    assert len(ranks[0]["parallel"]) == len([n for n, _ in ref.named_parameters()
                                              if n.endswith(".weight") and _layout(n)[0] != "replicated"])
    assert column_rows, "no column-parallel linear found"
    for pname, p in ref.named_parameters():
        want = p.grad.t() if name == "gpt2" and _layout(pname)[0] != "replicated" and p.dim() == 2 else p.grad
        layout = _layout(pname)
        if layout[0] == "replicated":
            for rank, got in enumerate(ranks):
                assert_close(got["grads"][pname], want, f"{name}, rank {rank}: {pname} gradient", **TOLERANCE)
        else:
            full = _gathered([got["grads"][pname] for got in ranks], layout)
            assert_close(full, want, f"{name}: {pname} gradient gathered from {world} ranks", **TOLERANCE)


def test_an_attention_that_cannot_hold_whole_heads_per_rank_is_refused_with_the_reason(tp_ranks):
    for got in tp_ranks(2, "refusals"):
        # LLaMA with one key/value head (multi-query): sharding k_proj would split that head between the ranks
        assert got["multi_query"] is not None
        assert "layers.0.self_attn (num_key_value_heads=1) has 1 key/value head(s), not divisible by the " \
               "tensor-parallel world size 2: sharding it would split a head" in got["multi_query"]
        assert "Keep this attention replicated" in got["multi_query"]
        # a fused qkv whose heads are sized from the input's width: no whole-head layout reproduces it
        assert got["width_from_input"] is not None
        assert "does not reproduce the module with any layout of whole heads" in got["width_from_input"]
        assert "q.view(B, T, -1, head_dim)" in got["width_from_input"]
