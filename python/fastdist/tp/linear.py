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
is real on CPU; NCCL on its stream). Every rank must call with the same shapes; the chosen chunk count is checked
across ranks (a fingerprint exchange once per shape), so a mismatch raises instead of hanging.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

from fastdist.distributed import check_same
from fastdist.ops.epilogue import bias_epilogue
from fastdist.tp import comm
from fastdist.tp.chunks import chunk_bounds
from fastdist.tp.cost import CostModel, default_cost_model

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _world(group):
    return dist.get_world_size(group), dist.get_rank(group)


# ---- the autograd functions: GEMM + collective, no bias (the bias is the epilogue's) ----

class _ColumnParallelMatmul(torch.autograd.Function):
    """y = x W^T for a column shard W. Non-SP: x is [M, in] on every rank; backward all-reduces dx in chunks.
    SP: x is this rank's [M/t, in] shard; forward all-gathers it as a ring (each step's GEMM overlapping the
    next shard's transfer), backward reduce-scatters dx in chunks."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks, sequence_parallel):
        world, rank = _world(group)
        ctx.group, ctx.chunks, ctx.sp = group, chunks, sequence_parallel
        if not sequence_parallel:
            ctx.save_for_backward(x, weight)
            return x @ weight.t()
        # All-gather as a ring: at step s this rank holds shard (rank - s) mod t; it sends it on to the next rank
        # and receives the one after it from the previous rank while its GEMM runs on the shard in hand.
        shard_rows = x.shape[0]
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
                torch.matmul(grad[start:stop], weight, out=dx[start:stop])
                pending.append(comm.all_reduce(dx[start:stop], group, site="column.backward", backward=True))
            dw = grad.t() @ x  # overlaps the all-reduces still in flight
            comm.wait_all(pending)
            return dx, dw, None, None, None
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
        comm.wait_all(pending)
        return dx, dw, None, None, None


class _RowParallelMatmul(torch.autograd.Function):
    """y = sum over ranks of x_r W_r^T for a row shard W_r. Non-SP: y is [M, out] on every rank (chunked
    all-reduce); SP: y is this rank's [M/t, out] shard (chunked reduce-scatter), backward all-gathers dy."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks, sequence_parallel):
        world, _ = _world(group)
        ctx.group, ctx.chunks, ctx.sp = group, chunks, sequence_parallel
        ctx.save_for_backward(x, weight)
        rows = x.shape[0]
        if not sequence_parallel:
            out = x.new_empty(rows, weight.shape[0])
            pending = []
            for start, stop in chunk_bounds(rows, chunks):
                torch.matmul(x[start:stop], weight.t(), out=out[start:stop])
                pending.append(comm.all_reduce(out[start:stop], group, site="row.forward"))
            comm.wait_all(pending)
            return out
        shard_rows = rows // world
        x3 = x.view(world, shard_rows, x.shape[1])
        out = x.new_empty(shard_rows, weight.shape[0])
        pending = []
        for start, stop in chunk_bounds(shard_rows, chunks):
            part = x3[:, start:stop] @ weight.t()  # [world, rows, out]: block r is rank r's
            pending.append(comm.reduce_scatter(out[start:stop], part.view(-1, part.shape[2]), group,
                                               site="row.forward"))
        comm.wait_all(pending)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, chunks = ctx.group, ctx.chunks
        grad = grad.contiguous()
        if not ctx.sp:
            return grad @ weight, grad.t() @ x, None, None, None
        world = x.shape[0] // grad.shape[0]
        shard_rows = grad.shape[0]
        bounds = chunk_bounds(shard_rows, chunks)
        gathered = [grad.new_empty(world, stop - start, grad.shape[1]) for start, stop in bounds]
        pending = [comm.all_gather(buf.view(-1, grad.shape[1]), grad[start:stop], group, site="row.backward",
                                   backward=True)
                   for buf, (start, stop) in zip(gathered, bounds)]
        x3 = x.view(world, shard_rows, x.shape[1])
        dx = x.new_empty(world, shard_rows, x.shape[1])
        dw = torch.zeros_like(weight)
        for p, buf, (start, stop) in zip(pending, gathered, bounds):
            p.wait()
            dx[:, start:stop] = buf @ weight
            dw.addmm_(buf.view(-1, buf.shape[2]).t(), x3[:, start:stop].reshape(-1, x.shape[1]))
        return dx.view(x.shape), dw, None, None, None


class _GatherLastDim(torch.autograd.Function):
    """Forward: concatenate every rank's [M, n] along the features; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        world, rank = _world(group)
        ctx.rank, ctx.cols = rank, y.shape[1]
        out = y.new_empty(world, *y.shape)
        comm.all_gather(out.view(-1, y.shape[1]), y.contiguous(), group, site="column.gather_output").wait()
        return out.permute(1, 0, 2).reshape(y.shape[0], world * y.shape[1])

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
        out = grad.new_empty(world, *grad.shape)
        comm.all_gather(out.view(-1, grad.shape[1]), grad.contiguous(), ctx.group, site="row.split_input",
                        backward=True).wait()
        return out.permute(1, 0, 2).reshape(grad.shape[0], world * grad.shape[1]), None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient. A sequence-parallel row-parallel bias is added to
    this rank's rows only, so its gradient is a partial sum until the ranks' parts are added up."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, ctx.group, site="row.bias_grad", backward=True).wait()
        return grad, None


# ---- the modules ----

class _ParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, group, overlap_chunks, sequence_parallel, cost_model, bias,
                 device, dtype, kind):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"fastdist: {type(self).__name__} needs an initialized torch.distributed process group")
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
        check_same(f"{type(self).__name__} config",
                   (in_features, out_features, str(overlap_chunks), self.sequence_parallel, bias, str(dtype)), group)

    def chunks_for(self, rows: int) -> int:
        """The chunk count used for ``rows`` GEMM rows (the full ``M``, or the shard's rows under SP).

        With ``overlap_chunks="auto"`` the cost model chooses, once per row count, and the ranks check that they
        chose alike (a collective).

        Raises:
            ValueError: a fixed ``overlap_chunks`` larger than ``rows``.
            MismatchError: the ranks' cost models chose differently.
        """
        k = self._chunks_by_rows.get(rows)
        if k is not None:
            return k
        if self.overlap_chunks == "auto":
            model = self.cost_model or default_cost_model()
            k = min(model.choose_chunks(self._gemm_shape(rows), op=self._kind, world_size=self.world_size), rows)
            k = max(k, 1)
            # Calibrations may differ between ranks: agree on the choice, or raise on every rank.
            check_same(f"{type(self).__name__} overlap_chunks for {rows} rows", k, self.group)
        else:
            k = self.overlap_chunks
            if rows < k:
                raise ValueError(f"fastdist: {type(self).__name__}: overlap_chunks={k} needs at least {k} rows "
                                 f"(tokens{' per rank' if self.sequence_parallel else ''}) to split, got {rows}")
        self._chunks_by_rows[rows] = k
        return k

    def _flat_rows(self, x, features, name):
        if x.dim() < 2:
            raise ValueError(f"fastdist: {type(self).__name__} input must have at least 2 dimensions "
                             f"[..., {features}], got shape {list(x.shape)}")
        if x.shape[-1] != features:
            raise ValueError(f"fastdist: {type(self).__name__} input must have {features} {name} in its last "
                             f"dimension, got shape {list(x.shape)}")
        return x.reshape(-1, features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, world_size={self.world_size}, "
                f"overlap_chunks={self.overlap_chunks!r}, sequence_parallel={self.sequence_parallel}")


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
                         device, dtype, "column")
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
        lead = x.shape[:-1]
        x2 = self._flat_rows(x, self.in_features, "input features")
        chunks = self.chunks_for(x2.shape[0])
        y = _ColumnParallelMatmul.apply(x2, self.weight, self.group, chunks, self.sequence_parallel)
        if self.bias is not None or self.activation != "none":
            y = bias_epilogue(y, self.bias, None, self.activation)
        if self.gather_output:
            y = _GatherLastDim.apply(y, self.group)
        if self.sequence_parallel:
            lead = (lead[0] * self.world_size, *lead[1:])
        return y.view(*lead, y.shape[-1])

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None,
                    **kwargs: object) -> "ColumnParallelLinear":
        """The column-parallel shard of an ``nn.Linear``, its weights copied, so that the ranks together compute
        exactly ``linear``.

        Args:
            linear: the full layer.
            group: the tensor-parallel process group (None: the default group).
            **kwargs: the constructor's other arguments.
        """
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        rows = slice(layer.rank * layer.out_per_rank, (layer.rank + 1) * layer.out_per_rank)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[rows])
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
                         device, dtype, "row")
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
        if self.input_is_parallel:
            x2 = self._flat_rows(x, self.in_per_rank, "input features per rank")
        else:
            x2 = _SplitLastDim.apply(self._flat_rows(x, self.in_features, "input features"), self.group)
        rows = x2.shape[0]
        if self.sequence_parallel:
            if rows % self.world_size:
                raise ValueError(f"fastdist: RowParallelLinear: sequence_parallel needs the {rows} rows (tokens) to be "
                                 f"divisible by the tensor-parallel world size {self.world_size}")
            if lead[0] % self.world_size:
                raise ValueError(f"fastdist: RowParallelLinear: sequence_parallel shards dimension 0 (the sequence, "
                                 f"size {lead[0]}); it must be divisible by the world size {self.world_size}")
            chunks = self.chunks_for(rows // self.world_size)
        else:
            chunks = self.chunks_for(rows)
        y = _RowParallelMatmul.apply(x2.contiguous(), self.weight, self.group, chunks, self.sequence_parallel)
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

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None,
                    **kwargs: object) -> "RowParallelLinear":
        """The row-parallel shard of an ``nn.Linear``, its weights copied (arguments as for
        :meth:`ColumnParallelLinear.from_linear`)."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        cols = slice(layer.rank * layer.in_per_rank, (layer.rank + 1) * layer.in_per_rank)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, cols])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer
