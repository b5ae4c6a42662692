"""sketch_allreduce: sparse gradient all-reduce with a union bitmap and a count-sketch (S2 Reducer).

Per call, on every rank of the group, in this order:
  1. header: one fixed-size all-gather of (configuration fingerprint, call number, local support size, auto's
     count of timed choices, this rank's measured cost of the two exact collectives, the packed local bitmap when it
     fits in HEADER_BITMAP_BYTES, e.g. 65536 embedding rows). Fixed size, so ranks that disagree on anything that
     decides what goes on the wire or how it is decoded (shape, dtype, seed, rows, ratio/cols, mode, op,
     thresholds, the error-feedback residual's digest) meet in the same collective and raise MismatchError
     together, naming the fields, every call, before any collective whose size depends on the configuration; a
     rank that skipped or added a call is caught by the call number (its call n would meet a peer's n + 1).
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
A call given a Channel (a sequence of calls every rank makes in the same order, e.g. one DDP bucket's) whose previous
call gathered own rows sends steps 1 and 4 as one all-gather instead: the header words and bitmap ahead of its rows
(see Channel).
NaN/Inf count as non-zero: they are in U and propagate as a dense all-reduce would propagate them
(for "sketch" also into the coordinates that share their buckets).
"""
import dataclasses
import math
import threading
import time
import weakref

import torch
import torch.distributed as dist

from fastdist import ops
from fastdist.comm.wire import ring_allgather_bytes, ring_allreduce_bytes
from fastdist.distributed import compat
from fastdist.distributed.fingerprint import CallCounter, fingerprint, global_ranks, raise_mismatch, state_digest
from fastdist.ops.bitpack import bitmap_from_indices
from fastdist.ops.sketch import union_sum_rows

MODES = ("sketch", "exact", "auto")
GRANULARITIES = ("row", "element")
EXACT_COLLECTIVES = ("auto", "allreduce-union", "allgather-local")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEFAULT_RATIO = 0.05  # sketch width as a fraction of the tensor's values when neither ratio nor cols is given
HEADER_BITMAP_BYTES = 8192  # bitmaps up to 65536 units ride in the header: one collective fewer per call
HEADER_FIXED_BYTES = 48  # fingerprint, call number, local support size, timed choices (int64), two rates (float64)
HEADER_INTS = 4
# The lossless all-gather of own rows must send at most this fraction of the union all-reduce's bytes: it then
# sums P blocks locally, which the ring all-reduce overlaps with its transfers, so it needs a clear byte saving.
GATHER_MAX_BYTES_FRACTION = 0.75
# Bytes alone do not pick the faster exact collective: where the CPU rather than the link is the bottleneck, the
# gather's local sums cost more than the bytes it saves. So each rank times the exact collectives it runs
# (ExactTimings); the header carries the figures, and once both have a figure on every rank, every rank keeps the
# gather (it wins wherever the link is the bottleneck) unless the slowest rank predicts it EXACT_SWITCH_MARGIN
# times slower than the union all-reduce, trying the other collective again every EXACT_REPROBE_EVERY calls. The
# figures are kept per size class of the union (powers of two of its ring bytes), because a per-byte cost measured
# at one size does not carry to one 16x larger. A call decides with the figures of the class of the previous call's
# union, which every rank knows alike before the header, and records into its own union's class.
TIMED_COLLECTIVES = ("allreduce-union", "allgather-local")  # the order of the header's rates
EXACT_RATE_SMOOTHING = 0.5  # weight of the newest measurement
EXACT_SWITCH_MARGIN = 1.1
EXACT_COUNTED_RUNS = 2  # runs averaged before a collective has a figure (after its first, uncounted one)
EXACT_REPROBE_EVERY = 32
# calls at a new union size class until auto has timed both exact collectives there (the first decides with the
# previous class's figures; then three runs of each, the first of each untimed)
EXACT_EXPLORE_CALLS = 2 * (EXACT_COUNTED_RUNS + 1) + 1
# A Channel's folded gather (see Channel): header words, then the bitmap, then up to `capacity` rows per rank, the
# capacity this much above the largest support of the channel's previous call (a larger one costs a second gather);
# every FOLD_RECHECK_EVERY-th call of a channel sends a header of its own again, so that auto re-decides with fresh
# timings.
FOLD_HEADER_INTS = 4  # fingerprint, call number, local support size, layout-changed flag
FOLD_CAPACITY_SLACK = 1 / 32
FOLD_RECHECK_EVERY = 32


# --- what a call reports ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class SketchStats:
    """What the last sketch_allreduce call on this process did."""
    method: str              # "sketch", "exact" or "dense"
    mode: str                # what was asked for
    units: int               # n: rows (granularity "row") or elements
    unit_size: int           # m: values per unit
    local_units: int         # |support| on this rank
    union_units: int         # |U|
    union_method: str        # "header" (bitmaps in the header), "allgather-or", "allreduce-max" or "folded" (in
                             # the gather of own rows, see Channel)
    sketch_shape: tuple      # (rows, cols) of the table (also when not used)
    wire_bytes: int          # bytes this rank sends, all steps (ring model for all-reduces)
    dense_wire_bytes: int    # what a dense ring all-reduce of the tensor would send
    seconds: float           # wall time of the synchronous part
    error_feedback: bool = False  # the residual sketch was used and updated by this call
    exact_collective: str = ""    # method "exact": "allreduce-union" or "allgather-local"
    exact_by: str = ""            # how exact_collective="auto" chose it: "bytes", "explore" (timing the other
                                  # once), "timed" (see TIMED_COLLECTIVES) or "folded" (a Channel's folded gather);
                                  # "" when the caller named one

    @property
    def union_fraction(self) -> float:
        """|U| / n: the share of the units some rank holds (0.0 for an empty tensor)."""
        return self.union_units / self.units if self.units else 0.0


_last = None


def last_stats() -> SketchStats | None:
    """The SketchStats of the last completed sketch_allreduce call on this process (None before any)."""
    return _last


# --- what a process learns across calls: the exact collectives' measured costs ----------------------------------

class CollectiveRates:
    """This process's measured cost of each exact collective for one tensor configuration and union size class.

    A cost is seconds per wire byte of the payload collective plus the write-back, less the call's header time (a
    collective's latency, so that small payloads are not charged it per byte), averaged exponentially. A
    collective's first run is not counted: it pays one-time costs (connections, first-touch buffers) that would bias
    the choice for good.
    """

    def __init__(self) -> None:
        self.runs = dict.fromkeys(TIMED_COLLECTIVES, 0)
        self.rate = dict.fromkeys(TIMED_COLLECTIVES, math.nan)
        self.timed_choices = 0  # the same count on every rank: set from the gathered header's largest

    def header(self) -> list[float]:
        """The rates this rank sends in the header, in TIMED_COLLECTIVES order; NaN where not yet measured."""
        return [self.rate[k] if self.runs[k] > EXACT_COUNTED_RUNS else math.nan for k in TIMED_COLLECTIVES]

    def record(self, collective: str, seconds: float, header_seconds: float, nbytes: int) -> None:
        """Counts one run of `collective` that sent `nbytes` in `seconds` (header_seconds: the call's header)."""
        self.runs[collective] += 1
        if self.runs[collective] == 1 or not nbytes:
            return
        rate = max(seconds - header_seconds, 0.1 * seconds) / nbytes
        before = self.rate[collective]
        self.rate[collective] = rate if math.isnan(before) else \
            (1 - EXACT_RATE_SMOOTHING) * before + EXACT_RATE_SMOOTHING * rate


class ExactTimings:
    """What exact_collective="auto" has measured on one process group: CollectiveRates per tensor configuration
    and size class of the union. The caller owns it (a SketchState holds one); a plain call uses its group's
    default_exact_timings. Measurements of this process: not saved with a state, measured afresh after a restore.
    """

    def __init__(self) -> None:
        self.by_class: dict[tuple, CollectiveRates] = {}  # ((configuration), union size class) -> rates
        self.last_class: dict[tuple, int] = {}  # configuration -> size class of its last exact call's union

    def for_header(self, configuration: tuple) -> CollectiveRates:
        """The rates a call sends and decides with: those of the previous exact call's union size class.

        Args:
            configuration: what the timings are kept by (world size, tensor shape, dtype, granularity).

        Returns:
            The CollectiveRates kept for that configuration and size class (created empty at first use).
        """
        return self.by_class.setdefault((configuration, self.last_class.get(configuration)), CollectiveRates())

    def for_union(self, configuration: tuple, union_ring_bytes: int) -> CollectiveRates:
        """The rates this exact call records into: its own union's size class, which the next call decides with.

        Args:
            configuration: the call's timed configuration, as given to :meth:`for_header`.
            union_ring_bytes: the union all-reduce's ring bytes; its bit length is the size class.

        Returns:
            The CollectiveRates kept for that configuration and size class (created empty at first use).
        """
        size_class = self.last_class[configuration] = union_ring_bytes.bit_length()
        return self.by_class.setdefault((configuration, size_class), CollectiveRates())


# ProcessGroup objects take weak references and c10d holds every group until destroy_process_group, so a group's
# timings live exactly as long as the group, and a group created later never finds another's (as it could under
# an id() key, which Python reuses). None (the default group) is keyed by dist.group.WORLD for the same reason:
# a re-initialized default group is a new object.
_default_timings: "weakref.WeakKeyDictionary[dist.ProcessGroup, ExactTimings]" = weakref.WeakKeyDictionary()
_default_timings_lock = threading.Lock()
_default_calls: "weakref.WeakKeyDictionary[dist.ProcessGroup, CallCounter]" = weakref.WeakKeyDictionary()


def default_exact_timings(group: dist.ProcessGroup | None = None) -> ExactTimings:
    """The ExactTimings that sketch_allreduce calls on `group` without a `timings` argument share.

    Args:
        group: the process group (None: the default group).

    Returns:
        The group's ExactTimings, created at first use and released with the group.
    """
    return _of_group(_default_timings, group, ExactTimings)


def default_call_counter(group: dist.ProcessGroup | None = None) -> CallCounter:
    """The CallCounter that numbers the sketch_allreduce calls on `group` without a `step` argument.

    Args:
        group: the process group (None: the default group).

    Returns:
        The group's CallCounter, created at first use and released with the group.
    """
    return _of_group(_default_calls, group, CallCounter)


def _of_group(registry, group, make):
    """registry[group], made at first use (the default group keyed by dist.group.WORLD, see above)."""
    key = dist.group.WORLD if group is None else group
    with _default_timings_lock:
        found = registry.get(key)
        if found is None:
            found = registry[key] = make()
        return found


class Channel:
    """A sequence of sketch_allreduce calls that every rank makes in the same order (one DDP bucket's calls), so
    that what one call agreed on can shape the next call's collectives on every rank alike.

    After a call that summed exactly by gathering each rank's own rows with the bitmaps in its header, the next
    call sends its header words and bitmap in that gather, ahead of its rows ("folded"): one collective instead of
    two. Its size comes from what the previous call agreed (the layout, and a row capacity from the largest support
    then), never from this call's arguments, so a rank whose arguments changed still meets the others in it: the
    header's fingerprint and call number are checked as in a header of its own (MismatchError on every rank, naming
    the fields), and a tensor of another layout on every rank alike sends the call through the plain header path.
    Rows beyond the capacity follow in a second gather. The result is the lossless sum whatever |U| came out; a call
    whose union would have chosen another method, or every FOLD_RECHECK_EVERY-th, ends the folding.

    The caller owns it (SketchState holds one per bucket index); it holds nothing a restart needs.
    """

    def __init__(self) -> None:
        self.layout: tuple | None = None  # (n, m, dtype, sparse, granularity) agreed by the last call; None: unfolded
        self.capacity = 0                 # rows per rank the folded gather carries
        self.folded_calls = 0             # since the last header of its own
        self._buffers: dict[str, torch.Tensor] = {}  # the folded gather's send and receive buffers, kept

    def _buffer(self, name, nbytes, device):
        """uint8 [nbytes] on `device`, the first bytes of the channel's buffer `name`, which calls reuse while it
        is large enough and not twice too large: a new buffer of that size would be fresh pages to fault in on every
        call, and the folded gather's size moves with each call's supports."""
        buf = self._buffers.get(name)
        if buf is None or buf.device != device or not nbytes <= buf.numel() <= 2 * nbytes:
            buf = self._buffers[name] = torch.empty(nbytes + nbytes // 8, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def _agree(self, layout, counts, folded):
        """After a call, on every rank alike: fold the next call (with this call's largest support) or not."""
        self.folded_calls = self.folded_calls + 1 if folded else 0
        if layout is None or self.folded_calls >= FOLD_RECHECK_EVERY:
            self.layout, self.capacity, self.folded_calls = None, 0, 0
        else:
            self.layout, self.capacity = layout, math.ceil(max(counts) * (1 + FOLD_CAPACITY_SLACK))


# --- arguments and this rank's view of the tensor ---------------------------------------------------------------

def sketch_width(numel: int, ratio: float | None = None, cols: int | None = None) -> int:
    """The number of columns c of a sketch of `numel` values: `cols` when given, else ceil(ratio * numel), at least 1.

    Args:
        numel: values of the sketched tensor.
        ratio: sketch width as a fraction of numel (DEFAULT_RATIO when neither ratio nor cols is given).
        cols: the width itself.

    Returns:
        c, as sketch_allreduce uses it (the residual of error feedback is [rows, c]).
    """
    if cols is not None:
        return int(cols)
    return max(1, math.ceil((DEFAULT_RATIO if ratio is None else ratio) * numel))


def _check_args(tensor, ratio, cols, rows, granularity, mode, op, exact_collective, thresholds):
    for name, value in thresholds.items():
        if not isinstance(value, (int, float)) or not value >= 0 or (name == "max_sketch_load" and not value > 0):
            raise ValueError(f"sketch_allreduce: {name} must be a number "
                             f"{'> 0' if name == 'max_sketch_load' else '>= 0'}, got {value!r}")
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


def _check_residual(residual, rows, cols):
    if residual is not None and (residual.dtype != torch.float32 or tuple(residual.shape) != (rows, cols)):
        raise ValueError(f"sketch_allreduce: 'residual' must be float32 of shape {(rows, cols)}, got "
                         f"{residual.dtype} {tuple(residual.shape)}")


def _collective_device(tensor, group):
    if dist.get_backend(group) == "nccl":
        return tensor.device if tensor.is_cuda else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _LocalUnits:
    """This rank's tensor as n units of m values (rows of dim 0, or elements): its support and its rows.

    A dense tensor is reduced in place through `buf` (the tensor, or a contiguous copy written back at the end); a
    row-sparse one is read from its rows as they are, nothing dense unless the union itself is dense (densify()).
    """

    def __init__(self, tensor, granularity):
        self.tensor, self.granularity = tensor, granularity
        self.sparse = tensor.is_sparse
        if self.sparse:
            self.coalesced = tensor.coalesce()
            self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, self.coalesced.device
            self.n, self.m = self.shape[0], math.prod(self.shape[1:])
            self.idx = self.coalesced.indices()[0]
            self.rows = self.coalesced.values().reshape(self.idx.numel(), self.m)  # the support's rows
            self.bits = bitmap_from_indices(self.idx, self.n)
            self.buf = self.rows2d = None
        else:
            self.buf = tensor.contiguous()
            self.shape, self.dtype, self.device = tuple(self.buf.shape), self.buf.dtype, self.buf.device
            if granularity == "element" or self.buf.dim() == 0:
                self.n, self.m = self.buf.numel(), 1
            else:
                self.n = self.shape[0]
                self.m = self.buf.numel() // self.n if self.n else 0
            self.rows2d = self.buf.view(self.n, self.m) if self.n else self.buf.view(0, 0)
            self.bits = ops.nonzero_bitmap(self.buf, granularity)
            self.idx = ops.unpack_bits(self.bits, self.n).nonzero().flatten() if self.n \
                else torch.zeros(0, dtype=torch.int64)
        self.units = int(self.idx.numel())
        self.esize = torch.empty(0, dtype=self.dtype).element_size()

    def densify(self):
        """Gives a sparse input the dense buffer a dense reduction sums (a dense input has it already)."""
        if self.sparse:
            self.buf = self.coalesced.to_dense()
            self.rows2d = self.buf.view(self.n, self.m)

    def write_back(self, union, union_rows):
        """The call's result: a sparse tensor of U's reduced rows, or the tensor itself with them written in."""
        if self.sparse:
            # sorted, in-range indices by construction: torch's invariant check would only warn once per process
            return torch.sparse_coo_tensor(union.idx.view(1, -1), union_rows.view(union.units, *self.shape[1:]),
                                           self.shape, is_coalesced=True, check_invariants=False)
        if union_rows is not None:
            self.rows2d.index_copy_(0, union.idx, union_rows)
        if self.buf is not self.tensor:
            self.tensor.copy_(self.buf)
        return self.tensor


# --- steps 1 and 2: the header and the union ------------------------------------------------------------------

@dataclasses.dataclass
class _Header:
    counts: list       # every rank's local support size
    rates: list        # every rank's CollectiveRates.header() ([world][2], NaN: not measured)
    bitmaps: object    # uint8 [world, ceil(n / 8)] of every rank's support, or None when they did not fit
    timed_choices: int  # the largest count of timed exact choices any rank sent (see _exact_choice)


def _exchange_header(config, step, local_units, timed_choices, rates, local_bits, group, world, device):
    """All-gathers (fingerprint of `config`, the call's step number, local support size, count of timed exact choices, this
    rank's seconds per byte of the TIMED_COLLECTIVES, NaN where not measured, local bitmap if it fits) in a buffer
    of fixed size; raises MismatchError on every rank, naming the fields, when the configurations or the call
    numbers differ."""
    nbytes = local_bits.numel()
    inline = nbytes <= HEADER_BITMAP_BYTES
    ints = 8 * HEADER_INTS
    mine = torch.zeros(HEADER_FIXED_BYTES + HEADER_BITMAP_BYTES, dtype=torch.uint8)
    mine[:ints] = torch.tensor([_config_fingerprint(config), step, local_units, timed_choices],
                               dtype=torch.int64).view(torch.uint8)
    mine[ints:HEADER_FIXED_BYTES] = torch.tensor(rates, dtype=torch.float64).view(torch.uint8)
    if inline:
        mine[HEADER_FIXED_BYTES:HEADER_FIXED_BYTES + nbytes] = local_bits.cpu()
    out, head = _gather_checked(mine, ints, config, group, world, device)
    all_rates = out[:, ints:HEADER_FIXED_BYTES].contiguous().view(torch.float64).tolist()
    bitmaps = out[:, HEADER_FIXED_BYTES:HEADER_FIXED_BYTES + nbytes].contiguous().to(local_bits.device) \
        if inline else None
    return _Header(head[:, 2].tolist(), all_rates, bitmaps, int(head[:, 3].max()))


_PER_CALL_FIELDS = ("iter", "seed", "residual")  # configuration fields that change from call to call
_static_fingerprints: dict = {}


def _config_fingerprint(config):
    """fingerprint(config), the fields that stay the same from call to call hashed once per process (a blake2b pass
    over a few dozen fields costs as much as the rest of a small call)."""
    static = tuple((k, type(v).__name__, v) for k, v in config.items() if k not in _PER_CALL_FIELDS)
    try:
        known = _static_fingerprints.get(static)
    except TypeError:  # an unhashable value
        return fingerprint(config)
    if known is None:
        if len(_static_fingerprints) >= 4096:
            _static_fingerprints.clear()
        known = _static_fingerprints[static] = fingerprint({k: v for k, _, v in static})
    return fingerprint((known, [config.get(k) for k in _PER_CALL_FIELDS]))


def _gather_checked(mine, ints, config, group, world, device, out=None):
    """All-gathers every rank's uint8 buffer `mine`, led by int64 words (fingerprint of `config`, call number, ...),
    into `out` (uint8 [world * len(mine)] on `device`; None: a new one); raises MismatchError on every rank, naming the
    fields, when the fingerprints or the call numbers differ. Returns the gathered buffers ([world, len(mine)], on the
    CPU) and their leading words ([world, ints / 8] int64)."""
    if out is None:
        out = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    compat.all_gather_single(out, mine.to(device), group=group)
    out = out.view(world, mine.numel()).cpu()
    head = out[:, :ints].contiguous().view(torch.int64)
    if len(set(head[:, 0].tolist())) > 1:
        raise_mismatch("sketch_allreduce configuration", config, group)
    calls = head[:, 1].tolist()
    if len(set(calls)) > 1:  # the ranks' global numbers only for the message
        CallCounter.check("sketch_allreduce", dict(zip(global_ranks(group), calls)))
    return out, head


@dataclasses.dataclass
class _Union:
    """The union support U, the same on every rank, and how it was computed."""
    bits: torch.Tensor   # packed
    mask: torch.Tensor   # bool [n]
    idx: torch.Tensor    # U's units, increasing
    units: int           # |U|
    bitmaps: object      # every rank's packed support ([world, bytes]), or None when not gathered
    method: str          # "header", "allgather-or" or "allreduce-max"
    wire_bytes: int      # what computing it sent beyond the header

    def position(self):
        """A unit's row in the compact union ([n], valid where mask is set)."""
        return self.mask.cumsum(0) - 1


def _union(local_bits, bitmaps, n, group, world, device):
    """The OR of every rank's bitmap: from the header's bitmaps, else by whichever collective sends fewer bytes."""
    if bitmaps is not None:
        bits, method, nbytes = ops.bitwise_or_reduce(bitmaps), "header", 0
    else:
        gather_bytes = ring_allgather_bytes(local_bits.numel(), world)
        max_bytes = ring_allreduce_bytes(n, world)
        if gather_bytes <= max_bytes:
            gathered = torch.empty(world * local_bits.numel(), dtype=torch.uint8, device=device)
            compat.all_gather_single(gathered, local_bits.to(device), group=group)
            bitmaps = gathered.view(world, local_bits.numel()).to(local_bits.device)
            bits, method, nbytes = ops.bitwise_or_reduce(bitmaps), "allgather-or", gather_bytes
        else:
            mask = ops.unpack_bits(local_bits, n).to(torch.uint8).to(device)
            dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
            bits, method, nbytes = ops.pack_bits(mask.to(local_bits.device).bool()), "allreduce-max", max_bytes
    mask = ops.unpack_bits(bits, n)
    idx = mask.nonzero().flatten()
    return _Union(bits, mask, idx, int(idx.numel()), bitmaps, method, nbytes)


# --- step 3: the method ----------------------------------------------------------------------------------------

def _choose(mode, union_values, total_values, rows, cols, lossless_slack, dense_fraction, max_sketch_load):
    if union_values >= dense_fraction * total_values:
        return "dense"  # in every mode: a dense union sketches badly and sends no fewer bytes exactly
    if mode != "auto":
        return mode
    # The error budget: a sketch narrower than the union's values decodes badly, so auto only considers sketches
    # with c >= |U| m / max_sketch_load, and then only if they are cheaper than exact by lossless_slack.
    if union_values > max_sketch_load * cols or union_values <= lossless_slack * rows * cols:
        return "exact"
    return "sketch"


def _exact_choice(rates, all_rates, gather_candidate, union_bytes, gather_bytes):
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
    rates.timed_choices += 1
    if rates.timed_choices % EXACT_REPROBE_EVERY == 0:
        return slower, "explore"
    return faster, "timed"


# --- step 4: the reductions, each prepare -> payload collective -> finish --------------------------------------

class _Reduction:
    """One way to sum U's rows over the group. prepare() builds this rank's payload and returns the bytes its
    collective sends; collective() issues it (its size is the same on every rank, so all skip an empty one
    together); finish(), once it has completed, returns U's reduced rows ([|U|, m]), or None when it reduced the
    dense buffer in place."""
    method = ""
    exact_collective = ""
    error_feedback = False

    def __init__(self, local, union, world, device, divisor):
        self.local, self.union, self.world, self.device, self.divisor = local, union, world, device, divisor
        self.payload = None

    def prepare(self):
        raise NotImplementedError

    def collective(self, group, async_op):
        """One SUM all-reduce of the payload."""
        return dist.all_reduce(self.payload, group=group, async_op=async_op) if self.payload.numel() else None

    def finish(self):
        raise NotImplementedError

    def _divided(self, t):  # divide, as DDP does: 1/world is inexact for most world sizes
        return t.div_(self.divisor) if self.divisor != 1 else t


class _DenseAllReduce(_Reduction):
    """The whole tensor, as dist.all_reduce would: a union this dense sends no fewer bytes any other way."""
    method = "dense"

    def prepare(self):
        self.local.densify()
        buf = self.local.buf
        self.payload = buf if self.device == buf.device else buf.to(self.device)
        return ring_allreduce_bytes(self.payload.numel() * self.local.esize, self.world)

    def finish(self):
        local = self.local
        if self.payload is not local.buf:
            local.buf.copy_(self.payload)
        self._divided(local.buf)
        return local.rows2d.index_select(0, self.union.idx) if local.sparse else None


class _UnionAllReduce(_Reduction):
    """Lossless (OmniReduce-style): an all-reduce of U's rows, zeros where this rank holds none."""
    method, exact_collective = "exact", "allreduce-union"

    def prepare(self):
        local, union = self.local, self.union
        if local.sparse:
            payload = torch.zeros(union.units, local.m, dtype=local.dtype, device=local.device)
            payload.index_copy_(0, union.position()[local.idx], local.rows)
            self.payload = payload.to(self.device)
        else:
            self.payload = local.rows2d.index_select(0, union.idx).to(self.device)
        return ring_allreduce_bytes(self.payload.numel() * local.esize, self.world)

    def finish(self):  # rows outside U are zero on every rank already: only the union's rows change
        return self._divided(self.payload.to(self.local.device))


class _GatherOwnRows(_Reduction):
    """Lossless (AGsparse without indices: the gathered bitmaps are the indices): an all-gather of every rank's own
    rows, padded to the largest support, summed in rank order identically on every rank."""
    method, exact_collective = "exact", "allgather-local"

    def __init__(self, local, union, world, device, divisor, counts):
        super().__init__(local, union, world, device, divisor)
        self.counts, self.max_local = counts, max(counts)

    def prepare(self):
        local = self.local
        self.mine = torch.empty(self.max_local, local.m, dtype=local.dtype, device=local.device)
        _own_rows(local, self.mine)
        self.gathered = torch.empty(self.world * self.max_local * local.m, dtype=local.dtype, device=self.device)
        return ring_allgather_bytes(self.max_local * local.m * local.esize, self.world)

    def collective(self, group, async_op):
        if not self.gathered.numel():
            return None
        return compat.all_gather_single(self.gathered, self.mine.view(-1).to(self.device), group=group,
                                        async_op=async_op)

    def finish(self):
        local = self.local
        rows_of = self.gathered.view(self.world, self.max_local, local.m).to(local.device)
        return union_sum_rows(self.union.bitmaps, rows_of, local.n, self.divisor)[1]


def _layout(local):
    return (local.n, local.m, str(local.dtype), local.sparse, local.granularity)


def _own_rows(local, out):
    """Writes this rank's first len(out) support rows into out ([k, m]), zeros past its own; returns how many."""
    k = min(out.shape[0], local.units)
    if local.sparse:
        out[:k] = local.rows[:k]
    elif k:
        torch.index_select(local.rows2d, 0, local.idx[:k], out=out[:k])
    out[k:].zero_()
    return k


def _folded_call(channel, config, step, local, group, world, device, divisor, timings, timed_config, start, choice):
    """sketch_allreduce through the channel's folded gather: the result, with last_stats() set, or None when the
    call must go the plain way (see _folded_gather)."""
    global _last
    issued = time.perf_counter()
    folded = _folded_gather(channel, config, step, local, group, world, device, divisor)
    if folded is None:
        channel._agree(None, [0], folded=False)
        return None
    total, union, counts, wire = folded
    n, m, esize = local.n, local.m, local.esize
    union_ring_bytes = ring_allreduce_bytes(union.units * m * esize, world)
    timings.for_union(timed_config, union_ring_bytes).record("allgather-local", time.perf_counter() - issued, 0.0,
                                                             wire)
    # what a call with a header of its own would choose from this union: still the gather, or the end of folding
    method = _choose(choice["mode"], union.units * m, n * m, choice["rows"], choice["c"], choice["lossless_slack"],
                     choice["dense_fraction"], choice["max_sketch_load"])
    gather_bytes = ring_allgather_bytes(max(counts) * m * esize, world)
    keep = method == "exact" and (choice["exact_collective"] == "allgather-local" or (
        choice["exact_collective"] == "auto" and gather_bytes <= GATHER_MAX_BYTES_FRACTION * union_ring_bytes))
    channel._agree(_layout(local) if keep else None, counts, folded=True)
    result = local.write_back(union, total)
    _last = SketchStats(
        method="exact", mode=choice["mode"], units=n, unit_size=m, local_units=local.units, union_units=union.units,
        union_method="folded", sketch_shape=(choice["rows"], choice["c"]), wire_bytes=wire,
        dense_wire_bytes=ring_allreduce_bytes(n * m * esize, world), seconds=time.perf_counter() - start,
        exact_collective="allgather-local", exact_by="folded")
    return result


def _folded_gather(channel, config, step, local, group, world, device, divisor):
    """One call through the channel's folded gather (see Channel): (U's summed rows, union, counts, wire bytes), or
    None when every rank's tensor left the agreed layout (the call then goes the plain way). Raises MismatchError on
    every rank when the fingerprints or call numbers differ."""
    n, m, dtype_name, _, _ = channel.layout
    dtype = getattr(torch, dtype_name.split(".")[-1])
    esize = torch.empty(0, dtype=dtype).element_size()
    bitmap_bytes = -(-n // 8)
    ints = 8 * FOLD_HEADER_INTS
    rows_at = ints + -(-bitmap_bytes // 8) * 8  # 8-byte aligned, so every rank's rows can be viewed in place
    cap = channel.capacity
    stale = _layout(local) != channel.layout
    mine = channel._buffer("send", rows_at + cap * m * esize, torch.device("cpu"))
    mine[:ints] = torch.tensor([_config_fingerprint(config), step, 0 if stale else local.units, int(stale)],
                               dtype=torch.int64).view(torch.uint8)
    mine[ints:rows_at].zero_()
    if stale:
        mine[rows_at:].zero_()
    else:
        mine[ints:ints + bitmap_bytes] = local.bits.cpu()
        _own_rows(local, mine[rows_at:].view(dtype).view(cap, m))
    out, head = _gather_checked(mine, ints, config, group, world, device,
                                out=channel._buffer("received", world * mine.numel(), device))
    if int(head[:, 3].max()):  # the same configuration, a new layout on every rank (e.g. DDP's rebuilt buckets)
        return None
    counts = head[:, 2].tolist()
    bitmaps = out[:, ints:ints + bitmap_bytes]
    wire = ring_allgather_bytes(mine.numel(), world)
    rows_of = out[:, rows_at:].view(dtype).view(world, cap, m)  # in place: the rows start 8-byte aligned
    extra = max(counts) - cap
    if extra > 0:  # a support beyond the capacity: its remaining rows in a second gather
        block = torch.zeros(extra, m, dtype=local.dtype)
        if local.units > cap:
            block[:local.units - cap] = _own_rows_from(local, cap).cpu()
        more = torch.empty(world * extra * m, dtype=local.dtype, device=device)
        compat.all_gather_single(more, block.view(-1).to(device), group=group)
        rows_of = torch.cat([rows_of, more.view(world, extra, m).cpu()], dim=1)
        wire += ring_allgather_bytes(extra * m * esize, world)
    units, total = union_sum_rows(bitmaps.to(local.bits.device), rows_of.to(local.device), n, divisor)
    union = _Union(None, None, units, int(units.numel()), bitmaps, "header", 0)
    return total, union, counts, wire


def _own_rows_from(local, start):
    """This rank's support rows from the start-th on."""
    return local.rows[start:] if local.sparse else local.rows2d.index_select(0, local.idx[start:])


class _SketchAllReduce(_Reduction):
    """Lossy: an all-reduce of an r x c count-sketch, decoded at U's units only. With a residual (error feedback)
    every rank decodes from S + R and keeps R <- S + R - sketch(decoded), the same R on every rank."""
    method = "sketch"

    def __init__(self, local, union, world, device, divisor, rows, cols, seed, residual):
        super().__init__(local, union, world, device, divisor)
        self.rows, self.cols, self.seed = rows, cols, seed
        # only a sketch as wide as the union's values: narrower, decoding all of U is too noisy and R would diverge
        self.error_feedback = residual is not None and union.units * local.m <= cols
        self.residual = residual if self.error_feedback else None

    def prepare(self):
        local = self.local
        if local.sparse:
            table = ops.count_sketch_units(local.rows, local.idx, self.rows, self.cols, self.seed)
        else:
            support = local.bits if local.granularity == "row" else None
            table = ops.count_sketch(local.buf, self.rows, self.cols, self.seed, support=support,
                                     granularity=local.granularity)
        self.payload = table.to(self.device)
        return ring_allreduce_bytes(self.payload.numel() * 4, self.world)

    def finish(self):  # decodes only U's rows: rows outside U are zero on every rank already
        union = self.union
        table = self.payload.to(self.local.device)
        if self.error_feedback:
            table = table + self.residual
        est = ops.count_sketch_decode_units(table, union.idx, self.local.m, self.seed).to(self.local.dtype)
        if self.error_feedback:  # re-sketch what the ranks apply, in the tensor's dtype: R keeps the rounding
            self.residual.copy_(table - ops.count_sketch_units(est, union.idx, self.rows, self.cols, self.seed))
        return self._divided(est)


def _exact_reduction(common, asked, header, decided_with):
    """The lossless reduction: the one the caller named, or auto's choice (_exact_choice). Returns it, how auto
    chose ("" when the caller named it) and the union all-reduce's ring bytes (whose size class files the timing)."""
    local, union, world = common[:3]
    union_ring_bytes = ring_allreduce_bytes(union.units * local.m * local.esize, world)
    exact_by = ""
    if asked == "auto" or union.bitmaps is None:  # the gather needs every rank's bitmap
        gather_bytes = ring_allgather_bytes(max(header.counts) * local.m * local.esize, world)
        gather_candidate = union.bitmaps is not None and gather_bytes <= GATHER_MAX_BYTES_FRACTION * union_ring_bytes
        asked, exact_by = _exact_choice(decided_with, header.rates, gather_candidate, union_ring_bytes, gather_bytes)
    reduction = _UnionAllReduce(*common) if asked == "allreduce-union" else _GatherOwnRows(*common, header.counts)
    return reduction, exact_by, union_ring_bytes


class _Pending:
    """Handle of an asynchronous sketch_allreduce. wait() (or the future's callback) runs the write-back
    once, after the payload collective has completed."""

    def __init__(self, work, complete):
        self._work, self._complete = work, complete
        self._lock = threading.Lock()
        self._done, self._result, self.stats = False, None, None

    def wait(self) -> bool:
        """Blocks until the result is written back; returns True (as dist's Work.wait does)."""
        self.result()
        return True

    def is_completed(self) -> bool:
        """Whether the write-back has run."""
        return self._done

    def result(self) -> torch.Tensor:
        """Waits for the payload collective, writes back once, and returns the call's result."""
        if self._work is not None and not self._done:
            self._work.wait()
        return self._finish()

    def _finish(self):
        # Runs once, after the payload collective completed. Never waits on the work itself: it is also
        # called from the work's future callback, where waiting would deadlock.
        with self._lock:
            if not self._done:
                self._result, self.stats = self._complete()
                self._done = True
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch.futures.Future that resolves to the result once the reduction has been written back."""
        if self._work is None:
            fut = torch.futures.Future()
            fut.set_result(self.result())
            return fut
        return self._work.get_future().then(lambda _: self._finish())


def sketch_allreduce(tensor: torch.Tensor, *, ratio: float | None = None, cols: int | None = None, rows: int = 3,
                     seed: int = 0, granularity: str = "row", mode: str = "sketch", op: str = "sum",
                     group: dist.ProcessGroup | None = None, async_op: bool = False, lossless_slack: float = 2.0,
                     dense_fraction: float = 0.5, max_sketch_load: float = 1.0, residual: torch.Tensor | None = None,
                     exact_collective: str = "auto", timings: ExactTimings | None = None,
                     step: int | None = None, agreed: dict | None = None,
                     channel: Channel | None = None) -> torch.Tensor | _Pending:
    """Sums `tensor` over the ranks of `group`, sending only its union support (exact) or a sketch of it.

    Args:
        tensor: float32/float16/bfloat16/float64, dense (reduced in place, like dist.all_reduce) or a row-sparse
            torch.sparse_coo tensor, e.g. an nn.Embedding(sparse=True) gradient: reduced from its rows without a
            dense copy (unless the union is dense) and returned as a new coalesced sparse tensor whose rows are U;
            the values are exactly those of reducing its dense form.
        ratio: sketch width c = ceil(ratio * numel) (DEFAULT_RATIO when cols is not given either).
        cols: sketch width c directly.
        rows: sketch rows r (odd).
        seed: the hash seed; must be the same on every rank (checked).
        granularity: "row" (support per row of dim 0: embedding gradients) or "element".
        mode: "sketch" (lossy, r*c values on the wire), "exact" (lossless union all-reduce), "auto" (per call from
            |U|: the sketch only if it is wide enough to decode well, c >= |U| m / max_sketch_load, and cheaper
            than exact by lossless_slack; else exact: on the workloads measured so far auto is lossless). In every
            mode a union covering >= dense_fraction of the units is reduced densely (dense_fraction > 1: never).
            Identical on every rank.
        op: "sum" or "avg".
        group: the process group (None: the default group).
        async_op: return a handle whose wait() completes the reduction (the payload collective is asynchronous).
        lossless_slack: see mode.
        dense_fraction: see mode.
        max_sketch_load: see mode.
        residual: sketch-space error feedback (FetchSGD): a float32 [rows, cols] tensor, zeros at first, kept by
            the caller across calls with a fixed seed. Every rank holds the same summed sketch S, so every rank
            keeps the same residual: decode from S + R, then R <- S + R - sketch(decoded). Applied only when the
            sketch is at least as wide as the union's values (c >= |U| m): narrower, decoding all of U is too
            noisy and re-sketching it makes R grow without bound. Calls that skip it, or end up exact or dense,
            leave R unchanged (see last_stats().error_feedback).
        exact_collective: how "exact" sums the union: "allreduce-union", "allgather-local" (needs every rank's
            bitmap: always at row granularity up to HEADER_BITMAP_BYTES * 8 rows), or "auto": the gather only when
            it sends at most GATHER_MAX_BYTES_FRACTION of the all-reduce's bytes; then, once each has been timed
            (such calls gather 3 times, then all-reduce 3 times: a first run is not counted), the gather unless it
            is measured EXACT_SWITCH_MARGIN times slower on the slowest rank, per group, tensor shape and size
            class of the union (at most EXACT_EXPLORE_CALLS calls explore a new one), with the other re-timed every
            EXACT_REPROBE_EVERY calls (last_stats().exact_by says which rule chose).
        timings: where "auto" keeps those timings across calls (None: default_exact_timings(group)).
        step: this call's number as the caller counts it (e.g. the training step), checked in the header: a rank
            that skipped or added a call raises MismatchError on every rank at its next call instead of pairing two
            steps' tensors. None: the group's count of calls that pass none (default_call_counter), which catches
            ranks whose counts differ (e.g. restored from different steps) but cannot tell a skipped call on its
            own, since every rank's k-th call then meets the others' k-th.
        agreed: more settings that must be identical on every rank, checked with the call's own (a caller's
            configuration, e.g. the DDP hook's state and the bucket's parameters): {field name: value}.
        channel: the Channel of a sequence of calls every rank makes in the same order (e.g. one DDP bucket's):
            a call after one that gathered own rows folds its header into that gather (see Channel).

    Returns:
        The result tensor (the input itself when dense), or, with async_op, a handle with wait(), result(),
        get_future() and, once completed, stats.

    Raises:
        TypeError, ValueError: bad arguments, before any communication.
        MismatchError: on every rank, naming the fields, when the ranks disagree on shape, dtype, granularity, rows,
            ratio, cols, seed, mode, op, exact_collective, lossless_slack, dense_fraction, max_sketch_load, whether a
            residual is given and its contents, or a field of `agreed`; or when one skipped or added a call.
    """
    _check_args(tensor, ratio, cols, rows, granularity, mode, op, exact_collective,
                dict(lossless_slack=lossless_slack, dense_fraction=dense_fraction, max_sketch_load=max_sketch_load))
    ratio = None if ratio is None else float(ratio)
    start = time.perf_counter()
    rows, seed = int(rows), int(seed)
    local = _LocalUnits(tensor, granularity)
    n, m = local.n, local.m
    c = sketch_width(n * m, ratio, cols)
    _check_residual(residual, rows, c)
    world, device = dist.get_world_size(group), _collective_device(tensor, group)
    timings = default_exact_timings(group) if timings is None else timings
    if step is None:
        step = default_call_counter(group).take()
    timed_config = (world, local.shape, str(local.dtype), granularity)

    # everything that decides the collectives, their sizes or the decoding; the residual by its digest, so that
    # ranks whose residuals drifted apart raise instead of returning different sums
    config = {"shape": local.shape, "dtype": local.dtype, "sparse": local.sparse, "granularity": granularity,
              "rows": rows, "ratio": ratio, "cols": c, "seed": seed, "mode": mode, "op": op,
              "exact_collective": exact_collective, "lossless_slack": float(lossless_slack),
              "dense_fraction": float(dense_fraction), "max_sketch_load": float(max_sketch_load),
              "residual": None if residual is None else fingerprint(state_digest(residual))}
    if agreed:
        if set(agreed) & set(config):
            raise ValueError(f"sketch_allreduce: 'agreed' may not redefine {sorted(set(agreed) & set(config))}")
        config.update(agreed)
    divisor = world if op == "avg" else 1
    if channel is not None and channel.layout is not None:
        folded = _folded_call(channel, config, int(step), local, group, world, device, divisor, timings,
                              timed_config, start, dict(mode=mode, rows=rows, c=c, lossless_slack=lossless_slack,
                                                        dense_fraction=dense_fraction, max_sketch_load=max_sketch_load,
                                                        exact_collective=exact_collective))
        if folded is not None:
            return _Pending(None, lambda: (folded, _last)) if async_op else folded
    decided_with = timings.for_header(timed_config)
    header_start = time.perf_counter()
    header = _exchange_header(config, int(step), local.units, decided_with.timed_choices, decided_with.header(),
                              local.bits, group, world, device)
    decided_with.timed_choices = header.timed_choices  # every rank continues from the same count
    header_seconds = time.perf_counter() - header_start
    union = _union(local.bits, header.bitmaps, n, group, world, device)

    method = _choose(mode, union.units * m, n * m, rows, c, lossless_slack, dense_fraction, max_sketch_load)
    common = (local, union, world, device, divisor)
    exact_by, union_rates = "", None  # where this call's exact timing goes (its own union's size class)
    if method == "exact":
        reduction, exact_by, union_ring_bytes = _exact_reduction(common, exact_collective, header, decided_with)
        union_rates = timings.for_union(timed_config, union_ring_bytes)
    elif method == "sketch":
        reduction = _SketchAllReduce(*common, rows, c, seed, residual)
    else:
        reduction = _DenseAllReduce(*common)
    if channel is not None:  # fold the next call only after a gather chosen by bytes or by timings
        gathers = isinstance(reduction, _GatherOwnRows) and union.method == "header" and exact_by != "explore"
        channel._agree(_layout(local) if gathers else None, header.counts, folded=False)

    payload_bytes = reduction.prepare()
    issued = time.perf_counter()
    handle = reduction.collective(group, async_op)

    def complete():
        global _last
        result = local.write_back(union, reduction.finish())
        if union_rates is not None:  # from issuing the payload to here (a late wait() counts too)
            seconds = time.perf_counter() - issued
            if channel is not None and reduction.exact_collective == "allreduce-union":
                # on a channel the gather folds the header into its payload (its folded calls time the whole call),
                # while the union all-reduce pays a header of its own every call: its figure carries the header
                union_rates.record(reduction.exact_collective, header_seconds + seconds, 0.0, payload_bytes)
            else:
                union_rates.record(reduction.exact_collective, seconds, header_seconds, payload_bytes)
        header_bytes = ring_allgather_bytes(HEADER_FIXED_BYTES + HEADER_BITMAP_BYTES, world)
        _last = SketchStats(
            method=reduction.method, mode=mode, units=n, unit_size=m, local_units=local.units,
            union_units=union.units, union_method=union.method, sketch_shape=(rows, c),
            wire_bytes=header_bytes + union.wire_bytes + payload_bytes,
            dense_wire_bytes=ring_allreduce_bytes(n * m * local.esize, world), seconds=time.perf_counter() - start,
            error_feedback=reduction.error_feedback,
            exact_collective=reduction.exact_collective, exact_by=exact_by)
        return result, _last

    return _Pending(handle, complete) if async_op else complete()[0]
