"""Run a function on N local ranks, one process each, with torch.distributed initialized.

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so code written for torchrun runs unchanged. The first rank to fail takes the others
down and its traceback is re-raised in the caller; a job that outlives its timeout is killed and the
stuck ranks' Python stacks are put in the error. Nothing here can hang the caller.

A rank is a fresh interpreter in a session (and process group) of its own, started on `_bootstrap.py`, which
ties it to the caller's life before anything slow runs (a SIGKILLed caller takes its ranks along) and then
loads the caller's main module and `fn` as multiprocessing's spawn start method does. Stopping a rank kills its
whole process group, so processes the rank started go with it.
"""
import dataclasses
import datetime
import gc
import math
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fastdist import netsim

_BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py")
_POLL_S = 1.0  # how often a rank's exit is checked besides its report channel (a forked child may hold that open)
_KILLED_GRACE_S = 5.0  # how long the others of a rank killed by a signal may take to report what they saw


class RankError(RuntimeError):
    """A rank raised or died; carries the rank and its traceback.

    Attributes:
        rank: the failing rank.
        others: for a rank killed by a signal, the tracebacks of the other ranks that raised within a few seconds
            of its death (what they saw of it), by rank; else empty.

    Args:
        rank: the failing rank.
        world_size: the job's ranks.
        detail: its traceback, or how it died.
        others: the other ranks' tracebacks, by rank (shown after ``detail``).
    """

    def __init__(self, rank: int, world_size: int, detail: str, others: dict[int, str] | None = None):
        self.rank = rank
        self.others = dict(others or {})
        seen = "".join(f"\n--- rank {r} raised meanwhile ---\n{text}" for r, text in sorted(self.others.items()))
        super().__init__(f"rank {rank} of {world_size} failed:\n{detail}{seen}")


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


@dataclasses.dataclass
class _Job:
    """What every rank loads from the job file: the function, its arguments and how to run it."""
    fn: Callable[..., object]
    args: tuple
    world_size: int
    backend: str
    pg_timeout_s: float | None  # None: torch's default
    netns: list | None          # per rank, on a simulated cluster


def _rank_main(job: _Job, rank: int, parent_pid: int, conn: mp.connection.Connection) -> None:
    """A rank's life after `_bootstrap.py` loaded the job: rendezvous, run, report."""
    if job.netns is not None:
        from fastdist import netsim  # only ranks placed on a simulated cluster need it
        netsim.enter_namespace(job.netns[rank])
    if os.getppid() != parent_pid:  # the caller is gone: nobody would read the result, nor stop the job
        os._exit(1)
    try:
        if job.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        timeout = {} if job.pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=job.pg_timeout_s)}
        dist.init_process_group(job.backend, init_method="env://", rank=rank, world_size=job.world_size, **timeout)
        result = job.fn(*job.args)
        # Plain pickle, not torch's fd-sharing reductions: those would hand the parent tensors whose
        # storage lives in this process, which is about to exit.
        report = pickle.dumps(("ok", result, time.time()))
        del result
        # Objects in reference cycles that hold collectives' state (DDP, PowerSGD hook state) must be
        # freed while the group exists: collected later on a gloo thread, they abort the process.
        gc.collect()
        if dist.is_initialized():  # fn may have destroyed it itself, as torchrun scripts end
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt, to the parent
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), time.time())))
        finally:
            # Skip the process-group teardown: peers may be blocked in a collective with us.
            os._exit(1)
    conn.send_bytes(report)
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


@dataclasses.dataclass
class _Rank:
    """A started rank: its process (the leader of its own process group) and the read end of its report channel."""
    process: subprocess.Popen
    reports: mp.connection.Connection
    stack_path: str

    @classmethod
    def start(cls, rank: int, job_path: str, env: dict, stack_path: str) -> "_Rank":
        read_fd, write_fd = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, _BOOTSTRAP, str(os.getpid()), job_path, str(rank), str(write_fd), stack_path],
                pass_fds=(write_fd,), start_new_session=True, stdin=subprocess.DEVNULL, env={**os.environ, **env})
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return cls(process, mp.connection.Connection(read_fd, writable=False), stack_path)

    def exit_code(self) -> int | None:
        """Its exit status as subprocess gives it (-N: killed by signal N), None while it runs. Does not reap it: its
        pid, which is also its process group's id, stays reserved until `reap`, so signalling the group is safe."""
        if self.process.returncode is not None or not hasattr(os, "waitid"):
            return self.process.poll()
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else
            return self.process.poll()
        if info is None or info.si_pid == 0:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def wait_exit(self, seconds: float) -> int | None:
        """`exit_code`, after waiting up to `seconds` for it."""
        deadline = time.monotonic() + seconds
        while (code := self.exit_code()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return code

    def signal_group(self, sig: int) -> None:
        """Sends `sig` to the rank and every process it started (its process group)."""
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):  # nothing left in the group
            pass

    def stacks(self) -> str:
        """What faulthandler wrote for the rank (its threads' Python stacks, on SIGUSR1 or a crash), or ""."""
        try:
            with open(self.stack_path) as f:
                return f.read().strip()
        except OSError:
            return ""


def _stop(ranks: list, grace_s: float = 3.0) -> None:
    """SIGTERM to every rank's process group, SIGKILL to what is left after `grace_s`, then reaps the ranks."""
    for r in ranks:
        r.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in ranks:
        r.wait_exit(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        r.signal_group(signal.SIGKILL)  # a rank that ignored SIGTERM, and its processes that did
        r.process.wait()
        r.reports.close()


def _exit_reason(code):
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    if code == 0:
        return "exited with code 0 without reporting a result (the process ended before fn returned: os._exit() " \
               "or a library calling exit())"
    return f"exited with code {code} without reporting a result"


def _check_timeout(timeout):
    if timeout is None:
        return math.inf
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"spawn: timeout must be a number of seconds or None (no limit), got {timeout!r}")
    if not 0 < timeout < math.inf:
        raise ValueError(f"spawn: timeout must be a positive, finite number of seconds or None (no limit), "
                         f"got {timeout!r}")
    return float(timeout)


def _check_not_starting_a_rank():
    """Raises if this process is a rank still loading the caller's main module: the module calls spawn when it is
    imported, and every rank re-imports it."""
    if getattr(mp.current_process(), "_inheriting", False):
        caller = sys._getframe(2).f_globals.get("__file__", "the main module")
        raise RuntimeError(
            f"spawn() was called while rank {os.environ.get('RANK', '?')} was starting, by {caller}: each rank is "
            "a new Python process that re-imports the main module to find fn, so a script must call spawn under "
            "`if __name__ == \"__main__\":` (and define fn above it, at module level)")


def _main_file():
    """The main module's file, or None where it has none (code run from stdin, ``python -c``, an interactive
    session; Python names stdin's "<stdin>")."""
    file = getattr(sys.modules.get("__main__"), "__file__", None)
    return None if file is None or (file.startswith("<") and file.endswith(">")) else file


def _check_importable(fn):
    """Raises ValueError for a function the ranks cannot import: one defined in a main module that has no file."""
    if getattr(fn, "__module__", None) == "__main__" and _main_file() is None:
        raise ValueError(
            f"spawn: fn ({getattr(fn, '__qualname__', fn)!r}) is defined in a main module that the ranks cannot "
            "import: code run from stdin, `python -c` or an interactive session has no file. Each rank is a new "
            "Python process that imports fn by its module and name: define fn in a .py file and run that file "
            "(calling spawn under `if __name__ == \"__main__\":`), or import fn from it")


def _write_job(path, job):
    """The job file `_bootstrap.py` loads: what multiprocessing's spawn start method gives a child to find the main
    module (less the authentication key: ranks talk to the caller through their report channels only; and less the
    main module where it has no file to re-import), then the job."""
    preparation = mp.spawn.get_preparation_data("fastdist-rank")
    preparation.pop("authkey", None)
    if _main_file() is None:
        preparation.pop("init_main_from_path", None)
    with open(path, "wb") as f:
        pickle.dump(preparation, f)
        pickle.dump((_rank_main, job), f)


def spawn(fn: Callable[..., object], world_size: int, *args: object, backend: str = "auto",
          timeout: float | None = 300.0, cluster: "netsim.Cluster | None" = None,
          threads_per_rank: int | None = None) -> list:
    """Runs ``fn(*args)`` on ``world_size`` local ranks and returns the list of their return values.

    Args:
        fn: a module-level function of an importable module or of the script being run (whose call to spawn
            must then be under ``if __name__ == "__main__":``, as each rank re-imports it); it runs with the default
            process group initialized (destroyed after it returns, unless it destroyed it itself) and torchrun's
            environment variables set.
        world_size: the ranks.
        *args: ``fn``'s arguments, pickled (tensors by value) to every rank.
        backend: ``"auto"`` (NCCL when there is a GPU per rank, else gloo), ``"gloo"``, ``"nccl"``, ...
        timeout: seconds for the whole job, start-up included, and the process group's timeout; None: no limit
            (and torch's default process-group timeout). ``math.inf`` is refused: say None.
        cluster: a fastdist.netsim.Cluster: rank i runs inside host i's network namespace and gloo binds to its
            shaped interface.
        threads_per_rank: torch threads in each rank (default: cores // world_size, at least 1;
            OMP_NUM_THREADS in the caller's environment wins).

    Returns:
        The ranks' return values, in rank order (plainly pickled back).

    Raises:
        RankError: a rank raised, died, or could not start (its main module or ``fn`` failed to load), with the
            first failing rank's traceback (the other ranks are killed). A rank that died without a word is
            named before ranks whose collectives its death broke; for one killed by a signal (the OOM killer), the
            errors the others raised within a few seconds follow (``RankError.others``).
        TimeoutError: the job outlived ``timeout``; every rank is killed and the stuck ranks' stacks are in it.
        ValueError: ``world_size < 1``, a cluster with fewer hosts than ranks, a timeout that is not positive and
            finite, or an ``fn`` defined where the ranks cannot import it (stdin, ``python -c``).
        TypeError: a timeout that is not a number or None.
        RuntimeError: spawn was called by a rank loading the main module (a script without the main guard).
    """
    _check_not_starting_a_rank()
    limit_s = _check_timeout(timeout)
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    if cluster is not None and len(cluster.hosts) < world_size:
        raise ValueError(f"spawn: the cluster has {len(cluster.hosts)} hosts, fewer than {world_size} ranks")
    _check_importable(fn)
    backend = resolve_backend(backend, world_size)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    master_addr = cluster.master_addr if cluster is not None else "127.0.0.1"
    port = _free_port()
    placements = [cluster.placement(rank) for rank in range(world_size)] if cluster is not None else None
    job = _Job(fn, args, world_size, backend, None if timeout is None else limit_s,
               [netns for netns, _ in placements] if placements else None)
    ranks = []
    with tempfile.TemporaryDirectory(prefix="fastdist-spawn-") as job_dir:
        job_path = os.path.join(job_dir, "job.pkl")
        _write_job(job_path, job)
        try:
            for rank in range(world_size):
                env = _rank_env(rank, world_size, master_addr, port, threads)
                if placements:
                    env.update(placements[rank][1])
                ranks.append(_Rank.start(rank, job_path, env, os.path.join(job_dir, f"rank{rank}.stack")))
            return _collect(ranks, limit_s)
        finally:
            _stop(ranks)


def _collect(ranks, limit_s):
    world_size = len(ranks)
    results = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + limit_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(_timeout_report(ranks, sorted(pending), limit_s))
        mp.connection.wait([ranks[r].reports for r in pending], timeout=min(remaining, _POLL_S))
        reports, silent = {}, []
        for rank in sorted(pending):
            if ranks[rank].reports.poll():
                try:
                    reports[rank] = pickle.loads(ranks[rank].reports.recv_bytes())
                except (EOFError, OSError):
                    silent.append(rank)
            elif ranks[rank].exit_code() is not None:
                silent.append(rank)
        if silent:
            # A rank that died without a word is what broke the others' collectives: name it, not them.
            rank = silent[0]
            code = ranks[rank].wait_exit(2.0)
            others = {}
            if code is not None and code < 0:  # killed from outside (the OOM killer): what did the others see?
                others = _errors_within(ranks, pending - {rank}, reports,
                                        min(_KILLED_GRACE_S, deadline - time.monotonic()))
            raise RankError(rank, world_size, _exit_reason(code) + _crash_stacks(ranks[rank]), others)
        failures = sorted((at, rank, status, detail) for rank, (status, detail, at) in reports.items()
                          if status != "ok")
        if failures:
            _, rank, status, detail = failures[0]  # the earliest failure; the later ones are mostly its echoes
            if status == "start-error":
                detail = "it could not start: loading the main module, fn or fn's arguments failed\n" + detail
            raise RankError(rank, world_size, detail)
        for rank, (_, result, _) in reports.items():
            results[rank] = result
            pending.discard(rank)
    for r in ranks:
        r.wait_exit(5.0)
    return results


def _errors_within(ranks, others, reports, seconds):
    """The tracebacks of the ranks among ``others`` that report an error within ``seconds`` (``reports``: what has
    arrived already), by rank; stops early once every one of them has reported or exited."""
    reports = dict(reports)
    waiting = set(others) - set(reports)
    deadline = time.monotonic() + seconds
    while waiting and time.monotonic() < deadline:
        mp.connection.wait([ranks[r].reports for r in waiting], timeout=max(0.0, min(0.1, deadline - time.monotonic())))
        for rank in sorted(waiting):
            if ranks[rank].reports.poll():
                try:
                    reports[rank] = pickle.loads(ranks[rank].reports.recv_bytes())
                except (EOFError, OSError):
                    pass
                waiting.discard(rank)
            elif ranks[rank].exit_code() is not None:
                waiting.discard(rank)
    return {rank: detail for rank, (status, detail, _) in reports.items() if rank in others and status != "ok"}


def _crash_stacks(rank):
    text = rank.stacks()
    return f"; its Python stacks at the crash:\n{text}" if text else ""


def _timeout_report(ranks, pending, limit_s):
    for rank in pending:
        if ranks[rank].exit_code() is None:
            os.kill(ranks[rank].process.pid, signal.SIGUSR1)
    time.sleep(1.0)
    parts = [f"ranks {pending} of {len(ranks)} did not finish within {limit_s:g} s; their Python stacks:"]
    for rank in pending:
        parts.append(f"--- rank {rank} ---\n{ranks[rank].stacks() or '(no stack written)'}")
    return "\n".join(parts)
