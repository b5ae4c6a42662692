"""Graph classifiers around a pluggable pooler: one GNN encoder, pooling levels, one readout, one classifier head.

Every pooler of the benchmark gets the same network around it: an encoder block (`layers` GCN or GIN convolutions
from PyG, ReLU after each) before the first level and after every level, a readout after every block (the graph's
mean node embedding, summed over blocks), and a two-layer MLP head. The poolers:

  hap, hap-no-moa, hap-no-gcont   fastdist.graph.HAPPool (and its two ablations), dense after the first level
  hap-small-c, hap-norm           HAP with the global content C started 10x smaller, or with layer-normalized
                                  pooled features (HAPPool's content_scale=0.1, normalize=True): candidate fixes
  diffpool                        PyG dense_diff_pool, assignment by a GNN of the encoder's kind (DiffPool's design)
  mincut                          PyG dense_mincut_pool, assignment by a linear layer (MinCutPool's design)
  topk, sag, asap                 PyG TopKPooling, SAGPooling, ASAPooling (sparse: keep a ratio of the nodes)
  mean                            no coarsening: the same blocks one after the other (global mean pooling)

Dense poolers keep ceil(num_nodes * ratio^l) clusters at level l; sparse poolers keep a `ratio` of each graph's
nodes; after a dense level the encoder block is PyG's dense counterpart (DenseGCNConv, DenseGINConv), the same
operator on a dense adjacency (for GIN degree-normalized, D^-1/2 A D^-1/2: GIN sums over a pooled adjacency that
carries whole clusters' edge mass). The dense poolers (AUX_POOLERS) return auxiliary losses that the training loss
adds with a weight; the sparse ones and mean pooling have none.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fastdist.graph._pyg import require
from fastdist.graph.pool import HAPPool, densify

__all__ = ["AUX_POOLERS", "DENSE_POOLERS", "POOLERS", "READOUTS", "GraphClassifier", "HAPClassifier"]

HAP_POOLERS = ("hap", "hap-no-moa", "hap-no-gcont", "hap-small-c", "hap-norm")
POOLERS = HAP_POOLERS + ("diffpool", "mincut", "topk", "sag", "asap", "mean")
DENSE_POOLERS = HAP_POOLERS + ("diffpool", "mincut")
AUX_POOLERS = DENSE_POOLERS
ENCODERS = ("gcn", "gin")
READOUTS = ("mean", "sum", "mean+sum")
# HAPPool's arguments per HAP pooler: the ablations and the candidate fixes
_HAP_KW = {"hap": {}, "hap-no-moa": {"moa": False}, "hap-no-gcont": {"gcont": False},
           "hap-small-c": {"content_scale": 0.1}, "hap-norm": {"normalize": True}}


def _mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o))


class _Block(nn.Module):
    """`layers` convolutions of one kind (sparse or dense), ReLU after each."""

    def __init__(self, encoder: str, dense: bool, i: int, o: int, layers: int) -> None:
        super().__init__()
        pyg = require("torch_geometric.nn")
        self.dense, self.encoder = dense, encoder
        dims = [i] + [o] * layers
        if encoder == "gcn":
            conv = pyg.DenseGCNConv if dense else pyg.GCNConv
            self.convs = nn.ModuleList(conv(a, b) for a, b in zip(dims, dims[1:]))
        else:
            conv = pyg.DenseGINConv if dense else pyg.GINConv
            self.convs = nn.ModuleList(conv(_mlp(a, b)) for a, b in zip(dims, dims[1:]))

    def forward(self, x, graph, mask=None):
        if self.dense and self.encoder == "gin":
            # A pooled adjacency S^T A S sums edge mass over whole clusters and GIN sums over it unnormalized, so
            # activations grow with cluster size; D^-1/2 A D^-1/2 keeps them at the scale of the input graph's.
            deg = graph.sum(-1).clamp(min=1).rsqrt()
            graph = deg[..., :, None] * graph * deg[..., None, :]
        for conv in self.convs:
            if self.dense:
                x = conv(x, graph, mask)
            elif self.encoder == "gcn":
                x = conv(x, graph[0], graph[1])  # edge weights: ASAP's pooled graphs carry them
            else:
                x = conv(x, graph[0])
            x = x.relu()
        return x


class GraphClassifier(nn.Module):
    """GNN encoder, `levels` pooling levels, readout, classifier: the network every pooler is compared in.

    Args:
        in_channels: Node feature size.
        hidden: Width of the encoder, the pooled features and the head.
        num_classes: Number of graph classes.
        levels: Pooling levels (0: encoder and readout only).
        pooler: One of POOLERS.
        encoder: "gcn" or "gin" (PyG's GCNConv/GINConv, their dense counterparts after a dense level).
        num_nodes: Typical node count of the data (e.g. the mean): dense poolers keep ceil(num_nodes * ratio^l)
            clusters at level l.
        ratio: Coarsening ratio per level (the fraction of nodes sparse poolers keep).
        layers: Convolutions per encoder block.
        dropout: Dropout before the head's last layer.
        hops, heads: HAPPool's multi-hop order and attention heads (HAP poolers only).
        readout: How a block's node embeddings become a graph vector: "mean", "sum", or "mean+sum" (both,
            concatenated; the sum sees the node count, which a mean cannot).
    """

    def __init__(self, in_channels: int, hidden: int, num_classes: int, levels: int = 2, pooler: str = "hap",
                 encoder: str = "gcn", num_nodes: int = 32, ratio: float = 0.5, layers: int = 2,
                 dropout: float = 0.0, hops: int = 2, heads: int = 4, readout: str = "mean") -> None:
        super().__init__()
        if pooler not in POOLERS:
            raise ValueError(f"GraphClassifier: unknown pooler {pooler!r}; choose from {', '.join(POOLERS)}")
        if encoder not in ENCODERS:
            raise ValueError(f"GraphClassifier: unknown encoder {encoder!r}; choose from {', '.join(ENCODERS)}")
        if readout not in READOUTS:
            raise ValueError(f"GraphClassifier: unknown readout {readout!r}; choose from {', '.join(READOUTS)}")
        for name, value, low in (("in_channels", in_channels, 1), ("hidden", hidden, 1),
                                 ("num_classes", num_classes, 2), ("levels", levels, 0), ("num_nodes", num_nodes, 1),
                                 ("layers", layers, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"GraphClassifier: {name} must be an int >= {low}, got {value!r}")
        if not 0 < ratio < 1:
            raise ValueError(f"GraphClassifier: ratio must be in (0, 1), got {ratio}")
        pyg = require("torch_geometric.nn")
        self.in_channels, self.pooler, self.levels, self.readout = in_channels, pooler, levels, readout
        self.clusters = [max(1, math.ceil(num_nodes * ratio ** (level + 1))) for level in range(levels)]
        dense = pooler in DENSE_POOLERS
        self.blocks = nn.ModuleList([_Block(encoder, False, in_channels, hidden, layers)]
                                    + [_Block(encoder, dense, hidden, hidden, layers) for _ in range(levels)])
        pools = []
        for k in self.clusters:
            if pooler.startswith("hap"):
                pools.append(HAPPool(hidden, k, hops=hops, heads=heads, **_HAP_KW[pooler]))
            elif pooler == "diffpool":
                pools.append(_Block(encoder, True, hidden, k, 1).convs[0])
            elif pooler == "mincut":
                pools.append(nn.Linear(hidden, k))
            elif pooler == "topk":
                pools.append(pyg.TopKPooling(hidden, ratio))
            elif pooler == "sag":
                pools.append(pyg.SAGPooling(hidden, ratio))
            elif pooler == "asap":
                pools.append(pyg.ASAPooling(hidden, ratio))
        self.pools = nn.ModuleList(pools)
        width = 2 * hidden if readout == "mean+sum" else hidden
        self.head = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor,
                edge_weight: torch.Tensor | None = None,
                num_graphs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Classifies a PyG-style sparse batch.

        Args:
            x: Node features [num_nodes, in_channels].
            edge_index: [2, E] (both directions for undirected graphs).
            batch: [num_nodes] sorted graph index of every node.
            edge_weight: Optional [E] edge weights.
            num_graphs: The number of graphs; None infers it from `batch`.

        Returns:
            (logits [num_graphs, num_classes], the sum of the poolers' auxiliary losses, a scalar).

        Raises:
            ValueError: x not [num_nodes, in_channels], an empty batch, a graph without nodes (num_graphs larger
                than the graphs `batch` holds), an unsorted or mis-sized `batch`, edges to nodes that do not exist,
                a mis-sized edge_weight, NaN or infinite features.
        """
        pyg = require("torch_geometric.nn")
        if x.dim() != 2 or x.shape[1] != self.in_channels:
            raise ValueError(f"GraphClassifier: x must be [num_nodes, {self.in_channels}], got {tuple(x.shape)}")
        if not torch.compiler.is_compiling():
            num_graphs = self._check(x, edge_index, batch, edge_weight, num_graphs)
        num_graphs = int(batch.max()) + 1 if num_graphs is None else num_graphs
        aux = x.new_zeros(())
        h = self.blocks[0](x, (edge_index, edge_weight))
        readout = self._read(h, batch, num_graphs)
        adj = mask = None
        for level, block in enumerate(self.blocks[1:]):
            if self.pooler == "mean":
                h = block(h, (edge_index, edge_weight))
            elif self.pooler in ("topk", "sag"):
                h, edge_index, edge_weight, batch, _, _ = self.pools[level](h, edge_index, edge_weight, batch)
                h = block(h, (edge_index, edge_weight))
            elif self.pooler == "asap":
                h, edge_index, edge_weight, batch, _ = self.pools[level](h, edge_index, edge_weight, batch)
                h = block(h, (edge_index, edge_weight))
            else:
                if adj is None:
                    h, adj, mask = densify(h, edge_index, batch, edge_weight, batch_size=num_graphs)
                pool = self.pools[level]
                if self.pooler.startswith("hap"):
                    h, adj, losses = pool(h, adj, mask)
                    aux = aux + losses.total()
                elif self.pooler == "diffpool":
                    h, adj, link, entropy = pyg.dense_diff_pool(h, adj, pool(h, adj, mask), mask)
                    aux = aux + link + entropy
                else:
                    h, adj, cut, ortho = pyg.dense_mincut_pool(h, adj, pool(h), mask)
                    aux = aux + cut + ortho
                mask = None  # every cluster of a pooled graph is real
                h = block(h, adj)
            readout = readout + self._read(h, batch, num_graphs)
        return self.head(readout), aux

    @staticmethod
    def _check(x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor, edge_weight: torch.Tensor | None,
               num_graphs: int | None) -> int:
        """Raises ValueError for a batch the poolers would misread (most would silently drop or pad); returns the
        number of graphs."""
        if x.shape[0] == 0:
            raise ValueError("GraphClassifier: the batch has no nodes")
        if batch.shape != (x.shape[0],) or batch.dtype != torch.long:
            raise ValueError(f"GraphClassifier: batch must be int64 [num_nodes] = [{x.shape[0]}], got "
                             f"{batch.dtype} {list(batch.shape)}")
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"GraphClassifier: edge_index must be [2, E], got {tuple(edge_index.shape)}")
        if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= x.shape[0]):
            raise ValueError(f"GraphClassifier: edge_index refers to nodes outside 0..{x.shape[0] - 1}")
        if edge_weight is not None and edge_weight.shape != (edge_index.shape[1],):
            raise ValueError(f"GraphClassifier: edge_weight must be [E] = [{edge_index.shape[1]}], got "
                             f"{list(edge_weight.shape)}")
        if bool((batch[1:] < batch[:-1]).any()) or int(batch[0]) < 0:
            raise ValueError("GraphClassifier: batch must be sorted and >= 0 (nodes of one graph together, graphs in "
                             "order)")
        needed = int(batch[-1]) + 1
        if num_graphs is not None and num_graphs < needed:
            raise ValueError(f"GraphClassifier: num_graphs={num_graphs} but batch numbers {needed} graphs")
        counts = torch.bincount(batch, minlength=num_graphs or needed)
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"GraphClassifier: graph(s) {empty[:8]} of the batch have no nodes; drop empty graphs "
                             "before batching (a pooled or read-out empty graph has no meaning)")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("GraphClassifier: x has NaN or infinite features")
        return num_graphs or needed

    def _read(self, h: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        """The graph vectors of one block's output: sparse [nodes, F] by `batch`, or dense [B, K, F] (all real)."""
        pyg = require("torch_geometric.nn")
        parts = []
        if self.readout in ("mean", "mean+sum"):
            parts.append(h.mean(1) if h.dim() == 3 else pyg.global_mean_pool(h, batch, size=num_graphs))
        if self.readout in ("sum", "mean+sum"):
            parts.append(h.sum(1) if h.dim() == 3 else pyg.global_add_pool(h, batch, size=num_graphs))
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


class HAPClassifier(GraphClassifier):
    """GraphClassifier with HAP levels: `HAPClassifier(in_channels, hidden, num_classes, levels=2, encoder="gcn")`.

    Takes GraphClassifier's arguments; `pooler` may name a HAP ablation ("hap-no-moa", "hap-no-gcont").

    Args:
        in_channels, hidden, num_classes, levels: as for GraphClassifier.
        pooler: "hap" or one of its variants ("hap-no-moa", "hap-no-gcont", "hap-small-c", "hap-norm").
        **kwargs: GraphClassifier's other arguments (encoder, num_nodes, ratio, layers, dropout, hops, heads,
            readout).
    """

    def __init__(self, in_channels: int, hidden: int, num_classes: int, levels: int = 2, pooler: str = "hap",
                 **kwargs: object) -> None:
        if not pooler.startswith("hap"):
            raise ValueError(f"HAPClassifier: pooler must be hap or one of its variants, got {pooler!r}; "
                             "use GraphClassifier for PyG's poolers")
        super().__init__(in_channels, hidden, num_classes, levels, pooler=pooler, **kwargs)
