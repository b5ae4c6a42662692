"""Train a language model with a large vocabulary under DDP, reducing its gradients with fastdist's sketch hook.

    torchrun --nproc-per-node 2 examples/sparse_embedding_lm.py --steps 20
    torchrun --nproc-per-node 4 examples/sparse_embedding_lm.py --mode sketch --ratio 0.002 --error-feedback

The model (from fastdist.testing.models) has two 32768-row matrices -- the input embedding and the output
embedding of a sampled softmax -- whose gradients are non-zero only in the rows a step touches (about 1-4 %).
A plain DDP all-reduce sends both matrices whole every step. `sketch_hook` sends only what is needed:

  mode="auto"    per bucket and step: a plain all-reduce for dense buckets (the LSTM), the union of the
                 ranks' non-zero rows all-reduced losslessly when that is cheap, a count-sketch otherwise
  mode="exact"   always the lossless union all-reduce
  mode="sketch"  always a count-sketch of `ratio` x the bucket's size (lossy; add error feedback)

Everything else is an ordinary DDP training loop. Two things matter for the hook:
  - `bucket_cap_mb` small, so that each big matrix sits alone in its DDP bucket: the hook then works per
    row (one bit per row in the support bitmap) instead of per element;
  - the data: each rank draws its own shard of a synthetic Zipf corpus (fastdist.testing.corpus).
"""
import argparse

import torch
import torch.distributed as dist
from fastdist.testing.models import SparseLM, make_data, step_batch
from fastdist.comm.hooks import SketchState, sketch_hook
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--negatives", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--mode", default="auto", choices=["auto", "exact", "sketch"])
    p.add_argument("--ratio", type=float, default=0.05, help="sketch size as a fraction of each bucket")
    p.add_argument("--error-feedback", action="store_true", help="sketch-space error feedback (mode sketch)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    """Trains; returns rank 0's list of (step, training loss, what the hook did) and the final held-out loss."""
    args = parse_args(argv)
    owns_group = not dist.is_initialized()  # under torchrun; fastdist.distributed.spawn initializes it for us
    if owns_group:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = {"vocab": args.vocab, "exponent": 1.1, "seed": args.seed, "negatives": args.negatives,
              "batch": args.batch, "seq": args.seq}
    corpus, sampler = make_data(config)  # the same language and negatives on every rank

    torch.manual_seed(args.seed)  # DDP broadcasts rank 0's initial weights anyway
    model = SparseLM(args.vocab, args.dim)
    ddp = DDP(model, bucket_cap_mb=1e-6)  # one bucket per parameter: each big matrix alone
    state = SketchState(mode=args.mode, ratio=args.ratio, seed=args.seed, error_feedback=args.error_feedback)
    ddp.register_comm_hook(state, sketch_hook)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)

    log, sent_before = [], 0
    for step in range(args.steps):
        inputs, targets, negatives = step_batch(corpus, sampler, rank, step, config)  # this rank's shard
        opt.zero_grad()
        loss = ddp(inputs, targets, negatives, sampler.log_expected)
        loss.backward()  # the hook reduces each bucket here
        opt.step()
        stats = state.stats()
        big = [b for b in stats.values() if b["numel"] >= args.vocab]  # the two V-row matrices
        sent = sum(b["wire_bytes"] for b in stats.values())  # running totals per bucket
        step_bytes = sent - sent_before if sent >= sent_before else sent  # (DDP re-buckets after step 0)
        sent_before = sent
        how = "/".join(b["last_method"] for b in big)
        log.append((step, loss.item(), how, step_bytes))
        if rank == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  embeddings reduced as {how:<13}  "
                  f"sent {step_bytes / 2**10:8.1f} KiB", flush=True)

    held = corpus.heldout(16, args.seq)
    final = model.full_loss(held[:, :-1], held[:, 1:])  # full softmax, no communication
    if rank == 0:
        dense = sum(p.numel() * p.element_size() for p in model.parameters()) * 2 * (dist.get_world_size() - 1) \
            / dist.get_world_size()
        print(f"held-out loss (full softmax) after {args.steps} steps: {final:.4f}; "
              f"a dense all-reduce would send {dense / 2**10:.1f} KiB per step")
    if owns_group:
        dist.destroy_process_group()
    return log, final


if __name__ == "__main__":
    main()
