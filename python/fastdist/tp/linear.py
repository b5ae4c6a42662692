"""Megatron tensor-parallel linears whose collectives overlap their GEMMs.

A linear ``y = x W^T + b`` over a tensor-parallel group of ``t`` ranks (Megatron-LM semantics):

* :class:`ColumnParallelLinear` keeps rows ``[r * out/t, (r+1) * out/t)`` of ``W`` (and of ``b``) on rank ``r``.
  Its input is replicated; its output is the rank's slice of the features (or all of them with
  ``gather_output=True``). Backward all-reduces the input gradient.
* :class:`RowParallelLinear` keeps columns ``[r * in/t, (r+1) * in/t)`` of ``W``; ``b`` is whole on every rank.
  Its input is the rank's slice of the features (``input_is_parallel=True``) or replicated (it then takes its
  slice); forward all-reduces the partial products, then adds ``b`` once.

Overlap (``overlap_chunks=k``): the ``M`` rows (tokens: every leading dimension flattened) are split into ``k``
chunks of sizes differing by at most one. Row-parallel forward: GEMM chunk ``i``, start its all-reduce, GEMM
chunk ``i + 1`` while it runs; the GEMMs write into one preallocated output. Column-parallel backward: the input
gradient chunk by chunk, each all-reduced asynchronously, and the weight-gradient GEMM overlapping the tail.
``overlap_chunks="auto"`` asks a :class:`fastdist.tp.CostModel` (calibrated or not) for ``k`` per shape.

Sequence parallelism (``sequence_parallel=True``): activations outside the tensor-parallel region are sharded
along ``M`` (Megatron's layout ``[s, b, h]``: dimension 0 of the input is the sequence and ``M / t`` rows live on
each rank). The row-parallel all-reduce becomes a reduce-scatter, chunked the same way: chunk ``c`` takes
sub-block ``c`` of every rank's shard (chunks ordered by destination), so each chunk is one contiguous
reduce-scatter and the GEMM of one chunk overlaps the collective of another; its backward all-gathers the output
gradient in the same chunks. The column-parallel input becomes an all-gather run as a ring: in ``t - 1`` steps
each rank passes the shard it holds to the next rank while multiplying it (compute on the shard you have while
receiving the next); its backward reduce-scatters the input gradient in ``k`` chunks.

Collectives run asynchronously through :mod:`fastdist.tp.comm` (gloo runs them on its own threads, so the overlap
is real on CPU; NCCL on its stream). Every rank must call with the same number of tokens: each call exchanges its
token count (an 8-byte all-gather issued before the first GEMM and waited for before the first collective that
depends on it), so ranks given different inputs raise on every rank instead of issuing collectives of different
sizes, and the chosen chunk count is checked across ranks once per shape. A forward recomputed in backward
(activation checkpointing) repeats rows already checked, so it exchanges nothing.

Under ``torch.compile(fullgraph=True)`` the collectives are torch's functional ones (the compiler schedules the
overlap); the per-call token check and the cross-rank check of an automatic chunk choice run in eager calls only.
"""
import math
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fastdist.distributed import MismatchError, check_same
from fastdist.distributed.compat import all_gather_single
from fastdist.ops.epilogue import bias_epilogue
from fastdist.tp import comm
from fastdist.tp.chunks import chunk_bounds
from fastdist.tp.cost import CostModel, default_cost_model

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "dense_parameters", "output_rows"]


def _world(group):
    return dist.get_world_size(group), dist.get_rank(group)


def dense_parameters(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[out_features, in_features]`` weight and the bias of a dense layer: an ``nn.Linear``, or a GPT-2 style
    ``Conv1D`` (Hugging Face's, whose weight is stored transposed, ``[in, out]``, and which computes
    ``x @ weight + bias``).

    Raises:
        TypeError: any other module.
    """
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias
    if is_conv1d(layer):
        return layer.weight.t(), layer.bias
    raise TypeError(f"fastdist: expected an nn.Linear or a GPT-2 style Conv1D, got a {type(layer).__name__}")


def is_conv1d(layer: nn.Module) -> bool:
    """True for a GPT-2 style ``Conv1D``: a module named so, with ``nf`` output features and a ``[in, nf]``
    weight."""
    weight = getattr(layer, "weight", None)
    return (type(layer).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.shape[1] == getattr(layer, "nf", None))


def output_rows(out_features: int, parts: int | Sequence[int], world_size: int, rank: int) -> torch.Tensor:
    """The full layer's output features that rank ``rank`` holds when the output is ``parts`` consecutive blocks
    (e.g. 3 for a fused ``[q | k | v]``) and each block is split evenly over the ranks.

    Args:
        out_features: the full layer's output features.
        parts: the number of equal blocks, or the blocks' sizes (e.g. ``[q, k, v]`` widths of a grouped-query
            attention), summing to ``out_features``.
        world_size: the tensor-parallel ranks.
        rank: this rank.

    Returns:
        An int64 index tensor: rank ``rank``'s slice of each block, block after block.

    Raises:
        ValueError: the blocks do not add up to ``out_features`` or one is not divisible by ``world_size``.
    """
    if isinstance(parts, int):
        if parts < 1 or out_features % parts:
            raise ValueError(f"fastdist: out_features={out_features} cannot be split into {parts} equal blocks")
        sizes = [out_features // parts] * parts
    else:
        sizes = [int(n) for n in parts]
        if sum(sizes) != out_features:
            raise ValueError(f"fastdist: output blocks {sizes} do not add up to out_features={out_features}")
    if any(n % world_size for n in sizes):
        raise ValueError(f"fastdist: output blocks {sizes} are not each divisible by the tensor-parallel world size "
                         f"{world_size}")
    pieces, start = [], 0
    for n in sizes:
        per_rank = n // world_size
        pieces.append(torch.arange(start + rank * per_rank, start + (rank + 1) * per_rank))
        start += n
    return torch.cat(pieces)


class _TokenCheck:
    """Every rank's row (token) count, all-gathered asynchronously: started before the GEMM, verified before the
    first collective whose size depends on it. A rank whose input is invalid sends -1 and raises its own error;
    the others raise MismatchError. Either way every rank raises, and no collective of mismatched size runs."""

    def __init__(self, layer, rows, problem):
        self.layer, self.problem = layer, problem
        self._mine = torch.tensor([rows if problem is None else -1], dtype=torch.int64)
        self._all = torch.empty(layer.world_size, dtype=torch.int64)
        self._work = all_gather_single(self._all, self._mine, group=layer.host_group, async_op=True)
        comm.record_token_count_exchange(layer.world_size)

    def verify(self):
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        if self.problem is not None:
            raise ValueError(self.problem)
        counts = self._all.tolist()
        if len(set(counts)) > 1:
            group = self.layer.group
            ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(len(counts))]
            sp = " per rank" if self.layer.sequence_parallel else ""
            raise MismatchError(f"{type(self.layer).__name__} input rows (tokens{sp}; every rank must pass the same "
                                "number)", {r: c if c >= 0 else "invalid input" for r, c in zip(ranks, counts)})


def _verify(check):
    if check is not None:
        check.verify()


def _gemm_chunk(x, weight_t, out, start, stop):
    """out[start:stop] = x[start:stop] @ weight_t in eager mode (into the preallocated output); the chunk's product
    as a new tensor under torch.compile, whose functional collectives do not write in place."""
    if comm.compiling():
        return x[start:stop] @ weight_t
    torch.matmul(x[start:stop], weight_t, out=out[start:stop])
    return out[start:stop]


def _joined(out, parts, dim=0):
    """The collectives' results as one tensor: ``out`` itself in eager mode (they wrote into it), their
    concatenation under torch.compile."""
    return torch.cat(parts, dim) if comm.compiling() else out


# ---- the autograd functions: GEMM + collective, no bias (the bias is the epilogue's) ----

class _ColumnParallelMatmul(torch.autograd.Function):
    """y = x W^T for a column shard W. Non-SP: x is [M, in] on every rank; backward all-reduces dx in chunks.
    SP: x is this rank's [M/t, in] shard; forward all-gathers it as a ring (each step's GEMM overlapping the
    next shard's transfer), backward reduce-scatters dx in chunks."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks, sequence_parallel, token_check):
        world, rank = _world(group)
        ctx.group, ctx.chunks, ctx.sp = group, chunks, sequence_parallel
        if not sequence_parallel:
            ctx.save_for_backward(x, weight)
            y = x @ weight.t()
            _verify(token_check)  # backward all-reduces the input gradient, of x's size
            return y
        _verify(token_check)
        shard_rows = x.shape[0]
        if comm.compiling():  # no functional point-to-point: one all-gather
            gathered = comm.all_gather(x.new_empty(world * shard_rows, x.shape[1]), x.contiguous(), group,
                                       site="column.forward").wait()
            gathered = gathered.view(world, shard_rows, x.shape[1])
            ctx.save_for_backward(weight, gathered)
            return gathered.view(world * shard_rows, x.shape[1]) @ weight.t()
        # All-gather as a ring: at step s this rank holds shard (rank - s) mod t; it sends it on to the next rank
        # and receives the one after it from the previous rank while its GEMM runs on the shard in hand.
        gathered = x.new_empty(world, shard_rows, x.shape[1])
        gathered[rank].copy_(x)
        y = x.new_empty(world, shard_rows, weight.shape[0])
        for step in range(world):
            src = (rank - step) % world
            pending = None
            if step < world - 1:
                pending = comm.ring_exchange(gathered[src], gathered[(src - 1) % world], group,
                                             site="column.forward")
            torch.matmul(gathered[src], weight.t(), out=y[src])
            if pending is not None:
                pending.wait()
        ctx.save_for_backward(weight, gathered)
        return y.view(world * shard_rows, weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        group, chunks = ctx.group, ctx.chunks
        grad = grad.contiguous()
        if not ctx.sp:
            x, weight = ctx.saved_tensors
            dx = x.new_empty(x.shape)
            pending = []
            for start, stop in chunk_bounds(x.shape[0], chunks):
                part = _gemm_chunk(grad, weight, dx, start, stop)
                pending.append(comm.all_reduce(part, group, site="column.backward", backward=True))
            dw = grad.t() @ x  # overlaps the all-reduces still in flight
            dx = _joined(dx, [p.wait() for p in pending])
            return dx, dw, None, None, None, None
        weight, gathered = ctx.saved_tensors
        world, shard_rows = gathered.shape[0], gathered.shape[1]
        grad3 = grad.view(world, shard_rows, grad.shape[1])
        dx = grad.new_empty(shard_rows, weight.shape[1])
        pending = []
        for start, stop in chunk_bounds(shard_rows, chunks):
            part = grad3[:, start:stop] @ weight  # [world, rows, in]: block r is destined for rank r
            pending.append(comm.reduce_scatter(dx[start:stop], part.view(-1, part.shape[2]), group,
                                               site="column.backward", backward=True))
        # dW = dY^T X over all gathered rows, overlapping the reduce-scatters in flight.
        dw = grad.t() @ gathered.view(-1, gathered.shape[2])
        dx = _joined(dx, [p.wait() for p in pending])
        return dx, dw, None, None, None, None


class _RowParallelMatmul(torch.autograd.Function):
    """y = sum over ranks of x_r W_r^T for a row shard W_r. Non-SP: y is [M, out] on every rank (chunked
    all-reduce); SP: y is this rank's [M/t, out] shard (chunked reduce-scatter), backward all-gathers dy."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks, sequence_parallel, token_check):
        world, _ = _world(group)
        ctx.group, ctx.chunks, ctx.sp = group, chunks, sequence_parallel
        ctx.save_for_backward(x, weight)
        rows = x.shape[0]
        if not sequence_parallel:
            out = x.new_empty(rows, weight.shape[0])
            pending = []
            for start, stop in chunk_bounds(rows, chunks):
                part = _gemm_chunk(x, weight.t(), out, start, stop)
                _verify(token_check)  # the first chunk's GEMM overlapped the exchange of the token counts
                pending.append(comm.all_reduce(part, group, site="row.forward"))
            return _joined(out, [p.wait() for p in pending])
        shard_rows = rows // world
        x3 = x.view(world, shard_rows, x.shape[1])
        out = x.new_empty(shard_rows, weight.shape[0])
        pending = []
        for start, stop in chunk_bounds(shard_rows, chunks):
            part = x3[:, start:stop] @ weight.t()  # [world, rows, out]: block r is rank r's
            _verify(token_check)
            pending.append(comm.reduce_scatter(out[start:stop], part.reshape(-1, part.shape[2]), group,
                                               site="row.forward"))
        return _joined(out, [p.wait() for p in pending])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, chunks = ctx.group, ctx.chunks
        grad = grad.contiguous()
        if not ctx.sp:
            return grad @ weight, grad.t() @ x, None, None, None, None
        world = x.shape[0] // grad.shape[0]
        shard_rows = grad.shape[0]
        bounds = chunk_bounds(shard_rows, chunks)
        pending = [comm.all_gather(grad.new_empty(world * (stop - start), grad.shape[1]), grad[start:stop], group,
                                   site="row.backward", backward=True)
                   for start, stop in bounds]
        x3 = x.view(world, shard_rows, x.shape[1])
        dx = x.new_empty(world, shard_rows, x.shape[1])
        dw = torch.zeros_like(weight)
        for p, (start, stop) in zip(pending, bounds):
            buf = p.wait().view(world, stop - start, grad.shape[1])
            dx[:, start:stop] = buf @ weight
            dw.addmm_(buf.view(-1, buf.shape[2]).t(), x3[:, start:stop].reshape(-1, x.shape[1]))
        return dx.view(x.shape), dw, None, None, None, None


class _GatherLastDim(torch.autograd.Function):
    """Forward: concatenate every rank's [M, n] along the features; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        world, rank = _world(group)
        ctx.rank, ctx.cols = rank, y.shape[1]
        out = comm.all_gather(y.new_empty(world * y.shape[0], y.shape[1]), y.contiguous(), group,
                              site="column.gather_output").wait()
        return out.view(world, *y.shape).permute(1, 0, 2).reshape(y.shape[0], world * y.shape[1])

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.cols:(ctx.rank + 1) * ctx.cols], None


class _SplitLastDim(torch.autograd.Function):
    """Forward: this rank's slice of a replicated [M, n]; backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        world, rank = _world(group)
        ctx.group = group
        cols = x.shape[1] // world
        return x[:, rank * cols:(rank + 1) * cols].contiguous()

    @staticmethod
    def backward(ctx, grad):
        world, _ = _world(ctx.group)
        out = comm.all_gather(grad.new_empty(world * grad.shape[0], grad.shape[1]), grad.contiguous(), ctx.group,
                              site="row.split_input", backward=True).wait()
        return out.view(world, *grad.shape).permute(1, 0, 2).reshape(grad.shape[0], world * grad.shape[1]), None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient. A sequence-parallel row-parallel bias is added to
    this rank's rows only, so its gradient is a partial sum until the ranks' parts are added up."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous(), ctx.group, site="row.bias_grad", backward=True).wait(), None


class _AllReduceOutput(torch.autograd.Function):
    """Sums a row-parallel GEMM's partial output over the group (in place); identity backward. Kept apart from the
    GEMM, as Megatron does, so that a recomputing checkpoint, which stops once every tensor backward needs has been
    saved again, stops after the GEMM and skips an all-reduce whose result nothing saved depends on."""

    @staticmethod
    def forward(ctx, y, group, token_check):
        _verify(token_check)  # the GEMM overlapped the exchange of the token counts
        ctx.mark_dirty(y)
        return comm.all_reduce(y, group, site="row.forward").wait()

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


# ---- the modules ----

class _ParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, group, overlap_chunks, sequence_parallel, cost_model, bias,
                 device, dtype, kind, settings):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"fastdist: {type(self).__name__} needs an initialized torch.distributed process group")
        # First, before anything can raise on one rank only: every setting that decides the collectives or the
        # math of a rank's shard, by name (`settings`: the subclass's own).
        check_same(f"{type(self).__name__} config",
                   {"in_features": in_features, "out_features": out_features, "overlap_chunks": str(overlap_chunks),
                    "sequence_parallel": bool(sequence_parallel), "bias": bias, "dtype": str(dtype), **settings},
                   group)
        self.group = group
        self.world_size, self.rank = _world(group)
        self.in_features, self.out_features = in_features, out_features
        if overlap_chunks != "auto" and not (isinstance(overlap_chunks, int) and overlap_chunks >= 1):
            raise ValueError(f"fastdist: overlap_chunks must be 'auto' or an int >= 1, got {overlap_chunks!r}")
        self.overlap_chunks = overlap_chunks
        self.sequence_parallel = bool(sequence_parallel)
        self.cost_model = cost_model
        self._kind = kind
        self._chunks_by_rows = {}
        self.host_group = comm.host_group(group)  # where each call's token counts are exchanged (CPU tensors)

    def chunks_for(self, rows: int) -> int:
        """The chunk count used for ``rows`` GEMM rows (the full ``M``, or the shard's rows under SP).

        With ``overlap_chunks="auto"`` the cost model chooses, once per row count, and the ranks check that they
        chose alike (a collective; in eager calls only). An uncalibrated model warns that its choice is
        unmeasured.

        Raises:
            ValueError: a fixed ``overlap_chunks`` larger than ``rows``.
            MismatchError: the ranks' cost models chose differently.
        """
        k = self._chunks_by_rows.get(rows)
        if k is not None:
            return k
        if self.overlap_chunks == "auto":
            model = self.cost_model or default_cost_model()
            if not model.calibrated and not comm.compiling():
                warnings.warn(UNCALIBRATED_AUTO_WARNING, UserWarning, stacklevel=3)
            k = min(model.choose_chunks(self._gemm_shape(rows), op=self._kind, world_size=self.world_size), rows)
            k = max(k, 1)
            if not comm.compiling():
                # Calibrations may differ between ranks: agree on the choice, or raise on every rank.
                check_same(f"{type(self).__name__} overlap_chunks for {rows} rows", k, self.group)
        else:
            k = self.overlap_chunks
            if rows < k:
                raise ValueError(f"fastdist: {type(self).__name__}: overlap_chunks={k} needs at least {k} rows "
                                 f"(tokens{' per rank' if self.sequence_parallel else ''}) to split, got {rows}")
        self._chunks_by_rows[rows] = k
        return k

    def _input_problem(self, x, features, name):
        """What is wrong with input ``x`` (its message), or None."""
        if x.dim() < 2:
            return (f"fastdist: {type(self).__name__} input must have at least 2 dimensions [..., {features}], got "
                    f"shape {list(x.shape)}")
        if x.shape[-1] != features:
            return (f"fastdist: {type(self).__name__} input must have {features} {name} in its last dimension, got "
                    f"shape {list(x.shape)}")
        if x.dtype != self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            return (f"fastdist: {type(self).__name__} input must have the weight's dtype {self.weight.dtype} (or run "
                    f"under autocast), got {x.dtype}")
        return None

    def _token_check(self, rows, problem):
        """Starts this call's exchange of row counts (:class:`_TokenCheck`); verifies it at once when
        :meth:`chunks_for` has not seen ``rows`` (it may raise, or run a collective) or the input is bad."""
        if self.world_size == 1 or comm.compiling():
            if problem is not None:
                raise ValueError(problem)
            return None
        if problem is None and rows in self._chunks_by_rows and comm.recomputing():
            return None  # a recomputed forward repeats the rows its checked forward passed, on every rank
        check = _TokenCheck(self, rows, problem)
        if problem is not None or rows not in self._chunks_by_rows:
            check.verify()
        return check

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, world_size={self.world_size}, "
                f"overlap_chunks={self.overlap_chunks!r}, sequence_parallel={self.sequence_parallel}")


UNCALIBRATED_AUTO_WARNING = (
    "fastdist: overlap_chunks='auto' has no calibrated cost model, so it splits into an unmeasured default of "
    "fastdist.tp.cost.UNCALIBRATED_CHUNKS chunks. Calibrate once per machine (a collective; cached in a file): "
    "tp.set_default_cost_model(tp.CostModel.calibrate(group, shapes=..., cache='tp-cost.json')), or pass "
    "cost_model=, or give overlap_chunks an int.")


def _shard(total, world, what, cls):
    if total % world:
        raise ValueError(f"fastdist: {cls}: {what}={total} is not divisible by the tensor-parallel world size {world}")
    return total // world


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W``'s output rows split over ``group`` (Megatron's column-parallel linear).

    Args:
        in_features: the full layer's input features.
        out_features: the full layer's output features; divisible by the group size.
        group: the tensor-parallel process group (None: the default group).
        gather_output: return all ``out_features`` (all-gather) instead of this rank's ``out_features / t``.
        overlap_chunks: ``"auto"`` or ``k >= 1``: the backward input-gradient all-reduce (under sequence
            parallelism, reduce-scatter) runs in ``k`` chunks overlapping the GEMMs. Under sequence parallelism
            the forward all-gather is a ring of ``t - 1`` exchanges, each overlapping a shard's GEMM.
        sequence_parallel: the input is this rank's ``M / t`` rows of the sequence-sharded activation.
        activation: ``"none"``, ``"gelu_tanh"`` or ``"gelu_erf"``, fused with the bias add (the MLP's first
            linear).
        bias: whether the layer has a bias.
        cost_model: the :class:`fastdist.tp.CostModel` that picks ``k`` for ``"auto"`` (default: the process-wide
            one, uncalibrated until :meth:`CostModel.calibrate`).
        device: where the parameters live.
        dtype: the parameters' dtype.
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None,
                 gather_output: bool = False, overlap_chunks: int | str = "auto", *, sequence_parallel: bool = False,
                 activation: str = "none", bias: bool = True, cost_model: CostModel | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, group, overlap_chunks, sequence_parallel, cost_model, bias,
                         device, dtype, "column", {"gather_output": bool(gather_output), "activation": activation})
        self.out_per_rank = _shard(out_features, self.world_size, "out_features", type(self).__name__)
        if gather_output and sequence_parallel:
            raise ValueError("fastdist: ColumnParallelLinear: gather_output and sequence_parallel exclude each other "
                             "(a sequence-parallel column output stays sharded by features)")
        self.gather_output = gather_output
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization with the full layer's fan-in; each rank draws its own shard."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def _gemm_shape(self, rows):
        return (rows * (self.world_size if self.sequence_parallel else 1), self.in_features, self.out_per_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` (activation fused) on ``x`` of shape ``[..., in_features]``: this rank's output features
        (all of them with ``gather_output``); under sequence parallelism ``x`` is this rank's rows."""
        problem = self._input_problem(x, self.in_features, "input features")
        check = self._token_check(-1 if problem else x.numel() // self.in_features, problem)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        chunks = self.chunks_for(x2.shape[0])
        y = _ColumnParallelMatmul.apply(x2, self.weight, self.group, chunks, self.sequence_parallel, check)
        if self.bias is not None or self.activation != "none":
            y = bias_epilogue(y, self.bias, None, self.activation)
        if self.gather_output:
            y = _GatherLastDim.apply(y, self.group)
        if self.sequence_parallel:
            lead = (lead[0] * self.world_size, *lead[1:])
        return y.view(*lead, y.shape[-1])

    @classmethod
    def from_linear(cls, linear: nn.Module, group: dist.ProcessGroup | None = None,
                    parts: int | Sequence[int] = 1, **kwargs: object) -> "ColumnParallelLinear":
        """The column-parallel shard of an ``nn.Linear`` (or a GPT-2 style ``Conv1D``), its weights copied, so that
        the ranks together compute exactly ``linear``.

        Args:
            linear: the full layer.
            group: the tensor-parallel process group (None: the default group).
            parts: the layer's output as consecutive blocks, each split over the ranks (:func:`output_rows`):
                1 for a plain linear, 3 for a fused ``[q | k | v]`` projection (each rank then holds its heads of
                q, of k and of v, in that order), or the blocks' sizes.
            **kwargs: the constructor's other arguments.
        """
        weight, bias = dense_parameters(linear)
        layer = cls(weight.shape[1], weight.shape[0], group, bias=bias is not None, device=weight.device,
                    dtype=weight.dtype, **kwargs)
        rows = output_rows(layer.out_features, parts, layer.world_size, layer.rank).to(weight.device)
        with torch.no_grad():
            layer.weight.copy_(weight[rows])
            if bias is not None:
                layer.bias.copy_(bias[rows])
        return layer


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W``'s input columns split over ``group`` (Megatron's row-parallel linear).

    Args:
        in_features: the full layer's input features; divisible by the group size.
        out_features: the full layer's output features.
        group: the tensor-parallel process group (None: the default group).
        input_is_parallel: the input is already this rank's ``in_features / t`` slice (the output of a
            ColumnParallelLinear); False: it is replicated and each rank takes its slice.
        overlap_chunks: ``"auto"`` or ``k >= 1``: the forward all-reduce (reduce-scatter under sequence
            parallelism) runs in ``k`` chunks, each overlapping the next chunk's GEMM.
        sequence_parallel: the output is this rank's ``M / t`` rows (reduce-scatter instead of all-reduce).
        bias, cost_model, device, dtype: as for :class:`ColumnParallelLinear`.

    ``forward(x, residual=None)`` adds ``b`` (and ``residual``, of the output's shape) once, after the
    reduction, in one fused pass.
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None = None,
                 input_is_parallel: bool = True, overlap_chunks: int | str = "auto", *, sequence_parallel: bool = False,
                 bias: bool = True, cost_model: CostModel | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, group, overlap_chunks, sequence_parallel, cost_model, bias,
                         device, dtype, "row", {"input_is_parallel": bool(input_is_parallel)})
        self.in_per_rank = _shard(in_features, self.world_size, "in_features", type(self).__name__)
        self.input_is_parallel = input_is_parallel
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization; the whole bias, held by every rank, is drawn identically everywhere."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            g = torch.Generator().manual_seed(self.out_features * 1_000_003 + self.in_features)
            with torch.no_grad():
                self.bias.copy_(torch.rand(self.out_features, generator=g) * 2 * bound - bound)

    def _gemm_shape(self, rows):
        return (rows, self.in_per_rank, self.out_features)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b (+ residual)`` on ``x`` of shape ``[..., in_features]`` (or this rank's slice of the
        features with ``input_is_parallel``); under sequence parallelism, this rank's rows of the output."""
        lead = x.shape[:-1]
        features = self.in_per_rank if self.input_is_parallel else self.in_features
        problem = self._input_problem(x, features, "input features per rank" if self.input_is_parallel
                                      else "input features")
        rows = x.numel() // features if problem is None else -1
        if problem is None:
            problem = self._rows_problem(rows, lead, residual)
        check = self._token_check(-1 if problem else rows, problem)
        x2 = x.reshape(-1, features)
        if not self.input_is_parallel:
            x2 = _SplitLastDim.apply(x2, self.group)
        chunks = self.chunks_for(rows // self.world_size if self.sequence_parallel else rows)
        if chunks == 1 and not self.sequence_parallel and not comm.compiling():
            y = _AllReduceOutput.apply(x2 @ self.weight.t(), self.group, check)
        else:
            y = _RowParallelMatmul.apply(x2.contiguous(), self.weight, self.group, chunks, self.sequence_parallel,
                                         check)
        bias = self.bias
        if bias is not None and self.sequence_parallel:
            bias = _AllReduceGrad.apply(bias, self.group)
        if self.sequence_parallel:
            lead = (lead[0] // self.world_size, *lead[1:])
        if residual is not None:
            residual = residual.reshape(y.shape)
        if bias is not None or residual is not None:
            y = bias_epilogue(y, bias, residual, "none")
        return y.view(*lead, self.out_features)

    def _rows_problem(self, rows, lead, residual):
        """What is wrong with ``rows`` tokens (and ``residual``) for this layer, or None."""
        if self.sequence_parallel:
            if rows % self.world_size:
                return (f"fastdist: RowParallelLinear: sequence_parallel needs the {rows} rows (tokens) to be "
                        f"divisible by the tensor-parallel world size {self.world_size}")
            if lead[0] % self.world_size:
                return (f"fastdist: RowParallelLinear: sequence_parallel shards dimension 0 (the sequence, size "
                        f"{lead[0]}); it must be divisible by the world size {self.world_size}")
        out_rows = rows // self.world_size if self.sequence_parallel else rows
        if residual is not None and residual.numel() != out_rows * self.out_features:
            return (f"fastdist: RowParallelLinear: residual must have the output's {out_rows} x {self.out_features} "
                    f"elements, got shape {list(residual.shape)}")
        return None

    @classmethod
    def from_linear(cls, linear: nn.Module, group: dist.ProcessGroup | None = None,
                    **kwargs: object) -> "RowParallelLinear":
        """The row-parallel shard of an ``nn.Linear`` (or a GPT-2 style ``Conv1D``), its weights copied.

        Args:
            linear: the module to shard.
            group: the tensor-parallel process group (None: the default group).
            **kwargs: RowParallelLinear's other arguments.
        """
        weight, bias = dense_parameters(linear)
        layer = cls(weight.shape[1], weight.shape[0], group, bias=bias is not None, device=weight.device,
                    dtype=weight.dtype, **kwargs)
        cols = slice(layer.rank * layer.in_per_rank, (layer.rank + 1) * layer.in_per_rank)
        with torch.no_grad():
            layer.weight.copy_(weight[:, cols])
            if bias is not None:
                layer.bias.copy_(bias)
        return layer
