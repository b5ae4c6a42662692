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


def test_hap_classifier_training_lowers_the_loss():
    x, edge_index, b, y = data.collate(data.make_dataset("digits", 24))
    torch.manual_seed(0)
    model = HAPClassifier(3, 16, 10, num_nodes=30, heads=2)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    losses = []
    for _ in range(40):
        logits, aux = model(x, edge_index, b)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        (loss + aux).backward()
        opt.step()
        losses.append(loss.item())
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
