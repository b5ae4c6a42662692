"""fastdist-bench tp: every row-op chunk count and every block variant in one run, predictions beside
measurements, registered with a small tour entry."""
import json
import subprocess
import sys

import pytest

from fastdist.bench import cli, tp


def test_the_suite_is_registered_with_a_small_tour_entry():
    assert cli.SUITES["tp"] == "fastdist.bench.tp"
    argv = cli.TOUR["tp"]
    assert argv[argv.index("--ranks") + 1] == "2"
    m, k, n = (int(v) for v in argv[argv.index("--op-shape") + 1].split(","))
    assert m * k * n <= 512 ** 3


def test_the_network_defaults_to_auto_and_takes_auto_loopback_or_a_rate_but_nothing_else():
    parser = cli.build_parser()
    assert parser.parse_args(["tp"]).net == "auto"
    assert parser.parse_args(["tp", *cli.TOUR["tp"]]).net == "auto"
    for net in ("auto", "loopback", "1gbit"):
        assert parser.parse_args(["tp", "--net", net]).net == net
    with pytest.raises(SystemExit):
        parser.parse_args(["tp", "--net", "fast"])


def test_balanced_rates_are_positive_and_scale_with_the_bytes_moved():
    world = 2
    ring_share = 2 * (world - 1) / world  # of its bytes, what a ring all-reduce sends from each rank
    m, k, n = 256, 256, 128
    rate, gemm_s = tp.balanced_rate("op", (m, k, n), world)
    assert rate > 0 and gemm_s > 0
    # the bits of the all-reduce of the row op's float32 [M, N] output, in the GEMM's time
    assert rate * gemm_s == pytest.approx(8 * ring_share * m * n * 4)
    hidden, heads, seq, batch = 32, 2, 8, 2
    rate, compute_s = tp.balanced_rate("block", (hidden, heads, seq, batch), world)
    assert rate > 0 and compute_s > 0
    # the bits of a step's 4 all-reduces of the float32 [batch * seq, hidden] activation, in the compute's time
    assert rate * compute_s == pytest.approx(8 * 4 * ring_share * batch * seq * hidden * 4)


def test_cli_run_times_every_variant_beside_torch_dtensor_tp_after_checking_outputs_against_unsharded(tmp_path):
    out, png = tmp_path / "tp.json", tmp_path / "tp.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "tp", "--net", "loopback", "--op-shape", "64,64,32",
           "--block", "32,2,8,2", "--mlp", "16,32,64", "--reps", "2", "--op-reps", "2", "--warmup", "0",
           "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loopback" in proc.stdout and "model error (%)" in proc.stdout and "vs DTensor" in proc.stdout
    assert "unwaited collective" not in proc.stderr  # DTensor's results are waited for inside the timed call
    result = json.loads(out.read_text())
    assert result["env"]["ranks"] == 2 and png.stat().st_size > 0
    runs = {r["part"]: r for r in result["runs"]}
    assert list(runs) == tp.PARTS
    op_rows = runs["op"]["op_rows"]
    assert [r["k"] for r in op_rows] == ["1", "2", "4", "8", "auto", tp.OP_PEER]
    for r in op_rows:
        assert len(r["samples_ms"]) == 2 and r["time_ms"] > 0
    assert all(r["predicted_ms"] > 0 for r in op_rows[:-1]) and op_rows[-1]["predicted_ms"] is None
    assert op_rows[4]["chunks"] in (1, 2, 4, 8)
    assert [r["variant"] for r in runs["mlp"]["mlp_rows"]] == tp.MLP_VARIANTS
    assert [r["variant"] for r in runs["block"]["block_rows"]] == tp.BLOCK_VARIANTS
    assert "dtensor" in tp.MLP_VARIANTS and {"dtensor", "dtensor+recompute"} <= set(tp.BLOCK_VARIANTS)
    for r in runs["mlp"]["mlp_rows"] + runs["block"]["block_rows"]:
        assert r["time_ms"] > 0 and len(r["samples_ms"]) == 2
    # Every variant, DTensor's included, computed the unsharded module's output (and input gradient) first.
    for r in op_rows + runs["mlp"]["mlp_rows"] + runs["block"]["block_rows"]:
        assert 0 <= r["max_error"] <= tp.CHECK_TOLERANCE


def test_gemm_check_times_one_gemm_and_its_2_4_8_chunk_splits():
    result = tp.chunked_gemm_cost((64, 32, 16), reps=2, warmup=1, device="cpu")
    assert [r["k"] for r in result["rows"]] == [1, 2, 4, 8]
    assert result["rows"][0]["overhead_pct"] == 0
    assert all(r["time_ms"] > 0 and len(r["samples_ms"]) == 2 for r in result["rows"])
