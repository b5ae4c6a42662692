"""fastdist: fast distributed training of large models where links are slow and memory is short.

`import fastdist` loads the C++/CUDA ops (torch.ops.fastdist.*) and their Python wrappers. The families and
their plumbing (``fastdist.adapters``, ``.admm``, ``.comm``, ``.compress``, ``.distributed``, ``.embedding``,
``.graph``, ``.memory``, ``.moe``, ``.netsim``, ``.parallel``, ``.tp``; and ``fastdist.parallelize``, which is
``fastdist.parallel.parallelize``) are attributes too, imported on first use, so that
``import fastdist`` costs no more than loading the ops. The benchmark CLI, ``fastdist.bench``, is not one of them:
it is a program (``fastdist-bench``), not library API, and is imported by name when wanted.
"""
import importlib

import torch

from fastdist._version import __version__

try:
    from fastdist._build_info import BUILD_INFO
except ImportError as e:  # the package was imported from a source tree that was never built
    raise ImportError("fastdist: the extension is not built. From the repository root run "
                      "`pip install --no-build-isolation -e .` (or `make test`).") from e


def _torch_release(version: str) -> list[str]:
    return version.split("+")[0].split(".")[:2]


if _torch_release(BUILD_INFO["torch_version"]) != _torch_release(torch.__version__):
    raise ImportError(f"fastdist was built against torch {BUILD_INFO['torch_version']} but torch "
                      f"{torch.__version__} is installed; C++ ops are tied to the torch they were built "
                      "with. Rebuild: `pip install --no-build-isolation -e .`")

from fastdist import _C  # noqa: E402,F401  (registers torch.ops.fastdist.*)
from fastdist import ops  # noqa: E402,F401


def cuda_kernels_built() -> bool:
    """True when this build of fastdist contains CUDA kernels."""
    return bool(BUILD_INFO["cuda_built"])


def cuda_kernels_available() -> bool:
    """True when fastdist's CUDA kernels are built, registered, and a CUDA device is visible."""
    return (cuda_kernels_built()
            and torch._C._dispatch_has_kernel_for_dispatch_key("fastdist::pack_bits", "CUDA")
            and torch.cuda.is_available())


# Imported on first attribute access (PEP 562), as torch does for its own subpackages.
_SUBMODULES = ("adapters", "admm", "comm", "compress", "distributed", "embedding", "graph", "memory", "moe", "netsim",
               "parallel", "tp")
# Functions re-exported from a submodule, imported on first use like the submodules: name -> submodule.
_LAZY_FUNCTIONS = {"parallelize": "parallel"}


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f"fastdist.{name}")  # binds fastdist.<name>: called once per submodule
    if name in _LAZY_FUNCTIONS:
        value = getattr(importlib.import_module(f"fastdist.{_LAZY_FUNCTIONS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastdist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES) | set(_LAZY_FUNCTIONS))


__all__ = ["__version__", "cuda_kernels_available", "cuda_kernels_built", "ops", *_SUBMODULES, *_LAZY_FUNCTIONS]
