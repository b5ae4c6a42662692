"""The gradient reductions a user would otherwise pick, as plain functions on one tensor.

They are the peers `fastdist-bench sparse` measures sketch_allreduce against. Each one sums (op="sum")
or averages (op="avg") a tensor over the ranks of `group`, writes the result back into the tensor
(in place, like `dist.all_reduce`; a non-contiguous tensor is reduced through a contiguous copy and
written back) and returns it. Every rank of the group must call it, in the same order.

  dense_allreduce      dist.all_reduce of the whole tensor.
  fp16_allreduce       torch's fp16_compress_hook on a raw tensor: cast to float16, all-reduce, cast
  bf16_allreduce       back (bfloat16 likewise). With op="avg" it *is* torch's hook (the tuple-bucket
                       form the hook accepts), which pre-divides by the world size; op="sum" runs the same
                       steps without that division.
  agsparse_allreduce   AGsparse, what Horovod and PyTorch do for sparse gradients: exchange the non-zero
                       counts, all-gather (index, value) lists padded to the largest count, scatter-add
                       every rank's list locally. Lossless.
  topk_allgather       GRACE-style TopK: each rank keeps its k largest-magnitude elements, all-gathers
                       (index, value) pairs of fixed k, scatter-adds. Lossy (drops the rest).
  powersgd_allreduce   torch's own DDP PowerSGD hook (`powerSGD_hook`), run on the tensor as a bucket of
                       one gradient. Its state (`make_powersgd_state`) carries error feedback and
                       warm-start matrices between calls; the first `start_powerSGD_iter` calls are plain
                       all-reduces, as in DDP. The hook averages; op="sum" scales its result by the
                       world size.

The OmniReduce-style lossless union all-reduce is `sketch_allreduce(t, mode="exact")`.

What each call sent is recorded, one style for all: `last_baseline_stats()` returns the BaselineStats of
the last call on this process -- `wire_bytes` is the model of the bytes this rank sends over all of the
call's collectives (fastdist.comm.wire: all-reduce: ring, 2(P-1)/P x payload; all-gather: ring,
(P-1) x this rank's block), the same model as SketchStats.wire_bytes, so the two compare directly.
Indices travel as int32 when the tensor has fewer than 2^31 elements (rows), int64 otherwise.
"""
import dataclasses
import math
import time
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fastdist.comm.wire import ring_allgather_bytes, ring_allreduce_bytes
from fastdist.distributed import compat
from fastdist.distributed.fingerprint import check_same

if TYPE_CHECKING:
    # imported where used otherwise: importing fastdist.comm does not load torch's DDP hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

__all__ = [
    "BaselineStats",
    "agsparse_allreduce",
    "bf16_allreduce",
    "dense_allreduce",
    "fp16_allreduce",
    "last_baseline_stats",
    "make_powersgd_state",
    "powersgd_allreduce",
    "ring_allgather_bytes",
    "ring_allreduce_bytes",
    "topk_allgather",
    "topk_for_wire_budget",
    "topk_k",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass
class BaselineStats:
    """What the last baseline reduction on this process did."""
    method: str                 # "dense", "fp16", "bf16", "agsparse", "topk", "powersgd" or "powersgd-warmup"
    wire_bytes: int             # bytes this rank sends, all collectives of the call (ring model)
    dense_wire_bytes: int       # what a dense ring all-reduce of the tensor would send
    seconds: float              # wall time of the call
    local_nnz: int = None       # agsparse: units (rows or elements) this rank sent; topk: k
    max_nnz: int = None         # agsparse: the largest count over ranks (the padded list length)
    detail: dict = dataclasses.field(default_factory=dict)


_last = None


def last_baseline_stats() -> BaselineStats | None:
    """The BaselineStats of the last baseline call on this process (None before any)."""
    return _last


def _record(method, t, world, start, **fields):
    global _last
    _last = BaselineStats(method=method, dense_wire_bytes=ring_allreduce_bytes(t.numel() * t.element_size(), world),
                          seconds=time.perf_counter() - start, **fields)
    return _last


def _check_tensor(name, t, op):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{name}: expects a dense (strided) tensor; convert sparse gradients with .to_dense()")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: 'tensor' must be float32/float16/bfloat16/float64, got {t.dtype}")
    if op not in ("sum", "avg"):
        raise ValueError(f"{name}: op must be 'sum' or 'avg', got {op!r}")


def _device(t, group):
    if dist.get_backend(group) == "nccl" and not t.is_cuda:
        raise ValueError("fastdist baselines: the NCCL backend needs CUDA tensors")
    return t.device


class _Contiguous:
    """A contiguous buffer for `t`; on exit copies the result back if it had to make a copy."""

    def __init__(self, t):
        self.t = t
        self.buf = t if t.is_contiguous() else t.contiguous()

    def __enter__(self):
        return self.buf

    def __exit__(self, exc_type, *_):
        if exc_type is None and self.buf is not self.t:
            self.t.copy_(self.buf)
        return False


# group -> the (name, configuration) pairs checked on it; keyed by the group object, weakly, so that a group
# created later (possibly at a freed group's address) is checked afresh
_checked: "weakref.WeakKeyDictionary[dist.ProcessGroup, set]" = weakref.WeakKeyDictionary()


def _check_config_once(name, config, group):
    """Cross-rank agreement on what sizes the all-gathers (a mismatch would hang or mis-slice), once per config."""
    checked = _checked.setdefault(dist.group.WORLD if group is None else group, set())
    if (name, config) not in checked:
        check_same(f"{name} configuration (shape, dtype, granularity/k, op)", config, group=group)
        checked.add((name, config))


def _index_dtype(n):
    return torch.int32 if n < 2**31 else torch.int64


# --- dense and cast-to-16-bit ------------------------------------------------------------------------

def dense_allreduce(tensor: torch.Tensor, *, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """dist.all_reduce of the whole tensor (SUM, then divided by the world size for op="avg").

    Args:
        tensor: a dense float32/float16/bfloat16/float64 tensor, reduced in place.
        op: "sum" or "avg".
        group: the process group (None: the default group).

    Returns:
        `tensor`, holding the reduction.
    """
    _check_tensor("dense_allreduce", tensor, op)
    start, world = time.perf_counter(), dist.get_world_size(group)
    _device(tensor, group)
    with _Contiguous(tensor) as buf:
        dist.all_reduce(buf, group=group)
        if op == "avg":
            buf.div_(world)
    _record("dense", tensor, world, start,
            wire_bytes=ring_allreduce_bytes(tensor.numel() * tensor.element_size(), world))
    return tensor


def _cast_allreduce(name, dtype, hook, tensor, op, group):
    _check_tensor(name, tensor, op)
    start, world = time.perf_counter(), dist.get_world_size(group)
    _device(tensor, group)
    with _Contiguous(tensor) as buf:
        if op == "avg":
            # torch's own hook; it accepts a 1-tuple in place of a GradBucket and averages
            hook(group, (buf,)).wait()
        else:
            low = buf.to(dtype)
            dist.all_reduce(low, group=group)
            buf.copy_(low)
    esize = torch.empty((), dtype=dtype).element_size()
    _record(name.split("_")[0], tensor, world, start, wire_bytes=ring_allreduce_bytes(tensor.numel() * esize, world))
    return tensor


def fp16_allreduce(tensor: torch.Tensor, *, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch's fp16_compress_hook on a raw tensor: float16 on the wire, result cast back to the tensor's dtype.

    Values beyond float16's range (65504) overflow to inf, as with the hook; op="avg" pre-divides by the
    world size (the hook itself), which makes overflow less likely.

    Args:
        tensor, op, group: as for :func:`dense_allreduce`; `tensor` is reduced in place and returned.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        fp16_compress_hook,
    )
    return _cast_allreduce("fp16_allreduce", torch.float16, fp16_compress_hook, tensor, op, group)


def bf16_allreduce(tensor: torch.Tensor, *, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch's bf16_compress_hook on a raw tensor: bfloat16 on the wire (float32's range, 8-bit mantissa).

    Args:
        tensor, op, group: as for :func:`dense_allreduce`; `tensor` is reduced in place and returned.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
        bf16_compress_hook,
    )
    return _cast_allreduce("bf16_allreduce", torch.bfloat16, bf16_compress_hook, tensor, op, group)


# --- all-gather of (index, value) lists --------------------------------------------------------------

def _gather_lists(idx, vals, group, world):
    """All-gathers this rank's padded index and value blocks; returns [world, L] and [world, L, m] views."""
    length = idx.shape[0]
    g_idx = torch.empty(world * length, dtype=idx.dtype, device=idx.device)
    g_val = torch.empty((world * length,) + tuple(vals.shape[1:]), dtype=vals.dtype, device=vals.device)
    compat.all_gather_single(g_idx, idx, group=group)
    compat.all_gather_single(g_val, vals, group=group)
    return g_idx.view(world, length), g_val.view((world, length) + tuple(vals.shape[1:]))


def agsparse_allreduce(tensor: torch.Tensor, granularity: str = "row", *, op: str = "sum",
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """AGsparse: lossless all-gather of every rank's non-zero (index, value) list, then a local scatter-add.

    Steps: all-gather the local non-zero counts (one int64 per rank), all-gather the indices (padded to
    the largest count), all-gather the values (same padding), then add every rank's first count[r]
    entries into the zeroed tensor, rank 0 first. A row is non-zero if any of its values is non-zero
    (NaN counts as non-zero, so it propagates as in a dense all-reduce).
    Wire bytes: (P-1) x [8 + L x (index bytes + m x value bytes)], L = the largest count.

    Args:
        tensor: a dense float32/float16/bfloat16/float64 tensor, reduced in place.
        granularity: "row" (a unit is a row of dim 0 with all its values: embedding gradients) or "element".
        op: "sum" or "avg".
        group: the process group (None: the default group).

    Returns:
        `tensor`, holding the reduction.

    Raises:
        MismatchError: on every rank, when the ranks disagree on shape, dtype or granularity (checked once).
    """
    _check_tensor("agsparse_allreduce", tensor, op)
    if granularity not in ("row", "element"):
        raise ValueError(f"agsparse_allreduce: granularity must be 'row' or 'element', got {granularity!r}")
    start, world = time.perf_counter(), dist.get_world_size(group)
    device = _device(tensor, group)
    _check_config_once("agsparse_allreduce", (tuple(tensor.shape), str(tensor.dtype), granularity), group)
    with _Contiguous(tensor) as buf:
        if granularity == "row" and buf.dim() > 0:
            n = buf.shape[0]
            units = buf.view(n, buf.numel() // n if n else 0)
        else:
            n = buf.numel()
            units = buf.view(n, 1)
        m = units.shape[1]
        nonzero = units.ne(0).any(1) if m > 1 else units.view(-1).ne(0)
        local_idx = nonzero.nonzero().flatten()
        count = local_idx.numel()

        counts = torch.empty(world, dtype=torch.int64, device=device)
        compat.all_gather_single(counts, torch.tensor([count], dtype=torch.int64, device=device), group=group)
        counts = counts.tolist()
        length = max(counts)
        idx_dtype = _index_dtype(n)
        if length:
            send_idx = torch.zeros(length, dtype=idx_dtype, device=device)
            send_idx[:count] = local_idx
            send_val = torch.zeros(length, m, dtype=buf.dtype, device=device)
            torch.index_select(units, 0, local_idx, out=send_val[:count])
            g_idx, g_val = _gather_lists(send_idx, send_val, group, world)
        units.zero_()
        if length:
            for r, c in enumerate(counts):
                if c:
                    units.index_add_(0, g_idx[r, :c].long(), g_val[r, :c])
        if op == "avg":
            buf.div_(world)
    esize = tensor.element_size()
    idx_bytes = torch.empty((), dtype=idx_dtype).element_size()
    wire = ring_allgather_bytes(8, world) + ring_allgather_bytes(length * (idx_bytes + m * esize), world)
    _record("agsparse", tensor, world, start, wire_bytes=wire, local_nnz=count, max_nnz=length,
            detail={"granularity": granularity, "unit_size": m, "counts": counts})
    return tensor


def topk_k(numel: int, ratio: float | None = None, k: int | None = None) -> int:
    """k for topk_allgather: given directly, or ceil(ratio x numel), at least 1, at most numel.

    Args:
        numel: elements of the tensor.
        ratio: the kept fraction, in (0, 1].
        k: the kept count (exactly one of ratio and k).

    Returns:
        k, clamped to numel.
    """
    if (ratio is None) == (k is None):
        raise ValueError("topk_allgather: give exactly one of ratio or k")
    if k is None:
        if not (0.0 < float(ratio) <= 1.0):
            raise ValueError(f"topk_allgather: ratio must be in (0, 1], got {ratio}")
        k = math.ceil(float(ratio) * numel)
    k = int(k)
    if k < 1:
        raise ValueError(f"topk_allgather: k must be >= 1, got {k}")
    return min(k, numel)


def topk_allgather(tensor: torch.Tensor, ratio: float | None = None, *, k: int | None = None, op: str = "sum",
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """GRACE-style TopK: each rank's k largest-magnitude elements, all-gathered as (index, value), summed.

    Everything outside the k kept elements of every rank is dropped (no error feedback here: the caller keeps
    residuals if it wants them). Wire bytes: (P-1) x k x (index bytes + value bytes).

    Args:
        tensor: a dense float32/float16/bfloat16/float64 tensor, reduced in place.
        ratio: k = ceil(ratio x numel) (see topk_k).
        k: k itself; the same on every rank (checked once per configuration).
        op: "sum" or "avg".
        group: the process group (None: the default group).

    Returns:
        `tensor`, holding the sum of every rank's kept elements.
    """
    _check_tensor("topk_allgather", tensor, op)
    numel = tensor.numel()
    k = topk_k(max(numel, 1), ratio, k)  # validates ratio / k before any communication
    start, world = time.perf_counter(), dist.get_world_size(group)
    _device(tensor, group)
    if numel == 0:
        _record("topk", tensor, world, start, wire_bytes=0, local_nnz=0)
        return tensor
    _check_config_once("topk_allgather", (tuple(tensor.shape), str(tensor.dtype), k), group)
    with _Contiguous(tensor) as buf:
        flat = buf.view(-1)
        _, idx = torch.topk(flat.abs(), k, sorted=False)
        vals = flat.index_select(0, idx)
        g_idx, g_val = _gather_lists(idx.to(_index_dtype(numel)), vals, group, world)
        flat.zero_()
        flat.index_add_(0, g_idx.view(-1).long(), g_val.view(-1))
        if op == "avg":
            buf.div_(world)
    idx_bytes = torch.empty((), dtype=_index_dtype(numel)).element_size()
    wire = ring_allgather_bytes(k * (idx_bytes + tensor.element_size()), world)
    _record("topk", tensor, world, start, wire_bytes=wire, local_nnz=k, detail={"k": k})
    return tensor


def topk_for_wire_budget(wire_bytes: int, world: int, numel: int, value_bytes: int = 4) -> int:
    """The k whose topk_allgather sends at most `wire_bytes` per rank (at least 1).

    Args:
        wire_bytes: the budget per rank.
        world: ranks.
        numel: elements of the tensor (k is at most numel; it also sets the index width).
        value_bytes: bytes per value on the wire.

    Returns:
        k in [1, numel] (numel for a single rank, which sends nothing).
    """
    idx_bytes = torch.empty((), dtype=_index_dtype(numel)).element_size()
    if world < 2:
        return numel
    return max(1, min(numel, int(wire_bytes // ((world - 1) * (idx_bytes + value_bytes)))))


# --- PowerSGD: torch's hook on a bucket of one tensor ------------------------------------------------

class _OneTensorBucket:
    """What torch's powerSGD_hook reads from a dist.GradBucket (which has no Python constructor):
    the flat buffer, its per-parameter views (here: the one tensor), the bucket index, and whether it is
    the iteration's last bucket (always: one bucket per call, so the hook's iteration counter advances)."""

    def __init__(self, tensor, index):
        self._tensor, self._flat, self._index = tensor, tensor.view(-1), index

    def buffer(self):
        return self._flat

    def gradients(self):
        return [self._tensor]

    def parameters(self):
        return []

    def index(self):
        return self._index

    def is_last(self):
        return True

    def set_buffer(self, buffer):
        self._flat.copy_(buffer)


def make_powersgd_state(group: dist.ProcessGroup | None = None, *, rank: int = 4, start_iter: int = 2,
                        error_feedback: bool = True, warm_start: bool = True, min_compression_rate: float = 2,
                        seed: int = 0) -> "PowerSGDState":
    """A torch PowerSGDState for powersgd_allreduce: rank-`rank` approximation, error feedback and warm start on.

    Args:
        group: the process group (None: the default group).
        rank: the approximation's rank r.
        start_iter: the first start_iter calls are plain all-reduces (torch requires start_iter > 1 with error
            feedback or warm start, because DDP rebuilds its buckets after the first iteration).
        error_feedback: keep the compression error and add it to the next call's input.
        warm_start: start each call's power iteration from the previous call's Q.
        min_compression_rate: tensors that would compress less than this are all-reduced plainly.
        seed: seed of the initial random Q.

    Returns:
        A torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    return PowerSGDState(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
                         min_compression_rate=min_compression_rate, use_error_feedback=error_feedback,
                         warm_start=warm_start, random_seed=seed)


def _powersgd_plan(state, shape, esize, world):
    """(compressed?, wire bytes, (P elements, Q elements)) of the hook's next call on a tensor of `shape`."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        _should_compress,
    )
    numel = math.prod(shape)
    if state.iter < state.start_powerSGD_iter:
        return False, ring_allreduce_bytes(numel * esize, world), (0, 0)
    n = shape[0] if len(shape) else 1
    m = numel // n if n else 0
    r = min(n, m, state.matrix_approximation_rank)
    if not _should_compress(n, m, r, state.min_compression_rate)[0]:
        return False, ring_allreduce_bytes(numel * esize, world), (0, 0)
    p_elems, q_elems = n * r, m * r
    return True, ring_allreduce_bytes(p_elems * esize, world) + ring_allreduce_bytes(q_elems * esize, world), \
        (p_elems, q_elems)


def powersgd_allreduce(state: "PowerSGDState", tensor: torch.Tensor, *, op: str = "sum",
                       bucket_index: int = 0) -> torch.Tensor:
    """torch's powerSGD_hook on `tensor` (viewed as rows of dim 0 x everything else), in place.

    The hook all-reduces P (n x r) and then Q (m x r); it averages, and op="sum" multiplies its result by the
    world size. Before state.start_powerSGD_iter calls it is a plain all-reduce (stats method "powersgd-warmup").

    Args:
        state: from make_powersgd_state (a torch PowerSGDState; its process_group is the group). Keep one state per
            tensor you reduce, or give each tensor its own bucket_index: error feedback and warm start are stored
            per bucket index.
        tensor: a dense float32/float16/bfloat16/float64 tensor, reduced in place.
        op: "sum" or "avg".
        bucket_index: the bucket index the hook files this tensor's error feedback and warm start under.

    Returns:
        `tensor`, holding the (approximate) reduction.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
    _check_tensor("powersgd_allreduce", tensor, op)
    group = state.process_group
    start, world = time.perf_counter(), dist.get_world_size(group)
    _device(tensor, group)
    compressed, wire, (p_elems, q_elems) = _powersgd_plan(state, tuple(tensor.shape), tensor.element_size(), world)
    with _Contiguous(tensor) as buf:
        if buf.numel():
            powerSGD_hook(state, _OneTensorBucket(buf, bucket_index)).wait()
            if op == "sum":
                buf.mul_(world)
    _record("powersgd" if compressed else "powersgd-warmup", tensor, world, start, wire_bytes=wire,
            detail={"rank": state.matrix_approximation_rank, "p_elements": p_elems, "q_elements": q_elems})
    return tensor
