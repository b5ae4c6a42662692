"""hybrid_parallel on users' models (a DLRM-style recommender, a nanoGPT-style LM) on 2 ranks trains exactly as one
process on the concatenated batch: losses and every parameter after several optimizer steps, with the next batch
prefetched too (bit for bit the run without); the tables the model calls one by one share one exchange per step
(deferred outputs, bit for bit the unfused run); a table tied to the LM head is refused, never silently untied; the
collection places whole tables on ranks balanced by size; the README's recipe runs as written under torchrun."""
import re

import pytest
import torch
import torch.nn.functional as F
from fastdist.embedding import balance_tables
from helpers import assert_close, run_readme_recipe_under_torchrun

import models
import ranks

STEPS = 3
WORLD = 2


def reference(name):
    torch.manual_seed(0)
    if name == "dlrm":
        model = models.DLRM()
        opts = ranks.dlrm_optimizers(model)
    else:
        model = models.GPT(tie=False)
        opts = ranks.gpt_optimizers(model)
    losses = []
    for step in range(STEPS):
        for o in opts:
            o.zero_grad()
        if name == "dlrm":
            parts = [models.dlrm_batch(r, step) for r in range(WORLD)]
            dense = torch.cat([p[0] for p in parts])
            ids = [torch.cat([p[1][t] for p in parts]) for t in range(3)]
            offsets, lengths = [], [0] * 3
            for t in range(3):
                chunks, base = [], 0
                for p in parts:
                    chunks.append(p[2][t] + base)
                    base += p[1][t].numel()
                offsets.append(torch.cat(chunks))
            labels = torch.cat([p[3] for p in parts])
            per_rank = F.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels, reduction="none")
        else:
            parts = [models.gpt_batch(r, step) for r in range(WORLD)]
            idx, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            per_rank = torch.stack([model(i, t) for i, t in zip(idx.split(3), targets.split(3))])
        per_rank = per_rank.view(WORLD, -1).mean(1)
        per_rank.mean().backward()
        for o in opts:
            o.step()
        losses.append(per_rank.detach())
    return torch.stack(losses), model.state_dict()


def check_equal_to_reference(name, results, sharded):
    want_losses, want_state = reference(name)
    for rank, got in enumerate(results):
        assert got["sharded"] == sharded
        assert_close(torch.tensor(got["losses"]), want_losses[:, rank], f"{name} rank {rank} losses",
                     rtol=1e-5, atol=1e-6)
        assert got["state"].keys() == want_state.keys()
        for key, value in want_state.items():
            assert_close(got["state"][key], value, f"{name} rank {rank} {key}", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sharding", ["row", "table"])
def test_dlrm_with_sharded_bags_trains_like_one_process(two_ranks, sharding):
    results = [r["dlrm" if sharding == "row" else "dlrm-table"] for r in two_ranks]
    check_equal_to_reference("dlrm", results, ["embeddings.0", "embeddings.1"])
    if sharding == "table":  # this run passed a comm hook for the dense part: every step went through it
        assert all(r["hook_calls"] >= STEPS for r in results)


def test_dlrm_prefetching_the_next_batch_trains_exactly_as_without(two_ranks):
    results = [r["dlrm-prefetch"] for r in two_ranks]
    check_equal_to_reference("dlrm", results, ["embeddings.0", "embeddings.1"])
    for rank, (ours, plain) in enumerate(zip(results, (r["dlrm"] for r in two_ranks))):
        assert ours["losses"] == plain["losses"], rank
        assert all(torch.equal(ours["state"][k], v) for k, v in plain["state"].items()), rank


def test_nanogpt_with_a_sharded_vocabulary_trains_like_one_process(two_ranks):
    check_equal_to_reference("gpt", [r["gpt"] for r in two_ranks], ["transformer.wte"])


def test_tied_input_embedding_is_refused_with_the_way_out(two_ranks):
    message = two_ranks[0]["tied"]
    assert "cannot shard 'transformer.wte': its weight is tied to ['lm_head.weight']" in message
    assert "shard={'transformer.wte': False}" in message


def test_a_model_with_a_sharded_table_compiles_and_equals_eager(two_ranks):
    for rank, got in enumerate(r["compiled"] for r in two_ranks):
        assert got["compiled"][0] == pytest.approx(got["eager"][0], rel=1e-6, abs=1e-7), rank
        assert_close(got["compiled"][1], got["eager"][1], f"rank {rank} table gradient", rtol=1e-5, atol=1e-7)


def test_tables_are_placed_whole_and_balanced_by_size():
    # largest first, each to the rank holding the least so far (ties: the lower rank)
    owners = balance_tables({"e": 10, "d": 100, "c": 500, "b": 600, "a": 1000}, 2)
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}


def test_readme_recipe_runs_as_written_under_torchrun(tmp_path):
    stdout = run_readme_recipe_under_torchrun("tests/embedding/test_hybrid.py", tmp_path)
    # the two ranks' prints may interleave (print writes the text and the newline separately)
    assert sorted(re.findall(r"rank (\d) loss \d+\.\d+", stdout)) == ["0", "1"], stdout
    shards = re.findall(r"ShardedEmbedding\(100000, 32, .*?rows \[(\d+), (\d+)\) on rank (\d) of 2", stdout)
    assert sorted(shards) == [("0", "50000", "0"), ("50000", "100000", "1")], stdout


def test_tables_called_one_by_one_share_one_exchange_per_step(two_ranks):
    # The DLRM calls its two sharded tables one by one. Fused (hybrid_parallel's default) the step makes one ids
    # AlltoAll (a second when the ids outgrow the exchange's capacity, as on the first step) and one rows AlltoAll
    # forward and one gradient AlltoAll backward for both tables; unfused, each table makes its own. Same training.
    results = [r["fused"][True] for r in two_ranks]
    check_equal_to_reference("dlrm", results, ["embeddings.0", "embeddings.1"])
    for rank, r in enumerate(two_ranks):
        fused, plain = r["fused"][True], r["fused"][False]
        assert fused["backward"] == [1] * STEPS and plain["backward"] == [2] * STEPS, rank
        assert fused["forward"][0] == 3 and all(n in (2, 3) for n in fused["forward"]), (rank, fused["forward"])
        assert all(n >= 4 for n in plain["forward"]), (rank, plain["forward"])
        assert fused["losses"] == plain["losses"], rank
        for key, value in plain["state"].items():
            assert torch.equal(fused["state"][key], value), (rank, key)


def test_fused_tables_prefetch_together_and_train_as_without(two_ranks):
    # Each table prefetches the next batch after the forward: the fusion issues both prefetches as one exchange
    # once both tables have one, and the next step's fused lookup finishes it with one AlltoAll (the rows the
    # update changed). Training is bit for bit the run without prefetch.
    for rank, r in enumerate(two_ranks):
        ours, plain = r["fused"]["prefetch"], r["fused"][True]
        assert ours["forward"][1:] == [1] * (STEPS - 1), (rank, ours["forward"])
        assert ours["losses"] == plain["losses"], rank
        for key, value in plain["state"].items():
            assert torch.equal(ours["state"][key], value), (rank, key)


def test_deferred_outputs_answer_metadata_then_look_up_together_at_first_use(two_ranks):
    # Three calls (one table twice, a bag table once) are recorded; shape, dim, size, dtype, len and requires_grad
    # are answered without a lookup; the first torch op looks all three up. Outputs and the table's gradient equal
    # the unsharded modules'; a call under no_grad stays without gradient; a custom autograd.Function, which
    # bypasses __torch_function__, is refused in the backward instead of dropping the table's gradient.
    table = ranks.reference_table({"seed": 12, "rows": 29})
    loss = 0
    for rank in range(WORLD):
        a_ids, b_ids = torch.tensor([[1, 28], [5, 5 + rank]]), torch.tensor([3, 4, 20 + rank])
        loss = loss + table(a_ids).sum() + table(b_ids).sum() * 2
    loss.backward()
    shards = []
    for rank, got in enumerate(r["deferred"] for r in two_ranks):
        assert got["metadata"] == ((2, 2, ranks.DIM), 3, ranks.DIM, torch.float32, 2, True, 3), rank
        assert got["pending after use"] == 0 and got["outputs equal"], rank
        assert got["no_grad"] is False, rank
        assert "custom autograd.Function" in got["refused"] and "fuse=False" in got["refused"], rank
        shards.append((got["start"], got["grad"]))
    full = torch.cat([g for _, g in sorted(shards, key=lambda s: s[0])])
    assert_close(full, table.weight.grad, "the table's gradient", rtol=1e-6, atol=1e-6)
