"""The 2D schedule's next-batch prefetch changes when rows move, never what is looked up: training with the next
batch prefetched (before the backward, with or without rows sent ahead, or after the optimizer step) equals the
unprefetched run bit for bit and a single process on the unsharded table, and a row updated in one step is looked
up in the next with its updated value; a rank looking up other ids than it prefetched makes every rank look up
afresh; bad prefetched ids raise on every rank. A table's sharded state saved with torch.distributed.checkpoint loads
on any world size."""
import pytest
import torch
from helpers import assert_close

import ranks


def reference(name, world):
    """Single process, the unsharded table: every rank's outputs per step, and the next step's outputs as a read
    before the update would give them (stale)."""
    case = dict(ranks.TRAIN_CASE, sparse=name != "torch-adam-dense")
    table = ranks.reference_table(case)
    opt = ranks.make_optimizer(name, table.parameters(), sharded=False)
    ys, stale = [[] for _ in range(world)], [[None] for _ in range(world)]
    for step in range(ranks.PREFETCH_STEPS):
        opt.zero_grad()
        loss = 0
        for rank in range(world):
            ids, offsets, psw, upstream = ranks.prefetch_batch(rank, step)
            y = table(ids, offsets, psw)
            ys[rank].append(y.detach())
            loss = loss + (y * upstream).sum()
        loss.backward()
        with torch.no_grad():
            for rank in range(world):
                stale[rank].append(table(*ranks.prefetch_batch(rank, step + 1)[:3]))
        opt.step()
    return ys, stale, table.weight.detach()


@pytest.fixture(params=[2, 4])
def job(request):
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[request.param])


@pytest.mark.parametrize("schedule", ["2d", "now", "ids", "after-step", "mismatch"])
def test_prefetched_training_equals_the_unprefetched_run_and_one_process(job, schedule):
    world = len(job)
    for name in ranks.PREFETCH_OPTIMIZERS:
        want, _, table = reference(name, world)
        shards = []
        for rank, got in enumerate(r["prefetch"] for r in job):
            plain, ours = got["plain"][name], got[schedule][name]
            for step in range(ranks.PREFETCH_STEPS):
                assert torch.equal(ours["y"][step], plain["y"][step]), (name, rank, step)
                assert_close(ours["y"][step], want[rank][step], f"{name} rank {rank} step {step}",
                             rtol=1e-5, atol=1e-6)
            assert torch.equal(ours["weight"], plain["weight"]), (name, rank)
            shards.append((ours["start"], ours["weight"]))
        full = torch.cat([w for _, w in sorted(shards, key=lambda s: s[0])])
        assert_close(full, table, f"{name} table after {ranks.PREFETCH_STEPS} steps", rtol=1e-5, atol=1e-6)


def test_a_row_updated_in_one_step_is_looked_up_with_its_updated_value(two_ranks):
    # Rows 0-3 are in every step's batch on every rank: each step updates them and the next looks them up while
    # the prefetch runs. A read before the update (stale) would differ; the prefetched lookup equals the fresh one.
    for name, schedule in [(n, s) for n in ranks.PREFETCH_OPTIMIZERS for s in ("2d", "now")]:
        want, stale, _ = reference(name, 2)
        for rank, got in enumerate(r["prefetch"][schedule][name] for r in two_ranks):
            for step in range(1, ranks.PREFETCH_STEPS):
                assert not torch.allclose(stale[rank][step], want[rank][step], atol=1e-4), (name, rank, step)
                assert_close(got["y"][step], want[rank][step], f"{name} rank {rank} step {step}",
                             rtol=1e-5, atol=1e-6)


def test_prefetched_collection_equals_the_unprefetched_one(two_ranks):
    for rank, got in enumerate(r["prefetch collection"] for r in two_ranks):
        for step, (plain, ours) in enumerate(zip(got[False], got[True])):
            assert plain.keys() == ours.keys() == {"a", "b"}
            for n in plain:
                assert torch.equal(ours[n], plain[n]), (rank, step, n)


def test_bad_prefetched_ids_raise_on_every_rank(job):
    for rank, (error, after) in enumerate(r["prefetch refusal"] for r in job):
        kind, message = error
        assert kind == "EmbeddingInputError" and "rank 1:" in message and "got 11" in message, rank
        assert after == torch.Size([2, ranks.DIM])


def test_sharded_state_saved_with_torch_distributed_checkpoint_loads_on_any_world_size(two_ranks, four_ranks,
                                                                                       checkpoint_path):
    # Saved on 2 ranks (each its own rows, no gather), loaded on 2 and 4 ranks and in one process: the full table
    # and the dense layer equal what was saved, whatever the new row ranges.
    import torch.distributed.checkpoint as dcp
    want = two_ranks[0]["checkpoint"]["saved"]
    assert not torch.equal(ranks.checkpoint_model(1).state_dict()["head.weight"], want["head.weight"])
    table = dcp.FileSystemReader(checkpoint_path).read_metadata().state_dict_metadata["table.weight"]
    assert list(table.size) == [13, ranks.DIM] and len(table.chunks) == 2  # one table, in the two ranks' rows
    loaded = {2: [r["checkpoint"]["reloaded"] for r in two_ranks],
              4: [r["checkpoint"]["reloaded"] for r in four_ranks], 1: [ranks.dcp_load(checkpoint_path)]}
    for world, states in loaded.items():
        for rank, state in enumerate(states):
            assert state.keys() == want.keys()
            for key, value in want.items():
                assert torch.equal(state[key], value), (world, rank, key)


def test_every_prefetched_row_travels_once(job):
    # With rows sent ahead, a row the pending update changes is not sent early (it waits for the lookup), one it
    # leaves alone is not sent again: each schedule sends exactly the rows and gradient rows the unprefetched run
    # sends; what the prefetch adds is one byte per requested row saying which rows wait, and a flag row per pair.
    for rank, got in enumerate(r["prefetch"] for r in job):
        for name in ranks.PREFETCH_OPTIMIZERS:
            plain = got["plain"][name]["traffic"]
            for schedule in ("2d", "now", "ids", "after-step"):
                ours = got[schedule][name]["traffic"]
                assert (ours["rows"], ours["grad_rows"]) == (plain["rows"], plain["grad_rows"]), \
                    (rank, name, schedule)
            assert plain["control"] == 0 and got["2d"][name]["traffic"]["control"] > 0, (rank, name)
            assert got["now"][name]["traffic"]["control"] > 0, (rank, name)
