"""The 2D schedule's priority queue: the tables' AlltoAlls and DDP's dense buckets ordered by when the next
iteration needs them, the tables' traffic first.

The next forward starts with the lookups, and a row can only be read once the update it waits for is done, which waits
for its gradient rows; DDP's buckets are needed only by the dense layers' update. So the tables' collectives (gradient
rows, a prefetch's ids and early rows) are never held back: they are issued where they are today and only *tracked*
here. A dense bucket is held while any table collective is in flight, while a lookup whose exchange node this backward
will still run has not sent its gradient rows yet (the autograd engine says which nodes the running backward executes:
a lookup whose output is not part of this loss is not waited for), or while a job of a higher priority waits; it is
issued when the last of them completes (from the thread that completes it). Within one priority the jobs keep their
submission order: collectives on one process group must be issued in the same order on every rank, and DDP calls its
hook for the buckets in bucket order on every rank, whereas which bucket is ready first when the link frees up depends
on each rank's timing. The tables run on a process group of their own (``hybrid_parallel``), so how a rank interleaves
the two groups' collectives needs no agreement between ranks.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveQueue", "TABLES", "DENSE"]

TABLES = 0
"""Priority of the tables' collectives (the highest: the next forward reads their rows first)."""
DENSE = 1
"""Priority of DDP's dense buckets."""


class CollectiveQueue:
    """Issues collectives by priority: a submitted job starts once no job of a higher priority (a lower number) is
    in flight or waiting, and no earlier job of its own priority waits; tracked collectives count as in flight
    until they complete.

    Args:
        log: keep a list of ``(seconds, "issue" | "done", name, priority)`` events in :attr:`events` (for tests
            and profiles).
    """

    def __init__(self, log: bool = False) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}
        self._waiting: list = []  # (priority, sequence, name, start, out, awaits), kept sorted
        self._sequence = itertools.count()
        self.events: list | None = [] if log else None
        self.held = 0  # jobs that had to wait at submission (a profile's count)
        self._tables: list = []  # weak references to the ShardedEmbeddings whose exchanges are tracked

    def add_tables(self, tables: Any) -> None:
        """Registers sharded tables whose pending lookups a dense bucket waits for (see :meth:`awaited`)."""
        self._tables += [weakref.ref(t) for t in tables]

    def awaited(self) -> list:
        """The pending lookups of the registered tables whose exchange node the running backward will execute and
        whose gradient rows have not left yet (call it inside the backward, on its thread, as DDP's hooks run)."""
        out = []
        for ref in self._tables:
            table = ref()
            if table is None:
                continue
            for token in list(table._pending.keys()):
                if token.issued or token.node is None:
                    continue
                try:
                    if torch._C._will_engine_execute_node(token.node):
                        out.append(weakref.ref(token))
                except RuntimeError:  # not inside a backward: nothing of this one to wait for
                    return []
        return out

    def _note(self, kind: str, name: str, priority: int) -> None:
        if self.events is not None:
            self.events.append((time.perf_counter(), kind, name, priority))

    def _held_back(self, priority: int, awaits: list) -> bool:
        """Whether a job of ``priority`` awaiting the lookups ``awaits`` must wait now (the lock held)."""
        if any(n for p, n in self._in_flight.items() if p < priority):
            return True
        return any(t is not None and not t.issued for t in (ref() for ref in awaits))

    def track(self, work: Any, priority: int = TABLES, name: str = "tables", fulfils: Any = None) -> None:
        """Counts an already issued collective (an async ``dist`` work handle) as in flight until it completes.

        Args:
            work: the handle ``dist.*(..., async_op=True)`` returned.
            priority: its priority (:data:`TABLES` for the tables' traffic).
            name: its name in :attr:`events`.
            fulfils: the pending lookup whose gradient rows it carries (jobs awaiting it now wait for it).
        """
        with self._lock:
            self._enter(priority)
            if fulfils is not None:
                fulfils.issued = True
            self._note("issue", name, priority)
        work.get_future().add_done_callback(lambda _: self._done(priority, name))

    def submit(self, start: Callable[[], torch.futures.Future], priority: int = DENSE, name: str = "dense",
               awaits: list = ()) -> torch.futures.Future:
        """Issues ``start()`` (which starts a collective and returns its future) now or when the queue lets it.

        Args:
            start: starts the job's collective; it runs on the submitting thread, or on the thread that completes
                the last collective holding it back, so it must not block.
            priority: the job's priority (lower first).
            name: its name in :attr:`events`.
            awaits: weak references to pending lookups whose gradient rows must leave (and arrive) first
                (:meth:`awaited`); one that is freed unsent (its graph dropped) no longer holds the job.

        Returns:
            A future completed with the job's result (or its error).
        """
        out: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._waiting or self._held_back(priority, awaits):
                self.held += 1
                self._waiting.append((priority, next(self._sequence), name, start, out, list(awaits)))
                self._waiting.sort(key=lambda job: job[:2])
                ready = self._ready()
                job = None
            else:
                self._enter(priority)
                ready, job = [], (priority, None, name, start, out, ())
        for p, _, n, st, o, _ in ready + ([job] if job else []):
            self._start(p, n, st, o)
        return out

    def _start(self, priority, name, start, out):
        self._note("issue", name, priority)
        try:
            fut = start()
        except BaseException as e:  # the job failed to start: its waiter learns it, the queue moves on
            out.set_exception(e)
            self._done(priority, name)
            return

        def finish(f):
            try:
                out.set_result(f.value())
            except BaseException as e:
                out.set_exception(e)
            self._done(priority, name)

        fut.add_done_callback(finish)

    def _enter(self, priority: int) -> None:
        """Counts one more job of ``priority`` in flight (the lock held)."""
        self._in_flight[priority] = self._in_flight.get(priority, 0) + 1

    def _ready(self) -> list:
        """Takes the waiting jobs that may start now, in order (the lock held): the first ones whose higher
        priorities are done and whose awaited lookups have left; a job stops the ones behind it."""
        ready = []
        while self._waiting:
            job = self._waiting[0]
            if self._held_back(job[0], job[5]):
                break
            self._waiting.pop(0)
            self._enter(job[0])
            ready.append(job)
        return ready

    def _done(self, priority: int, name: str) -> None:
        with self._lock:
            self._in_flight[priority] -= 1
            self._note("done", name, priority)
            ready = self._ready()
        for p, _, n, start, out, _ in ready:
            self._start(p, n, start, out)

    def idle(self) -> bool:
        """Whether nothing is in flight or waiting."""
        with self._lock:
            return not self._waiting and not any(self._in_flight.values())


def prioritized_hook(queue: CollectiveQueue, hook: Callable | None = None) -> Callable:
    """A DDP communication hook that submits each bucket's ``hook`` (torch's all-reduce hook when None) to
    ``queue`` at :data:`DENSE` priority; register it with the hook's state (the process group for the default).

    Args:
        queue: the queue the tables' collectives are tracked by.
        hook: the dense part's own hook, or None. It is started from the thread that completes the collective
            holding it back when it waits, so it must only issue asynchronous collectives.
    """
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as hook

    def queued(state, bucket):  # no annotations: DDP compares them with dist.GradBucket, not as strings
        return queue.submit(lambda: hook(state, bucket), DENSE, f"bucket {bucket.index()}", queue.awaited())

    return queued
