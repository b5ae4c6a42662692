"""fastdist-bench compress: registered, every method runs, wire bytes as the compressors say."""
import json
import subprocess
import sys

from fastdist.bench import cli, compress


def test_the_suite_is_registered_with_a_small_tour_entry():
    assert cli.SUITES["compress"] == "fastdist.bench.compress"
    assert "compress" in cli.TOUR


def test_pipeline_run_has_every_method_and_each_compresses_its_boundaries(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "compress", "--ranks", "4", "--net", "loopback", "--batch", "2",
           "--seq", "64", "--hidden", "16", "--steps", "5", "--warmup", "2", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loopback" in proc.stdout and "step (ms)" in proc.stdout
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == set(compress.METHODS)
    dense = 2 * 64 * 16 * 4
    header = 1000  # a pickled header per message (kind, shape, dtype, layout) is well under this
    assert dense <= rows["none"]["fwd_wire_bytes"] <= dense + header
    assert rows["none"]["bwd_wire_bytes"] == rows["none"]["fwd_wire_bytes"]
    # TopK 10%: 103 of 1024 values per sample + a 128-byte bitmap; the gradient: those 103 values at 8 bits
    assert 2 * (103 * 4 + 128) <= rows["topk10+q8"]["fwd_wire_bytes"] <= 2 * (103 * 4 + 128) + header
    assert 2 * (103 + 8) <= rows["topk10+q8"]["bwd_wire_bytes"] <= 2 * (103 + 8) + header
    # 4-bit codes + a scale and zero point per sample (AQ-SGD adds 9 bytes of sample id and flag per sample)
    assert 2 * (512 + 8) <= rows["quant4"]["fwd_wire_bytes"] <= 2 * (512 + 8) + header
    assert rows["quant4"]["fwd_wire_bytes"] < rows["aqsgd4"]["fwd_wire_bytes"] < rows["quant4"]["fwd_wire_bytes"] \
        + 2 * 9 + header
    for r in rows.values():
        assert len(r["samples_ms"]) == 5 and r["time_ms"] > 0 and r["tx_bytes"] is None
    assert png.exists()
