"""Where a suite's ranks run: torchrun's processes, or local ranks on the simulated network or loopback."""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fastdist import netsim
from fastdist.bench import report
from fastdist.bench.toolkit import at_least, delay, network
from fastdist.distributed import resolve_backend, spawn


@dataclasses.dataclass
class Launch:
    """What `run_ranks` returns: rank 0's result and where the ranks ran."""

    result: object          # what fn returned on rank 0 (None on the other torchrun ranks)
    backend: str
    world: int
    network: str            # the label every figure carries
    link_gbps: float | None = None  # the simulated link rate in GB/s, None when not shaped


def add_launch_arguments(p: argparse.ArgumentParser, timeout: float, net_words: Mapping[str, str] | None = None,
                         net_default: str = "loopback") -> None:
    """The options run_ranks takes, shared by every multi-rank suite.

    Args:
        net_words: values --net takes besides 'loopback' and a link rate, with what each means (the suite resolves
            them before calling run_ranks), e.g. {"auto": "links at ... measured first"}.
        net_default: --net's default.
    """
    words = dict(net_words or {})

    def net_type(text: str) -> str:
        return text if text in words else network(text)

    said = "".join(f"'{w}' ({meaning}), " for w, meaning in words.items())
    p.add_argument("--ranks", type=at_least(1), default=4, help="number of local ranks (default %(default)s)")
    p.add_argument("--net", type=net_type, default=net_default,
                   help=f"{said}'loopback' or a simulated link rate such as 1gbit, 10gbit, 100mbit (needs root; "
                        "default %(default)s)")
    p.add_argument("--delay", type=delay, default=None, help="added one-way latency on the simulated links, e.g. 50us")
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"seconds before the whole run is aborted (default {timeout:g})")


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or with its environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def tx_counter(enabled: bool) -> int:
    """Bytes this rank's interface has sent (its own namespace on the simulated cluster); 0 when not measured."""
    return netsim.tx_bytes() if enabled else 0


def pin_to_core(rank: int) -> int:
    """Every thread of this process (gloo's too) on core `rank` (mod the cores it may use), and one torch thread.
    Returns the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass
    torch.set_num_threads(1)
    return core


def pin_local_rank(device: torch.device | None = None) -> int | None:
    """On CPU, this rank on a core of its own (`pin_to_core`) when the host has a core per local rank.

    Returns:
        The core, or None when the ranks must share the cores (or run on a GPU), where nothing is changed.
    """
    world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if (device is not None and device.type != "cpu") or world > len(os.sched_getaffinity(0)):
        return None
    return pin_to_core(int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def _with_group(fn, config):
    return fn(config), (dist.get_backend(), dist.get_world_size())


def _torchrun(fn, config, backend):
    if not dist.is_initialized():
        backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    result, (backend, world) = _with_group(fn, config)
    dist.destroy_process_group()
    return Launch(result, backend, world, "real network (launched by torchrun)")


def run_ranks(fn: Callable[[dict], Any], config: dict, *, ranks: int, net: str = "loopback",
              delay: str | None = None, timeout: float = 1800.0, backend: str = "auto") -> Launch:
    """Runs fn(config) on every rank; returns a Launch with rank 0's result.

    Under torchrun: in this process, on the process group torchrun's environment describes.
    Otherwise: `ranks` local processes, each on its own host of a simulated cluster whose links run at
    `net` (e.g. "1gbit") when one can be built here — config["measure_tx"] is then True, so ranks can
    read their own interface counters — or on loopback, which is said on stdout and in the label.
    """
    config["measure_tx"] = False
    if under_torchrun():
        return _torchrun(fn, config, backend)
    label = "loopback (one host, no shaping)"
    if net != "loopback":
        rate = netsim.parse_rate(net)
        ok, why = netsim.available()
        if ok:
            config["measure_tx"] = True
            with netsim.Cluster(ranks, rate=net, delay=delay) as cluster:
                results = spawn(_with_group, ranks, fn, config, backend=backend, timeout=timeout, cluster=cluster)
            return Launch(results[0][0], *results[0][1], cluster.label, rate / 8e9)
        print(f"fastdist-bench: cannot simulate a {net} network here ({why}); running on loopback instead", flush=True)
        label = f"loopback (requested {net}: netsim unavailable: {why})"
    results = spawn(_with_group, ranks, fn, config, backend=backend, timeout=timeout)
    return Launch(results[0][0], *results[0][1], label)


def run_suite(suite: str, args: argparse.Namespace, bench_rank: Callable[[dict], Any], config: dict,
              collect: Callable[[Any, dict, Launch], dict], tables: Callable[[dict], list],
              backend: str = "auto") -> dict | None:
    """The multi-rank suite's `run`: `bench_rank(config)` on the ranks `args` asks for (add_launch_arguments'
    options), then on the printing process the environment header, the payload and its tables.

    Args:
        suite: The payload's "suite".
        collect: (rank 0's result, config, the Launch) -> the payload's fields after suite, env, link_gbps and config.
        tables: The suite's `tables`, printed as text.
        backend: run_ranks' backend.

    Returns:
        The JSON payload; None on the other torchrun ranks.
    """
    launch = run_ranks(bench_rank, config, ranks=args.ranks, net=args.net, delay=args.delay, timeout=args.timeout,
                       backend=backend)
    if launch.result is None:
        return None
    env = report.launch_environment(launch)  # the header first: `collect` may print lines under it
    result = {"suite": suite, "env": env, "link_gbps": launch.link_gbps, "config": config,
              **collect(launch.result, config, launch)}
    print(report.text_parts(tables(result)))
    return result
