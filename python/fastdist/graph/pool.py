"""HAP: hierarchical adaptive pooling, one coarsening level on dense batched graphs.

Our reading of Liu et al., "Hierarchical Adaptive Pooling by Capturing High-order Dependency for Graph
Representation Learning" (arXiv 2104.05960; only the abstract is public, see docs/graph.md for what is the
paper's and what is ours):

- the next level's K clusters are queries; the current level's nodes are keys and values (MOA, a cross-level
  attention). Keys are multi-hop: every head mixes the node features propagated 0..hops times through the
  normalized adjacency with learned per-head hop weights, so a cluster can attend to close neighbourhoods and to
  higher-order dependencies;
- the queries come from GCont, a learned global content matrix [K, F'] shared by all graphs, shifted by the
  graph's own summary (masked mean of its node features). The same content is added to the pooled features
  (clusters keep an identity across graphs) and a content loss asks the clusters together to carry the content of
  the level below (the mass-weighted mean of the pooled features equals the mean of the node values);
- the attention logits, averaged over heads and soft-maxed over clusters, are the soft assignment S [N, K] that
  coarsens the structure, A' = S^T A S (as DiffPool); the pooled features are the attention read-out (soft-maxed
  over nodes), so both come from one set of logits.

Because the queries do not depend on node order, the pooled graph (x', adj') is invariant to any permutation of
the nodes, and S permutes with them.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["HAPPool", "PoolLosses", "SparseHAPPool", "densify"]

_EPS = 1e-12


class PoolLosses(NamedTuple):
    """The auxiliary losses of one pooling level (scalars; add them to the task loss).

    Attributes:
        link: ||A - S S^T||_F / n^2 per graph, batch mean (DiffPool's link-prediction loss).
        entropy: mean over nodes of the assignment's entropy, batch mean (crisp assignments).
        content: GCont's content-stability loss, ||mean values - mass-weighted mean pooled||^2 / ||mean values||^2;
            zero without GCont.
    """

    link: torch.Tensor
    entropy: torch.Tensor
    content: torch.Tensor

    def total(self) -> torch.Tensor:
        """The sum of the three losses."""
        return self.link + self.entropy + self.content


class HAPPool(nn.Module):
    """One HAP coarsening level: x [B, N, F], adj [B, N, N], mask [B, N] -> x' [B, K, F'], adj' [B, K, K], losses.

    Args:
        in_channels: F, the node feature size.
        num_clusters: K, the number of nodes of the coarsened graph.
        hops: How many times node features are propagated for the multi-hop keys (0: the features only).
        heads: Attention heads; must divide `out_channels`.
        out_channels: F'; default `in_channels`.
        moa: False replaces MOA by a single-head attention to the plain node features (hops=0): an ablation.
        gcont: False drops the global content: the queries are a function of the graph's summary only, nothing is
            added to the pooled features and the content loss is zero (an ablation).
        dropout: Dropout on the attention weights (training only).
        content_scale: The global content C starts as a normal matrix times content_scale / sqrt(F'); below 1 the
            content, the same for every graph, no longer drowns the graph-specific part of the pooled features at
            initialization (must be > 0: a zero C gives every cluster the same query, and they never part).
        normalize: Layer-normalize the attention read-out before C is added, so the graph-specific part of the
            pooled features has unit scale whatever the scale of the values.
        check_inputs: Validate shapes, dtypes, empty graphs and non-finite values on every call (one host sync).
    """

    def __init__(self, in_channels: int, num_clusters: int, hops: int = 2, heads: int = 4,
                 out_channels: int | None = None, moa: bool = True, gcont: bool = True, dropout: float = 0.0,
                 content_scale: float = 1.0, normalize: bool = False, check_inputs: bool = True) -> None:
        super().__init__()
        out_channels = in_channels if out_channels is None else out_channels
        for name, value, low in (("in_channels", in_channels, 1), ("num_clusters", num_clusters, 1),
                                 ("hops", hops, 0), ("heads", heads, 1), ("out_channels", out_channels, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"HAPPool: {name} must be an int >= {low}, got {value!r}")
        if not moa:
            hops, heads = 0, 1
        if out_channels % heads:
            raise ValueError(f"HAPPool: heads={heads} must divide out_channels={out_channels}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"HAPPool: dropout must be in [0, 1), got {dropout}")
        if not (isinstance(content_scale, (int, float)) and math.isfinite(content_scale) and content_scale > 0):
            raise ValueError(f"HAPPool: content_scale must be a finite number > 0, got {content_scale!r}")
        self.in_channels, self.out_channels, self.num_clusters = in_channels, out_channels, num_clusters
        self.hops, self.heads, self.moa, self.gcont = hops, heads, moa, gcont
        self.content_scale, self.normalize = float(content_scale), normalize
        self.check_inputs = check_inputs
        self.key = nn.Linear(in_channels, out_channels, bias=False)
        self.value = nn.Linear(in_channels, out_channels)
        self.query = nn.Linear(out_channels, out_channels, bias=False)
        self.out = nn.Linear(out_channels, out_channels)
        # Per head, a softmax over hop orders 0..hops; zero logits start every head at the uniform mix.
        self.hop_logits = nn.Parameter(torch.zeros(heads, hops + 1)) if hops else None
        if gcont:
            self.content = nn.Parameter(torch.randn(num_clusters, out_channels) * (content_scale
                                                                                   / math.sqrt(out_channels)))
            self.summary = nn.Linear(in_channels, out_channels)
        else:
            self.seeds = nn.Linear(in_channels, num_clusters * out_channels)
        self.norm = nn.LayerNorm(out_channels) if normalize else None
        self.dropout = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return (f"{self.in_channels} -> {self.out_channels}, clusters={self.num_clusters}, hops={self.hops}, "
                f"heads={self.heads}, moa={self.moa}, gcont={self.gcont}, content_scale={self.content_scale:g}, "
                f"normalize={self.normalize}")

    def _check(self, x: torch.Tensor, adj: torch.Tensor, mask: torch.Tensor) -> None:
        if x.dim() != 3 or adj.dim() != 3:
            raise ValueError(f"HAPPool: expected x [B, N, F] and adj [B, N, N], got x {tuple(x.shape)} and "
                             f"adj {tuple(adj.shape)}")
        batch, nodes, features = x.shape
        if features != self.in_channels:
            raise ValueError(f"HAPPool: x has {features} features per node, this pool was built for "
                             f"in_channels={self.in_channels}")
        if adj.shape != (batch, nodes, nodes):
            raise ValueError(f"HAPPool: adj must be [B, N, N] = {[batch, nodes, nodes]} to match x, got "
                             f"{list(adj.shape)}")
        if mask.shape != (batch, nodes):
            raise ValueError(f"HAPPool: mask must be [B, N] = {[batch, nodes]} to match x, got {list(mask.shape)} "
                             "(a graph larger than the padding does not fit)")
        if mask.dtype != torch.bool:
            raise TypeError(f"HAPPool: mask must be torch.bool, got {mask.dtype}")
        weight = self.key.weight
        for name, t in (("x", x), ("adj", adj)):
            if t.dtype != weight.dtype:
                raise TypeError(f"HAPPool: {name} is {t.dtype} but the pool's parameters are {weight.dtype} "
                                "(convert one with .to(dtype))")
        if batch == 0:
            raise ValueError("HAPPool: the batch is empty (B = 0)")
        empty = (~mask.any(1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"HAPPool: graph(s) {empty[:8]} of the batch have no nodes (mask all False); an "
                             "empty graph cannot be pooled")
        if not (torch.isfinite(x) | ~mask[..., None]).all():
            raise ValueError("HAPPool: x has NaN or infinite features on real (unmasked) nodes")
        pad = ~(mask[:, :, None] & mask[:, None, :])
        if not (torch.isfinite(adj) | pad).all():
            raise ValueError("HAPPool: adj has NaN or infinite entries between real (unmasked) nodes")
        if ((adj < 0) & ~pad).any():
            raise ValueError("HAPPool: adj has negative edge weights; the multi-hop keys need a non-negative "
                             "adjacency")

    def forward(self, x: torch.Tensor, adj: torch.Tensor, mask: torch.Tensor | None = None,
                return_assignment: bool = False) -> tuple:
        """Coarsens a batch of padded graphs to `num_clusters` nodes each.

        Args:
            x: Node features [B, N, F]; padded nodes may hold anything (they are ignored).
            adj: Adjacency [B, N, N], non-negative weights; entries touching padded nodes are ignored.
            mask: [B, N] bool, True for real nodes; None means every node is real.
            return_assignment: Also return the soft assignment S [B, N, K] (rows of padded nodes are zero).

        Returns:
            (x' [B, K, F'], adj' [B, K, K], PoolLosses), plus S when `return_assignment`.

        Raises:
            ValueError: bad shapes, feature size other than in_channels, an empty batch or graph, NaN or infinite
                values on real nodes, negative edge weights.
            TypeError: a dtype other than the parameters', a mask that is not bool.
        """
        if mask is None:
            mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        if self.check_inputs:
            self._check(x, adj, mask)
        batch, nodes, _ = x.shape
        heads, dh, k = self.heads, self.out_channels // self.heads, self.num_clusters
        pair = mask[:, :, None] & mask[:, None, :]
        # where, not multiply: a NaN in a padded entry must not leak (NaN * 0 is NaN).
        x = torch.where(mask[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        adj = torch.where(pair, adj, torch.zeros((), dtype=adj.dtype, device=adj.device))
        m = mask.to(x.dtype)
        n = m.sum(1)  # real nodes per graph

        # Keys of order p are A_hat^p X W_K, A_hat = D^-1/2 (A + I) D^-1/2 over real nodes: the projection X W_K is
        # propagated (the same product, done once), and D^-1/2 scales features, not the N x N matrix.
        key = self.key(x).view(batch, nodes, heads, dh)
        if self.hop_logits is None:
            keys = key
        else:
            inv = (adj.sum(-1) + m).clamp_min(_EPS).rsqrt() * m  # [B, N]; 0 on padded nodes
            beta = self.hop_logits.softmax(-1)  # [heads, hops + 1]
            h = key.reshape(batch, nodes, -1)
            keys = key * beta[:, 0, None]
            for p in range(1, self.hops + 1):
                scaled = inv[..., None] * h
                h = inv[..., None] * (adj @ scaled + scaled)
                keys = keys + h.view(batch, nodes, heads, dh) * beta[:, p, None]
        keys = keys.transpose(1, 2)  # [B, h, N, dh]
        values = self.value(x)  # [B, N, F']
        summary = (x * m[..., None]).sum(1) / n[:, None]  # masked mean [B, F]
        if self.gcont:
            base = self.content.expand(batch, k, self.out_channels) + self.summary(summary)[:, None, :]
        else:
            base = self.seeds(summary).view(batch, k, self.out_channels)
        queries = self.query(base).view(batch, k, heads, dh).transpose(1, 2) / math.sqrt(dh)  # [B, h, K, dh]
        logits = queries @ keys.transpose(-1, -2)  # [B, h, K, N]

        att = logits.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)  # over nodes
        att = self.dropout(att)
        pooled = (att @ values.view(batch, nodes, heads, dh).transpose(1, 2))  # [B, h, K, dh]
        pooled = pooled.transpose(1, 2).reshape(batch, k, self.out_channels)
        x_out = self.out(pooled)
        if self.norm is not None:
            x_out = self.norm(x_out)
        if self.gcont:
            x_out = x_out + self.content

        s = logits.mean(1).transpose(1, 2).softmax(-1) * m[..., None]  # [B, N, K], over clusters
        st = s.transpose(1, 2)
        adj_out = st @ adj @ s

        link = ((adj - s @ st).square().sum((1, 2)).sqrt() / n.square()).mean()
        entropy = ((-s * s.clamp_min(_EPS).log()).sum((1, 2)) / n).mean()
        if self.gcont:
            before = (values * m[..., None]).sum(1) / n[:, None]
            after = (pooled * s.sum(1)[..., None]).sum(1) / n[:, None]
            content = ((before - after).square().sum(-1) / (before.square().sum(-1) + _EPS)).mean()
        else:
            content = x_out.new_zeros(())
        losses = PoolLosses(link, entropy, content)
        if return_assignment:
            return x_out, adj_out, losses, s
        return x_out, adj_out, losses


def densify(x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor | None = None,
            edge_weight: torch.Tensor | None = None, max_num_nodes: int | None = None,
            batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyG's sparse batch (x, edge_index, batch) as dense padded tensors, with PyG's to_dense_batch/to_dense_adj.

    Args:
        x: Node features [num_nodes, F].
        edge_index: [2, E] long, node indices into x (both directions listed for an undirected graph).
        batch: [num_nodes] graph index of every node, sorted; None for a single graph.
        edge_weight: [E] edge weights; None for ones.
        max_num_nodes: The padding N; None pads to the largest graph. A graph with more nodes raises
            (to_dense_batch would silently drop its extra nodes).
        batch_size: The number of graphs; None infers it from `batch` (graphs with no nodes at the end need it).

    Returns:
        (x [B, N, F], adj [B, N, N], mask [B, N] bool).

    Raises:
        ValueError: a graph larger than `max_num_nodes`, an unsorted `batch`, shapes that do not match.
        ImportError: torch_geometric is not installed.
    """
    from fastdist.graph._pyg import require

    utils = require("torch_geometric.utils")
    if x.dim() != 2:
        raise ValueError(f"densify: x must be [num_nodes, F], got {tuple(x.shape)}")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"densify: edge_index must be [2, E], got {tuple(edge_index.shape)}")
    if batch is None:
        batch = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    if batch.shape != (x.shape[0],):
        raise ValueError(f"densify: batch must be [num_nodes] = [{x.shape[0]}], got {list(batch.shape)}")
    if batch.numel() > 1 and (batch[1:] < batch[:-1]).any():
        raise ValueError("densify: batch must be sorted (nodes of one graph together, graphs in order)")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= x.shape[0]):
        raise ValueError(f"densify: edge_index refers to nodes outside 0..{x.shape[0] - 1}")
    if batch_size is None:
        batch_size = int(batch.max()) + 1 if batch.numel() else 0
    counts = torch.bincount(batch, minlength=batch_size)
    if max_num_nodes is not None and counts.numel() and int(counts.max()) > max_num_nodes:
        big = (counts > max_num_nodes).nonzero().flatten().tolist()
        raise ValueError(f"densify: graph(s) {big[:8]} have {int(counts.max())} nodes at most, more than the "
                         f"padding max_num_nodes={max_num_nodes}")
    xd, mask = utils.to_dense_batch(x, batch, max_num_nodes=max_num_nodes, batch_size=batch_size)
    adj = utils.to_dense_adj(edge_index, batch, edge_attr=edge_weight, max_num_nodes=xd.shape[1],
                             batch_size=batch_size).to(x.dtype)
    return xd, adj, mask


class SparseHAPPool(nn.Module):
    """A HAPPool that takes PyG's sparse batch: densifies (x, edge_index, batch) and calls the pool.

    Args:
        pool: The HAPPool to call (its parameters are shared, not copied).
        max_num_nodes: The padding; None pads each batch to its largest graph.
    """

    def __init__(self, pool: HAPPool, max_num_nodes: int | None = None) -> None:
        super().__init__()
        self.pool, self.max_num_nodes = pool, max_num_nodes

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor | None = None,
                edge_weight: torch.Tensor | None = None, return_assignment: bool = False) -> tuple:
        """Densifies with `densify` and returns what `HAPPool.forward` returns.

        Args:
            x: node features [sum n, F] of the batch's graphs.
            edge_index: [2, E] edges (both directions), as PyG's.
            batch: [sum n] graph of each node (None: one graph).
            edge_weight: [E] non-negative weights (None: 1).
            return_assignment: also return the soft assignment S [B, N, K].
        """
        xd, adj, mask = densify(x, edge_index, batch, edge_weight, self.max_num_nodes)
        return self.pool(xd, adj, mask, return_assignment=return_assignment)
