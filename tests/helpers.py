"""Helpers the test directories share (imported as `helpers`: pytest puts this folder on sys.path, the folder of
the root conftest.py)."""
import os
import re
import subprocess
import sys

import torch


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """A standard normal tensor of `shape` drawn from its own generator seeded with `seed`."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, **tolerance: float) -> None:
    """torch.testing.assert_close whose failure message starts with `what` (the rank, the case, the tensor)."""
    torch.testing.assert_close(got, want, msg=lambda message: f"{what}: {message}", **tolerance)


def run_readme_recipe_under_torchrun(test_file: str, tmp_path, nproc: int = 2) -> str:
    """Runs the README recipe marked `<!-- runs in <test_file> under torchrun -->` as written, under torchrun with
    `nproc` ranks of one thread each; fails with its output unless it exits 0. Returns what the ranks printed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        marker = re.escape(f"<!-- runs in {test_file} under torchrun -->")
        recipes = re.findall(marker + r"\n```python\n(.*?)```", f.read(), re.S)
    assert len(recipes) == 1, f"README: {len(recipes)} recipes marked for {test_file}"
    script = tmp_path / "recipe.py"
    script.write_text(recipes[0])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
