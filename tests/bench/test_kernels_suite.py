"""fastdist-bench kernels: every op family runs, agrees with its torch path, and is set against a copy timed in the
same rounds; --ops and --family take only known names."""
import argparse
import json
import math
import statistics
import subprocess
import sys

import pytest
import torch

from fastdist.bench import cli, kernels

QUICK = ["--quick", "--sizes", "64K", "--sketch-shape", "2048x256", "--sketch-element-shape", "256x256",
         "--shape", "16x4096", "--layout-size", "4096"]


def _args(argv):
    parser = argparse.ArgumentParser(prog="fastdist-bench kernels")
    kernels.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_suite_is_registered_and_covers_what_compress_kernels_did():
    assert cli.SUITES["kernels"] == "fastdist.bench.kernels"
    assert "compress-kernels" not in cli.SUITES and "compress-kernels" not in cli.TOUR
    assert "--quick" in cli.TOUR["kernels"]
    assert set(kernels.FAMILIES) == {"bitpack", "sketch", "topk", "quantize", "moe", "epilogue"}
    assert {"topk_compress", "topk_decompress", "quantize", "dequantize", "moe_layout", "bias_epilogue"} \
        <= set(kernels.OPS)


@pytest.mark.parametrize("family", list(kernels.FAMILIES))
def test_every_case_of_a_family_agrees_with_its_torch_path(family):
    inputs = kernels.inputs_from(_args(QUICK))
    for op in kernels.FAMILIES[family]:
        cases = list(kernels.CASES[family](op, inputs, "cpu"))
        assert cases, op
        for case in cases:
            assert case.op == op and case.nbytes > 0
            assert case.agree(case.ours(), case.theirs()), f"{op} {case.label}"


def test_a_wrong_torch_path_is_caught_for_moe_layout_and_bias_epilogue(monkeypatch):
    monkeypatch.setattr(kernels, "torch_moe_layout", lambda ids, e: (torch.zeros(e, dtype=torch.long),) * 4)
    with pytest.raises(RuntimeError, match="moe_layout and its torch path disagree"):
        kernels.run(_args(QUICK + ["--family", "moe"]))
    monkeypatch.setitem(kernels.ACTIVATIONS, "gelu_tanh", torch.relu)
    with pytest.raises(RuntimeError, match="bias_epilogue and its torch path disagree on 16x4096 gelu_tanh"):
        kernels.run(_args(QUICK + ["--ops", "bias_epilogue"]))


@pytest.mark.parametrize("flag, value, unknown", [("--ops", "pack_bits,pack_bit", "pack_bit"),
                                                  ("--family", "topk,bitpak", "bitpak")])
def test_unknown_ops_and_families_are_rejected_with_the_known_names(capsys, flag, value, unknown):
    with pytest.raises(SystemExit):
        _args([flag, value])
    err = capsys.readouterr().err
    known = kernels.OPS if flag == "--ops" else list(kernels.FAMILIES)
    assert f"unknown item '{unknown}'" in err and ", ".join(known) in err


def test_ops_outside_the_chosen_families_select_nothing_and_say_so():
    with pytest.raises(SystemExit, match="none of --ops pack_bits is in --family topk"):
        kernels.run(_args(["--family", "topk", "--ops", "pack_bits"]))


def test_every_family_reports_its_share_of_the_copy_timed_in_its_own_rounds(tmp_path):
    out, png = tmp_path / "k.json", tmp_path / "k.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "kernels", *QUICK, "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "of copy (%)" in proc.stdout and "vs torch" in proc.stdout
    result = json.loads(out.read_text())
    cases_per_op = {"bitpack": 1, "sketch": 2, "topk": 1, "quantize": len(kernels.QUANTIZE_BITS), "moe": 1,
                    "epilogue": len(kernels.ACTIVATIONS)}  # sketch: one row density (--quick) and one element case
    assert [r["op"] for r in result["rows"]] == [op for op in kernels.OPS
                                                 for _ in range(cases_per_op[kernels.FAMILY_OF[op]])]
    rows = {(r["op"], r["case"]): r for r in result["rows"]}
    assert rows["topk_compress", f"16x4096 k={math.ceil(0.1 * 4096)}"]["k"] == math.ceil(0.1 * 4096)
    assert rows["moe_layout", "4096 assignments, 64 experts"]["bytes"] == 33 * 4096 + 16 * 64
    assert rows["bias_epilogue", "16x4096 gelu_erf +bias +residual"]["bytes"] == 12 * 16 * 4096 + 4 * 4096
    copy_bytes = result["copy_bytes"] * 2
    for r in result["rows"]:
        assert len(r["samples_s"]) == len(r["torch_samples_s"]) == len(r["copy_samples_s"]) == 5
        ratios = [r["bytes"] * c / (copy_bytes * o) for o, c in zip(r["samples_s"], r["copy_samples_s"])]
        assert abs(r["pct_copy"] - 100 * statistics.median(ratios)) < 1e-9 * max(r["pct_copy"], 1)
        assert r["speedup"] == statistics.median(r["torch_samples_s"]) / statistics.median(r["samples_s"])
        assert r["gbps"] > 0
    all_copies = [c for r in result["rows"] for c in r["copy_samples_s"]]
    assert result["copy_gbps"] == copy_bytes / statistics.median(all_copies) / 1e9
    assert png.exists()
