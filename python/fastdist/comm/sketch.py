"""sketch_allreduce: sparse gradient all-reduce with a union bitmap and a count-sketch (S2 Reducer).

Per call, on every rank of the group, in this order:
  1. header: one fixed-size all-gather of (configuration fingerprint, local support size, this rank's measured
     cost of the two exact collectives, the packed local bitmap when it fits in HEADER_BITMAP_BYTES, e.g. 65536
     embedding rows). Fixed size, so ranks that
     disagree on shape, dtype, seed, rows, cols, mode or op meet in the same collective and raise
     MismatchError together, every call, before any collective whose size depends on the configuration.
  2. union support U: the OR of the gathered bitmaps — from the header when they fit in it, else from an
     all-gather of the bitmaps or a MAX all-reduce of a uint8 mask, whichever sends fewer bytes for (n, P).
     Every rank now knows U and |U| identically, and every rank's support where the bitmaps were gathered.
  3. method: "exact" sums the union's values losslessly — one all-reduce of the |U| rows (OmniReduce-style),
     or, when it sends clearly fewer bytes and the supports are known, one all-gather of each rank's own rows
     (AGsparse without indices: the bitmaps are the indices), summed in rank order identically on every rank;
     once both have run for a configuration, the one measured faster per byte on the slowest rank;
     "sketch" sums an r x c count-sketch and decodes the union's coordinates from it; "dense" is a plain
     all-reduce; "auto" picks one from |U| — lossless whenever it costs at most `lossless_slack` times the sketch.
  4. the payload collective (asynchronous with async_op=True), then write-back into the tensor.
NaN/Inf count as non-zero: they are in U and propagate as a dense all-reduce would propagate them
(for "sketch" also into the coordinates that share their buckets).
"""
import dataclasses
import math
import threading
import time

import torch
import torch.distributed as dist

from fastdist import ops
from fastdist.comm.wire import ring_allreduce_bytes
from fastdist.distributed import compat
from fastdist.distributed.fingerprint import MismatchError, fingerprint

MODES = ("sketch", "exact", "auto")
GRANULARITIES = ("row", "element")
HEADER_BITMAP_BYTES = 8192  # bitmaps up to 65536 units ride in the header: one collective fewer per call
# The lossless all-gather of own rows must send at most this fraction of the union all-reduce's bytes: it then
# sums P blocks locally, which the ring all-reduce overlaps with its transfers (measured, 4 ranks at 1 Gbit/s:
# at 0.67 of the bytes the gather is 1.2x faster; at 0.77, 10% slower).
GATHER_MAX_BYTES_FRACTION = 0.75
# Bytes alone do not pick the faster exact collective: where the CPU rather than the link is the bottleneck the
# gather's local sums cost more than the bytes it saves (2 ranks at 10 Gbit/s, 2% rows: 41 vs 27 ms). So each
# rank times the exact collectives it runs, per group and tensor configuration (_ExactTimings); the header carries
# the figures, and once both have a figure on every rank, every rank keeps the gather unless the slowest rank
# predicts it EXACT_SWITCH_MARGIN times slower than the union all-reduce (the gather won wherever the link was the
# bottleneck; where the CPU was, the all-reduce was 15-25% faster: 4 ranks at 10 Gbit/s, 2% rows), trying the other
# collective again every EXACT_REPROBE_EVERY calls. The figures are kept per size class of the union (powers of two
# of its ring bytes): per-byte costs measured at one size do not carry to one 16x larger (2 ranks at 10 Gbit/s: the
# gather, timed faster at 0.9% union rows, was 1.4x slower at 16%). A call decides with the figures of the class of
# the previous call's union, which every rank knows alike before the header, and records into its own union's class.
TIMED_COLLECTIVES = ("allreduce-union", "allgather-local")  # the order of the header's rates
EXACT_RATE_SMOOTHING = 0.5  # weight of the newest measurement
EXACT_SWITCH_MARGIN = 1.1
EXACT_COUNTED_RUNS = 2  # runs averaged before a collective has a figure (after its first, uncounted one)
EXACT_REPROBE_EVERY = 32
# calls at a new union size class until auto has timed both exact collectives there (the first decides with the
# previous class's figures; then three runs of each, the first of each untimed)
EXACT_EXPLORE_CALLS = 2 * (EXACT_COUNTED_RUNS + 1) + 1
_exact_timings = {}  # ((group, world, shape, dtype, granularity), union size class) -> _ExactTimings
_union_class = {}  # (group, world, shape, dtype, granularity) -> size class of its last exact call's union


class _ExactTimings:
    """This process's measured cost of each exact collective for one configuration: seconds per wire byte of the
    payload collective plus the write-back, less the call's header time (a collective's latency, so that small
    payloads are not charged it per byte), averaged exponentially. A collective's first run is not counted: it pays
    one-time costs (connections, first-touch buffers) that would bias the choice for good."""

    def __init__(self):
        self.runs = dict.fromkeys(TIMED_COLLECTIVES, 0)
        self.rate = dict.fromkeys(TIMED_COLLECTIVES, math.nan)
        self.timed_choices = 0  # the same count on every rank: it follows the gathered header

    def header(self):
        return [self.rate[k] if self.runs[k] > EXACT_COUNTED_RUNS else math.nan for k in TIMED_COLLECTIVES]

    def record(self, collective, seconds, header_seconds, nbytes):
        self.runs[collective] += 1
        if self.runs[collective] == 1 or not nbytes:
            return
        rate = max(seconds - header_seconds, 0.1 * seconds) / nbytes
        before = self.rate[collective]
        self.rate[collective] = rate if math.isnan(before) else \
            (1 - EXACT_RATE_SMOOTHING) * before + EXACT_RATE_SMOOTHING * rate


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass
class SketchStats:
    """What the last sketch_allreduce call on this process did."""
    method: str              # "sketch", "exact" or "dense"
    mode: str                # what was asked for
    units: int               # n: rows (granularity "row") or elements
    unit_size: int           # m: values per unit
    local_units: int         # |support| on this rank
    union_units: int         # |U|
    union_method: str        # "header" (bitmaps in the header), "allgather-or" or "allreduce-max"
    sketch_shape: tuple      # (rows, cols) of the table (also when not used)
    wire_bytes: int          # bytes this rank sends, all steps (ring model for all-reduces)
    dense_wire_bytes: int    # what a dense ring all-reduce of the tensor would send
    seconds: float           # wall time of the synchronous part
    error_feedback: bool = False  # the residual sketch was used and updated by this call
    exact_collective: str = ""    # method "exact": "allreduce-union" or "allgather-local"
    exact_by: str = ""            # how exact_collective="auto" chose it: "bytes", "explore" (timing the other
                                  # once) or "timed" (see TIMED_COLLECTIVES); "" when the caller named one

    @property
    def union_fraction(self):
        return self.union_units / self.units if self.units else 0.0


_last = None


def last_stats():
    """The SketchStats of the last completed sketch_allreduce call on this process (None before any)."""
    return _last


def _view_rows(t, granularity):
    """(n, m) of the tensor's unit view."""
    if granularity == "element" or t.dim() == 0:
        return t.numel(), 1
    n = t.shape[0]
    return n, (t.numel() // n if n else 0)


def _sketch_cols(ratio, cols, total):
    if cols is not None:
        return int(cols)
    return max(1, math.ceil(ratio * total))


EXACT_COLLECTIVES = ("auto", "allreduce-union", "allgather-local")


def _check_args(tensor, ratio, cols, rows, granularity, mode, op, exact_collective):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sketch_allreduce: expected a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"sketch_allreduce: 'tensor' must be a floating-point tensor "
                        f"(float32/float16/bfloat16/float64), got {tensor.dtype}")
    if mode not in MODES:
        raise ValueError(f"sketch_allreduce: mode must be one of {MODES}, got {mode!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"sketch_allreduce: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if exact_collective not in EXACT_COLLECTIVES:
        raise ValueError(f"sketch_allreduce: exact_collective must be one of {EXACT_COLLECTIVES}, "
                         f"got {exact_collective!r}")
    if op not in ("sum", "avg"):
        raise ValueError(f"sketch_allreduce: op must be 'sum' or 'avg', got {op!r}")
    if ratio is not None and cols is not None:
        raise ValueError("sketch_allreduce: give either ratio or cols, not both")
    if ratio is not None and not (0.0 < float(ratio) <= 1.0):
        raise ValueError(f"sketch_allreduce: ratio must be in (0, 1], got {ratio}")
    if cols is not None and int(cols) < 1:
        raise ValueError(f"sketch_allreduce: cols must be >= 1, got {cols}")
    if int(rows) < 1:
        raise ValueError(f"sketch_allreduce: rows must be >= 1, got {rows}")
    if tensor.is_sparse and granularity != "row":
        raise ValueError("sketch_allreduce: sparse tensors are reduced with granularity='row'")
    if tensor.is_sparse and tensor.sparse_dim() != 1:
        raise ValueError(f"sketch_allreduce: sparse tensors must be row-sparse (sparse_dim 1, like "
                         f"nn.Embedding(sparse=True) gradients), got sparse_dim {tensor.sparse_dim()}")
    if tensor.is_sparse and tensor._nnz() > 0:  # torch checks none of this unless its invariant checks are on
        low, high = (int(v) for v in torch.aminmax(tensor._indices()[0]))
        if low < 0 or high >= tensor.shape[0]:
            raise ValueError(f"sketch_allreduce: the sparse tensor's row indices must be in [0, {tensor.shape[0]}), "
                             f"got values in [{low}, {high}]")


def _collective_device(tensor, group):
    if dist.get_backend(group) == "nccl":
        return tensor.device if tensor.is_cuda else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


HEADER_FIXED_BYTES = 32  # fingerprint, local support size (int64), the two exact collectives' rates (float64)


def _exchange_header(config, local_units, rates, local_bits, group, world, device):
    """All-gathers (fingerprint, local support size, this rank's seconds per byte of the TIMED_COLLECTIVES, NaN
    where not measured, local bitmap if it fits) in a buffer of fixed size; raises MismatchError on every rank on
    disagreement. Returns the local sizes of all ranks, their rates ([world][2]) and their bitmaps as a uint8
    [world, ceil(n / 8)] tensor, or None when the bitmaps did not fit."""
    nbytes = local_bits.numel()
    inline = nbytes <= HEADER_BITMAP_BYTES
    mine = torch.zeros(HEADER_FIXED_BYTES + HEADER_BITMAP_BYTES, dtype=torch.uint8)
    mine[:16] = torch.tensor([fingerprint(config), local_units], dtype=torch.int64).view(torch.uint8)
    mine[16:HEADER_FIXED_BYTES] = torch.tensor(rates, dtype=torch.float64).view(torch.uint8)
    if inline:
        mine[HEADER_FIXED_BYTES:HEADER_FIXED_BYTES + nbytes] = local_bits.cpu()
    out = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    compat.all_gather_single(out, mine.to(device), group=group)
    out = out.view(world, mine.numel()).cpu()
    head = out[:, :16].contiguous().view(torch.int64)
    if len(set(head[:, 0].tolist())) > 1:
        reprs = [None] * world
        dist.all_gather_object(reprs, repr(config), group=group)
        ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
        raise MismatchError("sketch_allreduce configuration (shape, dtype, granularity, rows, cols, seed, "
                            "mode, op)", dict(zip(ranks, reprs)))
    all_rates = out[:, 16:HEADER_FIXED_BYTES].contiguous().view(torch.float64).tolist()
    bitmaps = out[:, HEADER_FIXED_BYTES:HEADER_FIXED_BYTES + nbytes].contiguous().to(local_bits.device) \
        if inline else None
    return head[:, 1].tolist(), all_rates, bitmaps


def _union(local_bits, bitmaps, n, group, world, device):
    """The packed union bitmap of all ranks, every rank's bitmap ([world, bytes], or None when not
    gathered), how the union was computed, and the bytes that sent beyond the header."""
    if bitmaps is not None:
        return ops.bitwise_or_reduce(bitmaps), bitmaps, "header", 0
    nbytes = local_bits.numel()
    gather_bytes = (world - 1) * nbytes
    max_bytes = ring_allreduce_bytes(n, world)
    if gather_bytes <= max_bytes:
        gathered = torch.empty(world * nbytes, dtype=torch.uint8, device=device)
        compat.all_gather_single(gathered, local_bits.to(device), group=group)
        bitmaps = gathered.view(world, nbytes).to(local_bits.device)
        return ops.bitwise_or_reduce(bitmaps), bitmaps, "allgather-or", gather_bytes
    mask = ops.unpack_bits(local_bits, n).to(torch.uint8).to(device)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    return ops.pack_bits(mask.to(local_bits.device).bool()), None, "allreduce-max", max_bytes


def _choose(mode, union_values, total_values, rows, cols, lossless_slack, dense_fraction, max_sketch_load):
    if union_values >= dense_fraction * total_values:
        return "dense"  # in every mode: a dense union sketches badly and sends no fewer bytes exactly
    if mode != "auto":
        return mode
    # The error budget: a sketch narrower than the union's values decodes badly (relative error 0.8 at
    # c = 0.5 |U| m, 2.1 at 0.1 |U| m on Zipf embedding gradients), so auto only considers sketches with
    # c >= |U| m / max_sketch_load, and then only if they are cheaper than exact by lossless_slack.
    if union_values > max_sketch_load * cols or union_values <= lossless_slack * rows * cols:
        return "exact"
    return "sketch"


def _exact_choice(timings, all_rates, gather_candidate, union_bytes, gather_bytes):
    """(exact collective, why) from every rank's measured seconds per byte ([world][2], NaN: not measured), the
    same on every rank. Until both are measured everywhere: the gather when it is a candidate, then the union
    all-reduce, so that both get a figure; then the gather unless the slowest rank predicts it EXACT_SWITCH_MARGIN
    times slower than the all-reduce, and every EXACT_REPROBE_EVERY-th call the other one, to refresh its figure."""
    if not gather_candidate:
        return "allreduce-union", "bytes"
    known = [all(not math.isnan(r[k]) for r in all_rates) for k in range(len(TIMED_COLLECTIVES))]
    if not known[1]:
        return "allgather-local", "bytes"
    if not known[0]:
        return "allreduce-union", "explore"
    union_s, gather_s = (max(r[k] for r in all_rates) for k in range(len(TIMED_COLLECTIVES)))
    gather_stays = gather_s * gather_bytes <= EXACT_SWITCH_MARGIN * union_s * union_bytes
    faster, slower = TIMED_COLLECTIVES[::-1] if gather_stays else TIMED_COLLECTIVES
    timings.timed_choices += 1
    if timings.timed_choices % EXACT_REPROBE_EVERY == 0:
        return slower, "explore"
    return faster, "timed"


class _Pending:
    """Handle of an asynchronous sketch_allreduce. wait() (or the future's callback) runs the write-back
    once, after the payload all-reduce has completed."""

    def __init__(self, work, complete):
        self._work, self._complete = work, complete
        self._lock = threading.Lock()
        self._done, self._result, self.stats = False, None, None

    def wait(self):
        self.result()
        return True

    def is_completed(self):
        return self._done

    def result(self):
        if self._work is not None and not self._done:
            self._work.wait()
        return self._finish()

    def _finish(self):
        # Runs once, after the payload all-reduce completed. Never waits on the work itself: it is also
        # called from the work's future callback, where waiting would deadlock.
        with self._lock:
            if not self._done:
                self._result, self.stats = self._complete()
                self._done = True
        return self._result

    def get_future(self):
        """A torch.futures.Future that resolves to the result once the reduction has been written back."""
        if self._work is None:
            fut = torch.futures.Future()
            fut.set_result(self.result())
            return fut
        return self._work.get_future().then(lambda _: self._finish())


def sketch_allreduce(tensor, *, ratio=None, cols=None, rows=3, seed=0, granularity="row", mode="sketch",
                     op="sum", group=None, async_op=False, lossless_slack=2.0, dense_fraction=0.5,
                     max_sketch_load=1.0, residual=None, exact_collective="auto"):
    """Sums `tensor` over the ranks of `group`, sending only its union support (exact) or a sketch of it.

    tensor:      float32/float16/bfloat16/float64, dense (reduced in place, like dist.all_reduce) or a
                 row-sparse torch.sparse_coo tensor, e.g. an nn.Embedding(sparse=True) gradient: reduced from its
                 rows without a dense copy (unless the union is dense) and returned as a new coalesced sparse
                 tensor whose rows are U; the values are exactly those of reducing its dense form.
    ratio, cols: sketch width c = ceil(ratio * numel) or cols directly (default ratio 0.05); rows r (odd).
    seed:        the hash seed; must be the same on every rank (checked).
    granularity: "row" (support per row of dim 0: embedding gradients) or "element".
    mode:        "sketch" (lossy, r*c values on the wire), "exact" (lossless union all-reduce),
                 "auto" (per call from |U|: the sketch only if it is wide enough to decode well,
                 c >= |U| m / max_sketch_load, and cheaper than exact by lossless_slack; else exact — on
                 the workloads measured so far this means auto is lossless). In every mode a union covering
                 >= dense_fraction of the units is reduced densely (set dense_fraction > 1 to never do so).
                 Identical on every rank.
    op:          "sum" or "avg".
    async_op:    return a handle whose wait() completes the reduction (the payload all-reduce is asynchronous).
    residual:    sketch-space error feedback (FetchSGD): a float32 [rows, cols] tensor, zeros at first, kept by
                 the caller across calls with a fixed seed. Every rank holds the same summed sketch S, so
                 every rank keeps the same residual: decode from S + R, then R <- S + R - sketch(decoded).
                 Applied only when the sketch is at least as wide as the union's values (c >= |U| m): below
                 that, decoding all of U is too noisy and re-sketching it makes R grow without bound
                 (measured: cumulative error 1.4 at c = 0.85 |U| m vs 0.03 at c = |U| m after 64 calls).
                 Calls that skip it, or end up exact or dense, leave R unchanged (see last_stats().error_feedback).
    exact_collective: how "exact" sums the union: "allreduce-union", "allgather-local" (needs every rank's
                 bitmap: always at row granularity up to HEADER_BITMAP_BYTES * 8 rows), or "auto": the gather
                 only when it sends at most GATHER_MAX_BYTES_FRACTION of the all-reduce's bytes; then, once each
                 has been timed (such calls gather 3 times, then all-reduce 3 times: a first run is not counted),
                 the gather unless it is measured EXACT_SWITCH_MARGIN times slower on the slowest rank, per group,
                 tensor shape and size class of the union (at most EXACT_EXPLORE_CALLS calls explore a new one),
                 with the other re-timed every EXACT_REPROBE_EVERY calls
                 (last_stats().exact_by says which rule chose).
    Returns the result tensor (the input itself when dense), or a handle when async_op.
    """
    _check_args(tensor, ratio, cols, rows, granularity, mode, op, exact_collective)
    if ratio is None and cols is None:
        ratio = 0.05
    rows = int(rows)
    start = time.perf_counter()
    world = dist.get_world_size(group)
    sparse_input = tensor.is_sparse
    if sparse_input:  # its rows as they are: nothing dense unless the union itself is dense
        sp = tensor.coalesce()
        shape, dtype, dev = tuple(sp.shape), sp.dtype, sp.device
        n, m = shape[0], math.prod(shape[1:])
        local_idx = sp.indices()[0]
        local_rows = sp.values().reshape(local_idx.numel(), m)
        mask = torch.zeros(n, dtype=torch.bool, device=dev)
        mask[local_idx] = True
        local_bits = ops.pack_bits(mask)
    else:
        work_buf = tensor.contiguous()
        shape, dtype, dev = tuple(work_buf.shape), work_buf.dtype, work_buf.device
        n, m = _view_rows(work_buf, granularity)
        rows2d = work_buf.view(n, m) if n else work_buf.view(0, 0)
        local_bits = ops.nonzero_bitmap(work_buf, granularity)
    c = _sketch_cols(ratio, cols, n * m)
    device = _collective_device(tensor, group)
    config = (shape, str(dtype), granularity, rows, c, int(seed), mode, op, residual is not None, exact_collective)
    if residual is not None and (residual.dtype != torch.float32 or tuple(residual.shape) != (rows, c)):
        raise ValueError(f"sketch_allreduce: 'residual' must be float32 of shape {(rows, c)}, got "
                         f"{residual.dtype} {tuple(residual.shape)}")

    if not sparse_input:
        local_idx = ops.unpack_bits(local_bits, n).nonzero().flatten() if n else torch.zeros(0, dtype=torch.int64)
    local_units = int(local_idx.numel())
    rate_key = (id(group) if group is not None else None, world, shape, str(dtype), granularity)
    timings = _exact_timings.setdefault((rate_key, _union_class.get(rate_key)), _ExactTimings())
    header_start = time.perf_counter()
    counts, all_rates, bitmaps = _exchange_header(config, local_units, timings.header(), local_bits, group, world,
                                                  device)
    header_seconds = time.perf_counter() - header_start
    header_bytes = (HEADER_FIXED_BYTES + HEADER_BITMAP_BYTES) * (world - 1)
    union_bits, bitmaps, union_method, union_bytes = _union(local_bits, bitmaps, n, group, world, device)
    union_mask = ops.unpack_bits(union_bits, n)
    union_idx = union_mask.nonzero().flatten()
    union_units = int(union_idx.numel())
    esize = torch.empty(0, dtype=dtype).element_size()
    method = _choose(mode, union_units * m, n * m, rows, c, lossless_slack, dense_fraction, max_sketch_load)
    use_ef = residual is not None and method == "sketch" and union_units * m <= c
    # Lossless: all-reduce the union's rows, or all-gather every rank's own rows padded to the largest
    # support: the gather only when it sends clearly fewer bytes (it needs every rank's bitmap: its row indices),
    # and once both have been timed, whichever is faster (see TIMED_COLLECTIVES).
    max_local = max(counts)
    gather_bytes = (world - 1) * max_local * m * esize
    exact_by, filed = "", None  # filed: where this call's exact timing goes (its own union's size class)
    if method != "exact":
        exact_collective = ""
    else:
        union_ring_bytes = ring_allreduce_bytes(union_units * m * esize, world)
        if exact_collective == "auto" or bitmaps is None:
            gather_candidate = bitmaps is not None and gather_bytes <= GATHER_MAX_BYTES_FRACTION * union_ring_bytes
            exact_collective, exact_by = _exact_choice(timings, all_rates, gather_candidate, union_ring_bytes,
                                                       gather_bytes)
        _union_class[rate_key] = union_ring_bytes.bit_length()
        filed = _exact_timings.setdefault((rate_key, _union_class[rate_key]), _ExactTimings())

    def union_position():  # a unit's row in the compact union
        return union_mask.cumsum(0) - 1

    divisor = world if op == "avg" else 1  # divide, as DDP does: 1/world is inexact for most world sizes
    if method == "dense":
        if sparse_input:
            work_buf = sp.to_dense()
            rows2d = work_buf.view(n, m)
        payload = work_buf if device == work_buf.device else work_buf.to(device)
        payload_bytes = ring_allreduce_bytes(payload.numel() * esize, world)

        def finish():
            if payload is not work_buf:
                work_buf.copy_(payload)
            if divisor != 1:
                work_buf.div_(divisor)
            return rows2d.index_select(0, union_idx) if sparse_input else None
    elif exact_collective == "allreduce-union":
        if sparse_input:
            payload = torch.zeros(union_units, m, dtype=dtype, device=dev)
            payload.index_copy_(0, union_position()[local_idx], local_rows)
            payload = payload.to(device)
        else:
            payload = rows2d.index_select(0, union_idx).to(device)
        payload_bytes = ring_allreduce_bytes(payload.numel() * esize, world)

        def finish():  # rows outside U are zero on every rank already: only the union's rows change
            reduced = payload.to(dev)
            return reduced.div_(divisor) if divisor != 1 else reduced
    elif exact_collective == "allgather-local":
        mine = torch.empty(max_local, m, dtype=dtype, device=dev)
        if sparse_input:
            mine[:local_units] = local_rows
        else:
            torch.index_select(rows2d, 0, local_idx, out=mine[:local_units])
        mine[local_units:].zero_()
        gathered = torch.empty(world * max_local * m, dtype=dtype, device=device)
        payload_bytes = gather_bytes

        def finish():  # the same sum, in rank order, on every rank
            rows_of = gathered.view(world, max_local, m).to(dev)
            position = union_position()
            total = torch.zeros(union_units, m, dtype=dtype, device=dev)
            for r in range(world):
                own = ops.unpack_bits(bitmaps[r], n).nonzero().flatten()
                total.index_add_(0, position[own], rows_of[r, :counts[r]])
            return total.div_(divisor) if divisor != 1 else total
    else:
        if sparse_input:
            table = ops.count_sketch_units(local_rows, local_idx, rows, c, seed)
        else:
            support = local_bits if granularity == "row" else None
            table = ops.count_sketch(work_buf, rows, c, seed, support=support, granularity=granularity)
        payload = table.to(device)
        payload_bytes = ring_allreduce_bytes(payload.numel() * 4, world)

        def finish():  # decodes only U's rows: rows outside U are zero on every rank already
            table = payload.to(dev)
            if use_ef:
                table = table + residual
            est = ops.count_sketch_decode_units(table, union_idx, m, seed).to(dtype)
            if use_ef:  # re-sketch what the ranks apply, in the tensor's dtype: the residual keeps the rounding too
                residual.copy_(table - ops.count_sketch_units(est, union_idx, rows, c, seed))
            return est.div_(divisor) if divisor != 1 else est

    def complete():
        global _last
        union_rows = finish()  # the reduced rows of U ([|U|, m]), or None when written in place
        if sparse_input:
            result = torch.sparse_coo_tensor(union_idx.view(1, -1), union_rows.view(union_units, *shape[1:]), shape,
                                             is_coalesced=True)
        else:
            if union_rows is not None:
                rows2d.index_copy_(0, union_idx, union_rows)
            if work_buf is not tensor:
                tensor.copy_(work_buf)
            result = tensor
        if filed is not None:  # from issuing the payload to here (a late wait() counts too)
            filed.record(exact_collective, time.perf_counter() - issued, header_seconds, payload_bytes)
        stats = SketchStats(
            method=method, mode=mode, units=n, unit_size=m, local_units=local_units, union_units=union_units,
            union_method=union_method, sketch_shape=(rows, c),
            wire_bytes=header_bytes + union_bytes + payload_bytes,
            dense_wire_bytes=ring_allreduce_bytes(n * m * esize, world), seconds=time.perf_counter() - start,
            error_feedback=use_ef, exact_collective=exact_collective, exact_by=exact_by)
        _last = stats
        return result, stats

    # the payload's size is the same on every rank (|U| * m, P * max_local * m, r * c or n * m): all skip an
    # empty one together
    issued = time.perf_counter()
    if exact_collective == "allgather-local":
        handle = compat.all_gather_single(gathered, mine.view(-1).to(device), group=group, async_op=async_op) \
            if gathered.numel() else None
    else:
        handle = dist.all_reduce(payload, group=group, async_op=async_op) if payload.numel() else None
    if async_op:
        return _Pending(handle, complete)
    return complete()[0]
