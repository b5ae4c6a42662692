"""One failure mechanism for fastdist's distributed steps: a rank whose step fails makes every other rank's step
raise within seconds, naming it, instead of leaving them in a collective until the backend's timeout.

- A rank whose step raises records ``rank, step, where, what`` in the job's store under one key (``compare_set``: the
  job's first failure wins), then aborts its process groups; gloo's abort closes its sockets, so its peers'
  collectives and receives fail at once.
- A peer whose collective failed reads that record, aborts its own groups in turn (which frees the ranks blocked on
  it) and raises :class:`RankFailedError` naming the failing rank, its step and where it sat (a mesh coordinate, an
  MoE layer).
- A rank killed without raising (SIGKILL, the OOM killer) records nothing, but its sockets close all the same. A peer
  whose collective failed on a closed connection, with no record in the store, looks for the rank that died: on its
  own host in the process table (every rank publishes its process identity), elsewhere by a heartbeat that stopped
  (every rank's daemon thread counts one up in the store every :data:`HEARTBEAT_S`). It records the dead rank, so
  every peer names the same one, and raises naming it.
- A rank that hangs without dying (a deadlock, a sleep, a stuck loop) is found by an optional step watchdog
  (``FailureWatch(step_timeout=...)``): inside a guarded step every process group's timeout becomes the bound, so a
  peer waiting for the hung rank in a collective raises after it instead of after the backend's default (30
  minutes for gloo); meanwhile each rank's watchdog thread publishes, once its step (or the pause before its next
  step) has lasted half the bound, where its main thread stands and whether that is a collective's wait. The
  peer whose collective timed out names the rank found elsewhere than in a collective.
- When the store itself is gone, the rank that hosted it died: under ``env://`` rendezvous (fastdist.distributed.spawn,
  ``init_method="env://"``) that is rank 0; under torchrun the agent hosts it and nothing can be said.

Users see this through ``fastdist.parallelize``'s ``Engine.step`` and ``fastdist.moe`` (``MoELayer``, ``moe.step``);
:class:`FailureWatch` is what they use.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["FailureWatch", "JobFailureError", "RankFailedError", "agreed", "recorded_failure", "replaced_by",
           "set_default_step_timeout", "start_heartbeat"]

HEARTBEAT_S = 0.5    # how often each rank's heartbeat moves
DEAD_AFTER_S = 3.0   # a heartbeat that did not move for this long (a rank on another host) marks its rank dead
_RECORD_KEY = "fastdist/failure"
_BEAT_KEY = "fastdist/alive/{}"
_PROCESS_KEY = "fastdist/process/{}"
_STUCK_KEY = "fastdist/stuck/{}"
# Where a main thread blocked in a collective stands: torch.distributed's calls, DDP and autograd's engine (whose
# hooks run DDP's all-reduces), fastdist's collective wrappers; or a line that waits on a Work handle.
_WAITING_PATHS = tuple(os.sep.join(p) for p in (("torch", "distributed", ""), ("torch", "autograd", ""),
                                                   ("torch", "nn", "parallel", ""), ("fastdist", "tp", "comm.py"),
                                                   ("fastdist", "distributed", "compat.py")))
_TIMED_OUT = ("timed out", "timeout")
# What gloo (and the store) say when the other end of a connection went away.
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
           "connection was likely closed", "connection refused", "remote worker crashing")


class JobFailureError(RuntimeError):
    """The job cannot go on here because of another rank: it raised, died, or never joined a call.

    The base of :class:`RankFailedError` and ``fastdist.moe.UnmatchedCallError``; catch it to handle any of them.
    """


class RankFailedError(JobFailureError):
    """Raised on every rank but the failing one when a rank's step failed: it raised (in the user's loss, a forward,
    anywhere in the step) or its process died; names that rank, the step and what happened.

    Attributes:
        rank: the global rank that failed first (None: not known).
        step: the step in which it failed (None: not known or not numbered).
        died: whether that rank's process died without raising (killed) rather than raised.

    Args:
        message: the error's message.
        rank: the global rank that failed first (None: not known).
        step: the step in which it failed (None: not known).
        died: whether it died without raising.
    """

    def __init__(self, message: str, rank: int | None, step: int | None, died: bool = False):
        super().__init__(message)
        self.rank, self.step, self.died = rank, step, died


def agreed(error: BaseException) -> BaseException:
    """Marks ``error`` as raised on every rank alike (a check every rank made on the same data), so that a
    :class:`FailureWatch` lets it through without recording a failure or aborting the process groups.

    Args:
        error: the exception about to be raised.

    Returns:
        ``error``.
    """
    error.__fastdist_agreed__ = True
    return error


def _passes_through(error: BaseException) -> bool:
    """Errors every rank raises alike (a mismatch found by a collective check), or that a watch already handled."""
    from fastdist.distributed.fingerprint import MismatchError
    return isinstance(error, (MismatchError, JobFailureError)) or getattr(error, "__fastdist_agreed__", False)


def _describe(error: BaseException) -> str:
    """The exception at the root of ``error``'s causes (torch's pipelining wraps the user's), by type and message."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    return f"{type(root).__name__}: {root}"


def _closed_connection(error: BaseException) -> bool:
    """Whether ``error`` (or one of its causes) says a peer's connection went away."""
    seen = error
    while seen is not None:
        if isinstance(seen, getattr(dist, "DistNetworkError", ())) or \
                any(s in str(seen).lower() for s in _CLOSED):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _default_store() -> Any | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _store_in_rank0() -> bool:
    """Whether the job's store lives in rank 0's process (``env://`` rendezvous) rather than in torchrun's agent."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() not in ("true", "1")


# ---- this process: identity and heartbeat ----

def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None: no such process, or a
    zombie (it exited, its parent has not reaped it)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else ""


def _host_identity() -> str:
    """The host (and pid namespace) whose process table this process sees; '' where unknown."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}|{boot}|{ns}" if boot else ""


def _process_identity() -> str:
    return json.dumps({"host": _host_identity(), "pid": os.getpid(), "start": _start_time(os.getpid())})


_HEART: dict[str, Any] = {}
_HEART_LOCK = threading.Lock()


def start_heartbeat() -> None:
    """Publishes this rank's process identity in the job's store and starts its heartbeat (a daemon thread), once per
    process group; nothing on one rank or without torch.distributed. Called by every :class:`FailureWatch`."""
    store = _default_store()
    if store is None or dist.get_world_size() == 1:
        return
    with _HEART_LOCK:
        if _HEART.get("store") is store:
            return
        rank = dist.get_rank()
        store.set(_PROCESS_KEY.format(rank), _process_identity())
        if "stop" in _HEART:  # a heartbeat for an earlier process group
            _HEART["stop"].set()
        stop = threading.Event()
        thread = threading.Thread(target=_beat, args=(store, rank, stop), daemon=True, name="fastdist-heartbeat")
        _HEART.update(store=store, stop=stop, thread=thread)
        thread.start()


def _beat(store: Any, rank: int, stop: threading.Event) -> None:
    key = _BEAT_KEY.format(rank)
    while not stop.is_set():
        try:
            store.add(key, 1)
        except Exception:  # noqa: BLE001 - the store is gone (its host ended): nobody can read a heartbeat
            return
        if stop.wait(HEARTBEAT_S) or not dist.is_initialized():  # destroyed, or aborted after a failure
            return


@atexit.register
def _stop_heartbeat() -> None:
    """Stops the heartbeat before the interpreter exits: a daemon thread ended inside the store's C++ call would
    abort the process ("terminate called without an active exception")."""
    with _HEART_LOCK:
        stop, thread = _HEART.pop("stop", None), _HEART.pop("thread", None)
        _HEART.pop("store", None)
    if stop is not None:
        stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5.0)


def _find_dead(store: Any, world: int, me: int, deadline_s: float) -> tuple[int, str] | None:
    """The first rank whose process is gone, and how that is known; None if every rank is alive (or a failure was
    recorded meanwhile). A rank on this host is looked up in the process table (its socket may close a moment
    before its process is gone, so until the heartbeats answer); any other by its heartbeat, which must move within
    ``deadline_s``."""
    here = _host_identity()
    local, watched = {}, []
    for rank in range(world):
        if rank == me or not store.check([_PROCESS_KEY.format(rank)]):
            continue  # a rank without a watch publishes nothing: nothing to say about it
        identity = json.loads(store.get(_PROCESS_KEY.format(rank)).decode())
        if here and identity["host"] == here and identity["start"]:
            local[rank] = identity
        watched.append(rank)
    if not watched:
        return None
    first = {r: store.add(_BEAT_KEY.format(r), 0) for r in watched}
    alive: set[int] = set()
    start = time.monotonic()
    while True:
        for rank, identity in local.items():
            if _start_time(identity["pid"]) != identity["start"]:
                return rank, f"its process {identity['pid']} is gone"
        if time.monotonic() - start >= deadline_s:
            break
        time.sleep(HEARTBEAT_S / 5)
        if store.check([_RECORD_KEY]):
            return None
        alive |= {r for r in watched if r not in alive and store.add(_BEAT_KEY.format(r), 0) != first[r]}
        if len(alive) == len(watched):
            return None
    dead = sorted(set(watched) - alive - set(local))  # a process still in this host's table is alive, if slow
    return (dead[0], f"its heartbeat stopped for {deadline_s:g} s") if dead else None


# ---- the step watchdog ----

def _main_thread_position() -> tuple[bool, str]:
    """(whether the main thread waits in a collective, where it stands as 'file:line in function'), from its
    innermost Python frame: a blocking collective's caller is a library's wait (torch.distributed, DDP's backward
    in autograd's engine, fastdist's collective wrappers) or a line calling ``.wait(``."""
    import linecache
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "unknown"
    path = frame.f_code.co_filename
    shown = f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
    waiting = any(p in path for p in _WAITING_PATHS) or ".wait(" in linecache.getline(path, frame.f_lineno)
    return waiting, shown


def _timed_out(error: BaseException) -> bool:
    """Whether ``error`` (or one of its causes) is a collective's timeout."""
    seen = error
    while seen is not None:
        if isinstance(seen, TimeoutError) or any(s in str(seen).lower() for s in _TIMED_OUT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_WATCHDOGS: "weakref.WeakSet[_StepWatchdog]" = weakref.WeakSet()


@atexit.register
def _stop_watchdogs() -> None:
    """Stops the step watchdogs before the interpreter exits (as :func:`_stop_heartbeat` does the heartbeat)."""
    for dog in list(_WATCHDOGS):
        dog.close()


class _StepWatchdog:
    """The watch's thread: publishes this rank's position (:data:`_STUCK_KEY`) once its step, or its pause between
    steps, has lasted half the bound; clears it when the step ends."""

    def __init__(self, store: Any, rank: int, bound: float):
        self.store, self.rank, self.bound = store, rank, bound
        self.lock = threading.Lock()
        self.step: int | None = None          # the step running, or None between steps
        self.last: int | None = None          # the last step begun
        self.since = time.monotonic()
        self.published = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fastdist-step-watchdog")
        _WATCHDOGS.add(self)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def enter(self, step: int | None) -> None:
        with self.lock:
            self.step, self.last, self.since = step, step, time.monotonic()
        self._clear()

    def leave(self) -> None:
        with self.lock:
            self.step, self.since = None, time.monotonic()
        self._clear()

    def _clear(self):
        if self.published:
            self.published = False
            with contextlib.suppress(Exception):
                self.store.set(_STUCK_KEY.format(self.rank), "")

    def _run(self):
        tick = min(0.25, self.bound / 8)
        while not self.stop.wait(tick):
            with self.lock:
                step, last, since = self.step, self.last, self.since
            if last is None or time.monotonic() - since < self.bound / 2 or self.published:
                continue  # before the first step (setting up may take long), or not late yet, or said already
            waiting, where = _main_thread_position()
            state = {"step": step, "after": last if step is None else None, "waiting": waiting, "where": where,
                     "seconds": round(time.monotonic() - since, 2)}
            try:
                self.store.set(_STUCK_KEY.format(self.rank), json.dumps(state))
                self.published = True
            except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
                return


def _groups() -> list[Any]:
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


@contextlib.contextmanager
def _collective_timeout(seconds: float) -> Iterator[None]:
    """Every process group's collectives time out after ``seconds`` inside the ``with`` body; restored after."""
    saved = []
    for group in _groups():
        for backend in _backends(group):
            with contextlib.suppress(Exception):
                saved.append((backend, backend.options._timeout))
                backend._set_default_timeout(datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        for backend, timeout in saved:
            with contextlib.suppress(Exception):
                backend._set_default_timeout(timeout)


def _backends(group: Any) -> list[Any]:
    out = []
    for device in getattr(group, "_device_types", ()):
        with contextlib.suppress(Exception):
            backend = group._get_backend(device)
            if hasattr(backend, "_set_default_timeout") and backend not in out:
                out.append(backend)
    return out


def _find_hung(store: Any, world: int, me: int, bound: float) -> tuple[int, dict] | None:
    """The first rank whose watchdog says it is late and not waiting in a collective, waiting up to ``bound`` for
    one to say so; None if none does (every late rank waits: a deadlock among collectives)."""
    start = time.monotonic()
    while True:
        for rank in range(world):
            key = _STUCK_KEY.format(rank)
            if rank == me or not store.check([key]):
                continue
            raw = store.get(key).decode()
            state = json.loads(raw) if raw else None
            if state and not state["waiting"]:
                return rank, state
        if time.monotonic() - start >= bound or store.check([_RECORD_KEY]):
            return None
        time.sleep(min(0.1, bound / 10))


# ---- the watch ----

@contextlib.contextmanager
def replaced_by(handle: Callable[[BaseException], BaseException]) -> Iterator[None]:
    """Runs the ``with`` body; an exception it raises is re-raised as ``handle(exception)`` (chained to it), or as
    itself when ``handle`` returns it (as :meth:`FailureWatch.fail` does for this rank's own failure).

    Args:
        handle: the exception raised -> the exception to raise.
    """
    try:
        yield
    except BaseException as e:
        raised = handle(e)
        if raised is e:
            raise
        raise raised from e


def recorded_failure() -> dict | None:
    """The job's first recorded failure (``rank``, ``step``, ``where``, ``what``, ``died``), or None (none recorded,
    no store, or the store unreachable)."""
    store = _default_store()
    if store is None:
        return None
    try:
        return json.loads(store.get(_RECORD_KEY).decode()) if store.check([_RECORD_KEY]) else None
    except Exception:  # noqa: BLE001 - the store's host is gone: nothing recorded can be read
        return None


_DEFAULT_STEP_TIMEOUT: list[float | None] = [None]


def set_default_step_timeout(seconds: float | None) -> None:
    """The step bound of every :class:`FailureWatch` made from now on without one (``fastdist.parallelize``'s
    engine, ``fastdist.moe``): call it on every rank before building them. None: no watchdog (the default).

    Args:
        seconds: the bound, a positive number of seconds, or None.
    """
    _check_step_timeout(seconds)
    _DEFAULT_STEP_TIMEOUT[0] = seconds


def _check_step_timeout(seconds):
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not 0 < seconds < 1e9):
        raise ValueError(f"fastdist: FailureWatch step_timeout must be a positive number of seconds or None, got "
                         f"{seconds!r}")


class FailureWatch:
    """Turns a failed step on any rank into an error on every rank, naming the rank that failed.

    Every rank of the job makes one (a library makes one per engine, or one per process) and runs each step inside
    :meth:`guard`, or passes what it caught to :meth:`fail`. Making one starts the rank's heartbeat.

    Args:
        name: the library's prefix in messages (``"fastdist.parallel"``).
        where: a rank's position to name in messages, e.g. ``" (mesh coordinate (dp, tp, pp) = (0, 0, 1))"``, from its
            global rank ('' for none).
        step_timeout: seconds a step may take (None: no watchdog). Inside :meth:`guard` every process group's
            collectives then time out after it, and a rank whose step (or whose pause before its next step) runs
            longer while it is not waiting in a collective is named in a :class:`RankFailedError` on the ranks
            that wait for it, about ``step_timeout`` after they began waiting. Give it room: a step that is only
            slow is named like one that hangs. Default: :func:`set_default_step_timeout`'s (None unless set).
    """

    def __init__(self, name: str, where: Callable[[int], str] | None = None, step_timeout: float | None = None):
        _check_step_timeout(step_timeout)
        step_timeout = _DEFAULT_STEP_TIMEOUT[0] if step_timeout is None else step_timeout
        self.name = name
        self.where = where or (lambda rank: "")
        self.store = _default_store()
        self.world = dist.get_world_size() if self.store is not None else 1
        self.rank = dist.get_rank() if self.store is not None else 0
        self.failure: RankFailedError | None = None
        self.step_timeout = step_timeout
        self._watchdog = None
        if self.world > 1:
            start_heartbeat()
            if step_timeout is not None:
                self._watchdog = _StepWatchdog(self.store, self.rank, float(step_timeout))

    def close(self) -> None:
        """Stops the step watchdog's thread (if any)."""
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    @property
    def active(self) -> bool:
        """Whether there are other ranks to tell (more than one rank, under torch.distributed)."""
        return self.world > 1

    @contextlib.contextmanager
    def guard(self, step: int | None, context: str = "") -> Iterator[None]:
        """Runs a step: an exception inside it goes through :meth:`fail`; this rank's own exception is re-raised with
        a note naming it, a peer's failure raises :class:`RankFailedError` (from the exception seen here).

        Args:
            step: the step's number, named in messages (None: not numbered).
            context: where on this rank, e.g. ``"MoE layer 0's backward"`` ('' for the step itself).
        """
        dog = self._watchdog
        if dog is None:
            with replaced_by(lambda e: self.fail(e, step, context)):
                yield
            return
        dog.enter(step)
        try:
            with replaced_by(lambda e: self.fail(e, step, context)), _collective_timeout(self.step_timeout):
                yield
        finally:
            dog.leave()

    def fail(self, error: BaseException, step: int | None, context: str = "") -> BaseException:
        """Handles an exception a step raised on this rank; returns the exception to raise.

        Errors every rank raises alike (``MismatchError``, errors marked by :func:`agreed`, a watch's own
        ``JobFailureError``) come back untouched. Otherwise the job's first failure is found (the store's record; for
        a closed connection with none, the rank that died) or this rank records itself; then every process group of
        this rank is aborted.

        Args:
            error: what the step raised here.
            step: the step's number (None: not numbered).
            context: where on this rank it raised ('' for the step itself).

        Returns:
            ``error`` itself, with a note naming this rank, when this rank failed first (or the error passes through);
            else a :class:`RankFailedError` naming the rank that did.
        """
        if getattr(error, "__fastdist_failed__", False):  # this rank's own failure, handled by an inner guard
            return error
        if isinstance(error, RankFailedError) and self.failure is None:
            self.failure = error  # an inner watch's (an MoE layer's in a stage): this one's groups are gone too
        if not self.active or _passes_through(error):
            return error
        if self.failure is not None:
            return self.failure
        mine = {"rank": self.rank, "step": step, "where": self.where(self.rank), "what": _describe(error)[:1000],
                "context": context, "died": False}
        try:
            record = self._first_failure(error, mine)
        except Exception:  # noqa: BLE001 - the store's host is gone
            record = None
        with contextlib.suppress(Exception):
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group()
        self.failure = self._error(record, error, step)
        if self.failure.rank == self.rank:
            error.add_note(str(self.failure))
            error.__fastdist_failed__ = True
            return error
        return self.failure

    def _first_failure(self, error: BaseException, mine: dict) -> dict:
        store = self.store
        if store.check([_RECORD_KEY]):
            return json.loads(store.get(_RECORD_KEY).decode())
        if self._watchdog is not None and _timed_out(error):  # waited past the bound: for whom?
            hung = _find_hung(store, self.world, self.rank, self.step_timeout)
            if hung is not None:
                rank, state = hung
                how = (f"its step {state['step']} has run" if state["step"] is not None else
                       f"it has not begun the step after step {state['after']} for")
                mine = {"rank": rank, "step": mine["step"], "where": self.where(rank), "hung": True, "died": False,
                        "what": f"{how} {state['seconds']:g} s, past half the bound of {self.step_timeout:g} s, at "
                                f"{state['where']}, not in a collective", "context": ""}
            else:
                mine = {"rank": None, "step": mine["step"], "where": "", "hung": True, "died": False, "context": "",
                        "what": "every rank that was late waited in a collective (a deadlock, or a collective some "
                                "ranks did not issue)"}
        elif _closed_connection(error):  # a peer went away: it raised (recorded), or it died (find it)
            dead = _find_dead(store, self.world, self.rank, DEAD_AFTER_S)
            if dead is not None:
                rank, how = dead
                mine = {"rank": rank, "step": mine["step"], "where": self.where(rank), "what": how,
                        "context": "", "died": True}
        won = store.compare_set(_RECORD_KEY, "", json.dumps(mine)).decode()
        return json.loads(won)

    def _error(self, record: dict | None, error: BaseException, step: int | None) -> RankFailedError:
        stops = "every rank's step stops and the process groups are aborted"
        if record is None:
            if _closed_connection(error) and _store_in_rank0() and self.rank != 0:
                return RankFailedError(
                    f"{self.name}: rank 0{self.where(0)}, which hosts the job's store, died during step {step} "
                    f"without raising (the store and rank 0's connections closed: {_describe(error)}); {stops}",
                    0, step, died=True)
            return RankFailedError(f"{self.name}: step {step} failed on rank {self.rank} ({_describe(error)}) and "
                                   "the job's store could not say whether another rank failed first", None, step)
        rank, at = record["rank"], record["step"]
        in_step = f" in step {at}" if at is not None else ""
        if record.get("hung"):
            if rank is None:
                return RankFailedError(f"{self.name}: step {at} passed the step bound of {self.step_timeout:g} s and "
                                       f"{record['what']}; {stops}", None, at)
            return RankFailedError(f"{self.name}: rank {rank}{record['where']} hangs{in_step}: {record['what']}; "
                                   f"{stops}", rank, at)
        context = f" ({record['context']})" if record.get("context") else ""
        if record["died"]:
            return RankFailedError(f"{self.name}: rank {rank}{record['where']} died during step {at} without "
                                   f"raising (killed or crashed: {record['what']}); {stops}", rank, at, died=True)
        return RankFailedError(f"{self.name}: rank {rank}{record['where']} raised{in_step}{context}: "
                               f"{record['what']}; {stops}", rank, at)
