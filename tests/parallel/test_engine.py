"""fastdist.parallelize trains like one process: on every (dp, tp, pp) mesh of 2 and 4 ranks, a GPT (TransformerLM;
nanoGPT with its embedding tied to the head across pipeline stages; Hugging Face GPT-2 with its Conv1D layers
sharded; Hugging Face LLaMA) gives the single-process losses for 5 steps and the same parameters after, gathered by
Engine.state_dict(). Bad configurations raise a clear error on every rank. What runs on the ranks is in
engine_ranks.py."""
import re
import statistics

import pytest
import torch
from engine_ranks import STEPS, reference
from helpers import assert_close, run_readme_recipe_under_torchrun

import fastdist

# Pipelining splits the batch into microbatches and data parallelism averages gradients across ranks: the same
# sums in another order, so float32 rounding (a few ulp of the loss) is all that may differ.
LOSS_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
PARAM_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def _assert_trains_like_one_process(engine_ranks, world, model, mesh, case=None):
    want_losses, want_state = reference(model)
    ranks = engine_ranks(world, case or f"train:{model}:{mesh}")
    for rank, got in enumerate(ranks):
        assert len(got["losses"]) == STEPS
        assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), f"{model} on {mesh}, rank {rank}: "
                     "losses", **LOSS_TOLERANCE)
        assert got["losses"] == ranks[0]["losses"], f"rank {rank} returned another loss than rank 0"
    state = ranks[0]["state"]
    assert list(state) == list(want_state), "the gathered state dict is keyed as the user's model"
    for key, want in want_state.items():
        assert_close(state[key], want, f"{model} on {mesh}: {key} after {STEPS} steps", **PARAM_TOLERANCE)


@pytest.mark.parametrize("mesh", ["1,1,2", "1,2,1", "2,1,1"])
def test_transformer_lm_trains_like_one_process_on_two_ranks(engine_ranks, mesh):
    _assert_trains_like_one_process(engine_ranks, 2, "transformer_lm", mesh)


def test_nanogpt_with_its_embedding_tied_to_the_head_across_two_stages_trains_like_one_process(engine_ranks):
    _assert_trains_like_one_process(engine_ranks, 2, "nanogpt", "1,1,2")


def test_hugging_face_gpt2_sharded_over_two_tensor_parallel_ranks_trains_like_one_process(engine_ranks):
    _assert_trains_like_one_process(engine_ranks, 2, "gpt2", "1,2,1")


def test_hugging_face_llama_with_grouped_query_heads_and_rotary_tables_trains_like_one_process(engine_ranks):
    _assert_trains_like_one_process(engine_ranks, 2, "llama", "1,2,1")


@pytest.mark.parametrize("mesh", ["1,2,2", "2,1,2", "2,2,1"])
def test_transformer_lm_trains_like_one_process_on_four_ranks(engine_ranks, mesh):
    _assert_trains_like_one_process(engine_ranks, 4, "transformer_lm", mesh)


def test_training_saved_after_two_steps_and_resumed_in_a_new_engine_goes_on_exactly(engine_ranks):
    for rank, got in enumerate(engine_ranks(4, "resume:2,1,2")):
        assert got["resumed"] == got["whole"][2:], f"rank {rank}"


def test_a_device_mesh_with_named_dimensions_in_any_order_is_a_mesh(engine_ranks):
    _assert_trains_like_one_process(engine_ranks, 2, "transformer_lm", "DeviceMesh(pp=2, tp=1)", "device_mesh")


def test_the_plan_is_a_table_of_stages_with_their_layers(engine_ranks):
    got = engine_ranks(2, "train:transformer_lm:1,1,2")[0]
    lines = got["plan"].splitlines()
    assert lines[0].startswith("pipeline plan: mesh dp=1 tp=1 pp=2, schedule 1f1b, 2 microbatches")
    assert lines[1].split() == ["stage", "layers", "params", "time", "(ms)", "memory", "recompute"]
    first, second = lines[2], lines[3]
    assert "embed" in first and "head" in second
    split = got["split_points"][0]
    assert f"blocks.0-{split - 1} " in first if split > 1 else "blocks.0 " in first
    assert f"blocks.{split}-3 " in second if split < 3 else "blocks.3 " in second


BAD = {
    "mesh_product": "the mesh (dp, tp, pp) = (1, 1, 3) has 3 ranks but the world has 2",
    "more_stages_than_blocks": "2 pipeline stages but TransformerLM has only 1 blocks in blocks",
    "microbatches": "does not split into 3 equal microbatches",
    "no_blocks": "Sequential has no nn.ModuleList of blocks to cut between",
    "different_models": "'fastdist.parallelize model",
    "different_plans": "split_points",
    "meta_unset": "init left ['pos', 'causal'] of stage 0 unset",
    "compile_option": "compile must be a bool or a dict of torch.compile options, got 'inductor'",
    "init_allocated": "init= initializes a model built on the meta device; this model's tensors are already",
    "tp_plan_matches_nothing": "tp_plan {'blocks.*.ffn.0': 'colwise'} names no nn.Linear (or Conv1D) of stage 0",
    "moe_not_on_dp_group": "are expert parallel over another group than this rank's data-parallel ranks",
    # a step's batch of another shape than example_inputs on every rank, then on one rank only
    "step_batch": ("ValueError: fastdist.parallel: step() got inputs [((4, 16), 'torch.int64')]; parallelize was "
                   "built for [((8, 16), 'torch.int64')]",
                   "| MismatchError: fastdist: 'fastdist.parallel Engine.step: inputs' differs across ranks"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_configuration_raises_the_same_clear_error_on_every_rank(engine_ranks, case):
    errors = [e for e in engine_ranks(2, f"bad:{case}")]
    assert all(e is not None for e in errors), f"{case}: some rank did not raise: {errors}"
    for rank, e in enumerate(errors):
        for part in (BAD[case],) if isinstance(BAD[case], str) else BAD[case]:
            assert part in e, f"{case}, rank {rank}: {e}"


def test_parallelize_on_one_process_is_plain_training():
    want_losses, want_state = reference("transformer_lm")
    from engine_ranks import train
    got = train("transformer_lm", (1, 1, 1), microbatches=1)
    assert got["losses"] == want_losses
    for key, want in want_state.items():
        assert torch.equal(got["state"][key], want), key


def test_fastdist_parallelize_is_the_engine_entry_point():
    assert fastdist.parallelize is fastdist.parallel.parallelize


def test_stage_aware_recompute_with_compressed_boundaries_trains_as_the_same_pipeline_without_recompute(
        engine_ranks):
    ranks = engine_ranks(2, "compose:recompute_compress")
    want_losses, _ = reference("transformer_lm")
    for rank, got in enumerate(ranks):
        assert {"RecomputeStageMixin", "CompressedTransportMixin", "PipelineStage"} <= set(got["mixins"])
        assert got["ratios"] == [1.0, 0.0]  # stage-aware from r0 = 1: the last stage recomputes nothing
        # recompute is exact: the same losses as the same compressed pipeline that keeps its activations
        assert got["recompute"]["losses"] == got["plain"]["losses"], f"rank {rank}"
        # 8-bit activations and gradients at the boundary: close to uncompressed training, not equal to it
        diff = (torch.tensor(got["recompute"]["losses"]) - torch.tensor(want_losses)).abs().max().item()
        assert 0 < diff < 5e-3, f"rank {rank}: compressed training is {diff} from uncompressed"
    assert ranks[0]["recomputed_blocks"] > 0 and ranks[1]["recomputed_blocks"] == 0
    sent_activations = ranks[0]["recompute"]["wire_bytes"]["fwd"]
    dense = STEPS * 2 * (4 * 16 * 32 * 4)  # 5 steps x 2 microbatches of [4, 16, 32] float32
    assert 0 < sent_activations < dense / 3, "the activations crossed compressed"
    assert ranks[1]["recompute"]["wire_bytes"]["bwd"] < dense / 3, "the gradients crossed compressed"


def test_a_fastdist_comm_hook_reduces_the_data_parallel_gradients(engine_ranks):
    ranks = engine_ranks(2, "compose:sketch_hook")
    want_losses, _ = reference("transformer_lm")
    for rank, got in enumerate(ranks):
        assert got["hook_steps"] == STEPS, "the sketch hook ran once per step"
        assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), f"rank {rank}: losses",
                     **LOSS_TOLERANCE)


def test_an_moe_layer_in_each_stage_expert_parallel_over_the_data_parallel_group_trains_like_one_process(
        engine_ranks):
    # (dp, tp, pp) = (2, 1, 2): each stage's MoE layers hold 2 of the 4 experts on each data-parallel rank
    want_losses, want_state = reference("moe_gpt")
    ranks = engine_ranks(4, "compose:moe:2,1,2")
    for rank, got in enumerate(ranks):
        assert all(shape[0] == 2 for shape in got["local_expert_shapes"].values()), f"rank {rank}: experts sharded"
        assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), f"rank {rank}: losses",
                     **LOSS_TOLERANCE)
    state = ranks[0]["state"]
    for key, want in want_state.items():  # the experts gathered from both data-parallel ranks: all 4 of them
        assert_close(state[key], want, f"{key} after {STEPS} steps", **PARAM_TOLERANCE)


def test_memory_swap_installed_on_a_stage_trains_bit_for_bit_as_the_stage_without_it(engine_ranks):
    ranks = engine_ranks(2, "compose:swap")
    for rank, got in enumerate(ranks):
        assert got["bytes_swapped"] > 0 and got["bytes_read"] > 0, f"rank {rank}: the stage's activations swapped"
        assert got["swapped"]["losses"] == got["plain"]["losses"], f"rank {rank}"
    for key, want in ranks[0]["plain"]["state"].items():
        assert torch.equal(ranks[0]["swapped"]["state"][key], want), key


@pytest.mark.parametrize("world, case, sharded", [
    (2, "dcp:transformer_lm:1,2,1->1,1,2", "blocks.0.mlp.0.weight"),
    (2, "dcp:gpt2:1,1,2->1,2,1", None),  # read into Conv1D's [in, out] shards: q/k/v, 3 runs of rows each
    (4, "dcp:transformer_lm:1,2,2->2,2,1", "blocks.3.mlp.2.weight"),
    (4, "dcp:moe_gpt:2,1,2->4,1,1", "blocks.0.moe.w1")])  # 2 experts per rank saved, 1 per rank loaded
def test_a_sharded_checkpoint_each_rank_writes_its_part_of_loads_on_another_mesh_and_resumes_adamw(
        engine_ranks, world, case, sharded):
    ranks = engine_ranks(world, case)
    first = ranks[0]
    files = first["files"]
    if sharded is not None:
        assert len(files[sharded]) == 2, f"{sharded}'s shards written by their 2 ranks: {files[sharded]}"
    assert len({f for written in files.values() for f in written}) == world, "every rank wrote a part"
    for key, want in first["saved"].items():  # the gathered model after loading on the other mesh: bit for bit
        if not isinstance(want, torch.Tensor):  # a module's extra state (the MoE layers' planner)
            continue
        assert torch.equal(first["loaded"][key], want), key
        assert torch.equal(first["plain"][key], want), f"{key} in DCP's conversion to the plain model"
    for rank, got in enumerate(ranks):
        assert got["steps_after_load"] == 2
        # Adam's moments and step came back too: training goes on as the single process does
        assert_close(torch.tensor(got["resumed"]), torch.tensor(got["whole"][2:]), f"rank {rank}: resumed losses",
                     **LOSS_TOLERANCE)


@pytest.mark.slow
def test_transformer_lm_on_a_2x2x2_mesh_of_eight_ranks_trains_like_one_process(engine_ranks):
    _assert_trains_like_one_process(engine_ranks, 8, "transformer_lm", "2,2,2")


@pytest.mark.timing
def test_parallelize_on_one_process_costs_at_most_3_percent_more_than_a_plain_loop():
    from engine_ranks import overhead
    samples = overhead(steps=160)
    plain, engine = statistics.median(samples["plain"]), statistics.median(samples["engine"])
    assert engine <= 1.03 * plain, f"parallelize (1, 1, 1): {engine * 1e3:.2f} ms of CPU per step, a plain loop " \
                                   f"{plain * 1e3:.2f} ms"


@pytest.mark.parametrize("model", ["transformer_lm", "gpt2"])
def test_a_state_dict_saved_on_one_mesh_loads_on_another_and_into_the_plain_model(engine_ranks, model):
    got = engine_ranks(2, f"checkpoint:{model}")[0]
    saved, reloaded = got["saved"], got["reloaded"]
    assert list(reloaded) == list(saved)
    for key in saved:  # tensor-parallel shards (GPT-2's transposed Conv1D too) re-sharded into pipeline stages
        assert torch.equal(reloaded[key], saved[key]), key
    from engine_ranks import make_model
    plain = make_model(model)
    plain.load_state_dict(saved)  # strict: exactly the plain model's keys and shapes


def test_readme_recipe_runs_as_written_under_torchrun(tmp_path):
    stdout = run_readme_recipe_under_torchrun("tests/parallel/test_engine.py", tmp_path)
    losses = re.findall(r"rank (\d) loss (\d+\.\d+)", stdout)
    assert sorted(rank for rank, _ in losses) == ["0", "1"], stdout
    assert losses[0][1] == losses[1][1], stdout  # the loss reaches every pipeline rank
    assert "pipeline plan: mesh dp=1 tp=1 pp=2" in stdout, stdout



@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1,1,2", "1,2,1"])
def test_compiled_stages_train_like_the_eager_engine_and_one_process(engine_ranks, mesh):
    want_losses, want_state = reference("transformer_lm", steps=3)
    ranks = engine_ranks(2, f"compile:{mesh}")
    if mesh == "1,1,2":  # shifted critical path with stage-aware recompute: the first stage recomputes its blocks
        assert ranks[0]["recomputed_blocks"] > 0
    for rank, got in enumerate(ranks):
        assert got["compiled_modules"] > 0 and got["graphs"] >= 1, f"rank {rank}: nothing was compiled"
        compiled, eager = got["compiled"]["losses"], got["eager"]["losses"]
        assert_close(torch.tensor(compiled), torch.tensor(eager), f"{mesh}, rank {rank}: compiled vs eager losses",
                     **LOSS_TOLERANCE)
        assert_close(torch.tensor(compiled), torch.tensor(want_losses), f"{mesh}, rank {rank}: compiled vs one "
                     "process", **LOSS_TOLERANCE)
    state, eager_state = ranks[0]["compiled"]["state"], ranks[0]["eager"]["state"]
    assert list(state) == list(want_state), "compiling keeps the user's parameter names"
    for key, want in want_state.items():
        assert_close(state[key], eager_state[key], f"{mesh}: {key}, compiled vs eager", **PARAM_TOLERANCE)
        assert_close(state[key], want, f"{mesh}: {key}, compiled vs one process", **PARAM_TOLERANCE)


@pytest.mark.parametrize("mesh", ["1,1,2", "1,2,1"])
def test_a_model_built_on_the_meta_device_gets_the_values_of_the_model_built_normally_and_trains_like_it(
        engine_ranks, mesh):
    from engine_ranks import make_model
    normal = make_model("meta_ready_gpt").state_dict()  # built on the CPU after torch.manual_seed(0)
    want_losses, want_state = reference("meta_ready_gpt", steps=3)
    ranks = engine_ranks(2, f"meta:meta_ready_gpt:{mesh}")
    initial = ranks[0]["initial"]
    assert list(initial) == list(normal)
    for key, want in normal.items():  # every stage's tensor-parallel shards, gathered: the same draws
        assert torch.equal(initial[key], want), f"{mesh}: {key} differs from the normally built model's"
    total = sum(t.numel() for t in normal.values())
    for rank, got in enumerate(ranks):
        assert got["still_meta"], f"rank {rank}: the user's model was allocated"
        assert mesh != "1,1,2" or "balanced by time" in got["plan"], got["plan"]  # its pieces timed one by one
        assert got["stage_params"] < total, f"rank {rank} holds {got['stage_params']} of {total} parameters"
        assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), f"{mesh}, rank {rank}: losses",
                     **LOSS_TOLERANCE)
    for key, want in want_state.items():
        assert_close(ranks[0]["state"][key], want, f"{mesh}: {key} after training", **PARAM_TOLERANCE)


@pytest.mark.parametrize("mesh, dst", [("1,2,2", 3), ("2,1,2", 1)])
def test_a_state_dict_gathered_to_one_rank_is_the_whole_one_and_the_other_ranks_get_nothing(engine_ranks, mesh, dst):
    ranks = engine_ranks(4, f"gather_to:{mesh}:{dst}")
    full, got = ranks[dst]["full"], ranks[dst]["to_dst"]
    assert list(got) == list(full)
    for key in full:
        assert torch.equal(got[key], full[key]), key
    for rank, r in enumerate(ranks):
        if rank != dst:
            assert r["to_dst"] == {}, f"rank {rank} got {len(r['to_dst'])} tensors"
        assert "dst must be a rank in [0, 4)" in r["bad_dst"], r["bad_dst"]


def test_adam_state_saved_on_one_mesh_resumes_on_another_and_in_the_plain_model(engine_ranks):
    ranks = engine_ranks(2, "optimizer:1,2,1->1,1,2")
    saved, reloaded = ranks[0]["saved"], ranks[0]["reloaded"]
    assert set(saved["state"]) >= {"blocks.0.mlp.0.weight", "head.weight"}
    assert sorted(reloaded["state"]) == sorted(saved["state"])
    for name, entry in saved["state"].items():  # tensor-parallel Adam moments re-sharded into pipeline stages
        for key, value in entry.items():
            assert torch.equal(reloaded["state"][name][key], value), f"{name} {key}"
    for rank, got in enumerate(ranks):
        # the uninterrupted single-process AdamW run, from step 3 on: only the mesh's float32 rounding differs
        assert_close(torch.tensor(got["resumed"]), torch.tensor(got["whole"][2:]), f"rank {rank}: resumed",
                     **LOSS_TOLERANCE)
        assert_close(torch.tensor(got["plain"]), torch.tensor(got["whole"][2:]), f"rank {rank}: plain model",
                     **LOSS_TOLERANCE)


def test_nanogpt_on_the_meta_device_with_its_own_init_gets_the_values_that_init_gives_the_whole_model(engine_ranks):
    from engine_ranks import make_model, nanogpt_init
    normal = make_model("nanogpt")
    torch.manual_seed(5)  # the rank side's seed=
    normal.apply(nanogpt_init)  # on one process: every module's draws in apply's order
    want = normal.state_dict()
    ranks = engine_ranks(2, "meta:nanogpt:1,1,2")
    initial = ranks[0]["initial"]
    assert list(initial) == list(want)
    for key, value in want.items():  # the embedding tied to the head: stage 0 and stage 1 hold the head's draw
        assert torch.equal(initial[key], value), key
    assert ranks[0]["losses"] == ranks[1]["losses"]
