"""The overlap cost model: when does chunking a tensor-parallel linear pay, and by how many chunks.

An all-reduce of ``B`` bytes over ``t`` ranks takes ``C(B)``: measured (a table over the calibrated sizes,
interpolated) or the alpha-beta ring ``2(t-1) alpha + 2(t-1)/t * B / beta`` fitted on it. A GEMM of ``m`` rows
takes ``G(m)``: measured (a table filled by :meth:`CostModel.calibrate`) or fitted as ``lambda + 2 m K N / rate``.
Split ``M`` rows into ``k`` chunks: each chunk's GEMM ``g = G(M / k)``, each chunk's all-reduce ``c = C(B / k)``
(the latency is paid per message), and

    row-parallel forward     T(k) = g + c + (k - 1) * max(g + s, c)          T(1) = G(M) + C(B)
    column-parallel backward T(k) = g + (k - 1) * max(g + s, c) + max(c, G_dW + s)

where ``max(g + s, c)`` is one overlapped step, a chunk's GEMM beside the previous chunk's collective, and
``s = S(B / k)`` is the compute that collective takes from the GEMM. A collective is not free to the processor
that computes: on a CPU, gloo's thread and the kernel's network stack copy and sum every byte on the GEMM's core
(on a fast link, about all of an all-reduce's time; bench/README.md has the figures); on a GPU, NCCL's kernels
occupy SMs and HBM bandwidth. :meth:`calibrate` measures ``S`` at the calibration shape's chunk
sizes by running its chunked pipeline (a table; interpolated, proportional past it). So chunking hides only the
collective's waiting, never its work, and on a fast link less than the extra chunks cost: the model then keeps
``k = 1``. The best possible gain is
``(G + C) / max(G, C) <= 2``. :meth:`CostModel.choose_chunks` picks the fewest ``k`` from {1, 2, 4, 8}
within 3% of the least ``T(k)``; uncalibrated, it returns 4 (TransformerEngine's default too).

Calibration times every measurement on every rank and keeps the slowest rank's median, so all ranks hold the
same model and make the same choices (the linears also check that with a fingerprint exchange).
"""
import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from fastdist.distributed.timing import all_max, time_ranks
from fastdist.tp.chunks import chunk_bounds

__all__ = ["CHUNK_CHOICES", "CostModel", "TPOp", "default_cost_model", "set_default_cost_model"]

CHUNK_CHOICES = (1, 2, 4, 8)
UNCALIBRATED_CHUNKS = 4
# choose_chunks takes the fewest chunks predicted within this fraction of the best: a split that promises less
# is inside the model's error and adds messages whose latency varies.
CHUNK_TOLERANCE = 0.03


@dataclasses.dataclass(frozen=True)
class TPOp:
    """One tensor-parallel GEMM and its collective: ``rows x in_features`` times ``in_features x out_features``
    (the local shard's sizes), ``kind`` "row" (forward all-reduce of the output) or "column" (backward
    all-reduce of the input gradient)."""
    kind: str
    rows: int
    in_features: int
    out_features: int
    world_size: int
    dtype: torch.dtype = torch.float32

    @property
    def comm_bytes(self) -> int:
        """The bytes its collective all-reduces: the output (row) or the input gradient (column)."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return self.rows * (self.out_features if self.kind == "row" else self.in_features) * size


class CostModel:
    """Fitted all-reduce and GEMM costs of this machine (see the module docstring).

    Args:
        alpha: seconds per ring step of an all-reduce.
        beta: bytes per second per link.
        gemm_overhead: lambda, seconds per GEMM launch.
        gemm_rate: flop/s for GEMM shapes not in ``gemm_table``.
        gemm_table: ``(rows, K, N, dtype name) -> seconds`` of measured GEMMs.
        allreduce_table: all-reduced bytes -> seconds, measured on ``world_size`` ranks.
        comm_compute_table: all-reduced bytes -> the compute seconds the all-reduce takes from a GEMM beside it.
        world_size: the ranks the tables were measured on.

    Without ``alpha``, ``beta`` and ``gemm_rate`` the model is uncalibrated and chooses 4 chunks.
    """

    def __init__(self, alpha: float | None = None, beta: float | None = None, gemm_overhead: float = 0.0,
                 gemm_rate: float | None = None, gemm_table: dict | None = None, allreduce_table: dict | None = None,
                 comm_compute_table: dict | None = None, world_size: int | None = None):
        self.alpha = alpha                  # seconds per ring step
        self.beta = beta                    # bytes per second per link
        self.gemm_overhead = gemm_overhead  # lambda: seconds per GEMM launch
        self.gemm_rate = gemm_rate          # flop/s for unmeasured shapes
        self.gemm_table = dict(gemm_table or {})  # (rows, K, N, dtype name) -> seconds
        # all-reduced bytes -> seconds, measured on world_size ranks (interpolated inside, alpha-beta outside)
        self.allreduce_table = {int(b): float(v) for b, v in (allreduce_table or {}).items()}
        # all-reduced bytes -> compute seconds that all-reduce takes from a GEMM beside it (S); empty: free
        self.comm_compute_table = {int(b): float(v) for b, v in (comm_compute_table or {}).items()}
        self.world_size = world_size
        self._chosen = {}

    @property
    def calibrated(self) -> bool:
        """True when the model can predict (``alpha``, ``beta`` and ``gemm_rate`` are known)."""
        return self.alpha is not None and self.beta is not None and self.gemm_rate is not None

    # ---- the model ----

    def allreduce_time(self, nbytes: float, world_size: int | None = None) -> float:
        """C(B): seconds of an all-reduce of ``nbytes`` over ``world_size`` ranks (default: the calibration's);
        interpolated in the measured sizes, alpha-beta outside them or on another world size; 0 on one rank."""
        t = world_size or self.world_size
        if t is None or t <= 1:
            return 0.0
        sizes = sorted(self.allreduce_table)
        if t == self.world_size and sizes and sizes[0] <= nbytes <= sizes[-1]:
            return _interpolate(self.allreduce_table, sizes, nbytes)
        return 2 * (t - 1) * self.alpha + 2 * (t - 1) / t * nbytes / self.beta

    def gemm_time(self, rows: int, in_features: int, out_features: int,
                  dtype: torch.dtype = torch.float32) -> float:
        """G: seconds of a ``rows x in_features`` times ``in_features x out_features`` GEMM (measured, else
        ``lambda + 2 rows in out / rate``)."""
        key = (int(rows), int(in_features), int(out_features), str(dtype))
        if key in self.gemm_table:
            return self.gemm_table[key]
        return self.gemm_overhead + 2.0 * rows * in_features * out_features / self.gemm_rate

    def comm_compute_time(self, nbytes: float) -> float:
        """S(B): the compute time an all-reduce of ``nbytes`` takes from a GEMM running beside it. Interpolated
        in the measured sizes; past the largest, proportional to the bytes; 0 when nothing was measured."""
        if not self.comm_compute_table:
            return 0.0
        sizes = sorted(self.comm_compute_table)
        if nbytes > sizes[-1]:
            return self.comm_compute_table[sizes[-1]] * nbytes / sizes[-1]
        return _interpolate(self.comm_compute_table, sizes, nbytes)

    def predict(self, op: TPOp, k: int) -> float:
        """T(k): the predicted seconds of ``op`` split into ``k`` chunks.

        Raises:
            RuntimeError: the model is not calibrated.
        """
        if not self.calibrated:
            raise RuntimeError("fastdist: CostModel.predict needs a calibrated model (CostModel.calibrate(group) or "
                               "explicit alpha, beta and gemm_rate)")
        t = op.world_size
        rows_per_chunk = -(-op.rows // k)
        c = self.allreduce_time(op.comm_bytes / k, t)
        s = self.comm_compute_time(op.comm_bytes / k) if t > 1 else 0.0
        if op.kind == "row":
            g = self.gemm_time(rows_per_chunk, op.in_features, op.out_features, op.dtype)
            if k == 1:
                return g + c
            return g + c + (k - 1) * max(g + s, c)
        if op.kind == "column":
            # Backward: dX = dY W (rows x out -> rows x in) chunked; dW = dY^T X overlaps the last all-reduce.
            g = self.gemm_time(rows_per_chunk, op.out_features, op.in_features, op.dtype)
            g_dw = self.gemm_time(op.out_features, op.rows, op.in_features, op.dtype)
            return g + (k - 1) * max(g + s, c) + max(c, g_dw + s)
        raise ValueError(f"fastdist: TPOp.kind must be 'row' or 'column', got {op.kind!r}")

    def choose_chunks(self, shape: tuple[int, int, int], op: str = "row", world_size: int | None = None,
                      dtype: torch.dtype = torch.float32) -> int:
        """The chunk count for a GEMM of ``shape = (rows, in_features, out_features)`` (local sizes).

        Args:
            shape: the GEMM's local sizes.
            op: ``"row"`` or ``"column"`` (see :class:`TPOp`).
            world_size: the tensor-parallel ranks (default: the calibration's, else 2).
            dtype: the GEMM's dtype.

        Returns:
            The fewest chunks from ``CHUNK_CHOICES`` (at most ``rows``) predicted within ``CHUNK_TOLERANCE`` of
            the best; 4 (at most ``rows``) when uncalibrated. Remembered per shape.
        """
        rows = int(shape[0])
        t = world_size or self.world_size or 2
        key = (op, tuple(int(s) for s in shape), t, str(dtype))
        if key in self._chosen:
            return self._chosen[key]
        if not self.calibrated:
            k = min(UNCALIBRATED_CHUNKS, max(rows, 1))
        else:
            tp_op = TPOp(op, rows, int(shape[1]), int(shape[2]), t, dtype)
            candidates = [k for k in CHUNK_CHOICES if k <= max(rows, 1)]
            predicted = {kk: self.predict(tp_op, kk) for kk in candidates}
            best = min(predicted.values())
            k = min(kk for kk in candidates if predicted[kk] <= best * (1 + CHUNK_TOLERANCE))
        self._chosen[key] = k
        return k

    # ---- calibration ----

    @classmethod
    def calibrate(cls, group: dist.ProcessGroup | None = None,
                  shapes: tuple[tuple[int, int, int], ...] = ((1024, 1024, 1024),), sizes: list[int] | None = None,
                  reps: int = 5, dtype: torch.dtype = torch.float32) -> "CostModel":
        """Measures this machine: all-reduce times (fit alpha, beta), GEMM times of every shape and of its row
        chunks (the table, and a fit of lambda and the rate), and the first shape's chunked pipeline for k = 2, 4,
        8 (the compute an all-reduce of each chunk size takes from the GEMM beside it).

        A collective: every rank of ``group`` must call it; all get the same model (the slowest rank's figures).

        Args:
            group: the tensor-parallel process group (None: the default group).
            shapes: ``(rows, K, N)`` GEMMs to time, local sizes.
            sizes: all-reduced bytes to time (default: 16 and 64 KiB and every shape's output and its 2-, 4-, 8-way
                chunks).
            reps: timed repetitions per measurement (after a warm-up); the median is kept.
            dtype: the GEMMs' and all-reduces' dtype.

        Returns:
            The calibrated model; its ``samples`` attribute holds the raw measurements.
        """
        world = dist.get_world_size(group)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        elem = torch.tensor([], dtype=dtype).element_size()
        if sizes is None:
            chunk_bytes = {-(-rows // k) * n_out * elem for rows, _, n_out in shapes for k in CHUNK_CHOICES}
            sizes = sorted({1 << 14, 1 << 16} | chunk_bytes)

        def timed(fn):  # this rank's median after one warm-up; the slowest rank's figures are taken below
            return time_ranks(fn, reps, device=device, group=group, slowest=False).median

        raw = []
        for nbytes in sizes:
            buf = torch.zeros(max(nbytes // elem, 1), dtype=dtype, device=device)
            raw.append(timed(lambda buf=buf: dist.all_reduce(buf, group=group)))
        table_keys, gemm_raw = [], []
        for rows, k_in, n_out in shapes:
            w = torch.randn(n_out, k_in, dtype=dtype, device=device)
            for k in CHUNK_CHOICES:
                m = -(-rows // k)
                if m < 1:
                    continue
                x = torch.randn(m, k_in, dtype=dtype, device=device)
                table_keys.append((m, k_in, n_out, str(dtype)))
                gemm_raw.append(timed(lambda x=x, w=w: x @ w.t()))
        values = all_max(raw + gemm_raw, device, group)  # the slowest rank's figures, everywhere
        raw, gemm_raw = values[:len(raw)], values[len(raw):]
        # Relative least squares: the small sizes pin alpha, the large ones beta.
        a, b = _fit_line(np.array(sizes, dtype=float), np.array(raw), relative=True)
        steps = 2 * (world - 1) if world > 1 else 1
        alpha = max(a, 1e-7) / steps
        beta = (2 * (world - 1) / world) / max(b, 1e-15) if world > 1 else float("inf")
        flops = np.array([2.0 * m * k * n for m, k, n, _ in table_keys])
        launch_overhead, inv_rate = _fit_line(flops, np.array(gemm_raw))
        model = cls(alpha=alpha, beta=beta, gemm_overhead=max(launch_overhead, 0.0),
                    gemm_rate=1.0 / max(inv_rate, 1e-18),
                    gemm_table=dict(zip(table_keys, gemm_raw)), allreduce_table=dict(zip(sizes, raw)),
                    world_size=world)
        # S, what an all-reduce takes from the GEMM beside it: the first shape's GEMM in k = 2, 4, 8 chunks, each
        # chunk's all-reduce started after its GEMM as the linears run them. Where the GEMMs dominate,
        # T(k) = k g + (k - 1) s + c, so s = (T(k) - k g - c) / (k - 1) at the chunk's bytes; where the
        # all-reduces do, that is c - g and max(g + s, c) = c still holds.
        rows, k_in, n_out = shapes[0]
        x = torch.randn(rows, k_in, dtype=dtype, device=device)
        w = torch.randn(n_out, k_in, dtype=dtype, device=device)
        piped = []
        for k in CHUNK_CHOICES[1:]:
            def pipeline(bounds=chunk_bounds(rows, k)):
                out = x.new_empty(rows, n_out)  # a fresh output, as the linears allocate (and fault in) theirs
                pending = []
                for start, stop in bounds:
                    torch.matmul(x[start:stop], w.t(), out=out[start:stop])
                    pending.append(dist.all_reduce(out[start:stop], group=group, async_op=True))
                for work in pending:
                    work.wait()

            piped.append(timed(pipeline))
        for k, t_k in zip(CHUNK_CHOICES[1:], all_max(piped, device, group)):
            m = -(-rows // k)
            nbytes = m * n_out * elem
            g, c = model.gemm_time(m, k_in, n_out, dtype), model.allreduce_time(nbytes)
            model.comm_compute_table[nbytes] = max((t_k - k * g - c) / (k - 1), 0.0)
        model.samples = {"allreduce_bytes": list(sizes), "allreduce_s": raw, "gemm": list(zip(table_keys, gemm_raw)),
                         "pipeline_s": dict(zip(CHUNK_CHOICES[1:], piped)),
                         "allreduce_compute_s": sorted(model.comm_compute_table.items())}
        return model

    # ---- state ----

    def state_dict(self) -> dict:
        """The model and the chunk counts chosen so far, as plain data."""
        return {"alpha": self.alpha, "beta": self.beta, "gemm_overhead": self.gemm_overhead,
                "gemm_rate": self.gemm_rate, "world_size": self.world_size,
                "gemm_table": [list(k) + [v] for k, v in sorted(self.gemm_table.items())],
                "allreduce_table": [[b, v] for b, v in sorted(self.allreduce_table.items())],
                "comm_compute_table": [[b, v] for b, v in sorted(self.comm_compute_table.items())],
                "chosen": [[op, list(shape), t, dt, k] for (op, shape, t, dt), k in sorted(self._chosen.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned."""
        self.alpha, self.beta = state["alpha"], state["beta"]
        self.gemm_overhead, self.gemm_rate = state["gemm_overhead"], state["gemm_rate"]
        self.world_size = state["world_size"]
        self.gemm_table = {(int(m), int(k), int(n), dt): float(v) for m, k, n, dt, v in state["gemm_table"]}
        self.allreduce_table = {int(b): float(v) for b, v in state["allreduce_table"]}
        self.comm_compute_table = {int(b): float(v) for b, v in state["comm_compute_table"]}
        self._chosen = {(op, tuple(shape), t, dt): k for op, shape, t, dt, k in state.get("chosen", [])}

    def __repr__(self) -> str:
        if not self.calibrated:
            return "CostModel(uncalibrated: choose_chunks -> 4)"
        return (f"CostModel(alpha={self.alpha * 1e6:.1f}us, beta={self.beta / 1e9:.3f}GB/s, "
                f"gemm_rate={self.gemm_rate / 1e9:.1f}GFLOP/s, lambda={self.gemm_overhead * 1e6:.1f}us, "
                f"{len(self.gemm_table)} measured GEMMs, all-reduce compute {self._compute_summary()})")

    def _compute_summary(self):
        if not self.comm_compute_table:
            return "none"
        b = max(self.comm_compute_table)
        return f"{self.comm_compute_table[b] * 1e3:.2f} ms at {b / 2**20:g} MiB"


def _interpolate(table, sizes, nbytes):
    """Piecewise-linear interpolation of ``table`` (bytes -> seconds) at ``nbytes``; ``sizes`` its sorted keys."""
    return float(np.interp(nbytes, sizes, [table[b] for b in sizes]))


def _fit_line(x, y, relative=False):
    """Least-squares intercept and slope of y = a + b x (``relative``: of the relative residuals)."""
    if len(x) < 2:
        return 0.0, float(y[0] / x[0]) if len(x) else 0.0
    b, a = np.polyfit(x, y, 1, w=1.0 / np.maximum(y, 1e-12) if relative else None)
    return float(a), float(b)


_default = CostModel()


def default_cost_model() -> CostModel:
    """The process-wide model the ``overlap_chunks="auto"`` linears use unless given their own."""
    return _default


def set_default_cost_model(model: CostModel) -> None:
    """Makes ``model`` (e.g. a calibrated one) the process-wide model of the ``overlap_chunks="auto"`` linears."""
    global _default
    _default = model
