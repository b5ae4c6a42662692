"""fastdist-bench memory: every configuration runs in its own process and reports memory, time and plan."""
import argparse
import json
import subprocess
import sys

import pytest
from fastdist.bench import cli, memory
from fastdist.testing import models


def parse(argv):
    p = argparse.ArgumentParser()
    memory.add_arguments(p)
    return p.parse_args(argv)


def test_the_suite_is_registered_with_a_tour_entry_at_a_50_percent_budget():
    assert cli.SUITES["memory"] == "fastdist.bench.memory"
    argv = cli.TOUR["memory"]
    assert argv[argv.index("--budgets") + 1] == "50"


def test_configurations_expand_budgets_and_reject_unknown_names(capsys):
    names = [c[0] for c in memory._configurations(parse(["--budgets", "70,30"]))]
    assert names == ["none", "checkpoint", "save_on_cpu", "swap", "fastdist-70", "fastdist-30"]
    for flag, bad, why in [("--configs", "none,offload", "unknown item 'offload'"),
                           ("--budgets", "0", "not in (0, 100]"), ("--models", "vit", "unknown item 'vit'")]:
        with pytest.raises(SystemExit):
            parse([flag, bad])
        assert why in capsys.readouterr().err


def test_cli_run_measures_every_configuration_in_its_own_process(tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "memory", "--models", "transformer", "--scale", "tiny",
           "--configs", "none,checkpoint,swap,fastdist", "--budgets", "50", "--steps", "2", "--warmup", "1",
           "--min-bytes", "4096", "--swap-dir", str(tmp_path), "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# target:" in proc.stdout and "memory: 100%" in proc.stderr
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"none", "checkpoint", "swap", "fastdist-50"}
    for r in rows.values():
        assert len(r["samples_ms"]) == 2 and r["step_ms"] > 0 and r["peak_bytes"] > r["base_bytes"] > 0
    assert rows["none"]["overhead"] == 0
    # recomputing every block keeps only the blocks' inputs: measurably less than keeping everything
    assert rows["checkpoint"]["activation_peak_bytes"] < rows["none"]["activation_peak_bytes"]
    swap = rows["swap"]["prefetcher"]
    assert swap["bytes_swapped"] > 0 and swap["bytes_read"] > 0 and rows["swap"]["hidden_fraction"] is not None
    plan = rows["fastdist-50"]["plan"]
    assert plan["budget_bytes"] == int(0.5 * plan["unoptimized_saved_bytes"])
    assert set(plan["actions"]) == {"blocks.0", "blocks.1", "blocks.2"}
    assert not plan["fits"] or plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    assert png.stat().st_size > 0


@pytest.mark.parametrize("limit", [1, 7, 64, 100])
@pytest.mark.parametrize("largest", [0, 1, 5, 64, 99, 1000])
def test_the_batch_search_finds_the_largest_fitting_batch_within_the_limit(largest, limit):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= largest

    assert memory.largest_batch(fits, limit) == min(largest, limit)
    assert max(tried) <= limit + 1 and len(tried) <= 2 * limit.bit_length() + 2


def test_resnet50_has_sixteen_bottleneck_segments_and_the_right_parameter_count():
    import fastdist.memory as fm

    net = models.ResNet50()
    assert len(fm.default_segments(net)) == 16
    assert sum(p.numel() for p in net.parameters()) == 25_557_032  # torchvision's resnet50


def test_a_memory_cap_needs_cuda():
    with pytest.raises(ValueError, match="cuda"):
        memory.run(parse(["--memory-cap", "10"]))


def test_rounds_pool_step_samples_and_take_the_median_memory():
    def result(samples, peak):
        return {"model": "cnn", "config": "none", "samples_ms": samples, "step_ms": samples[0], "batch": 4,
                "activation_peak_bytes": peak, "peak_bytes": peak + 10, "base_bytes": 10, "samples_per_s": 1.0}

    row = memory._merge_rounds([result([1.0, 2.0], 100), result([3.0, 9.0], 300), result([4.0, 5.0], 200)])
    assert row["samples_ms"] == [1.0, 2.0, 3.0, 9.0, 4.0, 5.0] and row["step_ms"] == 3.5
    assert row["activation_peak_bytes"] == 200 and len(row["rounds"]) == 3
