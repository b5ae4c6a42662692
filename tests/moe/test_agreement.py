"""MoELayer's ranks disagreeing never hang, abort or pair the wrong calls: a different dtype on one rank, a cost
model on one rank only, or a call one rank skips each raise MismatchError on every rank; the layer pickles without
its process group and works again once attached."""
import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from fastdist.distributed import MismatchError, spawn
from fastdist.moe import CostModel, MoELayer

D, F_DIM, E = 8, 16, 4
COST = CostModel(d_model=D, d_ff=F_DIM, a2a_alpha_s=1e-5, a2a_bytes_per_s=1e9, flops_per_s=1e9, p2p_bytes_per_s=1e10)


def tokens(rank, step=0, count=12):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(count, D, generator=g)
    x[:, 0] = 1.0
    return x


def mismatch_of(run):
    """The MismatchError message `run()` raised, or None."""
    try:
        run()
    except MismatchError as err:
        return str(err)
    return None


def _one_rank_in_another_dtype(how):
    rank = dist.get_rank()
    layer = MoELayer(D, F_DIM, E, k=2, dropless=True, balance="none")
    x = tokens(rank)
    if rank == 1 and how in ("bfloat16", "float64"):
        dtype = getattr(torch, how)
        layer, x = layer.to(dtype), x.to(dtype)
    if rank == 1 and how == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mismatch_of(lambda: layer(x))
    return mismatch_of(lambda: layer(x))


@pytest.mark.parametrize("how", ["bfloat16", "float64", "autocast"])
def test_a_rank_computing_in_another_dtype_raises_on_every_rank(how):
    messages = spawn(_one_rank_in_another_dtype, 2, how, backend="gloo", timeout=60, threads_per_rank=1)
    assert all(m is not None and "'MoELayer dtype' differs across ranks" in m for m in messages), messages
    assert "bfloat16" in messages[0] or "float64" in messages[0]


def _cost_model_on_rank_0_only():
    return mismatch_of(lambda: MoELayer(D, F_DIM, E, k=2, cost_model=COST if dist.get_rank() == 0 else None))


def test_a_cost_model_on_one_rank_only_raises_on_every_rank_in_the_constructor():
    messages = spawn(_cost_model_on_rank_0_only, 2, backend="gloo", timeout=60, threads_per_rank=1)
    assert all(m is not None and "'MoELayer configuration' differs" in m and "'cost_model'" in m
               for m in messages), messages


def _a_skipped_call():
    rank = dist.get_rank()
    first = MoELayer(D, F_DIM, E, k=2, dropless=True, balance="none")
    second = MoELayer(D, F_DIM, E, k=2, dropless=True, balance="none")

    def step():
        if rank == 0:  # rank 1 skips the first layer: its second layer's call meets rank 0's first
            first(tokens(rank))
        second(tokens(rank))

    return mismatch_of(step)


def test_a_call_one_rank_skips_raises_on_every_rank_instead_of_pairing_other_calls():
    messages = spawn(_a_skipped_call, 2, backend="gloo", timeout=60, threads_per_rank=1)
    assert all(m is not None and "'MoELayer call' differs across ranks" in m for m in messages), messages
    assert "layer 0 of its group, call 0" in messages[0] and "layer 1 of its group, call 0" in messages[0]


def _pickled_and_attached():
    rank = dist.get_rank()
    layer = MoELayer(D, F_DIM, E, k=2, dropless=True, balance="prophet", cost_model=COST)
    for step in range(2):  # the planner has a history to keep
        layer(tokens(rank, step)).sum().backward()
    twin = pickle.loads(pickle.dumps(layer))
    try:
        twin(tokens(rank, 2))
        unattached = None
    except RuntimeError as err:
        unattached = str(err)
    twin.attach()
    x = tokens(rank, 3)
    copied = copy.deepcopy(layer)  # a copy in this process shares the process groups: no attach
    return {"unattached": unattached, "state": {n: t for n, t in twin.state_dict().items() if n != "_extra_state"},
            "planner": twin.planner.state_dict(), "original_planner": layer.planner.state_dict(),
            "twin_out": twin(x).detach(), "copy_out": copied(x).detach(), "original_out": layer(x).detach(),
            "original_state": {n: t for n, t in layer.state_dict().items() if n != "_extra_state"}}


def test_the_layer_pickles_without_its_process_group_and_computes_again_once_attached_and_deep_copies():
    for result in spawn(_pickled_and_attached, 2, backend="gloo", timeout=60, threads_per_rank=1):
        assert result["unattached"] is not None and "layer.attach(group)" in result["unattached"]
        assert result["planner"] == result["original_planner"] and result["planner"]["steps"] == 2
        for name, value in result["original_state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=0, atol=0)
        torch.testing.assert_close(result["twin_out"], result["original_out"], rtol=0, atol=0)
        torch.testing.assert_close(result["copy_out"], result["original_out"], rtol=0, atol=0)
