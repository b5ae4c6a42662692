"""fastdist-bench memory: every configuration runs in its own process and reports memory, time and plan."""
import argparse
import json
import subprocess
import sys

import pytest
from fastdist.bench import cli, memory


def parse(argv):
    p = argparse.ArgumentParser()
    memory.add_arguments(p)
    return p.parse_args(argv)


def test_the_suite_is_registered_with_a_tour_entry_at_a_50_percent_budget():
    assert cli.SUITES["memory"] == "fastdist.bench.memory"
    argv = cli.TOUR["memory"]
    assert argv[argv.index("--budgets") + 1] == "50"


def test_configurations_expand_budgets_and_reject_unknown_names():
    names = [c[0] for c in memory._configurations(parse(["--budgets", "70,30"]))]
    assert names == ["none", "checkpoint", "save_on_cpu", "swap", "fastdist-70", "fastdist-30"]
    with pytest.raises(ValueError, match="configuration"):
        memory._configurations(parse(["--configs", "none,offload"]))
    with pytest.raises(ValueError, match="budgets"):
        memory._configurations(parse(["--budgets", "0"]))


def test_cli_run_measures_every_configuration_in_its_own_process(tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "memory", "--models", "transformer", "--scale", "tiny",
           "--configs", "none,checkpoint,swap,fastdist", "--budgets", "50", "--steps", "2", "--warmup", "1",
           "--min-bytes", "4096", "--swap-dir", str(tmp_path), "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "shared machine" in proc.stdout and "# target:" in proc.stdout and "memory [" in proc.stderr
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
