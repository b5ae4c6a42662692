"""fastdist.moe.data_parallel: a GPT whose FFNs are MoE layers, trained on 2 ranks that each take half of the global
batch, ends with the parameters of one process training on the whole batch (SGD and Adam, 5 steps, replicas on
and off); the README's MoE recipe runs as written under torchrun."""
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastdist import moe
from fastdist.testing.models import TransformerLM
from fastdist.distributed import spawn
from helpers import run_readme_recipe_under_torchrun

VOCAB, DIM, HEADS, LAYERS, SEQ, EXPERTS = 32, 16, 2, 2, 8, 4
BATCH, STEPS = 8, 5   # global batch; each of the 2 ranks trains on half of it
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.5),
              "adam": lambda params: torch.optim.Adam(params, lr=1e-2)}


def moe_gpt(balance, group=None):
    """A GPT (fastdist.testing.models.TransformerLM) whose FFNs are replaced by MoE layers, as a user would do it."""
    torch.manual_seed(0)
    model = TransformerLM(VOCAB, DIM, HEADS, LAYERS, seq=SEQ)
    for block in model.blocks:
        block.mlp = moe.MoELayer(DIM, 2 * DIM, EXPERTS, k=2, dropless=True, balance=balance, group=group)
    return model.double()  # float64: the comparison sees the gradients' scale, not summation order


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def train(model, optimizer, rows):
    """STEPS optimizer steps on `rows` of each global batch; the parameters after them, by name."""
    opt = OPTIMIZERS[optimizer](model.parameters())
    for batch in batches():
        tokens = batch[rows]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {name: p.detach().clone() for name, p in inner.named_parameters()}


def is_expert(name):
    return name.rsplit(".", 1)[-1] in ("w1", "b1", "w2", "b2")


def _train_share(state, balance, optimizers, ep_size):
    """Trains on this rank's share of every global batch; experts spread over groups of `ep_size` ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(g, g + ep_size))) for g in range(0, world, ep_size)]
    group = groups[rank // ep_size] if ep_size < world else None
    ep_rank, per = rank % ep_size, EXPERTS // ep_size
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    results = {}
    for optimizer in optimizers:
        model = moe_gpt(balance, group)  # each rank builds its own experts; the single-process weights replace them
        model.load_state_dict({n: t[ep_rank * per:(ep_rank + 1) * per] if is_expert(n) else t
                               for n, t in state.items()})
        results[optimizer] = train(moe.data_parallel(model), optimizer, share)
    return results


def assert_trained_alike(ranks, state, balance, ep_size):
    """Every rank's parameters equal one process's after training on the whole batches, for every optimizer."""
    for optimizer in ranks[0]:
        single = moe_gpt(balance)  # no process group here: one process holds every expert
        single.load_state_dict(state)
        want = train(single, optimizer, slice(None))
        for name, expected in want.items():
            for r in range(len(ranks)):
                if is_expert(name):  # each rank holds its group's contiguous share of the experts
                    group_first = r - r % ep_size
                    got = torch.cat([ranks[g][optimizer][name] for g in range(group_first, group_first + ep_size)])
                else:
                    got = ranks[r][optimizer][name]
                torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9, msg=f"{optimizer} {name} rank {r}")


@pytest.mark.parametrize("balance", ["none", "replicate_topk"])
def test_two_ranks_on_half_batches_train_like_one_process_on_the_whole_batch(balance):
    state = moe_gpt(balance).state_dict()
    ranks = spawn(_train_share, 2, state, balance, list(OPTIMIZERS), 2, backend="gloo", timeout=180,
                  threads_per_rank=1)
    assert_trained_alike(ranks, state, balance, ep_size=2)


@pytest.mark.slow
def test_two_expert_parallel_groups_of_two_ranks_train_like_one_process():
    # 4 ranks = 2 data-parallel copies of a 2-rank expert-parallel group: each expert's gradient is summed over its
    # two holders before the average
    state = moe_gpt("replicate_topk").state_dict()
    ranks = spawn(_train_share, 4, state, "replicate_topk", ["adam"], 2, backend="gloo", timeout=240,
                  threads_per_rank=1)
    assert_trained_alike(ranks, state, "replicate_topk", ep_size=2)


def test_expert_and_non_expert_parameters_split_the_model():
    model = moe_gpt("none")
    experts, others = moe.expert_parameters(model), moe.non_expert_parameters(model)
    assert len(experts) == 4 * LAYERS
    assert {id(p) for p in experts} | {id(p) for p in others} == {id(p) for p in model.parameters()}
    assert not {id(p) for p in experts} & {id(p) for p in others}
    assert all(p is not block.mlp.gate.weight for block in model.blocks for p in experts)


def test_readme_moe_recipe_runs_as_written_under_torchrun(tmp_path):
    stdout = run_readme_recipe_under_torchrun("tests/moe/test_data_parallel.py", tmp_path)
    losses = re.findall(r"rank (\d) loss (\d+\.\d+)", stdout)
    assert sorted(r for r, _ in losses) == ["0", "1"], stdout
