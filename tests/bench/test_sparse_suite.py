"""fastdist-bench sparse: every method and density in one run, lossless exact, lossy not, columns consistent."""
import argparse
import json
import subprocess
import sys

import pytest

from fastdist.bench import cli, sparse


def _args(*argv):
    p = argparse.ArgumentParser()
    sparse.add_arguments(p)
    return p.parse_args(list(argv))


def test_shape_and_densities_are_parsed_and_bad_values_are_usage_errors(capsys):
    config = sparse._config_from(_args("--shape", "32768x1024", "--densities", "0.5,2,10"))
    assert (config["rows"], config["dim"], config["densities"]) == (32768, 1024, [0.005, 0.02, 0.1])
    for flag, bad, why in [("--shape", "32768", "2 dimensions"), ("--shape", "0x4", ">= 1"),
                           ("--shape", "ax2", "positive integers"), ("--densities", "0", "not in (0, 100]"),
                           ("--densities", "150", "not in (0, 100]"), ("--densities", "", "at least one"),
                           ("--methods", "dense,sketchy", "unknown item 'sketchy'")]:
        with pytest.raises(SystemExit):
            _args(flag, bad)
        assert why in capsys.readouterr().err


def test_the_suite_is_registered_with_a_small_tour_entry():
    assert cli.SUITES["sparse"] == "fastdist.bench.sparse"
    argv = cli.TOUR["sparse"]
    assert argv[argv.index("--ranks") + 1] == "2" and argv[argv.index("--densities") + 1] == "2"
    config = sparse._config_from(_args(*argv))
    assert config["rows"] * config["dim"] * 4 <= 16 << 20


def test_cli_run_has_every_method_and_density_exact_lossless_lossy_sketches_and_consistent_speedups(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "sparse", "--ranks", "2", "--shape", "512x32",
           "--densities", "2,10", "--reps", "5", "--warmup", "1", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# network" in proc.stdout and "loopback" in proc.stdout and "rel. error" in proc.stdout
    assert "lossless methods (dense, agsparse, omnireduce) exact: yes" in proc.stdout
    assert "sparse: 100%" in proc.stderr  # the progress bar's last line
    result = json.loads(out.read_text())
    assert result["env"]["ranks"] == 2
    rows = result["rows"]
    assert {(r["method"], r["density"]) for r in rows} == {(m, d) for m in sparse.METHODS for d in (0.02, 0.1)}
    for g in result["gradients"]:
        assert g["local_rows"] == round(g["density"] * 512)
        assert g["local_rows"] < g["union_rows"] <= 2 * g["local_rows"]
        assert g["sketch_shape"] == [3, -(-g["union_values"] // 6)]  # 3 x cols = 0.5 x union values
    for r in rows:
        assert len(r["samples_ms"]) == len(r["error_samples"]) == 5
        assert r["time_ms"] > 0 and r["algbw"] > 0 and r["wire_bytes"] > 0
        assert r["tx_bytes"] is None  # loopback: no interface counters
        if r["method"] in ("dense", "agsparse", "omnireduce"):
            assert r["rel_error"] == 0, r
        elif r["method"] in ("sketch", "powersgd", "fp16"):
            assert 0 < r["rel_error"] < (1 if r["method"] == "powersgd" else 0.01 if r["method"] == "fp16" else 10), r
        elif r["method"] == "topk":  # lossy unless k covers every non-zero of the rank
            g = next(g for g in result["gradients"] if g["density"] == r["density"])
            assert (r["rel_error"] > 0) == (r["topk_k"] < g["local_rows"] * 32), r
        if r["method"] == "auto":  # what it ran after its exploration calls, which were timed apart
            assert r["explore_ms"] > 0 and r["ran"]
            if all(ran.startswith("exact/") for ran in r["ran"]):
                assert r["rel_error"] == 0
        else:
            assert r["explore_ms"] is None
        dense = next(d for d in rows if d["method"] == "dense" and d["density"] == r["density"])
        assert r["speedup"] == pytest.approx(dense["time_ms"] / r["time_ms"])
        assert r["algbw"] == pytest.approx(r["size"] / (r["time_ms"] / 1e3) / 1e9)
        if r["method"] == "sketch":
            topk = next(t for t in rows if t["method"] == "topk" and t["density"] == r["density"])
            # topk's all-gather is sized to the sketch table's all-reduce: 2 ranks send r*c*4 bytes for it
            assert topk["wire_bytes"] <= 3 * r["sketch_shape"][1] * 4
    assert png.stat().st_size > 10_000


def test_part_ddp_times_every_hook_against_ddp_sparse_from_the_same_weights(tmp_path):
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "--json", str(out), "--plot", str(png), "sparse", "--parts", "ddp",
           "--ranks", "2", "--ddp-table", "2048x16", "--reps", "5", "--warmup", "2"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "time / ddp-sparse" in proc.stdout and "lossless methods" not in proc.stdout  # no collectives part
    result = json.loads(out.read_text())
    assert result["rows"] == [] and len(result["load_average"]) == 3
    rows = {r["method"]: r for r in result["ddp_rows"]}
    assert list(rows) == sparse.DDP_METHODS
    for name, r in rows.items():
        assert len(r["samples_ms"]) == 5 and r["time_ms"] > 0
        assert r["ratio"] == pytest.approx(r["time_ms"] / rows["ddp-sparse"]["time_ms"])
        assert r["param_diff"] == 0, name  # every hook here is lossless: DDP-sparse's weights, bit for bit
    assert set(rows["auto"]["methods"]) == {"exact", "hook"}  # the head through the dense hook
    assert set(rows["auto-nodh"]["methods"]) == {"exact", "dense"}  # the head through the bitmap path
    assert png.stat().st_size > 5_000
