"""parallelize(tp_overlap="oases") runs the user's blocks under the Oases sub-batch schedule on their own sharded
parameters and trains like one process: nanoGPT, Hugging Face GPT-2 and fastdist.testing's TransformerLM (its
nn.MultiheadAttention replicated, its MLP sharded) on a (1, 2, 1) mesh, nanoGPT on (1, 2, 2); the losses of 5 steps
and the parameters after, gathered by Engine.state_dict(), match single-process training. A block the schedule
cannot map raises an error naming it on every rank."""
import functools

import pytest
import torch
from engine_ranks import STEPS, reference, train
from helpers import assert_close
from torch import nn

from fastdist import tp
from fastdist.distributed import spawn
from fastdist.parallel.tensor import oases_pays
from fastdist.tp import comm

# The sub-batches sum the same products in another order: float32 rounding is all that may differ.
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


# Calibrated by hand: a link about as slow as the GEMMs (8 ms per all-reduce against 10-40 ms of a branch's GEMMs),
# and a free one.
SLOW_LINK = tp.CostModel(alpha=1e-5, beta=1e6, gemm_rate=1e7, world_size=2)
FAST_LINK = tp.CostModel(alpha=1e-7, beta=1e12, gemm_rate=1e7, world_size=2)
# nanoGPT's n_embd = 16 on 2 ranks: attention qkv (16 -> 24), proj (8 -> 16); MLP fc (16 -> 32), proj (32 -> 16)
GEMMS = [[(16, 24), (8, 16)], [(16, 32), (32, 16)]]


class PostNormBlock(nn.Module):
    """Named as nanoGPT's block, but post-norm (``norm(x + f(x))``): not the form the schedule computes."""

    def __init__(self, dim):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


class OddlyNamedBlock(PostNormBlock):
    """A block whose children follow no convention the schedule knows."""

    def __init__(self, dim):
        super().__init__(dim)
        self.first, self.second = self.ln_1, self.ln_2
        del self.ln_1, self.ln_2

    def forward(self, x):
        x = x + self.attn(self.first(x))
        return x + self.mlp(self.second(x))


class Stack(nn.Module):
    def __init__(self, block, layers=2, dim=16, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


_PLAN = {"blocks.*.attn.0": "colwise", "blocks.*.attn.2": "rowwise",
         "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


def _error_of(block):
    torch.manual_seed(0)
    try:
        train("unmappable", (1, 2, 1), model=Stack(block), tp_overlap="oases", tp_plan=_PLAN, steps=1)
    except ValueError as e:
        return str(e)
    return None


def ranks_run(cases):
    out = {}
    for case in cases:
        kind, _, arg = case.partition(":")
        if kind in ("train", "auto"):
            name, mesh = arg.split(":")
            if kind == "auto":
                tp.set_default_cost_model(SLOW_LINK)
            got = train(name, tuple(int(v) for v in mesh.split(",")), tp_overlap="oases" if kind == "train" else "auto")
            out[case] = {k: got[k] for k in ("losses", "state")}
            out[case]["chosen"] = [list(getattr(b.forward, "__self__", None).chosen.values())
                                   for b in got["engine"].module.pipeline_blocks]
            tp.set_default_cost_model(tp.CostModel())
        else:
            out[case] = _error_of({"post_norm": PostNormBlock, "oddly_named": OddlyNamedBlock}[arg])
    return out


JOBS = {2: ("train:nanogpt:1,2,1", "train:gpt2:1,2,1", "train:transformer_lm:1,2,1", "bad:post_norm",
            "bad:oddly_named", "auto:nanogpt:1,2,1"),
        4: ("train:nanogpt:1,2,2",)}


@functools.cache
def _job(world):
    return spawn(ranks_run, world, list(JOBS[world]), backend="gloo", timeout=600)


@pytest.mark.parametrize("model,mesh,world", [("nanogpt", "1,2,1", 2), ("gpt2", "1,2,1", 2),
                                              ("transformer_lm", "1,2,1", 2), ("nanogpt", "1,2,2", 4)])
def test_oases_schedule_in_parallelize_trains_like_one_process(model, mesh, world):
    want_losses, want_state = reference(model)
    ranks = [r[f"train:{model}:{mesh}"] for r in _job(world)]
    for rank, got in enumerate(ranks):
        assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), f"{model} on {mesh}, rank {rank}: "
                     f"losses of {STEPS} steps", **TOLERANCE)
    state = ranks[0]["state"]
    assert list(state) == list(want_state), "the gathered state dict is keyed as the user's model"
    for key, want in want_state.items():
        assert_close(state[key], want, f"{model} on {mesh}: {key} after {STEPS} steps", **TOLERANCE)


@pytest.mark.parametrize("case,says", [("post_norm", "differs from the block's own forward"),
                                       ("oddly_named", "children are named as one of")])
def test_a_block_the_schedule_cannot_map_raises_naming_it_on_every_rank(case, says):
    for rank, error in enumerate(r[f"bad:{case}"] for r in _job(2)):
        assert error is not None and "tp_overlap='oases' cannot map block blocks.0" in error and says in error, \
            f"rank {rank}: {error}"


def test_auto_takes_the_schedule_where_the_cost_model_predicts_it_pays_and_trains_like_one_process():
    assert oases_pays(SLOW_LINK, GEMMS, 8 * 16, 16, torch.float32, 2)
    assert not oases_pays(FAST_LINK, GEMMS, 8 * 16, 16, torch.float32, 2), "a free link leaves nothing to hide"
    assert not oases_pays(tp.CostModel(), GEMMS, 8 * 16, 16, torch.float32, 2), "uncalibrated: the plain block"
    want_losses, want_state = reference("nanogpt")
    ranks = [r["auto:nanogpt:1,2,1"] for r in _job(2)]
    for rank, got in enumerate(ranks):
        assert got["chosen"] == [[True]] * 4, f"rank {rank}: every block's microbatch shape takes the schedule"
        assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), f"rank {rank}: losses", **TOLERANCE)
    for key, want in want_state.items():
        assert_close(ranks[0]["state"][key], want, f"{key} after {STEPS} steps", **TOLERANCE)


def test_the_schedule_all_reduces_each_sharded_branch_once_per_sub_batch_each_way():
    """Counted on one block: 2 branches x 2 sub-batches forward and backward, nothing else."""
    got = spawn(_count_collectives, 2, backend="gloo", timeout=300)
    assert got[0] == {"forward": 4, "backward": 4}


def _count_collectives():
    """One nanoGPT block sharded and put under the schedule; its second call (the first also runs the block's own
    forward, as a check) counted: {phase: all-reduces}, and no more than one in flight."""
    import torch.distributed as dist
    import user_models as um

    from fastdist import tp
    from fastdist.parallel.tensor import install_oases

    torch.manual_seed(0)
    stack = um.NanoGPTStack(um.GPTConfig(n_layer=1, n_head=4, n_embd=16))
    tp.parallelize(stack, None, overlap_chunks=1)
    install_oases(stack, None)
    x = torch.randn(4, 8, 16)
    stack(x).sum().backward()
    with comm.count_collectives() as log:
        stack(x).sum().backward()
    assert log.max_in_flight == 1, f"{log.max_in_flight} collectives in flight"
    assert log.count(site="oases") == log.count(), [r.site for r in log.records]
    del dist
    return {phase: log.count("all_reduce", phase) for phase in ("forward", "backward")}
