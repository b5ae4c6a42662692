"""Train a small GPT whose feed-forward blocks are fastdist MoELayers, with experts spread over the ranks.

    torchrun --nproc-per-node 2 examples/moe_gpt.py --steps 50
    torchrun --nproc-per-node 4 examples/moe_gpt.py --balance shadow --experts 8

Each rank owns num_experts / world experts; tokens travel to them by all-to-all, and the planner (balance="prophet")
replicates the experts that the last step overloaded. Everything else is an ordinary data-parallel loop:
  - each MoE layer calibrates the planner's cost model once, before training (MoELayer.calibrate);
  - fastdist.moe.data_parallel wraps the model in DDP, which averages the replicated parameters (embeddings,
    attention, norms, gates), and has the MoE layers average their experts' gradients (each expert lives on one
    rank and its gradient already holds every rank's tokens), so the ranks train as one process on their joint batch;
  - each block asks its MoE layer to start the replica parameter transfer before its attention runs, so the
    transfer overlaps that compute (MoELayer.prefetch_replicas).

The data is a synthetic language: a fixed random bigram chain over --vocab tokens with Zipf-skewed rows (the same on
every rank), from which each rank samples its own sequences. The loss should fall toward the chain's entropy.
"""
import argparse
import math

import torch
import torch.distributed as dist
from fastdist import moe
from fastdist.moe import MoELayer
from torch import nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (a multiple of the ranks)")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--balance", default="prophet", choices=["prophet", "shadow", "replicate_topk", "none"])
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, dim, heads, experts, k, balance):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.moe = MoELayer(dim, 4 * dim, experts, k=k, balance=balance, dropless=True)

    def forward(self, x, causal_mask):
        self.moe.prefetch_replicas()  # replica parameters travel while the attention computes
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, experts, k, balance, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, experts, k, balance) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        seq = tokens.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        x = self.tok(tokens) + self.pos(torch.arange(seq))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))



def bigram_chain(vocab, seed):
    """Row-stochastic [vocab, vocab]: each token's successors Zipf-distributed over a random order."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.5
    rows = torch.stack([zipf[torch.randperm(vocab, generator=g)] for _ in range(vocab)])
    return rows / rows.sum(1, keepdim=True)


def sample(chain, batch, seq, generator):
    tokens = torch.empty(batch, seq + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(chain.shape[0], (batch,), generator=generator)
    for i in range(seq):
        tokens[:, i + 1] = torch.multinomial(chain[tokens[:, i]], 1, generator=generator).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]


def entropy_rate(chain):
    """Bits per token of the chain under its stationary distribution, in nats."""
    pi = torch.full((chain.shape[0],), 1.0 / chain.shape[0], dtype=torch.float64)
    for _ in range(200):
        pi = pi @ chain
    return float(-(pi[:, None] * chain * chain.clamp_min(1e-300).log()).sum())


def main(argv=None):
    """Trains; returns rank 0's list of (step, loss, tokens max/mean of the first MoE layer) and the entropy."""
    args = parse_args(argv)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same replicated weights on every rank (expert shapes are equal too)
    gpt = MoEGPT(args.vocab, args.dim, args.layers, args.heads, args.experts, args.k, args.balance, args.seq)
    for block in gpt.blocks:
        block.moe.calibrate()  # a collective; layers of one shape share the measurement
    model = moe.data_parallel(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    chain = bigram_chain(args.vocab, args.seed)
    data = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank its own sequences
    log = []
    for step in range(args.steps):
        inputs, targets = sample(chain, args.batch, args.seq, data)
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + moe.aux_loss(model)).backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        stats = gpt.blocks[0].moe.stats()
        log.append((step, mean_loss.item() / world, stats["tokens_max_over_mean"]))
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean_loss.item() / world:.4f}  layer-0 tokens max/mean "
                  f"{stats['tokens_max_over_mean']:.2f} (unbalanced {stats['tokens_max_over_mean_unbalanced']:.2f}), "
                  f"replicas {len(stats['replicas'])}", flush=True)
    entropy = entropy_rate(chain)
    if rank == 0:
        print(f"entropy rate of the chain: {entropy:.4f} nats/token (uniform would be {math.log(args.vocab):.4f})")
    if owns_group:
        dist.destroy_process_group()
    return log, entropy


if __name__ == "__main__":
    main()
