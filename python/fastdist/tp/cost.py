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
``(G + C) / max(G, C) <= 2``.

:meth:`CostModel.choose_chunks` takes a split only when its predicted gain exceeds the model's error: the fewest
``k`` from {1, 2, 4, 8} predicted within ``max(3%, error)`` of the least ``T(k)``, so ``k = 1`` (the plain,
Megatron-style path) unless chunking promises more than the model can tell apart. ``error`` is measured by
:meth:`calibrate`: the largest relative difference between the model's prediction and the calibration shape's
measured pipeline at k = 1, 2, 4, 8, or the measurements' own spread (their interquartile range over the median),
whichever is larger; a calibration taken on a loaded machine is noisy, and then keeps ``k = 1`` unless the gain is
large. Uncalibrated, ``choose_chunks`` returns 4 (TransformerEngine's default too), and the linears warn.

Calibration times every measurement on every rank and keeps the slowest rank's median, so all ranks hold the
same model and make the same choices (the linears also check that with a fingerprint exchange). It is a step of
its own, cacheable: ``calibrate(cache="tp-cost.json")`` loads the model measured for this hardware and these
shapes (:func:`calibration_key`) from the file when it is there, and measures and adds it otherwise.
"""
import dataclasses
import json
import os
import statistics
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from fastdist.distributed.hardware import hardware_key
from fastdist.distributed.timing import all_max, time_ranks
from fastdist.tp.chunks import chunk_bounds
from fastdist.tp.comm import collective_device

__all__ = ["CHUNK_CHOICES", "CostModel", "TPOp", "calibration_key", "default_cost_model", "set_default_cost_model"]

CHUNK_CHOICES = (1, 2, 4, 8)
UNCALIBRATED_CHUNKS = 4
# choose_chunks takes the fewest chunks predicted within this fraction of the best (or within the model's measured
# error, when larger): a split that promises less is inside the model's error and adds messages whose latency
# varies.
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
        error: the model's relative error, as measured by :meth:`calibrate`: a split is taken only when its
            predicted gain exceeds it.
        key: what the model was measured for (:func:`calibration_key`; None when not calibrated here).

    Without ``alpha``, ``beta`` and ``gemm_rate`` the model is uncalibrated and chooses 4 chunks. ``source`` says
    where a calibrated model came from: ``"measured"`` or ``"cache"``.
    """

    def __init__(self, alpha: float | None = None, beta: float | None = None, gemm_overhead: float = 0.0,
                 gemm_rate: float | None = None, gemm_table: dict | None = None, allreduce_table: dict | None = None,
                 comm_compute_table: dict | None = None, world_size: int | None = None, error: float = 0.0,
                 key: str | None = None):
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
        self.error = float(error)
        self.key = key
        self.source = None
        self.samples = None
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
        """G: seconds of a ``rows x in_features`` times ``in_features x out_features`` GEMM in ``dtype`` (measured,
        else ``lambda + 2 rows in out / rate``)."""
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
            The fewest chunks from ``CHUNK_CHOICES`` (at most ``rows``) predicted within ``max(CHUNK_TOLERANCE,
            error)`` of the best, so 1 unless a split's predicted gain exceeds the model's error; 4 (at most
            ``rows``) when uncalibrated. Remembered per shape.
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
            k = min(kk for kk in candidates if predicted[kk] <= best * (1 + max(CHUNK_TOLERANCE, self.error)))
        self._chosen[key] = k
        return k

    # ---- calibration ----

    @classmethod
    def calibrate(cls, group: dist.ProcessGroup | None = None,
                  shapes: tuple[tuple[int, int, int], ...] = ((1024, 1024, 1024),), sizes: list[int] | None = None,
                  reps: int = 5, dtype: torch.dtype = torch.float32,
                  cache: str | os.PathLike | None = None) -> "CostModel":
        """Measures this machine: all-reduce times (fit alpha, beta), GEMM times of every shape and of its row
        chunks (the table, and a fit of lambda and the rate), and the first shape's chunked pipeline for k = 1, 2,
        4, 8 (the compute an all-reduce of each chunk size takes from the GEMM beside it, and the model's error).

        A collective: every rank of ``group`` must call it; all get the same model (the slowest rank's figures).

        Args:
            group: the tensor-parallel process group (None: the default group).
            shapes: ``(rows, K, N)`` GEMMs to time, local sizes.
            sizes: all-reduced bytes to time (default: 16 and 64 KiB and every shape's output and its 2-, 4-, 8-way
                chunks).
            reps: timed repetitions per measurement (after a warm-up); the median is kept.
            dtype: the GEMMs' and all-reduces' dtype.
            cache: a JSON file of calibrated models keyed by :func:`calibration_key`: the model for this hardware
                and these arguments is loaded from it when present (group rank 0 reads the file and sends the model
                to the others), else measured and added to it (by group rank 0). None: always measure.

        Returns:
            The calibrated model; ``source`` is ``"cache"`` or ``"measured"``, and a measured model's ``samples``
            holds the raw measurements.
        """
        world = dist.get_world_size(group)
        device = collective_device(group)
        elem = torch.tensor([], dtype=dtype).element_size()
        if sizes is None:
            chunk_bytes = {-(-rows // k) * n_out * elem for rows, _, n_out in shapes for k in CHUNK_CHOICES}
            sizes = sorted({1 << 14, 1 << 16} | chunk_bytes)
        key = calibration_key(group, shapes, sizes, dtype)
        first_rank = dist.get_global_rank(group, 0) if group is not None else 0
        if cache is not None:
            cached = [None]
            if dist.get_rank() == first_rank:
                found = cls.load(cache, key)
                cached[0] = None if found is None else found.state_dict()
            dist.broadcast_object_list(cached, src=first_rank, group=group)
            if cached[0] is not None:
                model = cls()
                model.load_state_dict(cached[0])
                model.source = "cache"
                return model
        samples = {}

        def timed(fn, label=None):  # this rank's median after one warm-up; the slowest rank's figures are taken below
            timing = time_ranks(fn, reps, device=device, group=group, slowest=False)
            if label is not None:
                samples[label] = list(timing.samples)
            return timing.median

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
                    world_size=world, key=key)
        # S, what an all-reduce takes from the GEMM beside it: the first shape's GEMM in k = 2, 4, 8 chunks, each
        # chunk's all-reduce started after its GEMM as the linears run them. Where the GEMMs dominate,
        # T(k) = k g + (k - 1) s + c, so s = (T(k) - k g - c) / (k - 1) at the chunk's bytes; where the
        # all-reduces do, that is c - g and max(g + s, c) = c still holds.
        rows, k_in, n_out = shapes[0]
        x = torch.randn(rows, k_in, dtype=dtype, device=device)
        w = torch.randn(n_out, k_in, dtype=dtype, device=device)
        piped = []
        for k in CHUNK_CHOICES:
            def pipeline(bounds=chunk_bounds(rows, k)):
                out = x.new_empty(rows, n_out)  # a fresh output, as the linears allocate (and fault in) theirs
                pending = []
                for start, stop in bounds:
                    torch.matmul(x[start:stop], w.t(), out=out[start:stop])
                    pending.append(dist.all_reduce(out[start:stop], group=group, async_op=True))
                for work in pending:
                    work.wait()

            piped.append(timed(pipeline, label=k))
        spreads = [_relative_spread(samples[k]) for k in CHUNK_CHOICES]
        measured = all_max(piped + spreads, device, group)
        piped, spread = dict(zip(CHUNK_CHOICES, measured[:len(piped)])), max(measured[len(piped):])
        for k in CHUNK_CHOICES[1:]:
            m = -(-rows // k)
            nbytes = m * n_out * elem
            g, c = model.gemm_time(m, k_in, n_out, dtype), model.allreduce_time(nbytes)
            model.comm_compute_table[nbytes] = max((piped[k] - k * g - c) / (k - 1), 0.0)
        # The error: how far the model misses the pipeline it was fitted beside (k = 1 is not part of the fit), or
        # how much the measurements themselves vary, whichever is larger.
        op = TPOp("row", rows, k_in, n_out, world, dtype)
        misses = [abs(model.predict(op, k) - piped[k]) / piped[k] for k in CHUNK_CHOICES]
        model.error = max(max(misses), spread)
        model.source = "measured"
        model.samples = {"allreduce_bytes": list(sizes), "allreduce_s": raw, "gemm": list(zip(table_keys, gemm_raw)),
                         "pipeline_s": piped, "pipeline_spread": spread, "prediction_misses": misses,
                         "allreduce_compute_s": sorted(model.comm_compute_table.items())}
        if cache is not None and dist.get_rank() == first_rank:
            model.save(cache)
        return model

    def save(self, path: str | os.PathLike) -> None:
        """Adds this model to the JSON file of calibrated models at ``path`` under its :attr:`key` (replacing the
        entry of the same key; written whole to a temporary file and renamed, so a reader never sees half of it).

        Raises:
            ValueError: the model has no key (it was not made by :meth:`calibrate`).
        """
        if self.key is None:
            raise ValueError("fastdist: CostModel.save needs a model made by CostModel.calibrate (its key says which "
                             "hardware and shapes it was measured for)")
        models = _read_models(path)
        models[self.key] = self.state_dict()
        folder = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
            json.dump({"models": models}, f, indent=1, sort_keys=True)
        os.replace(f.name, path)

    @classmethod
    def load(cls, path: str | os.PathLike, key: str) -> "CostModel | None":
        """The model stored under ``key`` (:func:`calibration_key`) in the JSON file at ``path``; None when the file
        or the entry is missing."""
        state = _read_models(path).get(key)
        if state is None:
            return None
        model = cls()
        model.load_state_dict(state)
        model.source = "cache"
        return model

    # ---- state ----

    def state_dict(self) -> dict:
        """The model and the chunk counts chosen so far, as plain data."""
        return {"alpha": self.alpha, "beta": self.beta, "gemm_overhead": self.gemm_overhead,
                "gemm_rate": self.gemm_rate, "world_size": self.world_size, "error": self.error, "key": self.key,
                "gemm_table": [list(k) + [v] for k, v in sorted(self.gemm_table.items())],
                "allreduce_table": [[b, v] for b, v in sorted(self.allreduce_table.items())],
                "comm_compute_table": [[b, v] for b, v in sorted(self.comm_compute_table.items())],
                "chosen": [[op, list(shape), t, dt, k] for (op, shape, t, dt), k in sorted(self._chosen.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state``, what :meth:`state_dict` returned."""
        self.alpha, self.beta = state["alpha"], state["beta"]
        self.gemm_overhead, self.gemm_rate = state["gemm_overhead"], state["gemm_rate"]
        self.world_size = state["world_size"]
        self.error, self.key = float(state.get("error", 0.0)), state.get("key")
        self.gemm_table = {(int(m), int(k), int(n), dt): float(v) for m, k, n, dt, v in state["gemm_table"]}
        self.allreduce_table = {int(b): float(v) for b, v in state["allreduce_table"]}
        self.comm_compute_table = {int(b): float(v) for b, v in state["comm_compute_table"]}
        self._chosen = {(op, tuple(shape), t, dt): k for op, shape, t, dt, k in state.get("chosen", [])}

    def __repr__(self) -> str:
        if not self.calibrated:
            return "CostModel(uncalibrated: choose_chunks -> 4)"
        return (f"CostModel(alpha={self.alpha * 1e6:.1f}us, beta={self.beta / 1e9:.3f}GB/s, "
                f"gemm_rate={self.gemm_rate / 1e9:.1f}GFLOP/s, lambda={self.gemm_overhead * 1e6:.1f}us, "
                f"{len(self.gemm_table)} measured GEMMs, all-reduce compute {self._compute_summary()}, "
                f"error {self.error:.1%})")

    def _compute_summary(self):
        if not self.comm_compute_table:
            return "none"
        b = max(self.comm_compute_table)
        return f"{self.comm_compute_table[b] * 1e3:.2f} ms at {b / 2**20:g} MiB"


def calibration_key(group: dist.ProcessGroup | None, shapes: tuple[tuple[int, int, int], ...], sizes: list[int],
                    dtype: torch.dtype) -> str:
    """What a calibration was measured for, as one string: the hardware (as MoE's calibration keys it: the device,
    torch's threads, the ranks, the backend, torch's version) and the calibration's shapes, all-reduce sizes and
    dtype. A cached model is used only for an equal key; the link between the ranks is not part of it (a changed
    network needs a new cache file).

    Args:
        group: the tensor-parallel process group (None: the default group).
        shapes, sizes, dtype: as for :meth:`CostModel.calibrate` (``sizes`` resolved).
    """

    hardware = hardware_key(collective_device(group), dist.get_world_size(group), dist.get_backend(group))
    return f"{hardware} | shapes {[list(s) for s in shapes]} | sizes {list(sizes)} | {dtype}"


def _read_models(path):
    """{key: state} of the JSON file of calibrated models at ``path`` ({} when there is none)."""
    try:
        with open(path) as f:
            return json.load(f).get("models", {})
    except FileNotFoundError:
        return {}


def _relative_spread(samples):
    """The interquartile range of ``samples`` over their median (0 for fewer than 2)."""
    if len(samples) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else 0.0


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
