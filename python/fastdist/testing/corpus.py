"""A deterministic synthetic language for convergence experiments: Zipf-distributed tokens with learnable
bigram structure, generated on the fly (no files, no downloads).

    corpus = ZipfMarkovCorpus(vocab=32768, seed=0)
    tokens = corpus.batch(rank, step, batch=8, seq=32)     # int64 [8, 33]: inputs [:, :-1], targets [:, 1:]
    held_out = corpus.heldout(batch=16, seq=32)            # a fixed batch no training stream ever draws

The language. Token k has base probability p(k) ∝ (k + 1)^-exponent (Zipf). Every token a owns a short
successor list succ[a, 0..K-1] with Dirichlet(1) weights w[a, :]. A sequence starts from a token drawn
from p; after token a the next token is, with probability `follow`, succ[a, j] for j ~ w[a, :], and
otherwise a fresh draw from p. So the next token is far more predictable from the previous one than from
frequency alone: the entropy rate is well below the unigram entropy (`entropy_rate`, `unigram_entropy`),
and a language model's loss can actually fall.

The successor lists are filled so that p stays the chain's stationary distribution (token frequencies
follow Zipf over the whole vocabulary, not only the head): every list slot (a, j) carries the flow
p(a) w[a, j]; the slots are ordered by that flow (with a log-normal jitter, so lists are random) and laid
end to end on [0, 1), the tokens are laid on [0, 1) by their cumulative p, and each slot points at the
token under its midpoint. Each token b then receives list flow ≈ p(b), so large flows go to frequent
tokens and successors are themselves Zipf-distributed. (Drawing successors independently from p instead
keeps the head Zipf but makes the tail fall much faster: a rare token is then reached mostly through rare
predecessors.)

Streams. Every (rank, step) pair has its own generator, seeded from (seed, rank, step): rank r's shard is
stream r, the held-out batch is its own stream, and any batch can be regenerated alone, in any order, on
any thread count. The tables themselves come from one generator seeded by `seed` only, so every rank
builds the same language.
"""

import torch

from fastdist.distributed.fingerprint import fingerprint

_HELDOUT_STREAM = -1


def generator(*key: object) -> torch.Generator:
    """A torch.Generator seeded from a key (any fingerprintable values): one independent stream per key."""
    return torch.Generator().manual_seed(fingerprint(("fastdist.corpus",) + key) & ((1 << 63) - 1))


def zipf_probs(vocab: int, exponent: float) -> torch.Tensor:
    """float64 [vocab]: p(k) ∝ (k + 1)^-exponent, normalized."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    p = ranks.pow(-float(exponent))
    return p / p.sum()


def _draw(cdf, u):
    """Inverse-CDF sampling: indices k with cdf[k-1] <= u < cdf[k] (cdf along the last dim)."""
    return torch.searchsorted(cdf, u.contiguous().unsqueeze(-1)).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


class ZipfMarkovCorpus:
    """Zipf unigram + sparse random bigram transitions; see the module docstring.

    vocab:      number of token ids (>= 2).
    exponent:   Zipf exponent of the base distribution (1.1 is close to natural text).
    successors: K, the length of each token's successor list.
    follow:     probability that the next token comes from the successor list rather than from p.
    seed:       selects the language (tables) and, with rank and step, every batch.
    """

    def __init__(self, vocab: int = 32768, exponent: float = 1.1, successors: int = 8, follow: float = 0.9,
                 seed: int = 0) -> None:
        if vocab < 2:
            raise ValueError(f"ZipfMarkovCorpus: vocab must be >= 2, got {vocab}")
        if successors < 1:
            raise ValueError(f"ZipfMarkovCorpus: successors must be >= 1, got {successors}")
        if not 0.0 <= follow <= 1.0:
            raise ValueError(f"ZipfMarkovCorpus: follow must be in [0, 1], got {follow}")
        self.vocab, self.exponent, self.successors, self.follow, self.seed = (
            int(vocab), float(exponent), int(successors), float(follow), int(seed))
        self.unigram = zipf_probs(self.vocab, self.exponent)            # float64 [V]: the base p
        self._cdf = torch.cumsum(self.unigram, 0)
        self._cdf[-1] = 1.0
        g = generator("tables", self.seed)
        w = -torch.log(torch.rand(self.vocab, self.successors, generator=g, dtype=torch.float64).clamp_min(1e-300))
        self.weights = w / w.sum(1, keepdim=True)                        # float64 [V, K], rows sum to 1
        self._wcdf = torch.cumsum(self.weights, 1)
        self._wcdf[:, -1] = 1.0
        self.succ = self._fill_successors(g)                             # int64 [V, K]

    def _fill_successors(self, g, jitter=2.0):
        flow = (self.unigram.unsqueeze(1) * self.weights).reshape(-1)   # stationary flow through each slot
        key = torch.log(flow) + jitter * torch.randn(flow.shape, generator=g, dtype=torch.float64)
        order = torch.argsort(key, descending=True, stable=True)
        ends = torch.cumsum(flow[order], 0)
        succ = torch.empty_like(order)
        succ[order] = _draw(self._cdf, ends - flow[order] / 2)
        return succ.view(self.vocab, self.successors)

    # --- sampling --------------------------------------------------------------------------------------

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """int64 [batch, length] token ids from the chain, using `generator`."""
        out = torch.empty(batch, length, dtype=torch.int64)
        if length == 0 or batch == 0:
            return out
        u = torch.rand(batch, length, 3, generator=generator, dtype=torch.float64)
        out[:, 0] = _draw(self._cdf, u[:, 0, 0])
        for t in range(1, length):
            prev = out[:, t - 1]
            j = _draw(self._wcdf[prev], u[:, t, 0])
            followed = self.succ[prev, j]
            fresh = _draw(self._cdf, u[:, t, 1])
            out[:, t] = torch.where(u[:, t, 2] < self.follow, followed, fresh)
        return out

    def batch(self, rank: int, step: int, batch: int, seq: int) -> torch.Tensor:
        """Rank `rank`'s batch at `step`: int64 [batch, seq + 1] (inputs = [:, :-1], targets = [:, 1:])."""
        if rank < 0:
            raise ValueError(f"ZipfMarkovCorpus.batch: rank must be >= 0, got {rank}")
        return self.sample(batch, seq + 1, generator("batch", self.seed, int(rank), int(step)))

    def heldout(self, batch: int, seq: int) -> torch.Tensor:
        """A fixed held-out batch int64 [batch, seq + 1], from a stream no rank trains on."""
        return self.sample(batch, seq + 1, generator("batch", self.seed, _HELDOUT_STREAM, 0))

    # --- what the language looks like ------------------------------------------------------------------

    def transition_rows(self, prev: torch.Tensor) -> torch.Tensor:
        """float64 [len(prev), V]: P(next | prev) for the given previous tokens (dense; use on few rows)."""
        prev = torch.as_tensor(prev, dtype=torch.int64).reshape(-1)
        rows = (1.0 - self.follow) * self.unigram.expand(prev.numel(), -1).clone()
        rows.scatter_add_(1, self.succ[prev], self.follow * self.weights[prev])
        return rows

    def stationary(self, iters: int = 200, tol: float = 1e-12) -> torch.Tensor:
        """float64 [V]: the chain's stationary token distribution (power iteration from p)."""
        pi = self.unigram.clone()
        for _ in range(iters):
            nxt = (1.0 - self.follow) * self.unigram
            nxt = nxt.index_add(0, self.succ.reshape(-1), (self.follow * pi.unsqueeze(1) * self.weights).reshape(-1))
            done = float((nxt - pi).abs().sum()) < tol
            pi = nxt
            if done:
                break
        return pi

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the stationary token distribution: the best loss without context."""
        pi = self.stationary()
        return float(-(pi * torch.log(pi.clamp_min(1e-300))).sum())

    def entropy_rate(self) -> float:
        """H(next | prev) in nats under the stationary distribution: the best loss a bigram model can reach
        (the chain is first-order, so no longer context does better)."""
        pi = self.stationary()
        base = (1.0 - self.follow) * self.unigram                         # P(b | a) off a's successor list
        plogp = lambda x: x * torch.log(x.clamp_min(1e-300))
        same = self.succ.unsqueeze(2) == self.succ.unsqueeze(1)          # [V, K, K]: successor j == j'
        mass = (same * self.weights.unsqueeze(1)).sum(2) * self.follow    # list mass of succ[a, j] in row a
        first = ~torch.tril(same, diagonal=-1).any(2)                     # count each distinct successor once
        b = base[self.succ]
        correction = torch.where(first, -plogp(b + mass) + plogp(b), torch.zeros_like(b)).sum(1)
        h = float(-plogp(base).sum()) + correction                         # H(P(. | a)) for every a
        return float((pi * h).sum())
