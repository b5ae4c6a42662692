"""Graph-classification data sets made on the spot: no downloads.

Structure-labelled sets (every node's feature is the constant 1, so the label is in the structure alone), each
generated from a seed, classes balanced, 10-100 nodes per graph:

  house-cycle    a random sparse base graph with a 5-node motif attached by one edge: a house (label 1) or a
                 5-cycle (label 0); the cycle's graphs get one more base edge, so both classes have as many edges
  communities    2, 3 or 4 planted communities (labels 0-2) of a stochastic block model whose expected degree is
                 the same for every class (4 inside, 1 across), on 36-100 nodes whatever the class
  cycle-parity   one cycle of length 4-20 with random trees hanging from it; the label is the length's parity
  tree-cycle     a random tree (label 0) or a random tree plus one edge, i.e. one cycle (label 1)

and `digits`, scikit-learn's bundled 8x8 digits (1797 images, 10 classes) as graphs: the non-zero pixels are the
nodes, with features (intensity, row, column) scaled to [0, 1], joined to their 8 neighbours.

`with_degree` appends a one-hot node degree to every node's features: with the constant feature alone a GCN's
normalized mean aggregation cannot count neighbours, so the usual protocol for unlabelled graphs (as for the TU
social sets) gives the degree as a feature. `degree_baseline` is the structure-blind reference: logistic regression
on the node count and the degree histogram.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["DATASETS", "Graph", "collate", "degree_baseline", "degree_features", "make_dataset", "num_classes",
           "with_degree"]

DATASETS = ("house-cycle", "communities", "cycle-parity", "tree-cycle", "digits")
_CLASSES = {"house-cycle": 2, "communities": 3, "cycle-parity": 2, "tree-cycle": 2, "digits": 10}
MIN_NODES, MAX_NODES = 10, 100


class Graph(NamedTuple):
    """One graph: node features [n, F] float32, edge_index [2, E] long listing both directions, label."""

    x: torch.Tensor
    edge_index: torch.Tensor
    y: int

    @property
    def num_nodes(self) -> int:
        """The graph's node count, n."""
        return self.x.shape[0]


def num_classes(name: str) -> int:
    """The number of classes of data set `name`."""
    if name not in _CLASSES:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    return _CLASSES[name]


def _graph(n: int, edges: set[tuple[int, int]], y: int, x: np.ndarray | None = None) -> Graph:
    pairs = np.array(sorted(edges), dtype=np.int64).reshape(-1, 2).T
    both = np.concatenate([pairs, pairs[::-1]], axis=1)
    feats = np.ones((n, 1), dtype=np.float32) if x is None else x.astype(np.float32)
    return Graph(torch.from_numpy(feats), torch.from_numpy(both), int(y))


def _edge(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def _random_tree(rng: np.random.Generator, nodes: list[int], edges: set) -> None:
    """Joins `nodes` into a random recursive tree (each node to a random earlier one)."""
    for i in range(1, len(nodes)):
        edges.add(_edge(nodes[i], nodes[int(rng.integers(i))]))


def _extra_edges(rng: np.random.Generator, n: int, edges: set, count: int, low: int = 0) -> None:
    """Adds `count` new random edges among nodes low..n-1."""
    while count > 0:
        a, b = (int(v) for v in rng.integers(low, n, size=2))
        if a != b and _edge(a, b) not in edges:
            edges.add(_edge(a, b))
            count -= 1


def _house_cycle(rng: np.random.Generator, y: int) -> Graph:
    n = int(rng.integers(MIN_NODES, MAX_NODES + 1))
    base = n - 5
    edges: set = set()
    _random_tree(rng, list(range(base)), edges)
    _extra_edges(rng, base, edges, base // 10 + (1 - y))  # the cycle's graphs get the edge the house has more
    m = list(range(base, n))
    ring = [_edge(m[i], m[(i + 1) % (5 - y)]) for i in range(5 - y)]  # house: a 4-ring + roof; else a 5-ring
    edges.update(ring)
    if y:
        edges.update({_edge(m[4], m[0]), _edge(m[4], m[1])})
    edges.add(_edge(m[int(rng.integers(5))], int(rng.integers(base))))
    return _graph(n, edges, y)


def _communities(rng: np.random.Generator, y: int) -> Graph:
    c = y + 2
    n = int(rng.integers(36, MAX_NODES + 1))
    sizes = np.full(c, n // c)
    sizes[: n % c] += 1
    group = np.repeat(np.arange(c), sizes)
    rng.shuffle(group)
    same = group[:, None] == group[None, :]
    size_of = sizes[group]
    p_in = 4.0 / (size_of - 1)
    p_out = 1.0 / (n - size_of)
    p = np.where(same, p_in[:, None], p_out[:, None])
    upper = np.triu(rng.random((n, n)) < p, 1)
    edges = {(int(a), int(b)) for a, b in zip(*upper.nonzero())}
    return _graph(n, edges, y)


def _cycle_parity(rng: np.random.Generator, y: int) -> Graph:
    n = int(rng.integers(MIN_NODES + 10, MAX_NODES + 1))
    length = int(rng.choice([v for v in range(4, 21) if v % 2 == y]))
    edges = {_edge(i, (i + 1) % length) for i in range(length)}
    for i in range(length, n):  # trees hanging from the cycle: each new node joins a random earlier one
        edges.add(_edge(i, int(rng.integers(i))))
    return _graph(n, edges, y)


def _tree_cycle(rng: np.random.Generator, y: int) -> Graph:
    n = int(rng.integers(MIN_NODES, MAX_NODES + 1))
    edges: set = set()
    _random_tree(rng, list(range(n)), edges)
    _extra_edges(rng, n, edges, y)
    return _graph(n, edges, y)


def _digits(num_graphs: int, seed: int) -> list[Graph]:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))[:num_graphs]
    out = []
    for i in order:
        img = images[i].reshape(8, 8)
        rows, cols = np.nonzero(img)
        index = -np.ones((8, 8), dtype=np.int64)
        index[rows, cols] = np.arange(len(rows))
        edges = set()
        for r, c in zip(rows, cols):
            for dr, dc in ((0, 1), (1, -1), (1, 0), (1, 1)):
                rr, cc = r + dr, c + dc
                if 0 <= rr < 8 and 0 <= cc < 8 and index[rr, cc] >= 0:
                    edges.add(_edge(int(index[r, c]), int(index[rr, cc])))
        x = np.stack([img[rows, cols] / 16.0, rows / 7.0, cols / 7.0], axis=1)
        out.append(_graph(len(rows), edges, int(labels[i]), x))
    return out


_MAKERS = {"house-cycle": _house_cycle, "communities": _communities, "cycle-parity": _cycle_parity,
           "tree-cycle": _tree_cycle}


def make_dataset(name: str, num_graphs: int = 1000, seed: int = 0) -> list[Graph]:
    """Generates data set `name` (see the module docstring) deterministically from `seed`.

    Args:
        name: One of DATASETS.
        num_graphs: How many graphs (digits: at most 1797, a seeded random subset when fewer).
        seed: Everything random follows from it.

    Returns:
        The graphs; structure-labelled sets cycle through the labels (balanced classes).

    Raises:
        ValueError: an unknown name, or a count below the number of classes (or above 1797 for digits).
    """
    classes = num_classes(name)
    if num_graphs < classes:
        raise ValueError(f"make_dataset: num_graphs={num_graphs} is fewer than the {classes} classes of {name}")
    if name == "digits":
        if num_graphs > 1797:
            raise ValueError(f"make_dataset: digits has 1797 images, asked for {num_graphs}")
        return _digits(num_graphs, seed)
    rng = np.random.default_rng([seed, DATASETS.index(name)])
    return [_MAKERS[name](rng, i % classes) for i in range(num_graphs)]


def collate(graphs: list[Graph]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``graphs`` as one PyG-style sparse batch: (x [sum n, F], edge_index [2, sum E], batch [sum n], y [B])."""
    sizes = torch.tensor([g.num_nodes for g in graphs])
    offsets = torch.cumsum(sizes, 0) - sizes
    x = torch.cat([g.x for g in graphs])
    edge_index = torch.cat([g.edge_index + o for g, o in zip(graphs, offsets.tolist())], dim=1)
    batch = torch.arange(len(graphs)).repeat_interleave(sizes)
    y = torch.tensor([g.y for g in graphs])
    return x, edge_index, batch, y


def degree_features(graphs: list[Graph], max_degree: int = 16) -> np.ndarray:
    """Per graph of ``graphs``: the node count and the degree histogram (degrees >= max_degree in the last bin)."""
    rows = []
    for g in graphs:
        deg = np.bincount(g.edge_index[0].numpy(), minlength=g.num_nodes)
        hist = np.bincount(np.minimum(deg, max_degree), minlength=max_degree + 1)
        rows.append(np.concatenate([[g.num_nodes], hist]))
    return np.asarray(rows, dtype=np.float64)


def with_degree(graphs: list[Graph], max_degree: int = 10) -> list[Graph]:
    """The ``graphs`` with a one-hot node degree (max_degree + 1 columns, the last for degrees >= max_degree)
    appended to each node's features.

    Args:
        graphs: Graphs as make_dataset returns them.
        max_degree: Degrees from this one up share the last column.

    Raises:
        ValueError: max_degree below 1.
    """
    if not isinstance(max_degree, int) or max_degree < 1:
        raise ValueError(f"with_degree: max_degree must be an int >= 1, got {max_degree!r}")
    out = []
    for g in graphs:
        deg = torch.bincount(g.edge_index[0], minlength=g.num_nodes).clamp_max(max_degree)
        onehot = torch.nn.functional.one_hot(deg, max_degree + 1).to(g.x.dtype)
        out.append(Graph(torch.cat([g.x, onehot], 1), g.edge_index, g.y))
    return out


def degree_baseline(graphs: list[Graph], folds: int = 5, seed: int = 0) -> tuple[float, float]:
    """Structure-blind reference: stratified k-fold accuracy (mean, std) of logistic regression on
    `degree_features`. Needs scikit-learn.

    Args:
        graphs: the data set.
        folds: the k of the stratified k-fold.
        seed: the folds' shuffling seed.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    scores = cross_val_score(model, degree_features(graphs), [g.y for g in graphs],
                             cv=StratifiedKFold(folds, shuffle=True, random_state=seed))
    return float(scores.mean()), float(scores.std())
