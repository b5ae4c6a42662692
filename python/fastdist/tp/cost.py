"""The overlap cost model: when does chunking a tensor-parallel linear pay, and by how many chunks.

Alpha-beta ring all-reduce of ``B`` bytes over ``t`` ranks: ``C(B) = 2(t-1) alpha + 2(t-1)/t * B / beta``.
A GEMM of ``m`` rows takes ``G(m)``: measured (a table filled by :meth:`CostModel.calibrate`) or fitted as
``lambda + 2 m K N / rate``. Split ``M`` rows into ``k`` chunks: each chunk's GEMM ``g = G(M / k)``, each
chunk's all-reduce ``c = C_alpha + C_beta / k`` (the latency term is paid per message), and

    row-parallel forward     T(k) = g + c + (k - 1) * gamma * max(g, c)          T(1) = G(M) + C(B)
    column-parallel backward T(k) = g + (k - 1) * gamma * max(g, c) + max(c, G_dW)

where ``gamma >= 1`` is the contention factor measured by :meth:`calibrate` (a GEMM and a collective running
at once slow each other: on a CPU they share cores and memory bandwidth, on a GPU SMs and HBM). The best
possible gain is ``(G + C) / max(G, C) <= 2``. :meth:`CostModel.choose_chunks` picks ``k`` from {1, 2, 4, 8}
minimizing ``T(k)``; uncalibrated, it returns 4 (the spec's default, TransformerEngine's too).

Calibration times every measurement on every rank and keeps the slowest rank's median, so all ranks hold the
same model and make the same choices (the linears also check that with a fingerprint exchange).
"""
import dataclasses
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["CHUNK_CHOICES", "CostModel", "TPOp", "default_cost_model", "set_default_cost_model"]

CHUNK_CHOICES = (1, 2, 4, 8)
UNCALIBRATED_CHUNKS = 4


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
    def comm_bytes(self):
        size = torch.tensor([], dtype=self.dtype).element_size()
        return self.rows * (self.out_features if self.kind == "row" else self.in_features) * size


class CostModel:
    """Fitted all-reduce and GEMM costs of this machine (see the module docstring)."""

    def __init__(self, alpha=None, beta=None, gemm_overhead=0.0, gemm_rate=None, contention=1.0, gemm_table=None,
                 world_size=None):
        self.alpha = alpha                  # seconds per ring step
        self.beta = beta                    # bytes per second per link
        self.gemm_overhead = gemm_overhead  # lambda: seconds per GEMM launch
        self.gemm_rate = gemm_rate          # flop/s for unmeasured shapes
        self.contention = contention        # gamma
        self.gemm_table = dict(gemm_table or {})  # (rows, K, N, dtype name) -> seconds
        self.world_size = world_size
        self._chosen = {}

    @property
    def calibrated(self):
        return self.alpha is not None and self.beta is not None and self.gemm_rate is not None

    # ---- the model ----

    def allreduce_time(self, nbytes, world_size=None):
        t = world_size or self.world_size
        if t is None or t <= 1:
            return 0.0
        return 2 * (t - 1) * self.alpha + 2 * (t - 1) / t * nbytes / self.beta

    def gemm_time(self, rows, in_features, out_features, dtype=torch.float32):
        key = (int(rows), int(in_features), int(out_features), str(dtype))
        if key in self.gemm_table:
            return self.gemm_table[key]
        return self.gemm_overhead + 2.0 * rows * in_features * out_features / self.gemm_rate

    def predict(self, op, k):
        """Predicted seconds of ``op`` (a :class:`TPOp`) split into ``k`` chunks."""
        if not self.calibrated:
            raise RuntimeError("fastdist: CostModel.predict needs a calibrated model (CostModel.calibrate(group) or "
                               "explicit alpha, beta and gemm_rate)")
        t = op.world_size
        c_alpha = 2 * (t - 1) * self.alpha if t > 1 else 0.0
        c_beta = 2 * (t - 1) / t * op.comm_bytes / self.beta if t > 1 else 0.0
        rows_per_chunk = -(-op.rows // k)
        if op.kind == "row":
            g = self.gemm_time(rows_per_chunk, op.in_features, op.out_features, op.dtype)
            if k == 1:
                return g + c_alpha + c_beta
            c = c_alpha + c_beta / k
            return g + c + (k - 1) * self.contention * max(g, c)
        if op.kind == "column":
            # Backward: dX = dY W (rows x out -> rows x in) chunked; dW = dY^T X overlaps the last all-reduce.
            g = self.gemm_time(rows_per_chunk, op.out_features, op.in_features, op.dtype)
            g_dw = self.gemm_time(op.out_features, op.rows, op.in_features, op.dtype)
            c = c_alpha + c_beta / k
            return g + (k - 1) * self.contention * max(g, c) + max(c, g_dw)
        raise ValueError(f"fastdist: TPOp.kind must be 'row' or 'column', got {op.kind!r}")

    def choose_chunks(self, shape, op="row", world_size=None, dtype=torch.float32):
        """The chunk count for a GEMM of ``shape = (rows, in_features, out_features)`` (local sizes)."""
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
            k = min(kk for kk in candidates if predicted[kk] <= best * (1 + 1e-9))  # ties: fewer chunks
        self._chosen[key] = k
        return k

    # ---- calibration ----

    @classmethod
    def calibrate(cls, group=None, shapes=((1024, 1024, 1024),), sizes=None, reps=5, dtype=torch.float32):
        """Measures this machine: all-reduce times over ``sizes`` bytes (fit alpha, beta), GEMM times of every
        ``shape`` = (rows, K, N) and of its 2-, 4- and 8-way row chunks (the table, and a fit of lambda and the
        rate), and the contention of a GEMM running beside an all-reduce. A collective: every rank of ``group``
        must call it; all get the same model."""
        world = dist.get_world_size(group)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        sizes = sizes or [2**p for p in range(14, 23, 2)]  # 16 KiB .. 4 MiB
        elem = torch.tensor([], dtype=dtype).element_size()

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def timed(fn):
            samples = []
            for i in range(reps + 1):
                sync()
                dist.barrier(group)
                t0 = time.perf_counter()
                fn()
                sync()
                if i:  # the first is warm-up
                    samples.append(time.perf_counter() - t0)
            return statistics.median(samples)

        raw = []
        for nbytes in sizes:
            buf = torch.ones(max(nbytes // elem, 1), dtype=dtype, device=device)
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
        # Contention: the first shape's half-size GEMM beside an all-reduce of its output.
        rows, k_in, n_out = shapes[0]
        m = max(rows // 2, 1)
        x = torch.randn(m, k_in, dtype=dtype, device=device)
        w = torch.randn(n_out, k_in, dtype=dtype, device=device)
        out = torch.empty(m, n_out, dtype=dtype, device=device)

        def overlapped():
            work = dist.all_reduce(out, group=group, async_op=True)
            x @ w.t()
            work.wait()

        lone_comm = timed(lambda: dist.all_reduce(out, group=group))
        lone_gemm = timed(lambda: x @ w.t())
        both = timed(overlapped)
        # The slowest rank's numbers, everywhere.
        values = torch.tensor(raw + gemm_raw + [lone_comm, lone_gemm, both], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        values = values.cpu().tolist()
        raw, gemm_raw = values[:len(raw)], values[len(raw):len(raw) + len(gemm_raw)]
        lone_comm, lone_gemm, both = values[-3:]
        a, b = _fit_line(np.array(sizes, dtype=float), np.array(raw))
        steps = 2 * (world - 1) if world > 1 else 1
        alpha = max(a, 1e-7) / steps
        beta = (2 * (world - 1) / world) / max(b, 1e-15) if world > 1 else float("inf")
        flops = np.array([2.0 * m * k * n for m, k, n, _ in table_keys])
        lam, inv_rate = _fit_line(flops, np.array(gemm_raw))
        contention = both / max(lone_comm, lone_gemm)
        contention = min(max(contention, 1.0), (lone_comm + lone_gemm) / max(lone_comm, lone_gemm))
        model = cls(alpha=alpha, beta=beta, gemm_overhead=max(lam, 0.0), gemm_rate=1.0 / max(inv_rate, 1e-18),
                    contention=contention, gemm_table=dict(zip(table_keys, gemm_raw)), world_size=world)
        model.samples = {"allreduce_bytes": list(sizes), "allreduce_s": raw, "gemm": list(zip(table_keys, gemm_raw)),
                         "contention": {"comm_s": lone_comm, "gemm_s": lone_gemm, "overlapped_s": both}}
        return model

    # ---- state ----

    def state_dict(self):
        return {"alpha": self.alpha, "beta": self.beta, "gemm_overhead": self.gemm_overhead,
                "gemm_rate": self.gemm_rate, "contention": self.contention, "world_size": self.world_size,
                "gemm_table": [list(k) + [v] for k, v in sorted(self.gemm_table.items())],
                "chosen": [[op, list(shape), t, dt, k] for (op, shape, t, dt), k in sorted(self._chosen.items())]}

    def load_state_dict(self, state):
        self.alpha, self.beta = state["alpha"], state["beta"]
        self.gemm_overhead, self.gemm_rate = state["gemm_overhead"], state["gemm_rate"]
        self.contention, self.world_size = state["contention"], state["world_size"]
        self.gemm_table = {(int(m), int(k), int(n), dt): float(v) for m, k, n, dt, v in state["gemm_table"]}
        self._chosen = {(op, tuple(shape), t, dt): k for op, shape, t, dt, k in state.get("chosen", [])}

    def __repr__(self):
        if not self.calibrated:
            return "CostModel(uncalibrated: choose_chunks -> 4)"
        return (f"CostModel(alpha={self.alpha * 1e6:.1f}us, beta={self.beta / 1e9:.3f}GB/s, "
                f"gemm_rate={self.gemm_rate / 1e9:.1f}GFLOP/s, lambda={self.gemm_overhead * 1e6:.1f}us, "
                f"contention={self.contention:.2f}, {len(self.gemm_table)} measured GEMMs)")


def _fit_line(x, y):
    """Least-squares intercept and slope of y = a + b x."""
    if len(x) < 2:
        return 0.0, float(y[0] / x[0]) if len(x) else 0.0
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


_default = CostModel()


def default_cost_model():
    """The process-wide model the ``overlap_chunks="auto"`` linears use unless given their own."""
    return _default


def set_default_cost_model(model):
    global _default
    _default = model
