"""Models written the way users write them: a DLRM-style recommender and a nanoGPT-style language model."""
import torch
import torch.nn.functional as F
from torch import nn


class DLRM(nn.Module):
    """Dense features through a bottom MLP, sparse features through EmbeddingBags, their pairwise dot products
    and the dense vector through a top MLP to one logit."""

    def __init__(self, table_rows=(3000, 700, 40), dim=8, dense_in=5, sparse=True):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense_in, 16), nn.ReLU(), nn.Linear(16, dim), nn.ReLU())
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=sparse) for n in table_rows)
        pairs = (len(table_rows) + 1) * len(table_rows) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, ids, offsets):
        x = self.bottom(dense)
        feats = torch.stack([x] + [e(i, o) for e, i, o in zip(self.embeddings, ids, offsets)], 1)
        dots = feats @ feats.transpose(1, 2)
        rows, cols = torch.triu_indices(feats.shape[1], feats.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, rows, cols]], 1)).squeeze(1)


def dlrm_batch(rank, step, batch=6, table_rows=(3000, 700, 40), dense_in=5):
    g = torch.Generator().manual_seed(7919 * step + rank)
    dense = torch.randn(batch, dense_in, generator=g)
    ids, offsets = [], []
    for n in table_rows:
        lengths = torch.randint(0, 4, (batch,), generator=g)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
        ids.append(torch.randint(0, n, (int(lengths.sum()),), generator=g))
    labels = torch.randint(0, 2, (batch,), generator=g).float()
    return dense, ids, offsets, labels


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # bias=False as nanoGPT's config allows: the key bias's gradient is zero up to rounding, which Adam would
        # scale up to full steps in either run, differently
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, 2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, blocks, final LayerNorm, a bias-free head (tied or not)."""

    def __init__(self, vocab=1500, block_size=8, d=16, heads=2, layers=1, tie=True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block_size, d),
            h=nn.ModuleList(Block(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_batch(rank, step, batch=3, block_size=8, vocab=1500):
    g = torch.Generator().manual_seed(104729 * step + rank)
    tokens = torch.randint(0, vocab, (batch, block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
