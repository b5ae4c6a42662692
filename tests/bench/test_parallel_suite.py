"""fastdist-bench parallel: every pipeline peer (torch's Schedule1F1B with and without recompute, DeepSpeed's
pipeline engine with and without its checkpointing) runs beside fastdist's schedule on the same GPT and data, each
checked against the unpipelined model's loss; the balance and tp tables come out of the same run."""
import importlib.util
import json
import subprocess
import sys

import pytest

from fastdist.bench import cli, parallel

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed (a bench peer) is not installed")


def test_the_suite_is_registered_with_a_small_tour_entry():
    assert cli.SUITES["parallel"] == "fastdist.bench.parallel"
    argv = cli.TOUR["parallel"]
    assert argv[argv.index("--ranks") + 1] == "2"
    vocab, dim, _, layers, seq = (int(v) for v in argv[argv.index("--gpt") + 1].split(","))
    assert vocab * dim <= 4096 * 64 and layers <= 4 and int(argv[argv.index("--reps") + 1]) >= 5


def test_the_tp_part_runs_at_the_link_net_names_unless_tp_nets_does():
    import argparse

    p = argparse.ArgumentParser()
    parallel.add_arguments(p)
    assert parallel._tp_nets(p.parse_args([])) == ["loopback", "1gbit"]
    assert parallel._tp_nets(p.parse_args(["--net", "100mbit"])) == ["100mbit"]
    assert parallel._tp_nets(p.parse_args(["--net", "100mbit", "--tp-nets", "loopback"])) == ["loopback"]


def test_uniform_bounds_split_layers_as_deepspeeds_uniform_partition_does():
    for n, stages in [(10, 2), (11, 2), (10, 3), (3, 3), (17, 4)]:
        bounds = parallel.uniform_bounds(n, stages)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == stages + 1
        assert max(b - a for a, b in zip(bounds, bounds[1:])) - min(b - a for a, b in zip(bounds, bounds[1:])) <= 1
        if importlib.util.find_spec("deepspeed") is not None:
            from deepspeed.runtime.utils import partition_uniform
            assert bounds == list(partition_uniform(n, stages))


def test_the_pieces_of_the_gpt_compute_the_gpt():
    import torch

    lm = parallel.build_gpt((64, 16, 2, 3, 8), seed=0)
    x, _ = parallel.batch_for(0, {"gpt": (64, 16, 2, 3, 8), "batch": 2, "seed": 0})
    with torch.no_grad():
        want = lm(x)
        got = torch.nn.Sequential(*parallel.pieces(lm))(x)
    assert torch.equal(got, want)


def test_a_variant_whose_first_loss_is_off_stops_the_run_naming_it():
    rows = [{"variant": "torch-1f1b", "first_loss_error": 1e-7}, {"variant": "deepspeed", "first_loss_error": 0.1}]
    with pytest.raises(RuntimeError, match="deepspeed 1.00e-01"):
        parallel.check_losses(rows)
    parallel.check_losses(rows[:1])


@needs_deepspeed
def test_cli_runs_every_pipeline_peer_beside_fastdist_with_losses_checked_and_tables_written(tmp_path):
    out, png = tmp_path / "parallel.json", tmp_path / "parallel.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "parallel", "--net", "loopback", "--gpt", "256,16,2,2,8",
           "--batch", "4", "--microbatches", "2", "--reps", "1", "--warmup", "1", "--tp-block", "16,2,8,2",
           "--tp-nets", "loopback", "--parts", "pipeline,balance,tp", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vs torch 1F1B+recompute" in proc.stdout and "max/mean" in proc.stdout and "vs DTensor" in proc.stdout
    result = json.loads(out.read_text())
    assert result["suite"] == "parallel" and result["env"]["ranks"] == 2 and png.stat().st_size > 0
    rows = {r["variant"]: r for r in result["pipeline"]["rows"]}
    assert set(parallel.PEERS) <= set(rows)
    assert set(rows) == set(parallel.PEERS + parallel.OURS)
    for r in rows.values():
        # every row ran its steps, on the unpipelined model's loss first, with memory seen on both stages
        assert len(r["samples_ms"]) == 1 and r["time_ms"] > 0 and len(r["losses"]) == 2
        assert r["first_loss_error"] <= parallel.CHECK_TOLERANCE
        assert len(r["stage_peak_bytes"]) == 2 and len(r["stage_saved_bytes"]) == 2
    # the same model, data and microbatches: every engine's second loss agrees too
    second = [r["losses"][1] for r in rows.values()]
    assert max(second) - min(second) <= 1e-3 * max(second)
    assert [r["split"] for r in result["balance"]["rows"]] == ["uniform", "balanced"]
    assert all(r["max_over_mean"] >= 1 for r in result["balance"]["rows"])
    (tp_run,) = result["tp"]
    assert [r["variant"] for r in tp_run["rows"]][:len(parallel.TP_VARIANTS)] == parallel.TP_VARIANTS
    assert all(0 <= r["max_error"] <= 1e-4 for r in tp_run["rows"])
    assert {p.name for p in parallel.tables(result)} == {"pipeline", "balance", "tp-loopback"}


def test_the_cost_tables_show_each_measured_point_beside_its_prediction_and_the_sweep_per_depth():
    measured = {"rows": [{"variant": "torch-1f1b+ckpt", "time_ms": 100.0, "predicted_ms": 110.0, "error": 0.1,
                          "speedup": 1.0, "stage_saved_bytes": [2 ** 20, 2 ** 21], "fits_cap": True}],
                "cap_bytes": 3 * 2 ** 20, "r0": 0.5, "link": {"latency": 1e-4, "bandwidth": 1e9}}
    sweep = [{"pp": 4, "microbatches": 8, "schedule": schedule, "recompute": recompute, "step_time": t,
              "ideal": 1.0, "bubble_fraction": 0.25}
             for (schedule, recompute), t in zip(parallel.SWEEP_CONFIGS.values(), [2.0, 1.5, 2.5, 2.0, 1.8, 2.1])]
    result = {"config": {"reps": 5}, "cost": {"measured": measured, "sweep": sweep}}
    measured_part, sweep_part = parallel.tables(result)
    assert (measured_part.name, sweep_part.name) == ("cost-measured", "cost-sweep")
    assert "| 100.0 | 110.0 | 10.0 |" in measured_part.table and "1.0, 2.0" in measured_part.table
    (row,) = sweep_part.rows
    assert row["1f1b+full"] / row["scp+stage-aware"] == pytest.approx(2.5 / 1.8)
    assert "1.39x" in sweep_part.table and "| 4 | 8 | 2.00 | 1.50 |" in sweep_part.table


@pytest.mark.parametrize("flags, message", [
    (["--batch", "6", "--microbatches", "4"], "does not divide --batch"),
    (["--gpt", "64,16,3,2,8"], "does not divide dim"),
    (["--gpt", "64,16,2,1,8"], "cannot make 2 stages"),
    (["--microbatches", "1", "--batch", "4"], "needs --microbatches >= the stages"),
    (["--cap-fraction", "1.5"], "must be in \\[0, 1\\]"),
])
def test_a_configuration_the_pipeline_cannot_run_is_refused_before_any_rank_starts(flags, message, capsys):
    args = cli.build_parser().parse_args(["parallel", *flags])
    with pytest.raises(SystemExit, match=message):
        parallel.run(args)
