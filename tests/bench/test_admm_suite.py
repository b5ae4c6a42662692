"""fastdist-bench admm: ADMMiRNN and every SGD-family baseline train the same RNN from the same initialisation, each
tuned over a grid of the same size by training loss alone; the stability sweep and the cost ratio are recorded."""
import argparse
import json
import math
import os

import pytest
import torch
from fastdist.admm import ADMMiRNN
from fastdist.bench import admm, cli, report, results


def parse(argv):
    p = argparse.ArgumentParser()
    admm.add_arguments(p)
    return p.parse_args(argv)


def test_the_suite_is_registered_with_a_tour_entry():
    assert cli.SUITES["admm"] == "fastdist.bench.admm"
    assert "--tasks" in cli.TOUR["admm"]
    parse(cli.TOUR["admm"])


def test_every_method_gets_a_grid_of_the_same_size():
    args = parse(["--grid", "2"])
    assert {len(admm._grid(m, args)) for m in admm.METHODS} == {2}
    assert {len(g) for g in admm.LR_GRID.values()} == {len(admm.RHO_GRID)}


def test_the_five_value_grid_brackets_the_three_value_grid_for_every_method():
    three, five = parse(["--grid", "3"]), parse(["--grid", "5"])
    for m in admm.METHODS:
        small, wide = admm._grid(m, three), admm._grid(m, five)
        assert wide[:3] == small  # --grid 3 is the grid of the earlier recordings
        assert min(wide) < min(small) and max(wide) > max(small)


def test_a_grid_larger_than_the_grids_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--grid", str(len(admm.RHO_GRID) + 1)])
    assert "is not in (0, 5]" in capsys.readouterr().err


def test_cost_only_times_the_sweep_against_one_bptt_step_without_training(tmp_path):
    result = admm.run(parse(["--cost-only", "--tasks", "digits-rows,text", "--hidden", "4", "--reps", "2"]))
    assert "tuned" not in result and [c["task"] for c in result["cost"]] == ["digits-rows", "text"]
    for c in result["cost"]:
        assert len(c["samples"]["admm"]) == len(c["samples"]["sgd"]) == 2
        assert c["ratio"] == pytest.approx(c["admm_s"] / c["sgd_s"])
    assert result["env"]["load_average"]  # a timing under other work says so
    assert [p.name for p in admm.tables(result)] == ["cost"]
    admm.plot(result, str(tmp_path / "cost.png"))
    assert (tmp_path / "cost.png").stat().st_size > 0


def test_bad_flags_are_refused(capsys):
    for flag, bad, why in [("--methods", "admm,lbfgs", "unknown item 'lbfgs'"), ("--tasks", "mnist", "unknown item"),
                           ("--epochs", "0", "below 1")]:
        with pytest.raises(SystemExit):
            parse([flag, bad])
        assert why in capsys.readouterr().err


def test_tasks_have_the_documented_shapes_and_no_download():
    rows = admm.load_task("digits-rows")
    assert rows["x_train"].shape[1:] == (8, 8) and rows["classes"] == 10
    assert len(rows["y_train"]) + len(rows["y_test"]) == 1797
    assert admm.load_task("digits-pixels")["x_train"].shape[1:] == (64, 1)
    text, again = admm.load_task("text"), admm.load_task("text")
    assert torch.equal(text["x_train"], again["x_train"])  # seeded
    assert text["x_train"].shape[1:] == (20, 8) and set(text["y_train"].tolist()) == {0, 1, 2, 3}


def test_baselines_start_from_admms_initial_network():
    task = admm.load_task("digits-rows")
    net = ADMMiRNN(8, 6, 10, 8, init_scale=0.5, seed=3).model()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(net(task["x_train"]), task["y_train"])
    out = admm.run_baseline(task, 6, 1, "sgd", 0.0, 64, scale=0.5, seed=3)  # lr 0: the loss stays the initial one
    assert out["curve"]["loss"][0] == pytest.approx(float(want), rel=1e-6)
    assert out["grad_ratio"]["first"] > 0 and out["grad_ratio"]["last"] > 0


def test_a_small_run_records_tuned_curves_stability_and_cost(tmp_path):
    args = parse(["--tasks", "digits-rows", "--methods", "admm,sgd+clip", "--epochs", "2", "--grid", "2",
                  "--hidden", "4", "--scales", "1", "--stability-epochs", "1", "--stability-tasks", "digits-rows",
                  "--reps", "1"])
    result = admm.run(args)
    for tuned in result["tuned"]:
        mine = [r for r in result["runs"] if r["method"] == tuned["method"]]
        assert len(mine) == 2 and tuned["final_loss"] == min(r["final_loss"] for r in mine)  # chosen by train loss
        assert len(tuned["curve"]["loss"]) == 2 and len(tuned["curve"]["time_s"]) == 2
    assert {r["method"] for r in result["stability"]} == {"admm", "sgd+clip"}
    assert set(result["summary"]["converged_fraction"]) == {"admm", "sgd+clip"}
    (cost,) = result["cost"]
    assert cost["ratio"] == pytest.approx(cost["admm_s"] / cost["sgd_s"]) and len(cost["samples"]["admm"]) == 1
    path = tmp_path / "admm.json"
    report.write_json(str(path), result)
    parts = results.tables_of(json.loads(path.read_text()))
    assert [p.name for p in parts] == ["tuned", "stability", "cost"]
    assert "admm" in parts[0].table and not math.isnan(result["summary"]["accuracy_gap"]["digits-rows"]["gap"])
    admm.plot(result, str(tmp_path / "admm.png"))
    assert (tmp_path / "admm.png").stat().st_size > 0


def test_the_adding_problem_marks_one_value_in_each_half_and_asks_for_their_sum():
    x, y = admm.adding_problem(50, 20, seed=1)
    assert x.shape == (50, 20, 2) and y.shape == (50,)
    marks = x[..., 1]
    assert torch.equal(marks[:, :10].sum(1), torch.ones(50)) and torch.equal(marks[:, 10:].sum(1), torch.ones(50))
    torch.testing.assert_close(y, (x[..., 0] * marks).sum(1))
    task = admm.load_task("adding-100", adding_samples=40)
    assert task["x_train"].shape == (32, 100, 2) and task["loss"] == "mse" and task["classes"] == 1
    assert admm._prior_loss(task["y_train"], 1) == pytest.approx(0.5 * float(task["y_train"].var(unbiased=False)))


def test_digits_28_are_the_digits_upscaled_to_mnists_shape():
    task = admm.load_task("digits-28")
    assert task["x_train"].shape[1:] == (28, 28) and task["classes"] == 10
    assert float(task["x_train"].min()) >= 0 and float(task["x_train"].max()) <= 1


def test_a_seeded_mini_batch_run_on_the_adding_problem_reports_every_seed_of_every_method():
    args = parse(["--tasks", "adding-50", "--methods", "admm,admm-mb,adam+clip", "--epochs", "1", "--grid", "1",
                  "--hidden", "4", "--seeds", "2", "--adding-samples", "40", "--stability-tasks", "none",
                  "--reps", "1"])
    result = admm.run(args)
    assert result["stability"] == [] and {r["seed"] for r in result["seed_runs"]} == {1}
    rows = {r["method"]: r for r in result["seeds"]}
    assert set(rows) == {"admm", "admm-mb", "adam+clip"} and {r["seeds"] for r in rows.values()} == {2}
    assert all(len(r["acc"]) == 2 for r in rows.values())
    assert [p.name for p in admm.tables(result)] == ["tuned", "seeds", "cost"]
    mb = next(r for r in result["runs"] if r["method"] == "admm-mb")
    assert math.isfinite(mb["final_loss"])  # one epoch = one sweep per mini-batch of 128 (all 32 samples here)
    assert result["summary"]["accuracy_gap"]["adding-50"]["best_baseline"] == "adam+clip"


REFERENCE = os.environ.get("FASTDIST_ADMMIRNN_REF")
RECORDING = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "admm-reference.json")


def test_the_reference_mode_refuses_a_path_without_the_authors_code(tmp_path):
    with pytest.raises(FileNotFoundError, match="no common.py under"):
        admm.run(parse(["--reference", str(tmp_path)]))


def test_the_recorded_reference_comparison_renders_blocks_trajectories_and_their_script():
    with open(RECORDING) as f:
        data = json.load(f)
    parts = results.tables_of(data)
    assert [p.name for p in parts] == ["reference-blocks", "reference-trajectory", "reference-published"]
    assert all(r["relation_rel_diff"] < 1e-12 for r in data["reference"]["blocks"])


@pytest.mark.skipif(not (REFERENCE and os.path.isfile(os.path.join(REFERENCE, "common.py"))),
                    reason="FASTDIST_ADMMIRNN_REF does not name a checkout of the authors' ADMMiRNN code (not "
                           "vendored: no license)")
def test_the_reference_mode_runs_the_authors_code_and_ours_side_by_side(tmp_path):
    result = admm.run(parse(["--reference", REFERENCE, "--reference-iterations", "2", "--hidden", "4"]))
    traj = result["reference"]["trajectory"]
    assert len(traj["alpha10"]["loss_theirs"]) == len(traj["alpha10"]["loss_ours"]) == 3
    assert len(result["reference"]["published"]["loss"]) == 1000
    admm.plot(result, str(tmp_path / "ref.png"))
    assert (tmp_path / "ref.png").stat().st_size > 0
