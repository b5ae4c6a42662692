"""fastdist-bench collectives: every result is checked, the numbers are real, the outputs are complete."""
import argparse
import json
import subprocess
import sys

import pytest
import torch

from fastdist import netsim
from fastdist.bench import collectives
from fastdist.distributed import spawn


def _args(*argv):
    p = argparse.ArgumentParser()
    collectives.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_size_sweep_reads_binary_suffixes_and_rejects_a_bad_sweep():
    assert collectives.sizes_from(_args("--min-size", "1KiB", "--max-size", "64K")) == [1024, 4096, 16384, 65536]
    assert _args().max_size == 64 << 20 and _args("--min-size", "4096").min_size == 4096
    with pytest.raises(ValueError, match="bad size sweep"):
        collectives.sizes_from(_args("--min-size", "128K", "--max-size", "64K"))


def test_unknown_collectives_are_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _args("--ops", "all_reduce,allreduce")
    assert "unknown item 'allreduce'" in capsys.readouterr().err


def _cases_pass_and_corruption_is_counted(dtype_name):
    dtype = collectives.DTYPES[dtype_name]
    counts = {}
    for name in collectives.COLLECTIVES:
        case = collectives.Case(name, 4100, dtype, torch.device("cpu"))
        case.reset()
        case.call()
        clean = case.wrong()
        case.reset()
        case.call()
        case.buf.view(-1)[:: max(1, case.buf.numel() // 5)] += 1  # corrupt a few elements on every rank
        counts[name] = (clean, case.wrong())
    return counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_collective_result_checks_exactly_and_a_corrupted_result_is_counted_wrong(dtype):
    for rank_counts in spawn(_cases_pass_and_corruption_is_counted, 3, dtype, timeout=120):
        for name, (clean, corrupted) in rank_counts.items():
            assert clean == 0, name
            assert corrupted >= 1, name


def _bench(*args, env=None):
    cmd = [sys.executable, "-m", "fastdist.bench", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_cli_sweep_prints_the_environment_and_table_and_writes_json_with_raw_samples_and_a_plot(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    proc = _bench("collectives", "--ranks", "2", "--max-size", "16K", "--min-time", "0.02",
                  "--json", str(out), "--plot", str(png))
    assert "# network" in proc.stdout and "loopback" in proc.stdout
    assert "busbw (GB/s)" in proc.stdout and "all correct" in proc.stdout
    result = json.loads(out.read_text())
    assert result["env"]["ranks"] == 2 and result["env"]["backend"] == "gloo"
    names = {r["collective"] for r in result["rows"]}
    assert names == set(collectives.COLLECTIVES)
    for row in result["rows"]:
        assert row["wrong"] == 0
        assert len(row["samples_us"]) == row["reps"] >= 5
        assert row["time_us"] > 0 and row["busbw"] > 0
    assert png.stat().st_size > 10_000


def test_the_same_benchmark_runs_unchanged_under_torchrun(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fastdist.bench", "collectives", "--max-size", "4K", "--ops", "all_reduce,all_to_all_uneven",
           "--min-time", "0.01", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["env"]["ranks"] == 2 and "torchrun" in result["env"]["network"]
    assert all(r["wrong"] == 0 for r in result["rows"])


@pytest.mark.netsim
@pytest.mark.timing
def test_large_all_reduce_on_a_shaped_1gbit_network_runs_at_the_link_rate(tmp_path):
    out = tmp_path / "n.json"
    _bench("collectives", "--ranks", "4", "--net", "1gbit", "--ops", "all_reduce", "--min-size", "64M",
           "--max-size", "64M", "--iters", "3", "--warmup", "1", "--json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["wrong"] == 0
    assert 0.8 * 0.125 <= row["busbw"] <= 1.2 * 0.125, row["busbw"]
    # the rank's own interface really carried the ring's traffic (headers add a few %)
    assert row["wire_bytes"] <= row["tx_bytes"] <= 1.15 * row["wire_bytes"]
    # the benchmark's processes have exited: any namespace they left is now a dead process's leftover
    assert not netsim.cleanup(only_dead=True), "the benchmark left namespaces behind"
