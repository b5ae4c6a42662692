"""examples/moe_gpt.py: a GPT with MoELayer feed-forward blocks trains on 2 gloo ranks with the planner on."""
import os
import runpy

from fastdist.distributed import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "moe_gpt.py")


def _train(argv):
    return runpy.run_path(EXAMPLE)["main"](argv)


def test_moe_gpt_example_loss_falls_on_two_ranks():
    argv = ["--steps", "25", "--layers", "1", "--dim", "32", "--batch", "4", "--lr", "1e-2"]
    results = spawn(_train, 2, argv, backend="gloo", timeout=240, threads_per_rank=1)
    log, entropy = results[0]
    losses = [loss for _, loss, _ in log]
    assert results[1][0] == log  # every rank reports the same averaged loss
    assert losses[-1] < losses[0] - 0.8, losses
    assert losses[-1] > entropy - 0.05  # no rank can beat the data's entropy: the loss is a real held-out-like loss
