"""fastdist-bench kernels: every op and sketch case runs, is checked against torch, and is set against a copy timed
in the same rounds."""
import json
import statistics
import subprocess
import sys

from fastdist.bench import cli, kernels


def test_the_suite_is_registered():
    assert cli.SUITES["kernels"] == "fastdist.bench.kernels"


def test_every_case_reports_its_share_of_the_copy_timed_in_its_own_rounds(tmp_path):
    out, png = tmp_path / "k.json", tmp_path / "k.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "kernels", "--sizes", "64K", "--repeats", "5",
           "--sketch-shape", "2048x256", "--sketch-element-shape", "256x256", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "% of copy" in proc.stdout and "count_sketch" in proc.stdout
    result = json.loads(out.read_text())
    assert [r["op"] for r in result["rows"]] == kernels.SWEEP_OPS
    per_op = len(kernels.SKETCH_DENSITIES) + 1  # the row densities and one element case
    assert [r["op"] for r in result["sketch_rows"]] == [op for op in kernels.SKETCH_OPS for _ in range(per_op)]
    copy_bytes = result["copy_bytes"] * 2
    for r in result["rows"] + result["sketch_rows"]:
        assert len(r["samples_s"]) == len(r["torch_samples_s"]) == len(r["copy_samples_s"]) == 5
        ratios = [r["bytes"] * c / (copy_bytes * o) for o, c in zip(r["samples_s"], r["copy_samples_s"])]
        assert abs(r["pct_copy"] - 100 * statistics.median(ratios)) < 1e-9 * max(r["pct_copy"], 1)
        assert r["gbps"] > 0 and r["speedup"] > 0
    all_copies = [c for r in result["rows"] + result["sketch_rows"] for c in r["copy_samples_s"]]
    assert result["copy_gbps"] == copy_bytes / statistics.median(all_copies) / 1e9
    assert png.exists()
