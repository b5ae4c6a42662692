"""A rank that fails inside an MoE training step (``with fastdist.moe.step(i):``) under data parallelism, by raising
in its loss, raising in an MoE layer's forward, or being killed (SIGKILL, as the OOM killer does), makes the other
rank raise RankFailedError naming it within seconds, wherever it waits (the MoE all-to-all, DDP's reduce), instead
of at the process group's timeout."""
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastdist import moe
from fastdist.distributed import RankError, spawn
from fastdist.testing.models import TransformerLM

VOCAB, DIM, HEADS, LAYERS, SEQ, EXPERTS, BATCH = 32, 16, 2, 2, 8, 4, 4
GLOO_TIMEOUT_S = 300  # the process group's timeout (spawn's): what the other rank would wait without the failure path
PROMPT_S = 30         # a bound for the failing step, generous for a loaded 2-core machine
FAILING, STEP = 1, 2


def _fails_in_a_step(how, out_dir):
    """Trains a GPT whose FFNs are MoE layers under fastdist.moe.data_parallel until rank FAILING fails in step
    STEP (``how``: "loss" raises in the user's loss, "forward" in the first MoE layer's experts, "kill" kills the
    process); what each rank raised and how long its failing step took (also written to ``out_dir``)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TransformerLM(VOCAB, DIM, HEADS, LAYERS, seq=SEQ)
    for block in model.blocks:
        block.mlp = moe.MoELayer(DIM, 2 * DIM, EXPERTS, k=2, dropless=True, balance="replicate_topk")
    layer = model.blocks[0].mlp
    ffn = layer._ffn

    def experts_raise(*args):
        raise RuntimeError("forward: an expert raised")
    ddp = moe.data_parallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    done = []
    for i in range(1, STEP + 2):
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
        failing = rank == FAILING and i == STEP
        layer._ffn = experts_raise if failing and how == "forward" else ffn
        start = time.perf_counter()
        try:
            with moe.step(i):
                logits = ddp(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
                if failing and how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if failing and how == "loss":
                    raise ValueError("loss: the user's loss raised")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        except Exception as e:  # noqa: BLE001 - the test reads it
            got = {"error": f"{type(e).__name__}: {e}", "notes": getattr(e, "__notes__", []),
                   "seconds": time.perf_counter() - start, "steps_done": done, "rank_attr": getattr(e, "rank", None),
                   "died": getattr(e, "died", None)}
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(got, f)
            return got
        done.append(i)
    return {"error": None, "steps_done": done}


@pytest.mark.parametrize("how, context", [("loss", ""), ("forward", " (MoE layer 0's forward)")])
def test_a_rank_raising_in_an_moe_step_under_ddp_makes_the_other_raise_promptly_naming_it(tmp_path, how, context):
    ranks = spawn(_fails_in_a_step, 2, how, str(tmp_path), backend="gloo", timeout=GLOO_TIMEOUT_S)
    for rank, got in enumerate(ranks):
        assert got["error"] is not None and got["steps_done"] == [1], f"rank {rank}: {got}"
        assert got["seconds"] < PROMPT_S, f"rank {rank} raised after {got['seconds']:.1f} s"
    own, other = ranks[FAILING], ranks[1 - FAILING]
    assert own["error"].startswith(("ValueError: loss", "RuntimeError: forward")), own["error"]
    assert any(f"rank {FAILING}" in note for note in own["notes"]), own["notes"]
    assert other["error"].startswith(f"RankFailedError: fastdist.moe: rank {FAILING} raised in step {STEP}{context}: "
                                     f"{own['error']}"), other["error"]
    assert other["rank_attr"] == FAILING and other["died"] is False


def test_a_rank_killed_in_an_moe_step_under_ddp_makes_the_other_raise_promptly_naming_it(tmp_path):
    with pytest.raises(RankError) as info:
        spawn(_fails_in_a_step, 2, "kill", str(tmp_path), backend="gloo", timeout=GLOO_TIMEOUT_S)
    assert info.value.rank == FAILING and "SIGKILL" in str(info.value)
    other = json.loads((tmp_path / f"rank{1 - FAILING}.json").read_text())
    assert other["error"].startswith(f"RankFailedError: fastdist.moe: rank {FAILING} died during step {STEP} "
                                     "without raising"), other["error"]
    assert other["rank_attr"] == FAILING and other["died"] is True and other["steps_done"] == [1]
    assert other["seconds"] < PROMPT_S, f"the other rank raised after {other['seconds']:.1f} s"
