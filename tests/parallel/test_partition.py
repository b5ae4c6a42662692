"""The partitioner on one process: its stages, run one after the other, compute the user's model (forward and every
gradient) for models written as fastdist, nanoGPT and Hugging Face write them; the split it chooses is the best
contiguous one; ``split_points=`` overrides it; a model it cannot cut is refused with what to do."""
import itertools

import pytest
import torch
from engine_ranks import VOCAB, make_model
from torch import nn

from fastdist.parallel import partition as P


def _tokens(seed, batch=2, seq=16):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _stages(model, starts, tokens):
    analysis = P.analyze(model, (tokens,))
    bounds = list(starts) + [analysis.num_blocks]
    return analysis, [P.build_stage(analysis, bounds[s], bounds[s + 1], s, len(starts)) for s in range(len(starts))]


def _output(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", ["transformer_lm", "nanogpt", "gpt2", "llama"])
def test_three_stages_run_in_turn_give_the_models_output_and_gradients(name):
    model = make_model(name)
    _, stages = _stages(model, [0, 1, 3], _tokens(0))
    tokens = _tokens(1)  # another batch than the one the stages were built on
    h = tokens
    for stage in stages:
        h = stage(h)
    want = _output(model(tokens))
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (h * weight).sum().backward()
    (want * weight).sum().backward()
    got = {}
    for stage in stages:  # a parameter held by two stages (a tied embedding) gets both stages' gradients
        for n, p in stage.named_parameters():
            got[id(dict(model.named_parameters(remove_duplicate=False))[n])] = \
                got.get(id(dict(model.named_parameters(remove_duplicate=False))[n]), 0) + p.grad
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[id(p)], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")


def test_every_parameter_is_on_a_stage_under_the_models_own_name():
    model = make_model("gpt2")
    _, stages = _stages(model, [0, 2], _tokens(0))
    names = [set(s.state_dict()) for s in stages]
    assert names[0] | names[1] == set(model.state_dict())
    assert "transformer.wte.weight" in names[0] and "lm_head.weight" in names[1]   # tied: both ends hold it
    assert not any(k.startswith("transformer.h.2") for k in names[0])
    assert not any(k.startswith("transformer.h.1") for k in names[1])


def _brute_force(costs, stages):
    """The least largest stage cost over every split: middle stages hold a block; the first may hold only "pre",
    the last only "post"."""
    n = len(costs) - 2
    best = None
    for cuts in itertools.combinations_with_replacement(range(0, n + 1), stages - 1):
        if any(a >= b for a, b in zip(cuts, cuts[1:])):
            continue
        worst = max(P.stage_costs(costs, [0, *cuts], n))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_split_minimizes_the_largest_stage_exactly(seed):
    g = torch.Generator().manual_seed(seed)
    costs = (torch.rand(9, generator=g) * 10).tolist()
    for stages in (2, 3, 4):
        starts = P.split(costs, stages)
        assert starts[0] == 0 and len(starts) == stages
        assert max(P.stage_costs(costs, starts, 7)) == pytest.approx(_brute_force(costs, stages))


@pytest.mark.parametrize("name", ["transformer_lm", "gpt2"])
def test_a_stage_of_only_the_embedding_and_one_of_only_the_head_run_in_turn_give_the_models_output(name):
    model = make_model(name)
    analysis, stages = _stages(model, [0, 0, 4], _tokens(0))   # pre | blocks 0-3 | post
    # what each stage runs in order: the embeddings; the 4 blocks; the final norm and the head
    counts = [len(s.pipeline_blocks) for s in stages]
    assert counts[1] == 4 and counts[0] >= 1 and counts[2] == 2
    tokens = _tokens(1)
    h = tokens
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, _output(model(tokens)), rtol=0, atol=0)
    ref = P.cut_activations(analysis, (tokens,))
    assert all(P.check_stage(analysis, s, ref, (tokens,)) is None for s in stages)


def test_a_heavy_head_gets_a_stage_of_its_own_when_that_balances_best():
    costs = [0.5] + [1.0] * 6 + [4.0]
    starts = P.split(costs, 3)
    assert starts == [0, 3, 6]   # pre + 3 blocks | 3 blocks | the head alone
    assert max(P.stage_costs(costs, starts, 6)) == 4.0


def test_heavy_ends_get_fewer_blocks_than_a_uniform_split_gives_them():
    costs = [3.0] + [1.0] * 8 + [3.0]   # embedding and LM head each cost three blocks
    starts = P.split(costs, 2)
    assert starts == [0, 4]
    assert max(P.stage_costs(costs, starts, 8)) == 7.0
    four = P.split(costs, 4)
    assert max(P.stage_costs(costs, four, 8)) <= max(P.stage_costs(costs, [0, 2, 4, 6], 8))


def test_split_points_override_the_balancing_and_are_shown_in_the_plan():
    model = make_model("transformer_lm")
    plan = P.plan_stages(model, 2, (_tokens(0),), split_points=["blocks.3"])
    assert plan.split_points == [3] and plan.balance == "split_points"
    assert [s.layers for s in plan.stages] == ["embed, pos + blocks.0-2", "blocks.3 + norm, head"]
    by_params = P.plan_stages(model, 2, (_tokens(0),), balance="params")
    assert by_params.balance == "params"
    assert sum(s.params for s in by_params.stages) == sum(p.numel() for p in model.parameters())


def test_profiled_pieces_have_positive_times_and_the_blocks_save_activations():
    model = make_model("transformer_lm")
    analysis = P.analyze(model, (_tokens(0),))
    costs = P.profile_pieces(analysis, reps=3)
    assert [c.name for c in costs] == ["pre: embed, pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3",
                                       "post: norm, head"]
    assert all(c.forward_ms > 0 and c.backward_ms > 0 and len(c.samples_ms) == 3 for c in costs)
    assert all(c.activation_bytes > 0 for c in costs[1:-1])
    assert all(p.grad is None for p in model.parameters())  # profiling left no gradients behind


def test_a_meta_device_model_is_profiled_one_piece_at_a_time_and_saves_what_the_real_model_saves():
    tokens = _tokens(0)
    real = P.profile_pieces(P.analyze(make_model("meta_ready_gpt"), (tokens,)), reps=3)
    with torch.device("meta"):
        model = make_model("meta_ready_gpt")
    analysis = P.analyze(model, (tokens.to("meta"),))
    analysis.example_args = (tokens,)  # the stages' own code runs on the real batch (as parallelize sets it)
    costs = P.profile_meta_pieces(analysis, torch.device("cpu"), reps=3)
    assert [c.name for c in costs] == [c.name for c in real]
    assert all(c.forward_ms > 0 and c.backward_ms > 0 and len(c.samples_ms) == 3 for c in costs)
    assert [c.params for c in costs] == [c.params for c in real]
    # the bytes autograd saves per piece, as the whole model's profile counts them, but for a storage the blocks
    # share (the causal mask: counted once, on the whole model's first block; here on every block, 1 KiB)
    for got, want in zip(costs, real):
        assert abs(got.activation_bytes - want.activation_bytes) <= 1024, (got.name, got.activation_bytes,
                                                                            want.activation_bytes)
    assert len({id(c.samples_ms) for c in costs[1:-1]}) == 1  # alike blocks are timed once
    assert all(p.is_meta for p in model.parameters())  # nothing of the user's model was allocated
    plan = P.make_plan(analysis, costs, 2, "time")
    assert plan.balance == "time" and sum(s.params for s in plan.stages) == sum(c.params for c in costs)


@pytest.mark.parametrize("split_points, message", [
    ([5], "must be increasing block indices in 0..4"),
    ([2, 1], "make 3 stages; the mesh has 2"),
    (["layers.1"], "is not a block (blocks.<i>)"),
])
def test_bad_split_points_are_refused(split_points, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        P.plan_stages(make_model("transformer_lm"), 2, (_tokens(0),), split_points=split_points)


def test_a_model_without_a_block_list_is_refused_with_what_to_do():
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    with pytest.raises(ValueError, match="has no nn.ModuleList of blocks.*blocks='path.to.list'"):
        P.plan_stages(model, 2, (_tokens(0),))


class _DataDependentMask(nn.Module):
    """Blocks whose mask hides the padding tokens (id 0) of the batch: a later stage cannot know it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, tokens):
        x = self.embed(tokens)
        keep = (tokens != 0).unsqueeze(-1).float()
        for block in self.blocks:
            x = block(x) * keep
        return x


def test_a_stage_whose_block_inputs_depend_on_the_batchs_values_is_caught():
    model = _DataDependentMask()
    tokens = _tokens(0)
    analysis, stages = _stages(model, [0, 1], tokens)
    second = _tokens(5)
    second[:, :4] = 0
    problem = P.check_stage(analysis, stages[1], P.cut_activations(analysis, (second,)), (second,))
    assert problem is not None and "depend on the batch's values" in problem
    assert P.check_stage(analysis, stages[0], P.cut_activations(analysis, (second,)), (second,)) is None


def test_with_every_stage_holding_a_block_the_head_shares_the_last_stage():
    costs = [0.5] + [1.0] * 6 + [4.0]
    starts = P.split(costs, 3, empty_ends=False)
    assert starts[1] > 0 and starts[-1] < 6
    assert max(P.stage_costs(costs, starts, 6)) == pytest.approx(_brute_force_inner(costs, 3))
    model = make_model("transformer_lm")
    analysis = P.analyze(model, (_tokens(0),))
    with pytest.raises(ValueError, match="leave a stage without a block"):
        P.make_plan(analysis, P.param_costs(analysis), 2, split_points=[4], empty_ends=False)


def _brute_force_inner(costs, stages):
    n = len(costs) - 2
    return min(max(P.stage_costs(costs, [0, *cuts], n)) for cuts in itertools.combinations(range(1, n), stages - 1))
