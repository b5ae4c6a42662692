"""Builds fastdist._C against the installed torch.

CPU kernels always; CUDA kernels when the installed torch is a CUDA build and a CUDA toolkit is found
(FASTDIST_FORCE_CPU=1 / FASTDIST_FORCE_CUDA=1 override). Install with
`pip install --no-build-isolation -e .` so the build sees the torch you run with.
"""
import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0"


def _flag(name):
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _decide_cuda():
    """Returns (build_cuda, reason)."""
    if _flag("FASTDIST_FORCE_CPU"):
        return False, "FASTDIST_FORCE_CPU=1"
    torch_cuda = torch.version.cuda
    toolkit = cpp_extension.CUDA_HOME
    if _flag("FASTDIST_FORCE_CUDA"):
        if torch_cuda is None:
            sys.exit("fastdist: FASTDIST_FORCE_CUDA=1 but the installed torch is a CPU build "
                     f"({torch.__version__}); a CPU torch cannot link CUDA ops. Install a CUDA torch.")
        if toolkit is None:
            sys.exit("fastdist: FASTDIST_FORCE_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME).")
        return True, "FASTDIST_FORCE_CUDA=1"
    if torch_cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    if toolkit is None:
        return False, f"torch is built for CUDA {torch_cuda} but no CUDA toolkit was found (set CUDA_HOME)"
    return True, f"torch CUDA {torch_cuda}, toolkit at {toolkit}"


def _torch_runs_libgomp():
    """True when torch's parallel backend is OpenMP on GCC's libgomp (loaded with torch, so it is in our maps)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _summary(lines):
    width = max(len(line) for line in lines) + 4
    bar = "+" + "-" * (width - 2) + "+"
    return "\n".join([bar] + [f"| {line.ljust(width - 4)} |" for line in lines] + [bar])


build_cuda, cuda_reason = _decide_cuda()
if build_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if build_cuda else ""

cpp_sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "kernels", "*.cpp"))
                   + glob.glob(os.path.join(ROOT, "csrc", "ops", "*.cpp")))
cu_sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "kernels", "*.cu"))
                  + glob.glob(os.path.join(ROOT, "csrc", "ops", "*.cu"))) if build_cuda else []

version_ns = {}
with open(os.path.join(ROOT, "python", "fastdist", "_version.py")) as f:
    exec(f.read(), version_ns)

cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas"]
# With torch's OpenMP backend, at::parallel_for is an OpenMP region inlined into our code: without -fopenmp it runs
# on the calling thread alone. Linking -fopenmp adds NEEDED libgomp.so.1, which resolves to the copy torch has
# already loaded (same soname), so there is still one OpenMP runtime in the process. Under another OpenMP runtime
# (libiomp5, libomp) that would be a second one: there the glue stays serial.
openmp = _torch_runs_libgomp()
if openmp:
    cxx_flags.append("-fopenmp")
nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
define_macros = [("FASTDIST_WITH_CUDA", "1")] if build_cuda else []
ext_cls = cpp_extension.CUDAExtension if build_cuda else cpp_extension.CppExtension
ext = ext_cls(
    name="fastdist._C",
    sources=cpp_sources + cu_sources,
    include_dirs=[os.path.join(ROOT, "csrc")],
    define_macros=define_macros,
    extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags} if build_cuda else {"cxx": cxx_flags},
    extra_link_args=["-fopenmp"] if openmp else [],
)

build_info = {
    "version": version_ns["__version__"],
    "torch_version": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_built": build_cuda,
    "cuda_reason": cuda_reason,
    "cuda_arch_list": arch_list,
    "sources": cpp_sources + cu_sources,
}
with open(os.path.join(ROOT, "python", "fastdist", "_build_info.py"), "w") as f:
    f.write("# Written by setup.py at build time; do not edit.\n")
    f.write(f"BUILD_INFO = {build_info!r}\n")

print(_summary([
    f"fastdist {build_info['version']} build",
    f"torch        {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
    f"CUDA kernels {'yes' if build_cuda else 'no'}: {cuda_reason}",
    f"arch list    {arch_list or '-'}",
    f"OpenMP       {'yes (torch runs libgomp)' if openmp else 'no'}",
    f"C++ sources  {len(cpp_sources)}: " + " ".join(os.path.basename(s) for s in cpp_sources),
    f"CUDA sources {len(cu_sources)}: " + (" ".join(os.path.basename(s) for s in cu_sources) or "-"),
]), file=sys.stderr)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
