"""fastdist-bench moe: every method in one run on the same routing, static drops and the others do not, the planners
balance the skew, and the projection is labelled as one."""
import json
import subprocess
import sys

import pytest

from fastdist.bench import cli, moe


def test_the_suite_is_registered_with_a_small_tour_entry():
    assert cli.SUITES["moe"] == "fastdist.bench.moe"
    argv = cli.TOUR["moe"]
    assert argv[argv.index("--ranks") + 1] == "2"


def test_popularity_is_zipf_heaviest_first_and_drifts_slowly():
    config = {"drift_every": 4, "zipf": 1.2}
    assert moe.popularity_order(8, 0, config) == list(range(8))
    assert moe.popularity_order(8, 3, config) == list(range(8))
    assert moe.popularity_order(8, 4, config) == [1, 0, 2, 3, 4, 5, 6, 7]
    col = moe.gate_column(8, 0, config)
    assert col[0] == 0 and all(col[i] > col[i + 1] for i in range(7))


def test_projection_is_computed_from_the_cost_model_for_every_rank_count():
    cost = {"d_model": 64, "d_ff": 256, "a2a_alpha_s": 1e-5, "a2a_bytes_per_s": 1e9, "flops_per_s": 1e10,
            "p2p_bytes_per_s": 1e9, "elem_bytes": 4, "nec_fwd_s": 0.0, "nec_bwd_s": 0.0}
    config = {"project": [8, 16], "experts_per_rank": 2, "zipf": 1.2, "seed": 0, "tokens": 256, "k": 2,
              "max_replicas": 2}
    rows = moe.projection(cost, config)
    assert [r["ranks"] for r in rows] == [8, 16]
    for r in rows:
        assert r["predicted_ms"]["prophet"] <= r["predicted_ms"]["dropless"]
        assert r["tokens_max_over_mean"]["prophet"] < r["tokens_max_over_mean"]["dropless"]
    # a projection to a device per rank, even from a run whose ranks shared cores
    assert moe.projection({**cost, "rank_hosts": [0, 0], "host_slots": [1]}, config) == rows


def test_cli_run_compares_every_method_and_the_padded_dropless_peer_on_the_same_routing(tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "moe", "--ranks", "2", "--tokens", "256", "--d-model", "128",
           "--d-ff", "512", "--steps", "2", "--warmup", "1", "--project", "8",
           "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Projection from the calibrated cost model (not measured)" in proc.stdout
    assert "# network" in proc.stdout
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == [*moe.METHODS, *moe.PEERS]
    assert rows["static"]["dropped"] > 0
    for name in ("dropless", "shadow", "topk-all", "prophet"):
        assert rows[name]["dropped"] == 0
        assert len(rows[name]["samples_ms"]) == 2 and rows[name]["time_ms"] > 0
    # Same routing for every method: the unbalanced figure is the same; the planners improve on it.
    unbalanced = {r["tokens_max_over_mean_unbalanced"] for n, r in rows.items() if n in moe.METHODS and n != "static"}
    assert len(unbalanced) == 1 and unbalanced.pop() >= 1.6
    assert rows["dropless"]["replicas"] == 0
    # Expert compute dominates at this size, so the planner replicates and balances better than dropless. (Not to the
    # 1.10 target here: on a loaded machine its check against measured step times may decline the replicas for one
    # of the 2 steps, and the median of 2 steps is their mean.)
    assert rows["prophet"]["replicas"] > 0
    assert rows["prophet"]["tokens_max_over_mean"] < rows["dropless"]["tokens_max_over_mean"]
    assert rows["prophet"]["predicted_ms"] < rows["dropless"]["predicted_ms"]
    assert all(0 <= rows[m]["model_error_of_medians"] for m in moe.METHODS)
    assert "# cost model: mean error" in proc.stdout
    assert png.stat().st_size > 0
    # The padded-capacity peer (Tutel's dropless mode) computed dropless's output before it was timed, routes the
    # same tokens, drops none, and computes padding: more expert rows than assignments under skew.
    peer = rows["tutel-padded"]
    assert 0 <= result["peer_check"]["tutel-padded"] <= moe.CHECK_TOLERANCE
    assert peer["tokens_max_over_mean_unbalanced"] == pytest.approx(rows["dropless"]["tokens_max_over_mean_unbalanced"])
    assert peer["dropped"] == 0 and len(peer["samples_ms"]) == 2 and peer["time_ms"] > 0
    assert peer["rows_computed_over_routed"] > 1.2 and rows["dropless"]["rows_computed_over_routed"] == 1
    assert peer["predicted_ms"] is None and "not Tutel's code" in proc.stdout
