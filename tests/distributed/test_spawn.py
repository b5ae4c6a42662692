"""fastdist.distributed.spawn: the local multi-rank runner."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from fastdist.distributed import RankError, spawn


def _report_environment():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    return {"env": {k: os.environ.get(k) for k in keys}, "rank": dist.get_rank(),
            "world": dist.get_world_size(), "backend": dist.get_backend(), "sum": t.item(),
            "threads": torch.get_num_threads()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_runs_with_torchrun_environment_and_an_initialized_group(world_size):
    results = spawn(_report_environment, world_size, timeout=120)
    assert [r["rank"] for r in results] == list(range(world_size))
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, r in enumerate(results):
        assert r["env"]["RANK"] == r["env"]["LOCAL_RANK"] == str(rank)
        assert r["env"]["WORLD_SIZE"] == r["env"]["LOCAL_WORLD_SIZE"] == str(world_size)
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert r["world"] == world_size and r["backend"] == "gloo"
        assert r["sum"] == world_size * (world_size + 1) / 2
        assert r["threads"] >= 1


def _echo_args(a, b, *, _unused=None):
    return (dist.get_rank(), a + b)


def test_positional_args_reach_every_rank_and_results_come_back_in_rank_order():
    assert spawn(_echo_args, 2, 3, 4, timeout=120) == [(0, 7), (1, 7)]


def _return_tensors():
    return {"small": torch.full((3,), float(dist.get_rank())), "large": torch.ones(1 << 20)}


def test_tensors_returned_by_ranks_arrive_intact_after_the_ranks_exit():
    results = spawn(_return_tensors, 2, timeout=120)
    for rank, r in enumerate(results):
        assert torch.equal(r["small"], torch.full((3,), float(rank)))
        assert r["large"].sum().item() == 1 << 20


def _rank1_raises_while_others_block():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # would wait forever for rank 1
    time.sleep(600)


@pytest.mark.timing
def test_first_failure_propagates_its_traceback_and_kills_the_other_ranks():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_rank1_raises_while_others_block, 4, timeout=120)
    assert info.value.rank == 1
    assert "ValueError: boom from rank one" in str(info.value)
    assert "_rank1_raises_while_others_block" in str(info.value)  # the traceback, not just the message
    assert time.monotonic() - start < 60


def _rank0_dies_hard():
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(600)


def test_a_rank_that_exits_without_reporting_is_an_error_naming_its_exit_code():
    with pytest.raises(RankError, match="exited with code 3"):
        spawn(_rank0_dies_hard, 2, timeout=120)


def _rank1_segfaults():
    import ctypes
    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    time.sleep(600)


def test_a_rank_that_crashes_is_an_error_naming_the_signal_and_where_its_python_code_was():
    with pytest.raises(RankError) as info:
        spawn(_rank1_segfaults, 2, timeout=120)
    msg = str(info.value)
    assert "rank 1" in msg and "SIGSEGV" in msg and "_rank1_segfaults" in msg


def _rank1_sleeps_forever():
    if dist.get_rank() == 1:
        time.sleep(600)


@pytest.mark.timing
def test_a_job_past_its_timeout_is_killed_and_reports_where_each_stuck_rank_was():
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        spawn(_rank1_sleeps_forever, 2, timeout=15)
    assert time.monotonic() - start < 40
    msg = str(info.value)
    assert "[1]" in msg and "_rank1_sleeps_forever" in msg


def test_bad_world_size_is_rejected_before_starting_anything():
    with pytest.raises(ValueError, match="world_size"):
        spawn(_report_environment, 0)

