"""Start-up micro-benchmark for the planner's cost model, run once per (group, shape) and cached.

Measures on every rank of `group`: the expert GEMM rate (forward and backward of an FFN-shaped pair of matmuls, a
third of it charged to the forward as the cost model's 3 T_fec does), and all-to-all time at two message sizes,
fitted as ``alpha + bytes / bandwidth``. Replica traffic goes over the same links, so the point-to-point rate is
taken to be the all-to-all bandwidth; what a replica transfer takes from the computation beside it is the FFN's
stretch with one expert's parameters broadcast beside it. Each measurement is the median of a few repetitions;
then the slowest rank's figure is taken (an all-reduce MAX), so every rank holds identical constants, as the
planner's determinism requires.

Measurements draw from their own generator, never from torch's global one. A calibration can be kept in a JSON file,
keyed by the hardware it ran on (device, cores and threads, ranks and their hosts, backend, torch version) and the
layer's shape; every rank of the group must find the same one there for it to be used.

Ranks on one machine that share its cores (more ranks than its cores fit at their thread counts, on CPU) are
recorded in the model (rank_hosts, host_slots), and their expert GEMM rate is measured one rank at a time: the
model then shares the host between them (fastdist.moe.planner.shared_makespan).
"""
import dataclasses
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastdist.distributed.fingerprint import fingerprint
from fastdist.distributed.hardware import hardware_key
from fastdist.distributed.timing import time_fn
from fastdist.moe.planner import CostModel

__all__ = ["calibrate", "clear_cache", "hardware_key"]

_CACHE = {}


def clear_cache() -> None:
    """Forgets every calibrated model, so that the next :func:`calibrate` measures again."""
    _CACHE.clear()


def _typical_time(fn, reps):
    """The median of `reps` runs after a warm-up: what the layer meets step after step (the fastest run is the
    hardware's best case, which a step shared with other work rarely sees, and put the predictions under the
    layer's times)."""
    return time_fn(fn, reps).median


def _group_ranks(group):
    world = dist.get_world_size(group)
    return tuple(dist.get_global_rank(group, i) if group is not None else i for i in range(world))


def _machine_id():
    """The same on every process of one machine, whatever its namespaces (a simulated cluster gives each rank its own
    network): the kernel's boot id, else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def shared_hosts(group: dist.ProcessGroup | None, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(rank_hosts, host_slots) when some machine runs more of the group's ranks than its cores fit at their torch
    thread counts, else ((), ()). Hosts are numbered in order of their first rank; a host's slots are the cores its
    ranks may run on (the union of their affinities) over the most threads one of them uses."""
    mine = (_machine_id(), sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    machines = list(dict.fromkeys(m for m, _, _ in everyone))
    rank_hosts = tuple(machines.index(m) for m, _, _ in everyone)
    host_slots = []
    for host, machine in enumerate(machines):
        members = [e for e in everyone if e[0] == machine]
        cores = set().union(*(set(c) for _, c, _ in members))
        host_slots.append(max(1, len(cores) // max(t for _, _, t in members)))
    if all(rank_hosts.count(h) <= slots for h, slots in enumerate(host_slots)):
        return (), ()
    return rank_hosts, tuple(host_slots)


def _solo_time(fn, reps, group):
    """_typical_time of fn on each rank in turn, the others waiting in a barrier (they sleep in it)."""
    seconds, rank = 0.0, dist.get_rank(group)
    for turn in range(dist.get_world_size(group)):
        dist.barrier(group=group)
        if turn == rank:
            seconds = _typical_time(fn, reps)
    dist.barrier(group=group)
    return seconds


def _layer_overhead(x, num_experts, k, reps, sync, generator):
    """Seconds of the layer's work around its experts for x's tokens, forward + backward: the gate, route, layout,
    permute and combine, with identity experts and no communication."""
    from fastdist.ops import moe_layout, moe_permute, moe_route, moe_unpermute

    gate = (torch.randn(num_experts, x.shape[1], generator=generator, dtype=x.dtype) / x.shape[1] ** 0.5) \
        .to(x.device).requires_grad_()

    def step():
        xs = x.detach().requires_grad_()
        _, _, idx, weight = moe_route(F.linear(xs, gate).float(), k)
        _, offsets, _, _, row_of_slot, _, _ = moe_layout(idx, num_experts, 1, -1)
        rows = moe_permute(xs, row_of_slot, int(offsets[-1]))
        moe_unpermute(rows, row_of_slot, weight.to(rows.dtype)).pow(2).mean().backward()
        sync()

    return _typical_time(step, reps)




def _load_cached(path, key):
    try:
        with open(path) as f:
            fields = json.load(f)["calibrations"][key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    fields.update(rank_hosts=tuple(fields["rank_hosts"]), host_slots=tuple(fields["host_slots"]))
    return CostModel(**fields)


def _save_cached(path, key, model):
    """Adds `model` under `key` to the file at `path`, replacing the file in one step (ranks may share it)."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        kept = {}
    kept.setdefault("calibrations", {})[key] = dataclasses.asdict(model)
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".fastdist-calibration-", delete=False) as f:
        json.dump(kept, f, indent=1, sort_keys=True)
    os.replace(f.name, path)


def _everyone_found(model, group, world, device):
    """Whether every rank of `group` found the same cached `model` (a collective when world > 1)."""
    found = fingerprint(model) if model is not None else 0
    if world == 1:
        return model is not None
    mine = torch.tensor([found], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return found != 0 and all(int(t.item()) == found for t in everyone)


def calibrate(group: dist.ProcessGroup | None = None, d_model: int = 512, d_ff: int = 2048,
              dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, reps: int = 9,
              tokens: int = 1024, small_rows: int = 1, large_rows: int = 1024, num_experts: int | None = None,
              k: int = 2, cache: str | os.PathLike | None = None) -> CostModel:
    """The CostModel for an FFN expert of ``d_model x d_ff`` on ``group``, measured on this machine (kept per
    group and shape for the process, and in ``cache`` if given). A collective where a process group exists: every
    rank gets the slowest rank's figures. Leaves torch's global random state as it was.

    Args:
        group: the expert-parallel process group (None: the default group, or one process).
        d_model: the token width.
        d_ff: the expert's hidden width.
        dtype: the parameters' dtype.
        device: where to measure (default: the current CUDA device on NCCL, else the CPU).
        reps: timed repetitions per measurement.
        tokens: the token rows of the timed FFN.
        small_rows: token rows to every rank in the small timed all-to-all (its latency).
        large_rows: token rows to every rank in the large one (its bandwidth).
        num_experts: with it, also the layer's own work per routed assignment (top-``k`` of ``num_experts``).
        k: experts per token.
        cache: a JSON file of calibrations keyed by :func:`hardware_key` and the shape: used when every rank finds
            the same one there; otherwise measured and added to it.
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if distributed and dist.get_backend(group) == "nccl"
        else torch.device("cpu"))
    key = (_group_ranks(group) if distributed else (0,), d_model, d_ff, dtype, str(device), num_experts, k)
    if key in _CACHE:
        return _CACHE[key]
    shape = (f"d_model {d_model}, d_ff {d_ff}, {dtype}, {num_experts} experts, top-{k}, {tokens} tokens, "
             f"all-to-all rows {small_rows}/{large_rows}")
    file_key = f"{hardware_key(device, world, dist.get_backend(group) if distributed else None)}; {shape}"
    cached = _load_cached(cache, file_key) if cache is not None else None
    if cache is not None and _everyone_found(cached, group, world, device):
        _CACHE[key] = cached
        return cached
    model = _measure(group, world, d_model, d_ff, dtype, device, reps, tokens, small_rows, large_rows, num_experts, k)
    if cache is not None:
        _save_cached(cache, file_key, model)
    _CACHE[key] = model
    return model


def _measure(group, world, d_model, d_ff, dtype, device, reps, tokens, small_rows, large_rows, num_experts, k):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_model, generator=g, dtype=dtype).to(device).requires_grad_()
    w1 = torch.randn(d_model, d_ff, generator=g, dtype=dtype).to(device).requires_grad_()
    w2 = torch.randn(d_ff, d_model, generator=g, dtype=dtype).to(device).requires_grad_()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def ffn():  # forward + backward, as the layer runs it: the model charges 3 T_fec for both
        (torch.nn.functional.gelu(x @ w1) @ w2).sum().backward()
        sync()

    t_ffn = _typical_time(ffn, reps) / 3
    rank_hosts, host_slots = shared_hosts(group, world) if world > 1 and device.type == "cpu" else ((), ())
    # the FFN's rate alone on a core: the model shares the host between its ranks itself
    t_ffn_solo = _solo_time(ffn, reps, group) / 3 if rank_hosts else t_ffn
    elem = torch.empty((), dtype=dtype).element_size()

    def a2a(rows):
        send = torch.zeros(rows * world, d_model, dtype=dtype, device=device)
        recv = torch.empty_like(send)

        def run():
            if world > 1:
                dist.all_to_all_single(recv, send, group=group)
            sync()
        return _typical_time(run, reps)

    t_small, t_large = a2a(small_rows), a2a(large_rows)
    t_overhead = _layer_overhead(x.detach(), num_experts, k, reps, sync, g) if num_experts else 0.0
    # What a replica transfer (one expert's parameters, sent by group rank 0) takes from the FFN running beside it.
    expert_bytes = (2 * d_model * d_ff + d_model + d_ff) * elem
    t_beside = t_transfer = 3 * t_ffn
    if world > 1:
        params = torch.zeros(expert_bytes // elem, dtype=dtype, device=device)
        src = dist.get_global_rank(group, 0) if group is not None else 0

        def transfer():
            dist.broadcast(params, src=src, group=group)
            sync()

        def ffn_beside_transfer():
            work = dist.broadcast(params, src=src, group=group, async_op=True)
            ffn()
            work.wait()
            sync()

        t_transfer, t_beside = _typical_time(transfer, reps), _typical_time(ffn_beside_transfer, reps)
    measured = torch.tensor([t_ffn_solo, t_small, t_large, t_transfer, t_beside - 3 * t_ffn, t_overhead],
                            dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    t_ffn_solo, t_small, t_large, t_transfer, stretch, t_overhead = (float(v) for v in measured.cpu())
    # The stretch is the transfer's compute only while the transfer ends inside the FFN; past it, its waiting counts.
    transfer_compute = min(max(stretch, 0.0), t_transfer)
    # A rank sends (world - 1) blocks of `rows` rows in an all-to-all. Fit alpha + bytes / bandwidth through the two
    # sizes; when noise makes the large message look no slower than the small one, charge it all to bandwidth.
    bytes_small = small_rows * (world - 1) * d_model * elem
    bytes_large = large_rows * (world - 1) * d_model * elem
    if world == 1:
        bandwidth, alpha = float("inf"), 0.0
    elif t_large > 1.1 * t_small:
        bandwidth = (bytes_large - bytes_small) / (t_large - t_small)
        alpha = max(t_small - bytes_small / bandwidth, 0.0)
    else:
        bandwidth, alpha = bytes_large / t_large, 0.0
    return CostModel(d_model=d_model, d_ff=d_ff, a2a_alpha_s=alpha, a2a_bytes_per_s=bandwidth,
                     flops_per_s=tokens * 4 * d_model * d_ff / max(t_ffn_solo, 1e-12), p2p_bytes_per_s=bandwidth,
                     elem_bytes=elem, p2p_compute_s_per_byte=transfer_compute / expert_bytes,
                     overhead_s_per_assignment=t_overhead / (tokens * k), rank_hosts=rank_hosts,
                     host_slots=host_slots)
