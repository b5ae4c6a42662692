"""Synthetic embedding gradients with realistic overlap between ranks, for benchmarks and tests.

A rank's embedding gradient has a non-zero row for every token id its mini-batch touched. Token
frequencies in text follow Zipf's law, so frequent tokens appear in every rank's batch (their rows
overlap across ranks) and rare ones in at most one (they don't). This module draws each rank's rows
that way: token ids come from one Zipf distribution shared by all ranks (P(k-th most frequent) ~
1/k^exponent, exponent 1.1 by default; the frequency rank -> row id mapping is a fixed permutation from
`seed`, shared by all ranks), and a rank takes distinct tokens in the order its stream draws them until
its row density is reached. The first d distinct draws of a weighted stream are a weighted sample
without replacement, drawn here exactly and in one pass with the Gumbel-top-k trick.

Values: standard normal, rounded to multiples of 2^-12 and clipped to (-8, 8), never exactly 0 (so
every chosen row is non-zero and the local density is exact). With these values any sum over up to 512
ranks is exact in float32 whatever the order, so a lossless reduction reproduces `exact_sum` bit for bit
and its relative error is exactly 0.

Everything is seeded per (seed, rank, step): any process can rebuild any rank's gradient, which is how
`exact_sum` computes the reference sum without communicating.
"""
import dataclasses

import torch

__all__ = ["GradientSpec", "exact_sum", "union_rows", "zipf_embedding_grad", "zipf_rows"]

VALUE_QUANTUM = 2.0 ** -12
VALUE_LIMIT = 8.0 - VALUE_QUANTUM


@dataclasses.dataclass(frozen=True)
class GradientSpec:
    """The shape and statistics of a synthetic embedding gradient (the same on every rank)."""
    rows: int = 32768              # vocabulary size
    dim: int = 1024                # embedding width
    density: float = 0.02          # fraction of rows non-zero on each rank
    exponent: float = 1.1          # Zipf exponent of token frequencies
    seed: int = 0
    dtype: torch.dtype = torch.float32

    @property
    def local_rows(self) -> int:
        """Non-zero rows per rank: round(density x rows), at least 1 for a positive density."""
        if not (0.0 <= self.density <= 1.0):
            raise ValueError(f"GradientSpec: density must be in [0, 1], got {self.density}")
        return min(self.rows, max(int(self.density > 0), round(self.density * self.rows)))

    @property
    def nbytes(self) -> int:
        """The gradient's size in bytes (float32)."""
        return self.rows * self.dim * torch.empty((), dtype=self.dtype).element_size()


def _generator(*key):
    # one 63-bit seed from the key, stable across runs and platforms
    h = 1469598103934665603
    for k in key:
        h = ((h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return torch.Generator().manual_seed(h & 0x7FFFFFFFFFFFFFFF)


def _log_weights(spec):
    """log P(token) per row id: Zipf over frequency ranks, mapped to row ids by a permutation shared by all ranks."""
    ranks = torch.arange(1, spec.rows + 1, dtype=torch.float64)
    logw = -spec.exponent * torch.log(ranks)
    perm = torch.randperm(spec.rows, generator=_generator(spec.seed, 0x5EED))
    out = torch.empty_like(logw)
    out[perm] = logw  # row perm[k] is the (k+1)-th most frequent token
    return out


def zipf_rows(spec: GradientSpec, rank: int, step: int = 0) -> torch.Tensor:
    """The sorted row ids (int64) rank `rank` touches at `step`: spec.local_rows distinct Zipf-drawn tokens."""
    k = spec.local_rows
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    g = _generator(spec.seed, 1, rank, step)
    u = torch.rand(spec.rows, dtype=torch.float64, generator=g).clamp_(min=1e-300)
    keys = _log_weights(spec) - torch.log(-torch.log(u))  # log-weight + Gumbel noise
    return torch.topk(keys, k, sorted=False).indices.sort().values


def _values(spec, rank, step, count):
    g = _generator(spec.seed, 2, rank, step)
    v = torch.randn(count, spec.dim, generator=g)
    v = torch.round(v / VALUE_QUANTUM).mul_(VALUE_QUANTUM).clamp_(-VALUE_LIMIT, VALUE_LIMIT)
    v[v == 0] = VALUE_QUANTUM
    return v.to(spec.dtype)


def zipf_embedding_grad(spec: GradientSpec, rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient [rows, dim], its sorted non-zero row ids) of rank `rank` at `step`."""
    rows = zipf_rows(spec, rank, step)
    grad = torch.zeros(spec.rows, spec.dim, dtype=spec.dtype)
    grad[rows] = _values(spec, rank, step, rows.numel())
    return grad, rows


def union_rows(spec: GradientSpec, world: int, step: int = 0) -> torch.Tensor:
    """Sorted row ids non-zero on at least one of ranks 0..world-1."""
    if world < 1:
        raise ValueError(f"union_rows: world must be >= 1, got {world}")
    return torch.unique(torch.cat([zipf_rows(spec, r, step) for r in range(world)]))


def exact_sum(spec: GradientSpec, world: int, step: int = 0) -> torch.Tensor:
    """The exact sum of ranks 0..world-1's gradients at `step`, computed locally (no communication)."""
    if world > 512:
        raise ValueError("exact_sum: sums over more than 512 ranks are no longer exact in float32")
    total = torch.zeros(spec.rows, spec.dim, dtype=spec.dtype)
    for r in range(world):
        rows = zipf_rows(spec, r, step)
        total.index_add_(0, rows, _values(spec, r, step, rows.numel()))
    return total
