"""The collectives of tensor parallelism, issued in one place so that they can be counted.

Every collective fastdist.tp issues goes through :func:`all_reduce`, :func:`all_gather`, :func:`reduce_scatter` or
:func:`ring_exchange` here. Each returns a :class:`Pending` (``wait()`` it before reading the result); with
``count_collectives()`` active, each call is recorded with its kind, its size and the phase it was issued in:

* ``"forward"``: during a forward pass;
* ``"backward"``: during autograd's backward;
* ``"recompute"``: a forward collective issued while autograd runs a backward (activation recomputation).

The log is what the collective-count tests and the benchmark read: Megatron-style checkpointing of a GPT block
all-reduces 5 activations' worth per layer per step (2 forward, 2 backward, and the attention's again in
recomputation, which stops before the MLP's), the Oases block with recompute 4.

Under ``torch.compile`` the same calls issue torch's functional collectives
(``torch.distributed._functional_collectives``), which the compiler can trace and schedule: they return a new
tensor instead of writing in place, so callers use what ``wait()`` returns. Nothing is counted while compiling
(the log records what runs eagerly).
"""
import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fastdist.distributed.compat import all_gather_single, reduce_scatter_single


@dataclasses.dataclass
class CollectiveRecord:
    kind: str       # "all_reduce", "all_gather", "reduce_scatter", "ring_exchange" (send next, receive previous),
                    # "token_count" (a linear's check that every rank passed as many rows)
    phase: str      # "forward", "backward", "recompute"
    numel: int      # elements of the full (reduced or gathered) tensor
    site: str       # who issued it, e.g. "row.forward", "oases.attn"


class CollectiveLog:
    """What :func:`count_collectives` collected; ``max_in_flight``: the most collectives issued and not yet
    waited for at any moment."""

    def __init__(self):
        self.records = []
        self.max_in_flight = 0

    def count(self, kind: str | None = None, phase: str | None = None, site: str | None = None) -> int:
        """The collectives recorded that match every filter given.

        Args:
            kind: e.g. ``"all_reduce"``; None: any.
            phase: ``"forward"``, ``"backward"`` or ``"recompute"``; None: any.
            site: a prefix of the issuing site, e.g. ``"row"``; None: any.
        """
        return sum(1 for r in self._match(kind, phase, site))

    def numel(self, kind: str | None = None, phase: str | None = None, site: str | None = None) -> int:
        """The elements of the full tensors of the collectives that match ``kind``, ``phase`` and ``site`` (filters
        as for :meth:`count`)."""
        return sum(r.numel for r in self._match(kind, phase, site))

    def _match(self, kind, phase, site):
        return (r for r in self.records if (kind is None or r.kind == kind) and (phase is None or r.phase == phase)
                and (site is None or r.site.startswith(site)))


_active_logs = []
_in_flight = 0


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Records every tensor-parallel collective issued inside the ``with`` block (this process only).

    Yields:
        The :class:`CollectiveLog` the records go to.
    """
    log = CollectiveLog()
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)


def recomputing() -> bool:
    """Whether a forward called now runs inside autograd's backward (activation recomputation, as
    ``torch.utils.checkpoint`` does)."""
    return torch._C._current_graph_task_id() != -1


def _phase(backward):
    if backward:
        return "backward"
    return "recompute" if recomputing() else "forward"


def record_token_count_exchange(world_size: int) -> None:
    """Records a linear's exchange of every rank's row count (an 8-byte all-gather the linear issues and waits for
    itself) as kind ``"token_count"``, so that the log shows what each step pays for the check; never in flight.

    Args:
        world_size: the group's size (one count per rank).
    """
    if _active_logs:
        rec = CollectiveRecord("token_count", _phase(False), world_size, "token_check")
        for log in _active_logs:
            log.records.append(rec)


def _record(kind, numel, site, backward):
    global _in_flight
    _in_flight += 1
    if _active_logs:
        rec = CollectiveRecord(kind, _phase(backward), int(numel), site)
        for log in _active_logs:
            log.records.append(rec)
            log.max_in_flight = max(log.max_in_flight, _in_flight)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this process's CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_host_groups = {}


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A process group over ``group``'s ranks whose collectives take CPU tensors, for small checks read on the
    host: ``group`` itself when it is gloo's; otherwise a gloo group over the same ranks, created on the first call
    for ``group`` (a collective over its ranks), so that reading a check never waits for the GPU."""
    if dist.get_backend(group) == "gloo":
        return group
    key = group if group is not None else dist.group.WORLD
    if key not in _host_groups:
        ranks = dist.get_process_group_ranks(key)
        _host_groups[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _host_groups[key]


def compiling() -> bool:
    """True while ``torch.compile`` traces the caller (the collectives are then functional)."""
    return torch.compiler.is_compiling()


class Pending:
    """An issued collective: ``wait()`` returns its output tensor once it is complete (in eager mode the tensor
    the caller passed, written in place; under ``torch.compile`` a new one)."""

    def __init__(self, work: dist.Work | None, out: torch.Tensor):
        self._work = work
        self.out = out

    def wait(self) -> torch.Tensor:
        """Waits for the collective to complete and returns its output."""
        global _in_flight
        if self._work is not None:
            self._work.wait()
            self._work = None
            _in_flight -= 1
        return self.out


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, *, site: str, backward: bool = False) -> Pending:
    """Sums ``t`` in place over ``group``, asynchronously.

    Args:
        t: the tensor, summed in place.
        group: the process group (None: the default group).
        site: who issues it, as recorded (e.g. ``"row.forward"``).
        backward: issued by an autograd backward (recorded as the backward phase).
    """
    if compiling():
        return _FunctionalPending(funcol.all_reduce(t, "sum", _functional_group(group)))
    _record("all_reduce", t.numel(), site, backward)
    return Pending(dist.all_reduce(t, group=group, async_op=True), t)


def all_gather(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None, *, site: str,
               backward: bool = False) -> Pending:
    """Gathers every rank's ``t`` into ``out`` (``world`` times ``t``'s size, rank-major), asynchronously.

    Args:
        out: the gathered tensor.
        t: this rank's part, contiguous.
        group, site, backward: as for :func:`all_reduce`.
    """
    if compiling():
        return _FunctionalPending(funcol.all_gather_tensor(t, 0, _functional_group(group)))
    _record("all_gather", out.numel(), site, backward)
    return Pending(all_gather_single(out, t, group=group, async_op=True), out)


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None, *, site: str,
                   backward: bool = False) -> Pending:
    """Sums ``t`` over ``group`` and leaves block ``rank`` of the sum in ``out``, asynchronously.

    Args:
        out: this rank's block of the sum.
        t: this rank's addend, ``world`` blocks of ``out``'s size, rank-major.
        group, site, backward: as for :func:`all_reduce`.
    """
    if compiling():
        return _FunctionalPending(funcol.reduce_scatter_tensor(t, "sum", 0, _functional_group(group)))
    _record("reduce_scatter", t.numel(), site, backward)
    return Pending(reduce_scatter_single(out, t, group=group, async_op=True), out)


class _FunctionalPending(Pending):
    """A functional collective's result, traced by ``torch.compile``; ``wait()`` returns the completed tensor."""

    def __init__(self, out):
        super().__init__(None, out)

    def wait(self):
        return funcol.wait_tensor(self.out)


def _functional_group(group):
    return group if group is not None else dist.group.WORLD


class _PendingPair(Pending):
    def __init__(self, works, out):
        super().__init__(None, out)
        self._works = works

    def wait(self):
        global _in_flight
        if self._works:
            for w in self._works:
                w.wait()
            self._works = None
            _in_flight -= 1
        return self.out


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None, *, site: str,
                  backward: bool = False) -> Pending:
    """Sends ``send`` to the next rank of ``group`` and receives the previous rank's into ``recv`` (a ring step),
    asynchronously.

    Args:
        send: what this rank passes on.
        recv: where the previous rank's tensor lands.
        group, site, backward: as for :func:`all_reduce`.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    _record("ring_exchange", recv.numel(), site, backward)
    works = [dist.isend(send, nxt, group=group), dist.irecv(recv, prev, group=group)]
    return _PendingPair(works, recv)


def wait_all(pending: Iterable[Pending]) -> None:
    """Waits for every collective of ``pending``, in order."""
    for p in pending:
        p.wait()


def high_priority_nccl_options() -> "dist.ProcessGroupNCCL.Options | None":
    """``ProcessGroupNCCL.Options`` whose communication streams are created with high priority, or None where
    torch has no NCCL (a CPU build). Pass it as ``pg_options`` to ``init_process_group`` / ``new_group`` for the
    tensor-parallel group: on a GPU, a chunk's all-reduce then starts ahead of the GEMMs queued after it, which
    is what the chunked schedule needs (NCCL collectives issued with ``async_op=True`` run on the group's own
    stream, ordered after the GEMM that produced their input)."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not dist.is_nccl_available():
        return None
    options = nccl.Options()
    options.is_high_priority_stream = True
    return options
