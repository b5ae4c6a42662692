"""GraphClassifier / HAPClassifier: one encoder and readout around every pooler."""
import io

import pytest
import torch

from fastdist.graph import POOLERS, GraphClassifier, HAPClassifier, data


@pytest.fixture(scope="module")
def batch():
    return data.collate(data.make_dataset("digits", 10)[:6])


def build(pooler, encoder="gcn", seed=0, **kw):
    torch.manual_seed(seed)
    return GraphClassifier(3, 8, 10, levels=2, pooler=pooler, encoder=encoder, num_nodes=20, heads=2, **kw)


@pytest.mark.parametrize("encoder", ["gcn", "gin"])
@pytest.mark.parametrize("pooler", POOLERS)
def test_every_pooler_gives_logits_per_graph_and_gradients_to_every_parameter(pooler, encoder, batch):
    x, edge_index, b, y = batch
    model = build(pooler, encoder)
    logits, aux = model(x, edge_index, b)
    assert logits.shape == (6, 10) and aux.dim() == 0
    (torch.nn.functional.cross_entropy(logits, y) + aux).backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    # PyG's ASAPooling scores nodes by its fitness directly: its SelectTopK keeps a weight it never uses
    assert unused == ([f"pools.{i}.select.weight" for i in range(2)] if pooler == "asap" else [])


def test_hap_classifier_logits_do_not_depend_on_the_order_of_nodes_within_graphs(batch):
    x, edge_index, b, _ = batch
    model = HAPClassifier(3, 8, 10, num_nodes=20, heads=2).double()
    perm = torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(i)) + start
                      for i, (start, n) in enumerate(zip(*_starts(b)))])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(len(perm))
    want, _ = model(x.double(), edge_index, b)
    got, _ = model(x.double()[perm], inverse[edge_index], b)
    torch.testing.assert_close(got, want)


def _starts(b):
    n = torch.bincount(b)
    return (torch.cumsum(n, 0) - n).tolist(), n.tolist()


def test_same_seed_same_logits_and_state_dict_round_trips(batch):
    x, edge_index, b, _ = batch
    a, c = build("hap", seed=3), build("hap", seed=4)
    torch.testing.assert_close(build("hap", seed=3)(x, edge_index, b)[0], a(x, edge_index, b)[0], rtol=0, atol=0)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    c.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    torch.testing.assert_close(c(x, edge_index, b)[0], a(x, edge_index, b)[0], rtol=0, atol=0)


def _training_losses(model, steps):
    """Task losses of `steps` Adam steps on 24 digits graphs (the auxiliary losses are trained, not recorded)."""
    x, edge_index, b, y = data.collate(data.make_dataset("digits", 24))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    losses = []
    for _ in range(steps):
        logits, aux = model(x, edge_index, b)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        (loss + aux).backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_hap_classifier_training_lowers_the_loss():
    torch.manual_seed(0)
    losses = _training_losses(HAPClassifier(3, 16, 10, num_nodes=30, heads=2), 40)
    assert max(losses[-5:]) < 0.9 * losses[0]  # digits from pixel graphs: about what mean pooling reaches


def test_bad_arguments_raise(batch):
    x, edge_index, b, _ = batch
    with pytest.raises(ValueError, match="unknown pooler 'edgepool'"):
        GraphClassifier(3, 8, 2, pooler="edgepool")
    with pytest.raises(ValueError, match="unknown encoder 'gat'"):
        GraphClassifier(3, 8, 2, encoder="gat")
    with pytest.raises(ValueError, match="use GraphClassifier"):
        HAPClassifier(3, 8, 2, pooler="topk")
    with pytest.raises(ValueError, match="unknown readout 'max'"):
        GraphClassifier(3, 8, 2, readout="max")
    with pytest.raises(ValueError, match="ratio"):
        GraphClassifier(3, 8, 2, ratio=1.5)
    with pytest.raises(ValueError, match=r"x must be \[num_nodes, 3\]"):
        build("hap")(x[:, :2], edge_index, b)


def _nan_first(x):
    return x.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan")))


@pytest.mark.parametrize("change, match", [
    (lambda x, e, b, n: (x[:0], e[:, :0], b[:0], None), "the batch has no nodes"),
    (lambda x, e, b, n: (x, e, b + (b >= 2), None), r"graph\(s\) \[2\] of the batch have no nodes"),
    (lambda x, e, b, n: (x, e, b, n + 1), r"graph\(s\) \[6\] of the batch have no nodes"),
    (lambda x, e, b, n: (x, e, b, n - 1), "num_graphs=5 but batch numbers 6 graphs"),
    (lambda x, e, b, n: (x[:, :2], e, b, n), r"x must be \[num_nodes, 3\]"),
    (lambda x, e, b, n: (x, e, b[:-1], n), r"batch must be int64 \[num_nodes\]"),
    (lambda x, e, b, n: (x, e, b.flip(0), n), "sorted"),
    (lambda x, e, b, n: (x, e + 1, b, n), "outside"),
    (lambda x, e, b, n: (_nan_first(x), e, b, n), "NaN"),
])
@pytest.mark.parametrize("pooler", ["hap", "diffpool", "topk", "mean"])
def test_bad_batches_raise_a_clear_error_for_every_pooler(pooler, change, match, batch):
    x, edge_index, b, y = batch
    model = build(pooler)
    with pytest.raises(ValueError, match=match):
        model(*change(x, edge_index, b, len(y))[:3], num_graphs=change(x, edge_index, b, len(y))[3])


def test_a_dense_gin_block_sees_a_degree_normalized_adjacency_so_pooled_edge_mass_does_not_scale_it():
    from fastdist.graph.classifier import _Block

    torch.manual_seed(0)
    gin = _Block("gin", True, 4, 8, 2).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    adj = torch.rand(2, 5, 5, dtype=torch.float64)
    adj = adj + adj.transpose(1, 2)
    torch.testing.assert_close(gin(x, 50 * adj), gin(x, adj))  # a pooled graph's weights are cluster sums


@pytest.mark.parametrize("pooler", ["hap", "diffpool"])
def test_a_gin_classifier_with_dense_levels_starts_near_chance_and_trains(pooler):
    torch.manual_seed(0)
    losses = _training_losses(GraphClassifier(3, 16, 10, num_nodes=30, heads=2, encoder="gin", pooler=pooler), 30)
    # log(10) = 2.3 at chance; on an unnormalized pooled adjacency DiffPool's first loss was in the hundreds
    assert losses[0] < 3 and max(losses[-5:]) < 0.9 * losses[0]


@pytest.mark.parametrize("readout, sees_count", [("mean", False), ("sum", True), ("mean+sum", True)])
def test_only_a_readout_with_the_sum_tells_a_graph_from_two_copies_of_it(readout, sees_count):
    one = data.make_dataset("tree-cycle", 2)[1]
    n = one.num_nodes
    two = data.Graph(torch.cat([one.x, one.x]), torch.cat([one.edge_index, one.edge_index + n], 1), one.y)
    x, edge_index, b, _ = data.collate([one, two])
    torch.manual_seed(0)
    model = GraphClassifier(1, 8, 2, levels=2, pooler="mean", readout=readout).double()
    logits, _ = model(x.double(), edge_index, b)
    assert torch.allclose(logits[0], logits[1]) != sees_count
