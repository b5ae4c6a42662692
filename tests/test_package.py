"""`import fastdist`: the ops at once, every family as an attribute imported on first use, nothing else."""
import json
import subprocess
import sys

import pytest

import fastdist

SUBMODULES = ["adapters", "admm", "comm", "compress", "distributed", "embedding", "graph", "memory", "moe", "netsim",
              "parallel", "tp"]


def _in_a_fresh_interpreter(code):
    """What `code` prints as JSON, run where nothing of fastdist has been imported yet (this process has)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_families_are_attributes_of_fastdist_imported_on_first_use_only():
    got = _in_a_fresh_interpreter(
        "import json, sys, fastdist\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('fastdist.'))\n"
        "before = loaded()\n"
        f"names = {{n: getattr(fastdist, n).__name__ for n in {SUBMODULES!r}}}\n"
        "print(json.dumps({'before': before, 'names': names, 'after': loaded(), 'bench': hasattr(fastdist, 'bench'),"
        " 'dir': dir(fastdist), 'all': fastdist.__all__}))\n")
    assert not [m for m in got["before"] if m.split(".")[1] in SUBMODULES], got["before"]
    assert "fastdist.ops" in got["before"]
    assert got["names"] == {name: f"fastdist.{name}" for name in SUBMODULES}
    assert {f"fastdist.{name}" for name in SUBMODULES} <= set(got["after"])
    assert set(SUBMODULES) <= set(got["dir"]) and set(SUBMODULES) <= set(got["all"])
    assert got["bench"] is False  # the benchmark CLI is a program, imported by name


def test_an_unknown_attribute_of_fastdist_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="module 'fastdist' has no attribute 'commm'"):
        fastdist.commm  # noqa: B018
