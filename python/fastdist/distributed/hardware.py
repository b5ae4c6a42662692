"""The hardware a calibration was measured on, as the calibration caches of every family key it."""
import os
import platform

import torch

__all__ = ["hardware_key"]


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_key(device: torch.device, world: int, backend: str | None) -> str:
    """This rank's hardware as the calibration files of every family key it: the device (CPU model and the cores this process may use,
    or the GPU's name), torch's threads, the ranks (and how many share this host), the backend and torch's version.

    Args:
        device: where the calibrated work computes.
        world: the ranks of the group.
        backend: the process group's backend (None: one process).
    """
    what = f"cuda {torch.cuda.get_device_name(device)}" if device.type == "cuda" else \
        f"cpu {_cpu_model()} x{len(os.sched_getaffinity(0))}"
    local = os.environ.get("LOCAL_WORLD_SIZE", "?") if world > 1 else "1"
    return (f"{what}, {torch.get_num_threads()} threads, {world} ranks ({local} on this host), {backend or 'none'}, "
            f"torch {torch.__version__}")
