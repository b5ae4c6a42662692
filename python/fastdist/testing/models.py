"""The models the benchmark suites, the tests and the examples share.

- `Block`, `TransformerLM`: a pre-norm transformer; the `memory` suite's encoder stack and `compress-findings`'
  GPT (learned positions, causal mask, compressed stage boundaries between blocks) are both a TransformerLM.
- `ResidualCNN`, `ResNet50`: the `memory` suite's convolutional models; `StagedCNN`: `compress-findings`' 3-stage
  CNN with a boundary after each stage.
- `BagModel`: a recommendation-style model, a sparse EmbeddingBag under an MLP head (`sparse`'s part ddp).
- `SparseLM`, `NegativeSampler`, `make_data`, `step_batch`: `sparse-lm`'s large-vocabulary language model with
  a sampled softmax, and the data a step sees (what examples/sparse_embedding_lm.py trains).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdist.testing.corpus import ZipfMarkovCorpus, generator

# ---- transformers ----


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(LayerNorm x), then + MLP(LayerNorm x), MLP 4x wide, GELU."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Token embedding, `layers` Blocks, LayerNorm, a linear head over the vocabulary: [B, T] ids -> logits.

    Args:
        vocab: Token ids (and logits) per position.
        dim: Model width.
        heads: Attention heads per block.
        layers: Blocks.
        seq: With a length, a GPT: learned positions (zero at first) for up to `seq` tokens and a causal mask.
            None: neither (an encoder stack, attention over the whole sequence).
        boundaries: Modules applied to the activation after each of the first len(boundaries) blocks (the
            compressed stage boundaries of a pipeline).
    """

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int | None = None,
                 boundaries: Sequence[nn.Module] = ()):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim)) if seq else None
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.boundaries = nn.ModuleList(boundaries)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.triu(torch.full((seq, seq), float("-inf")), 1) if seq else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos[:t]
        mask = self.causal[:t, :t] if self.causal is not None else None
        for i, block in enumerate(self.blocks):
            x = block(x, mask)
            if i < len(self.boundaries):
                x = self.boundaries[i](x)
        return self.head(self.norm(x))


# ---- convolutional networks ----


class ConvBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual connection, channels kept."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class _PooledConvNet(nn.Module):
    """stem -> blocks -> global average pooling -> head, for networks that define those three."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class ResidualCNN(_PooledConvNet):
    """A 3x3 stem to `channels`, `blocks` ConvBlocks, global average pooling, `classes` logits."""

    def __init__(self, channels: int, blocks: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(blocks))
        self.head = nn.Linear(channels, classes)


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1 down to `width`, 3x3 (with the stride), 1x1 up to 4 x width, skip."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.skip(x) + self.body(x))


class ResNet50(_PooledConvNet):
    """ResNet-50 (bottleneck stages of 3, 4, 6, 3 blocks); its 16 blocks are the segments."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, cin = [], 64
        for width, count, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)


class StagedCNN(nn.Module):
    """Three convolutional stages (8, 16, 16 channels) on [B, 1, 16, 16] images, a boundary module after each,
    and 8 logits."""

    def __init__(self, boundaries: Sequence[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        ])
        self.boundaries = nn.ModuleList(boundaries)
        self.head = nn.Linear(16 * 4 * 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, boundary in zip(self.stages, self.boundaries):
            x = boundary(stage(x))
        return self.head(x.flatten(1))


# ---- a recommendation-style model ----


class BagModel(nn.Module):
    """A sparse EmbeddingBag (sum of each bag's rows), then an MLP head dim -> hidden -> 1 with ReLU."""

    def __init__(self, rows: int, dim: int, hidden: int = 256):
        super().__init__()
        self.emb = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids, offsets)).squeeze(1)


# ---- the sparse-embedding language model ----


class NegativeSampler:
    """Negatives for the sampled softmax: `count` draws (with replacement) from unigram^power, from a
    generator seeded by (seed, step), so every rank draws the same set at the same step.
    log_expected[k] = log(count * q(k)), the correction subtracted from sampled logits."""

    def __init__(self, unigram: torch.Tensor, count: int, power: float = 0.75, seed: int = 0):
        q = unigram.double().pow(power)
        q /= q.sum()
        self.count, self.seed = int(count), int(seed)
        self._cdf = torch.cumsum(q, 0)
        self._cdf[-1] = 1.0
        self.log_expected = torch.log(self.count * q).float()

    def draw(self, step: int) -> torch.Tensor:
        """The step's negatives: int64 [count] token ids."""
        u = torch.rand(self.count, generator=generator("negatives", self.seed, int(step)), dtype=torch.float64)
        return torch.searchsorted(self._cdf, u).clamp_(max=self._cdf.numel() - 1)


class SparseLM(nn.Module):
    """Embedding(V, D) -> LSTM(D, d) -> output embedding V x (d + 1) (the last column is the bias); D = d unless
    `embed_dim` says otherwise (a wide input embedding makes its gradient, not the compute, the large part).

    forward() is the sampled-softmax training loss (row-sparse gradients in both V-row matrices);
    full_loss() the full-softmax cross-entropy, for evaluation. sparse=True makes both embeddings produce
    torch.sparse_coo gradients (for DDP's sparse all-reduce)."""

    def __init__(self, vocab: int, dim: int, sparse: bool = False, embed_dim: int | None = None):
        super().__init__()
        self.vocab, self.dim = int(vocab), int(dim)
        self.embed_dim = self.dim if embed_dim is None else int(embed_dim)
        self.embed = nn.Embedding(vocab, self.embed_dim, sparse=sparse)
        self.lstm = nn.LSTM(self.embed_dim, dim, batch_first=True)
        self.out = nn.Embedding(vocab, dim + 1, sparse=sparse)
        nn.init.normal_(self.embed.weight, std=0.1)
        nn.init.zeros_(self.out.weight)  # uniform predictions at first: the loss starts at log(V)

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B*T, d + 1] features (LSTM output with a constant 1 for the bias column)."""
        h, _ = self.lstm(self.embed(inputs))
        h = h.reshape(-1, self.dim)
        return torch.cat([h, torch.ones_like(h[:, :1])], 1)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor,
                log_expected: torch.Tensor) -> torch.Tensor:
        h = self.hidden(inputs)
        t = targets.reshape(-1)
        true_logit = (h * self.out(t)).sum(1) - log_expected[t]
        neg_logits = h @ self.out(negatives).t() - log_expected[negatives]
        neg_logits = neg_logits.masked_fill(negatives.unsqueeze(0) == t.unsqueeze(1), float("-inf"))
        logits = torch.cat([true_logit.unsqueeze(1), neg_logits], 1)
        return (torch.logsumexp(logits, 1) - true_logit).mean()

    @torch.no_grad()
    def full_loss(self, inputs: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> float:
        """Full-softmax cross-entropy (nats per token), no communication."""
        h = self.hidden(inputs)
        t = targets.reshape(-1)
        total = 0.0
        for lo in range(0, t.numel(), chunk):
            logits = h[lo:lo + chunk] @ self.out.weight.t()
            total += float(F.cross_entropy(logits, t[lo:lo + chunk], reduction="sum"))
        return total / max(1, t.numel())

    @staticmethod
    def touched_rows(inputs: torch.Tensor, targets: torch.Tensor,
                     negatives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of (embed, out) that a step's gradient can be non-zero in."""
        return inputs.unique(), torch.cat([targets.reshape(-1), negatives]).unique()


def make_data(config: dict[str, Any]) -> tuple[ZipfMarkovCorpus, NegativeSampler]:
    """The corpus and negative sampler of a run: config holds vocab, exponent, seed and negatives."""
    corpus = ZipfMarkovCorpus(config["vocab"], exponent=config["exponent"], seed=config["seed"])
    sampler = NegativeSampler(corpus.unigram, config["negatives"], seed=config["seed"])
    return corpus, sampler


def step_batch(corpus: ZipfMarkovCorpus, sampler: NegativeSampler, rank: int, step: int,
               config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (inputs, targets, negatives) at `step`; config holds batch and seq."""
    tokens = corpus.batch(rank, step, config["batch"], config["seq"])
    return tokens[:, :-1], tokens[:, 1:], sampler.draw(step)
