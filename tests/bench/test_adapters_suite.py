"""fastdist-bench adapters: the kernel table sets qlinear against dequantize+matmul, the float32 matmul and
bitsandbytes in the same rounds; the fine-tuning comparison runs every method on the same data and records them all."""
import argparse
import json
import subprocess
import sys

import pytest

from fastdist.bench import adapters, cli


def _args(argv):
    parser = argparse.ArgumentParser(prog="fastdist-bench adapters")
    adapters.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_suite_is_registered_with_a_small_tour_entry():
    assert cli.SUITES["adapters"] == "fastdist.bench.adapters"
    assert "--shape" in cli.TOUR["adapters"]


def test_cli_run_times_every_alternative_with_raw_samples(tmp_path):
    pytest.importorskip("bitsandbytes")
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    subprocess.run([sys.executable, "-m", "fastdist.bench", "--json", str(out), "--plot", str(png), "adapters",
                    "--shape", "64x128", "--tokens", "1,40", "--repeats", "5", "--warmup", "1"], check=True,
                   capture_output=True, text=True, timeout=240)
    result = json.loads(out.read_text())
    rows = result["kernels"]
    assert [(r["scheme"], r["tokens"]) for r in rows] == [("nf4", 1), ("nf4", 40), ("int4", 1), ("int4", 40)]
    for r in rows:
        names = {"qlinear", "dequant+matmul", "fp32 matmul"} | ({"bnb Linear4bit"} if r["scheme"] == "nf4" else set())
        assert set(r["samples_s"]) == names and all(len(s) == 5 for s in r["samples_s"].values())
        assert r["weight_bytes"] == 64 * 64 + 4 * 64 * 2 * (2 if r["scheme"] == "int4" else 1)
    assert png.stat().st_size > 0
    assert "qlinear" in adapters.tables(result)[0].markdown()


def test_finetune_runs_every_method_with_the_same_budget_and_learning_rate_grid():
    pytest.importorskip("transformers")
    args = _args(["--finetune", "--pretrain-steps", "2", "--steps", "2", "--seeds", "0,1", "--hidden", "64",
                  "--seq", "32", "--methods", "lora-float,qlora,qalora,qbara,qahira", "--lrs", "0.001,0.01"])
    result = adapters.finetune(args)
    summary = {r["method"]: r for r in result["summary"]}
    # every method ran at every rate of the grid, and reports the rate of its lowest mean validation loss
    assert sorted((r["method"], r["lr"]) for r in result["grid"]) == sorted(
        (m, lr) for m in summary for lr in (0.001, 0.01))
    for method, entry in summary.items():
        rates = {r["lr"]: r["val_loss"] for r in result["grid"] if r["method"] == method}
        assert entry["lr"] == min(rates, key=rates.get)
        assert entry["val_loss"] == rates[entry["lr"]]
    assert [p.name for p in adapters.finetune_tables(result)] == ["finetune", "grid", "bases"]
    assert set(summary) == {"lora-float", "qlora", "qalora", "qbara", "qahira"}
    assert all("error" not in r and r["seeds"] == 2 for r in summary.values())
    lora = summary["lora-float"]["trainable"]
    assert summary["qbara"]["trainable"] == summary["qahira"]["trainable"] == summary["qlora"]["trainable"] == lora
    assert summary["qalora"]["trainable"] <= lora
    assert "merged_loss" in summary["qahira"] and len(result["runs"][0]["curve"]) == 2
    # step times are taken method after method on each batch, and compared with LoRA on the float base seed by seed
    assert all(len(r["step_samples_s"]) == len(r["step_cpu_samples_s"]) == 2 for r in result["runs"])
    assert summary["lora-float"]["step_vs_lora_float"] == 1.0 and summary["qahira"]["step_vs_lora_float"] > 0
    assert adapters.finetune_tables(result)[0].rows
