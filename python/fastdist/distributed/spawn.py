"""Run a function on N local ranks, one process each, with torch.distributed initialized.

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so code written for torchrun runs unchanged. The first rank to fail takes the others
down and its traceback is re-raised in the caller; a job that outlives its timeout is killed and the
stuck ranks' Python stacks are put in the error. Nothing here can hang the caller.
"""
import ctypes
import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fastdist import netsim


class RankError(RuntimeError):
    """A rank raised or died; carries the rank and its traceback.

    Args:
        rank: the failing rank.
        world_size: the job's ranks.
        detail: its traceback, or how it died.
    """

    def __init__(self, rank: int, world_size: int, detail: str):
        self.rank = rank
        super().__init__(f"rank {rank} of {world_size} failed:\n{detail}")


def resolve_backend(backend: str, world_size: int) -> str:
    """``backend`` itself, or for ``"auto"``: NCCL when each of ``world_size`` local ranks can have its own GPU,
    else gloo."""
    if backend != "auto":
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    # A rank orphaned by a SIGKILLed parent would otherwise sit in a collective until its timeout.
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _rank_main(fn, args, rank, world_size, backend, env, netns, pg_timeout_s, stack_path, conn):
    _die_with_parent()
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a crash (SIGSEGV, SIGABRT, ...) leaves its stacks too
    if netns is not None:
        from fastdist import netsim  # only ranks placed on a simulated cluster need it
        netsim.enter_namespace(netns)
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if backend == "nccl":
            torch.cuda.set_device(int(env["LOCAL_RANK"]))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(*args)
        dist.destroy_process_group()
        # Plain pickle, not torch's fd-sharing reductions: those would hand the parent tensors whose
        # storage lives in this process, which is about to exit.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt, to the parent
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        finally:
            # Skip the process-group teardown: peers may be blocked in a collective with us.
            os._exit(1)
    conn.close()


def _rank_env(rank, world_size, master_addr, port, threads):
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
    }
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)  # as torchrun does: don't oversubscribe the cores
    return env


def _stop(procs, grace_s=3.0):
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _exit_reason(code):
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def spawn(fn: Callable[..., object], world_size: int, *args: object, backend: str = "auto", timeout: float = 300.0,
          cluster: "netsim.Cluster | None" = None, threads_per_rank: int | None = None) -> list:
    """Runs ``fn(*args)`` on ``world_size`` local ranks and returns the list of their return values.

    Args:
        fn: a picklable (module-level) function; it runs with the default process group initialized
            (destroyed after it returns) and torchrun's environment variables set.
        world_size: the ranks.
        *args: ``fn``'s arguments, pickled to every rank.
        backend: ``"auto"`` (NCCL when there is a GPU per rank, else gloo), ``"gloo"``, ``"nccl"``, ...
        timeout: seconds for the whole job, start-up included; also the process group's timeout.
        cluster: a fastdist.netsim.Cluster: rank i runs inside host i's network namespace and gloo binds to its
            shaped interface.
        threads_per_rank: torch threads in each rank (default: cores // world_size, at least 1;
            OMP_NUM_THREADS in the caller's environment wins).

    Returns:
        The ranks' return values, in rank order (plainly pickled back).

    Raises:
        RankError: a rank raised or died, with the first failing rank's traceback (the other ranks are killed).
        TimeoutError: the job outlived ``timeout``; every rank is killed and the stuck ranks' stacks are in it.
        ValueError: ``world_size < 1``, or a cluster with fewer hosts than ranks.
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    if cluster is not None and len(cluster.hosts) < world_size:
        raise ValueError(f"spawn: the cluster has {len(cluster.hosts)} hosts, fewer than {world_size} ranks")
    backend = resolve_backend(backend, world_size)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    master_addr = cluster.master_addr if cluster is not None else "127.0.0.1"
    port = _free_port()
    ctx = mp.get_context("spawn")
    stack_dir = tempfile.TemporaryDirectory(prefix="fastdist-spawn-")
    procs, conns = [], []
    try:
        for rank in range(world_size):
            env = _rank_env(rank, world_size, master_addr, port, threads)
            netns = None
            if cluster is not None:
                netns, extra = cluster.placement(rank)
                env.update(extra)
            recv_end, send_end = ctx.Pipe(duplex=False)
            stack_path = os.path.join(stack_dir.name, f"rank{rank}.stack")
            p = ctx.Process(target=_rank_main, name=f"fastdist-rank{rank}", daemon=True,
                            args=(fn, args, rank, world_size, backend, env, netns, timeout, stack_path,
                                  send_end))
            p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        return _collect(procs, conns, world_size, timeout, stack_dir.name)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        stack_dir.cleanup()


def _collect(procs, conns, world_size, timeout, stack_dir):
    results = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(_timeout_report(procs, sorted(pending), world_size, timeout, stack_dir))
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        mp.connection.wait(waitables, timeout=remaining)
        for rank in sorted(pending):
            if conns[rank].poll():
                try:
                    status, payload = pickle.loads(conns[rank].recv_bytes())
                except EOFError:
                    procs[rank].join(1.0)
                    raise RankError(rank, world_size, _exit_reason(procs[rank].exitcode) + " without reporting"
                                    + _crash_stacks(stack_dir, rank))
                if status == "error":
                    raise RankError(rank, world_size, payload)
                results[rank] = payload
                pending.discard(rank)
            elif not procs[rank].is_alive():
                raise RankError(rank, world_size, _exit_reason(procs[rank].exitcode)
                                + " without reporting a result" + _crash_stacks(stack_dir, rank))
    for p in procs:
        p.join(5.0)
    return results


def _stacks(stack_dir, rank):
    """What faulthandler wrote for the rank (its threads' Python stacks, on SIGUSR1 or a crash), or ""."""
    try:
        with open(os.path.join(stack_dir, f"rank{rank}.stack")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _crash_stacks(stack_dir, rank):
    text = _stacks(stack_dir, rank)
    return f"; its Python stacks at the crash:\n{text}" if text else ""


def _timeout_report(procs, pending, world_size, timeout, stack_dir):
    for rank in pending:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)
    parts = [f"ranks {pending} of {world_size} did not finish within {timeout:g} s; their Python stacks:"]
    for rank in pending:
        parts.append(f"--- rank {rank} ---\n{_stacks(stack_dir, rank) or '(no stack written)'}")
    return "\n".join(parts)
