"""`python -m fastdist.env`: what a user pastes into a bug report.

Versions, how the extension was built, which kernels are registered for which device, what
torch.distributed can use here, and whether the simulated cluster can be built.
"""
import os
import platform
import sys

import torch
import torch.distributed as dist

import fastdist
from fastdist._build_info import BUILD_INFO


def _registered_ops():
    """{op name: [dispatch keys with a kernel]} for every torch.ops.fastdist op."""
    names = sorted(s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("fastdist::"))
    keys = ["CPU", "CUDA", "Meta"]
    return {n.split("::", 1)[1]: [k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key(n, k)]
            for n in names}


def _distributed_backends():
    if not dist.is_available():
        return "torch.distributed not available"
    have = [name for name, ok in [("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                  ("mpi", dist.is_mpi_available())] if ok]
    return ", ".join(have) or "none"


def collect() -> list[tuple[str, str]]:
    """The report as an ordered list of (key, value)."""
    from fastdist import netsim

    cuda = torch.cuda.is_available()
    devices = [f"{i}: {torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
               for i in range(torch.cuda.device_count())] if cuda else []
    netsim_ok, netsim_why = netsim.available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else "-"
    return [
        ("fastdist", f"{fastdist.__version__} at {os.path.dirname(fastdist.__file__)}"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", f"{platform.platform()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("built against", f"torch {BUILD_INFO['torch_version']} (CUDA {BUILD_INFO['torch_cuda'] or 'none'})"),
        ("CUDA kernels built", f"{'yes' if BUILD_INFO['cuda_built'] else 'no'} ({BUILD_INFO['cuda_reason']})"),
        ("CUDA arch list", BUILD_INFO["cuda_arch_list"] or "-"),
        ("CUDA kernels available", "yes" if fastdist.cuda_kernels_available() else "no"),
        ("CUDA devices", "; ".join(devices) or "none visible"),
        ("NCCL", nccl),
        ("distributed backends", _distributed_backends()),
        ("netsim", "available" if netsim_ok else f"unavailable: {netsim_why}"),
        ("ops", "; ".join(f"{name} [{', '.join(keys)}]" for name, keys in _registered_ops().items()) or "none"),
        ("sources", " ".join(os.path.relpath(s, "csrc") for s in BUILD_INFO["sources"])),
    ]


def main() -> None:
    """Prints the report, one aligned line per key."""
    rows = collect()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")


if __name__ == "__main__":
    main()
