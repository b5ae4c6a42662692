"""ShardedEmbedding equals an unsharded nn.Embedding / nn.EmbeddingBag: outputs on every rank's own batch and the
gradient of the whole table, on 2 and 4 ranks with uneven row counts; bad input on one rank raises on every rank in
the same call; an empty batch on one rank works."""
import pytest
import torch
from fastdist.embedding import EmbeddingInputError, ShardedEmbedding
from helpers import assert_close

import ranks

CASES = ranks.CASES


def reference(case, world):
    """Single process: the unsharded module on each rank's batch, one backward of the summed loss."""
    table = ranks.reference_table(case)
    outputs, loss = [], 0
    for rank in range(world):
        ids, offsets, psw, upstream = ranks.batch(case, rank)
        y = table(ids, offsets, psw) if case.get("mode") else table(ids)
        outputs.append(y.detach())
        loss = loss + (y.reshape(-1, ranks.DIM) * upstream).sum()
    loss.backward()
    grad = table.weight.grad
    return outputs, grad.to_dense() if grad.is_sparse else grad


@pytest.fixture(params=[2, 4])
def job(request):
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[request.param])


def test_outputs_and_gradients_equal_unsharded_embedding(job):
    world = len(job)
    results = [r["lookups"] for r in job]
    for c, case in enumerate(CASES):
        outputs, grad = reference(case, world)
        shards = []
        for rank, per_case in enumerate(results):
            got = per_case[c]
            assert_close(got["y"], outputs[rank], f"case {c} rank {rank} output", rtol=1e-6, atol=1e-6)
            assert got["sparse_grad"] == case.get("sparse", False)
            shards.append((got["start"], got["grad"]))
        full = torch.cat([g for _, g in sorted(shards, key=lambda s: s[0])])
        assert_close(full, grad, f"case {c} table gradient", rtol=1e-6, atol=1e-6)
        if case.get("pad") is not None:
            assert torch.count_nonzero(full[case["pad"]]) == 0


def test_bad_input_on_one_rank_raises_on_every_rank_naming_it(job):
    for rank, out in enumerate(r["refusals"] for r in job):
        for name, needle in [("out of range", "ids must be < num_embeddings = 11, got 11"),
                             ("negative", "ids must be >= 0, got -1"), ("float ids", "int64 or int32"),
                             ("bad offsets", "offsets must start at 0")]:
            kind, message = out[name]
            assert kind == "EmbeddingInputError" and "rank 1:" in message and needle in message, (rank, name)
            assert "rank 0:" not in message
        assert out["after"] == torch.Size([3, ranks.DIM])
        kind, message = out["config"]
        assert kind == "MismatchError" and "embedding_dim" in message and "dtype" not in message
        kind, message = out["config rows"]
        assert kind == "MismatchError" and "num_embeddings" in message


def test_ids_past_the_exchange_capacity_follow_in_a_second_round(job):
    for rank, errors in enumerate(r["capacity"] for r in job):
        assert errors == [0.0] * len(errors), rank


def test_bytes_sent_depend_on_the_distinct_ids_not_on_the_vocabulary(two_ranks):
    for rank, got in enumerate(r["traffic"] for r in two_ranks):
        assert got[1000] == got[1_000_000], rank
        assert got[1000]["rows"] > 0 and got[1000]["grad_rows"] > 0


def test_empty_batch_on_one_rank_does_not_hang(job):
    results = [r["empty"] for r in job]
    assert results[1]["y"] == torch.Size([0, ranks.DIM])
    full = torch.cat([r["grad"] for r in sorted(results, key=lambda r: r["start"])])
    want = torch.zeros(9, ranks.DIM)
    want[[1, 4, 8]] = len(job) - 1  # every rank but rank 1 looked up rows 1, 4, 8
    assert_close(full, want, "gradient of the table")
    assert_close(results[1]["b"], torch.zeros(1, ranks.DIM), "an empty mean bag is zero")


def test_single_process_without_a_group_is_an_embedding():
    ref = torch.nn.EmbeddingBag(20, 4, mode="mean", padding_idx=5)
    table = ShardedEmbedding.from_embedding(ref)
    ids = torch.tensor([[5, 1, 1], [19, 5, 0]])
    assert_close(table(ids), ref(ids), "2-D bags")
    with pytest.raises(EmbeddingInputError, match="ids must be < num_embeddings = 20, got 20"):
        table(torch.tensor([[20]]))


def test_non_finite_weights_are_refused_on_load():
    ref = torch.nn.Embedding(8, 4)
    with torch.no_grad():
        ref.weight[6, 1] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or infinite values \(rows \[6\]"):
        ShardedEmbedding.from_embedding(ref)
    table = ShardedEmbedding(8, 4)
    with pytest.raises(ValueError, match="NaN"):
        table.load_state_dict(ref.state_dict())


def test_nan_gradient_propagates_as_in_nn_embedding():
    ref = torch.nn.Embedding(8, 4)
    table = ShardedEmbedding.from_embedding(ref)
    ids = torch.tensor([1, 3, 3])
    upstream = torch.ones(3, 4)
    upstream[1, 2] = float("nan")
    (ref(ids) * upstream).sum().backward()
    (table(ids) * upstream).sum().backward()
    assert_close(table.weight.grad, ref.weight.grad, "gradient with a NaN", equal_nan=True)
    assert torch.isnan(table.weight.grad[3, 2])


def test_state_dict_is_the_full_table_a_plain_embedding_loads():
    table = ShardedEmbedding(12, 3, padding_idx=2)
    plain = torch.nn.Embedding(12, 3, padding_idx=2)
    plain.load_state_dict(table.state_dict())
    assert_close(plain.weight, table.weight, "loaded table")
    assert torch.count_nonzero(plain.weight[2]) == 0


def test_collection_equals_the_unsharded_tables(two_ranks):
    tables = ranks.collection_tables()
    loss = 0
    for rank, got in enumerate(r["collection"] for r in two_ranks):
        inputs = ranks.collection_inputs(rank)
        for i, name in enumerate(sorted(tables)):
            args = inputs[name] if isinstance(inputs[name], tuple) else (inputs[name],)
            y = tables[name](*args)
            assert_close(got["y"][name], y.detach(), f"rank {rank} table {name}")
            loss = loss + y.sum() * (i + 1)
    loss.backward()
    owned = {}
    for got in (r["collection"] for r in two_ranks):
        assert not owned.keys() & got["owned"].keys(), "a table owned twice"
        owned.update(got["owned"])
    assert owned.keys() == tables.keys()
    assert {n for n in two_ranks[0]["collection"]["owned"]} == {"user", "city"}  # the largest, and the balance
    for name, grad in owned.items():
        assert_close(grad, tables[name].weight.grad, f"gradient of {name}")


def test_state_dict_full_or_sharded_and_resharding(two_ranks):
    states = [r["state"] for r in two_ranks]
    assert torch.equal(states[0]["full"], states[1]["full"])
    shards = sorted((s["shard"] for s in states), key=lambda s: s["row_start"])
    assert [s["row_start"] for s in shards] == [0, 6]
    assert torch.equal(torch.cat([s["weight"] for s in shards]), states[0]["full"])
    assert all(s["reloaded"] for s in states)
    legacy, foreign = states[0]["refused"]
    assert "load the full table to re-shard" in legacy
    assert "whose local shards are not this rank's rows" in foreign and "torch.distributed.checkpoint" in foreign
    one = ShardedEmbedding(11, 3)  # the 2-rank checkpoint on one rank: re-sharded
    one.load_state_dict({"weight": states[0]["full"]})
    assert torch.equal(one.weight, states[0]["full"])
    assert torch.count_nonzero(one.weight[4]) == 0


def test_pickles_without_its_group_and_works_once_attached():
    import pickle
    table = ShardedEmbedding(6, 2)
    copy = pickle.loads(pickle.dumps(table))
    with pytest.raises(RuntimeError, match=r"attach\(group\)"):
        copy(torch.tensor([1]))
    copy.attach(None)
    assert_close(copy(torch.tensor([1, 5])), table(torch.tensor([1, 5])), "after attach")


@pytest.mark.cuda
def test_on_cuda_one_rank_equals_nn_embedding_bag():
    ref = torch.nn.EmbeddingBag(50, 4, mode="sum", padding_idx=3).cuda()
    table = ShardedEmbedding.from_embedding(ref)
    ids, offsets = torch.tensor([3, 1, 1, 49], device="cuda"), torch.tensor([0, 2], device="cuda")
    (table(ids, offsets) * 2).sum().backward()
    (ref(ids, offsets) * 2).sum().backward()
    assert_close(table.weight.grad, ref.weight.grad, "gradient on CUDA")
    with pytest.raises(EmbeddingInputError, match="ids are on cpu"):
        table(ids.cpu(), offsets.cpu())


def test_collection_on_one_process_equals_its_tables():
    from fastdist.embedding import ShardedEmbeddingCollection
    tables = ranks.collection_tables()
    collection = ShardedEmbeddingCollection(tables)
    inputs = ranks.collection_inputs(0)
    got = collection(inputs)
    for name, table in tables.items():
        args = inputs[name] if isinstance(inputs[name], tuple) else (inputs[name],)
        assert_close(got[name], table(*args), f"table {name}")
