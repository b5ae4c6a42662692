"""The build and `python -m fastdist.env` tell the truth about what was built and what can run."""
import os
import subprocess
import sys

import pytest
import torch

import fastdist
from fastdist import env
from fastdist._build_info import BUILD_INFO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_and_build_info_describe_this_build():
    assert fastdist.__version__ == BUILD_INFO["version"]
    assert BUILD_INFO["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert any(s.endswith("bitpack.cpp") for s in BUILD_INFO["sources"])
    assert BUILD_INFO["cuda_built"] == any(s.endswith(".cu") for s in BUILD_INFO["sources"])


def test_cuda_kernels_are_reported_available_only_when_built_and_a_gpu_is_visible():
    registered = torch._C._dispatch_has_kernel_for_dispatch_key("fastdist::pack_bits", "CUDA")
    assert registered == fastdist.cuda_kernels_built()
    assert fastdist.cuda_kernels_available() == (registered and torch.cuda.is_available())


def test_env_report_lists_every_op_with_the_devices_it_has_kernels_for():
    report = dict(env.collect())
    assert report["fastdist"].startswith(fastdist.__version__)
    assert report["torch"].startswith(torch.__version__)
    for op in ("pack_bits", "unpack_bits", "bitwise_or_reduce"):
        assert f"{op} [CPU" in report["ops"]
        assert ("CUDA" in report["ops"].split(op)[1].split("]")[0]) == fastdist.cuda_kernels_built()
    expected = "yes" if fastdist.cuda_kernels_available() else "no"
    assert report["CUDA kernels available"] == expected
    assert "gloo" in report["distributed backends"]


def test_python_m_fastdist_env_runs_and_prints_the_report():
    proc = subprocess.run([sys.executable, "-m", "fastdist.env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for key in ("fastdist", "torch", "CUDA kernels built", "CUDA arch list", "netsim", "ops"):
        assert key in proc.stdout


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-torch refusal")
def test_forcing_cuda_with_a_cpu_torch_fails_the_build_with_the_reason():
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "FASTDIST_FORCE_CUDA": "1"}, timeout=120)
    assert proc.returncode != 0
    assert "CPU build" in proc.stderr + proc.stdout


def test_importing_under_a_different_torch_than_the_build_is_refused():
    code = ("import sys, fastdist._build_info as b; b.BUILD_INFO['torch_version'] = '1.0.0'\n"
            "del sys.modules['fastdist']\n"
            "try:\n    import fastdist\nexcept ImportError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused: fastdist was built against torch 1.0.0" in proc.stdout, proc.stdout + proc.stderr
