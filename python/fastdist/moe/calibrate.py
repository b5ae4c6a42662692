"""Start-up micro-benchmark for the planner's cost model, run once per (group, shape) and cached.

Measures on every rank of `group`: the expert GEMM rate (an FFN-shaped pair of matmuls), and all-to-all time at two
message sizes, fitted as ``alpha + bytes / bandwidth``. Replica traffic goes over the same links, so the
point-to-point rate is taken to be the all-to-all bandwidth. Each measurement is the median of a few repetitions;
then the slowest rank's figure is taken (an all-reduce MAX), so every rank holds identical constants, as the
planner's determinism requires.
"""
import statistics
import time

import torch
import torch.distributed as dist

from fastdist.moe.planner import CostModel

__all__ = ["calibrate", "clear_cache"]

_CACHE = {}


def clear_cache():
    _CACHE.clear()


def _median_time(fn, reps):
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _group_ranks(group):
    world = dist.get_world_size(group)
    return tuple(dist.get_global_rank(group, i) if group is not None else i for i in range(world))


def calibrate(group=None, d_model=512, d_ff=2048, dtype=torch.float32, device=None, reps=5, tokens=256,
              small_rows=1, large_rows=256):
    """The CostModel for an FFN expert of d_model x d_ff on `group`, measured here (cached per group and shape)."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if distributed and dist.get_backend(group) == "nccl"
        else torch.device("cpu"))
    key = (_group_ranks(group) if distributed else (0,), d_model, d_ff, dtype, str(device))
    if key in _CACHE:
        return _CACHE[key]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_model, generator=g, dtype=dtype).to(device)
    w1 = torch.randn(d_model, d_ff, generator=g, dtype=dtype).to(device)
    w2 = torch.randn(d_ff, d_model, generator=g, dtype=dtype).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def ffn():
        (x @ w1).relu_() @ w2
        sync()

    t_ffn = _median_time(ffn, reps)
    elem = torch.empty((), dtype=dtype).element_size()

    def a2a(rows):
        send = torch.zeros(rows * world, d_model, dtype=dtype, device=device)
        recv = torch.empty_like(send)

        def run():
            if world > 1:
                dist.all_to_all_single(recv, send, group=group)
            sync()
        return _median_time(run, reps)

    t_small, t_large = a2a(small_rows), a2a(large_rows)
    measured = torch.tensor([t_ffn, t_small, t_large], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    t_ffn, t_small, t_large = (float(v) for v in measured.cpu())
    # A rank sends (world - 1) blocks of `rows` rows in an all-to-all.
    bytes_small = small_rows * (world - 1) * d_model * elem
    bytes_large = large_rows * (world - 1) * d_model * elem
    bandwidth = (bytes_large - bytes_small) / max(t_large - t_small, 1e-9) if world > 1 else float("inf")
    alpha = max(t_small - bytes_small / bandwidth, 0.0) if world > 1 else 0.0
    model = CostModel(d_model=d_model, d_ff=d_ff, a2a_alpha_s=alpha, a2a_bytes_per_s=bandwidth,
                      flops_per_s=tokens * 4 * d_model * d_ff / max(t_ffn, 1e-12), p2p_bytes_per_s=bandwidth,
                      elem_bytes=elem)
    _CACHE[key] = model
    return model
