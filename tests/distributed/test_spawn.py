"""fastdist.distributed.spawn: the local multi-rank runner."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import spawn_programs
from fastdist import netsim
from fastdist.distributed import RankError, spawn

PROGRAMS = spawn_programs.__file__


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



def _ends_by_destroying_the_process_group():
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()  # as torchrun scripts end
    return t.item()


def test_a_function_that_destroys_the_process_group_itself_returns_its_result():
    assert spawn(_ends_by_destroying_the_process_group, 2, timeout=120) == [2.0, 2.0]


def _last_rank_exits_0_while_the_others_wait():
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(0)
    dist.barrier()  # fails on the others once the last rank is gone
    time.sleep(600)


def test_a_rank_that_exits_0_without_a_result_is_named_rather_than_the_ranks_its_exit_broke():
    for _ in range(3):  # which report reaches the parent first varies from run to run
        with pytest.raises(RankError) as info:
            spawn(_last_rank_exits_0_while_the_others_wait, 4, timeout=120)
        assert info.value.rank == 3, str(info.value)
        assert "exited with code 0 without reporting" in str(info.value)


def _starts_a_sleep_then_rank1_raises(pid_dir):
    sleep = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(pid_dir, f"sleep{dist.get_rank()}"), "w") as f:
        f.write(str(sleep.pid))
    dist.barrier()
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails while its child process runs")
    time.sleep(600)


def _gone(pid):
    """The process `pid` has exited (a zombie waiting for a parent that does not reap it counts as gone)."""
    return netsim._start_time(pid) is None


def _wait_gone(pids, seconds):
    """The pids of `pids` still running after `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def test_the_child_processes_of_a_failed_rank_are_killed_with_it(tmp_path):
    with pytest.raises(RankError, match="rank 1 fails while its child process runs"):
        spawn(_starts_a_sleep_then_rank1_raises, 2, str(tmp_path), timeout=120)
    sleeps = [int((tmp_path / f"sleep{r}").read_text()) for r in range(2)]
    assert _wait_gone(sleeps, 5.0) == []


def _children(pid):
    """The pids of `pid`'s child processes, leaving out multiprocessing's resource tracker."""
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                tracker = b"resource_tracker" in f.read()
        except (FileNotFoundError, ValueError, ProcessLookupError):
            continue
        if ppid == pid and not tracker:
            children.append(int(entry))
    return children


def _kill_parent_while_ranks_start(mode, log_dir):
    """Runs spawn_programs.py `mode`, SIGKILLs it as soon as its 2 ranks exist (they are still starting: the
    import of torch alone takes longer), and returns (the rank pids, what the program printed first)."""
    log = log_dir / "parent.stderr"
    with open(log, "w") as stderr:  # a file, not a pipe: ranks that outlive the parent would hold a pipe open
        parent = subprocess.Popen([sys.executable, PROGRAMS, mode], stdout=subprocess.PIPE, stderr=stderr, text=True)
    with parent.stdout:
        first_line = parent.stdout.readline() if mode == "netsim" else ""
    deadline = time.monotonic() + 120
    ranks = []
    while len(ranks) < 2 and time.monotonic() < deadline and parent.poll() is None:
        ranks = _children(parent.pid)
        time.sleep(0.01)
    parent.kill()
    parent.wait(timeout=30)
    assert len(ranks) == 2, f"the ranks never started:\n{log.read_text()}"
    return ranks, first_line


def test_ranks_die_with_a_parent_killed_while_they_start(tmp_path):
    ranks, _ = _kill_parent_while_ranks_start("sleep", tmp_path)
    assert _wait_gone(ranks, 10.0) == []


@pytest.mark.netsim
def test_ranks_on_a_simulated_cluster_die_with_a_killed_parent_and_cleanup_leaves_no_namespace(tmp_path):
    ranks, first_line = _kill_parent_while_ranks_start("netsim", tmp_path)
    tag = json.loads(first_line)
    assert _wait_gone(ranks, 10.0) == []
    netsim.cleanup()
    assert not [n for n in netsim.list_namespaces() if n.startswith(tag + "-")]


def _tail_after_exception(stderr, exception_name):
    """What the last `exception_name` raised in a process said (the end of its stderr, from its name on)."""
    at = stderr.rfind(exception_name + ":")
    assert at >= 0, stderr
    return stderr[at:]


def test_a_main_module_without_the_main_guard_gets_an_error_saying_to_add_it():
    script = os.path.join(os.path.dirname(PROGRAMS), "spawn_unguarded_main.py")
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    message = _tail_after_exception(run.stderr, "RankError")
    assert 'if __name__ == "__main__":' in message and "spawn_unguarded_main.py" in message


def test_a_function_defined_in_code_run_from_stdin_gets_an_error_saying_to_put_it_in_a_file():
    code = "from fastdist.distributed import spawn\ndef rank_fn():\n    return 1\nspawn(rank_fn, 2, timeout=120)\n"
    run = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    message = _tail_after_exception(run.stderr, "ValueError")
    assert "rank_fn" in message and "stdin" in message and ".py file" in message


def test_an_importable_function_spawned_by_code_run_from_stdin_runs():
    code = (f"import json, sys\nsys.path.insert(0, {os.path.dirname(PROGRAMS)!r})\nimport spawn_programs\n"
            "from fastdist.distributed import spawn\n"
            "print(json.dumps(spawn(spawn_programs.sleep_then_return_pid, 2, 0.0, timeout=120)))\n")
    run = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    pids = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(set(pids)) == 2


def test_timeout_none_means_no_limit():
    assert spawn(_echo_args, 2, 1, 2, timeout=None) == [(0, 3), (1, 3)]


@pytest.mark.parametrize("timeout, error", [
    (math.inf, ValueError), (math.nan, ValueError), (-1.0, ValueError), (0, ValueError),
    ("60", TypeError), (True, TypeError),
])
def test_a_timeout_that_is_not_a_positive_finite_number_or_none_is_a_clear_error(timeout, error):
    with pytest.raises(error, match="spawn: timeout must be"):
        spawn(_echo_args, 2, 1, 2, timeout=timeout)
