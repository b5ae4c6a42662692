"""The generated graph-classification sets: deterministic, well-formed, labelled by structure."""
import numpy as np
import pytest
import torch

from fastdist.graph import data

STRUCTURE_SETS = [d for d in data.DATASETS if d != "digits"]


def _degrees(g):
    return np.bincount(g.edge_index[0].numpy(), minlength=g.num_nodes)


def _cycle_nodes(g):
    """Nodes left after peeling leaves repeatedly: the cycle of a unicyclic graph, nothing of a tree."""
    deg = _degrees(g).copy()
    nbrs = [[] for _ in range(g.num_nodes)]
    for a, b in g.edge_index.T.tolist():
        nbrs[a].append(b)
    leaves = [v for v in range(g.num_nodes) if deg[v] <= 1]
    alive = np.ones(g.num_nodes, bool)
    while leaves:
        v = leaves.pop()
        if not alive[v]:
            continue
        alive[v] = False
        for u in nbrs[v]:
            deg[u] -= 1
            if alive[u] and deg[u] == 1:
                leaves.append(u)
    return int(alive.sum())


@pytest.mark.parametrize("name", data.DATASETS)
def test_a_seed_gives_the_same_graphs_and_another_seed_others(name):
    a, b, c = (data.make_dataset(name, 40, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(g.x, h.x) and torch.equal(g.edge_index, h.edge_index) and g.y == h.y
               for g, h in zip(a, b))
    assert any(g.edge_index.shape != h.edge_index.shape or not torch.equal(g.edge_index, h.edge_index)
               for g, h in zip(a, c))


@pytest.mark.parametrize("name", STRUCTURE_SETS)
def test_structure_sets_have_a_thousand_balanced_simple_undirected_graphs_of_10_to_100_nodes(name):
    graphs = data.make_dataset(name)
    assert len(graphs) == 1000
    counts = np.bincount([g.y for g in graphs])
    assert len(counts) == data.num_classes(name) and counts.max() - counts.min() <= 1
    for g in graphs[:200]:
        assert 10 <= g.num_nodes <= 100 and g.x.shape == (g.num_nodes, 1)
        ei = g.edge_index
        pairs = set(map(tuple, ei.T.tolist()))
        assert (ei[0] != ei[1]).all() and len(pairs) == ei.shape[1]  # no self-loops, no duplicates
        assert pairs == {(b, a) for a, b in pairs}  # both directions


def test_tree_cycle_labels_are_whether_the_graph_has_a_cycle():
    for g in data.make_dataset("tree-cycle", 60):
        assert g.edge_index.shape[1] // 2 == g.num_nodes - 1 + g.y
        assert (_cycle_nodes(g) > 0) == bool(g.y)


def test_cycle_parity_labels_are_the_parity_of_the_one_cycle():
    for g in data.make_dataset("cycle-parity", 60):
        assert g.edge_index.shape[1] // 2 == g.num_nodes  # connected and unicyclic
        assert _cycle_nodes(g) % 2 == g.y


def test_house_and_cycle_graphs_have_the_same_edge_count_for_the_same_node_count():
    for g in data.make_dataset("house-cycle", 100):
        assert g.edge_index.shape[1] // 2 - g.num_nodes == (g.num_nodes - 5) // 10 + 1
        motif = _degrees(g)[-5:]  # the motif's nodes come last; one of them carries the edge to the base
        assert sorted(motif)[-2:] == ([3, 3] if g.y else [2, 3]) or sorted(motif)[-2:] == ([3, 4] if g.y else [2, 3])


def test_community_classes_have_the_same_mean_degree_so_only_the_structure_tells_them_apart():
    graphs = data.make_dataset("communities", 600)
    mean_degree = [np.mean([_degrees(g).mean() for g in graphs if g.y == y]) for y in range(3)]
    assert max(mean_degree) - min(mean_degree) < 0.2 * np.mean(mean_degree)


def test_a_degree_histogram_baseline_is_near_chance_on_communities_and_cycle_parity_but_not_on_tree_cycle():
    acc = {name: data.degree_baseline(data.make_dataset(name, 300))[0]
           for name in ("communities", "cycle-parity", "tree-cycle")}
    assert acc["communities"] < 1 / 3 + 0.12 and acc["cycle-parity"] < 0.5 + 0.1
    assert acc["tree-cycle"] > 0.75  # the baseline itself works: the extra edge shows in the degree sum


def test_digits_become_pixel_graphs_with_intensity_and_position():
    graphs = data.make_dataset("digits", 1797)
    assert len(graphs) == 1797 and sorted({g.y for g in graphs}) == list(range(10))
    g = graphs[0]
    assert g.x.shape[1] == 3 and (g.x[:, 0] > 0).all() and 0 <= g.x.min() and g.x.max() <= 1  # only inked pixels
    assert all(10 <= h.num_nodes <= 64 for h in graphs)
    with pytest.raises(ValueError, match="1797"):
        data.make_dataset("digits", 1798)


def test_collate_offsets_edges_and_numbers_the_graphs():
    graphs = data.make_dataset("tree-cycle", 3)
    x, edge_index, batch, y = data.collate(graphs)
    n = [g.num_nodes for g in graphs]
    assert x.shape == (sum(n), 1) and batch.tolist() == [0] * n[0] + [1] * n[1] + [2] * n[2]
    assert torch.equal(edge_index[:, -graphs[2].edge_index.shape[1]:], graphs[2].edge_index + n[0] + n[1])
    assert y.tolist() == [g.y for g in graphs]


def test_unknown_sets_and_too_few_graphs_raise():
    with pytest.raises(ValueError, match="unknown data set 'mutag'"):
        data.make_dataset("mutag")
    with pytest.raises(ValueError, match="fewer than the 3 classes"):
        data.make_dataset("communities", 2)


def test_with_degree_appends_the_one_hot_degree_capped_at_max_degree():
    graphs = data.make_dataset("tree-cycle", 12)
    out = data.with_degree(graphs, max_degree=3)
    for g, h in zip(graphs, out):
        assert torch.equal(h.x[:, :1], g.x) and h.x.shape == (g.num_nodes, 1 + 4) and h.y == g.y
        assert torch.equal(h.edge_index, g.edge_index)
        assert h.x[:, 1:].argmax(1).tolist() == np.minimum(_degrees(g), 3).tolist()
        assert (h.x[:, 1:].sum(1) == 1).all()
    with pytest.raises(ValueError, match="max_degree"):
        data.with_degree(graphs, max_degree=0)
