"""fastdist-bench graph: every pooler in the same classifier, stratified k-fold cross-validation, one table."""
import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from fastdist.bench import cli, graph, results


def parse(argv):
    p = argparse.ArgumentParser()
    graph.add_arguments(p)
    return p.parse_args(argv)


def test_the_suite_is_registered_and_its_defaults_are_the_full_protocol():
    assert cli.SUITES["graph"] == "fastdist.bench.graph" and "graph" in cli.TOUR
    args = parse([])
    assert (args.folds, args.epochs, args.graphs, args.aux_weights) == (10, 100, None, [0.0, 0.1, 1.0])
    assert (args.features, args.encoder, args.readout) == ("degree", "gcn", "mean+sum")
    assert "hap" in args.poolers and {"diffpool", "mincut", "topk", "sag", "asap", "mean"} <= set(args.poolers)
    assert {"hap-no-moa", "hap-no-gcont", "hap-small-c", "hap-norm"} <= set(args.poolers)
    assert len(args.datasets) >= 5


def test_every_pooler_with_auxiliary_losses_gets_the_same_weight_grid_and_keeps_the_best_on_validation(monkeypatch):
    calls = []
    val = {0.0: 0.6, 0.1: 0.8, 1.0: 0.8}  # 0.1 and 1 tie on accuracy: the lower validation loss wins
    loss = {0.0: 0.5, 0.1: 0.7, 1.0: 0.4}

    def fake(graphs, split, pooler, args, classes, num_nodes, fold, aux_weight=0.0):
        calls.append((pooler, aux_weight))
        return {"val_acc": val[aux_weight], "val_loss": loss[aux_weight], "test_acc": aux_weight, "best_epoch": 1,
                "epochs": 2, "epoch_s": [0.1, 0.1], "aux_weight": aux_weight}

    monkeypatch.setattr(graph, "run_fold", fake)
    args = parse(["--aux-weights", "0,0.1,1"])
    for pooler in ("hap", "hap-norm", "diffpool", "mincut"):
        best = graph.run_searched(None, None, pooler, args, 2, 10, 0)
        assert best["aux_weight"] == 1.0 and best["test_acc"] == 1.0 and len(best["epoch_s"]) == 6
        assert [g["aux_weight"] for g in best["grid"]] == [0.0, 0.1, 1.0]
    assert graph.run_searched(None, None, "topk", args, 2, 10, 0)["aux_weight"] == 0.0
    assert calls == [(p, w) for p in ("hap", "hap-norm", "diffpool", "mincut") for w in (0.0, 0.1, 1.0)] + [
        ("topk", 0.0)]


def test_bad_flags_are_rejected_with_the_reason(capsys):
    for flag, bad, why in [("--poolers", "hap,edgepool", "unknown item 'edgepool'"), ("--folds", "1", "below 2"),
                           ("--datasets", "mutag", "unknown item 'mutag'"), ("--val-fraction", "0.7", "not in")]:
        with pytest.raises(SystemExit):
            parse([flag, bad])
        assert why in capsys.readouterr().err


def test_folds_are_stratified_disjoint_and_cover_the_data_with_a_validation_split_inside_training():
    labels = np.repeat([0, 1, 2], 40)
    folds = graph.splits(labels, 4, 0.1, seed=0)
    tests = np.concatenate([test for _, _, test in folds])
    assert sorted(tests.tolist()) == list(range(120))
    for train, val, test in folds:
        assert not (set(train) & set(val) or set(train) & set(test) or set(val) & set(test))
        assert len(train) + len(val) + len(test) == 120
        assert np.bincount(labels[test]).tolist() == [10, 10, 10] and len(set(labels[val])) == 3
    assert [f[2].tolist() for f in folds] == [f[2].tolist() for f in graph.splits(labels, 4, 0.1, seed=0)]


def test_a_small_run_reports_every_pooler_on_every_set_with_the_reference_and_renders(tmp_path):
    out, png, partial = tmp_path / "g.json", tmp_path / "g.png", tmp_path / "partial.json"
    cmd = [sys.executable, "-m", "fastdist.bench", "graph", "--datasets", "tree-cycle,house-cycle", "--poolers",
           "hap,diffpool,topk,mean", "--folds", "2", "--epochs", "2", "--graphs", "24", "--hidden", "8",
           "--aux-weights", "0,1", "--search-folds", "1", "--partial", str(partial), "--json", str(out),
           "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = {(r["dataset"], r["pooler"]): r for r in result["rows"]}
    assert set(rows) == {(d, p) for d in ("tree-cycle", "house-cycle") for p in ("hap", "diffpool", "topk", "mean")}
    for r in rows.values():
        assert len(r["accs"]) == 2 and 0 <= r["acc_mean"] <= 1 and np.isclose(r["acc_mean"], np.mean(r["accs"]))
        searched = r["pooler"] in ("hap", "diffpool")  # two weights on the first fold, the chosen one on the second
        assert sum(r["epochs_run"]) == 4 and len(r["epoch_s"]) == (6 if searched else 4) and r["params"] > 0
        assert (r["aux_weights"] is not None) == searched
        if searched:
            assert [g["aux_weight"] for g in r["grids"][0]] == [0, 1] and r["grids"][1] is None
            assert r["aux_weights"][0] == r["aux_weights"][1] in (0, 1)
    assert json.loads(partial.read_text())["rows"] == result["rows"]  # the last fold's partial is the result
    assert [ref["dataset"] for ref in result["references"]] == ["tree-cycle", "house-cycle"]
    assert any(line.startswith("target: HAP best") for line in result["targets"]["lines"])
    assert "2 folds, up to 2 epochs" in proc.stdout and "degree-histogram LR" in proc.stdout
    assert "weight chosen from {0, 1} by validation accuracy on the first fold, then kept" in proc.stdout
    parts = results.tables_of(result)
    assert [p.name for p in parts] == ["accuracy", "cost"]
    assert parts[0].table.splitlines()[0] == "| pooler | tree-cycle (%) | house-cycle (%) |"
    assert png.stat().st_size > 0


def test_the_targets_name_where_hap_is_best_and_where_it_is_not():
    def row(d, p, acc, std=0.01, ms=10.0):
        return {"dataset": d, "pooler": p, "acc_mean": acc, "acc_std": std, "epoch_ms": ms}

    rows = [row("a", "hap", 0.9, ms=15), row("a", "diffpool", 0.8, ms=10), row("b", "hap", 0.7, ms=30),
            row("b", "diffpool", 0.75, std=0.1, ms=10), row("a", "hap-norm", 0.95)]  # a variant is no rival
    targets = graph._targets(rows)
    assert targets["checks"] == {"best_on_3": False, "a_epoch_2x": True, "b_epoch_2x": False}
    assert "best on 1" in targets["lines"][0] and "b: hap 70.0, best other diffpool 75.0+-10.0" in targets["lines"][0]


def test_later_folds_keep_the_weight_the_search_folds_chose_most_often():
    def run(w, val):
        return {"aux_weight": w, "val_acc": val}

    assert graph._searched_weight([run(0.1, 0.7)]) == 0.1
    assert graph._searched_weight([run(1.0, 0.6), run(0.1, 0.9), run(1.0, 0.5)]) == 1.0
    assert graph._searched_weight([run(1.0, 0.6), run(0.1, 0.9)]) == 0.1  # a tie: the better validation


_PROTOCOL = {"epochs": 2, "patience": 1, "graphs": 10, "encoder": "gcn", "hidden": 8, "levels": 2, "ratio": 0.5,
             "lr": 0.01, "batch_size": 4, "threads": 1}


def test_merge_joins_one_protocol_on_different_sets_and_counts_the_targets_over_all_of_them():
    def recording(d, hap, other, **config):
        rows = [{"dataset": d, "pooler": "hap", "acc_mean": hap, "acc_std": 0.01, "epoch_ms": 10.0},
                {"dataset": d, "pooler": "mean", "acc_mean": other, "acc_std": 0.01, "epoch_ms": 5.0}]
        return {"suite": "graph", "env": {"command": f"graph --datasets {d}"}, "rows": rows,
                "config": {"datasets": [d], "folds": 4, "run_folds": 4} | config,
                "references": [{"dataset": d, "acc_mean": 0.5}]}

    merged = graph.merge([recording("a", 0.9, 0.8), recording("b", 0.9, 0.7), recording("c", 0.6, 0.8)])
    assert merged["config"]["datasets"] == ["a", "b", "c"] and len(merged["rows"]) == 6
    assert [r["dataset"] for r in merged["references"]] == ["a", "b", "c"]
    assert merged["env"]["merged_commands"] == ["graph --datasets a", "graph --datasets b", "graph --datasets c"]
    assert "best on 2" in merged["targets"]["lines"][0] and not merged["targets"]["checks"]["best_on_3"]
    stopped = graph.merge([recording("a", 0.9, 0.8), recording("b", 0.9, 0.7, run_folds=2, json="b.json")])
    assert stopped["config"]["run_folds"] == 2 and stopped["config"]["run_folds_by_dataset"] == {"a": 4, "b": 2}
    assert "of 4 folds 4 on a, 2 on b" in graph._scale(stopped["config"] | _PROTOCOL)
    with pytest.raises(ValueError, match="differ in folds"):
        graph.merge([recording("a", 0.9, 0.8), recording("b", 0.9, 0.7, folds=5)])
    with pytest.raises(ValueError, match="more than one recording"):
        graph.merge([recording("a", 0.9, 0.8), recording("a", 0.9, 0.7)])


_TINY = ["--datasets", "tree-cycle", "--poolers", "hap,mean", "--folds", "3", "--epochs", "1", "--graphs", "12",
         "--hidden", "4", "--aux-weights", "0,1", "--search-folds", "1"]


def _accs(result):
    return {(r["dataset"], r["pooler"]): (r["accs"], r["aux_weights"]) for r in result["rows"]}


def test_a_stopped_run_resumes_at_its_next_fold_and_fold_pieces_merge_into_the_whole_run(tmp_path, monkeypatch):
    ran = []
    real = graph.run_fold

    def counted(graphs, split, pooler, args, classes, num_nodes, fold, aux_weight=0.0):
        ran.append((pooler, fold))
        return real(graphs, split, pooler, args, classes, num_nodes, fold, aux_weight)

    monkeypatch.setattr(graph, "run_fold", counted)
    whole = graph.run(parse(_TINY))
    stopped = str(tmp_path / "stopped.json")
    graph.run(parse(_TINY + ["--run-folds", "1", "--partial", stopped]))  # stopped after its first fold
    ran.clear()
    resumed = graph.run(parse(_TINY + ["--resume", "--partial", stopped]))
    assert sorted(set(ran)) == [(p, f) for p in ("hap", "mean") for f in (1, 2)]  # fold 0 is not run again
    assert _accs(resumed) == _accs(whole) and resumed["references"] == whole["references"]
    assert len(resumed["env"]["resumed"]) == 1

    first, rest = str(tmp_path / "first.json"), str(tmp_path / "rest.json")
    graph.run(parse(_TINY + ["--run-folds", "2", "--partial", first]))
    graph.run(parse(_TINY + ["--from-fold", "2", "--search-from", first, "--partial", rest]))
    merged = graph.merge([json.load(open(first)), json.load(open(rest))])
    assert _accs(merged) == _accs(whole) and merged["references"] == whole["references"]
    assert merged["config"]["run_folds"] == 3 and merged["config"]["datasets"] == ["tree-cycle"]


def test_pieces_that_do_not_fit_together_are_refused(tmp_path):
    first = str(tmp_path / "first.json")
    graph.run(parse(_TINY + ["--run-folds", "1", "--partial", first]))
    with pytest.raises(ValueError, match="differs in epochs"):
        graph.run(parse(_TINY + ["--epochs", "2", "--resume", "--partial", first]))
    with pytest.raises(ValueError, match="name the piece that ran them with --search-from"):
        graph.run(parse(_TINY + ["--from-fold", "1"]))
    with pytest.raises(ValueError, match="more than one recording"):
        graph.merge([json.load(open(first)), json.load(open(first))])


def test_the_cost_mode_times_every_pooler_interleaved_with_hap_and_diffpool_at_the_same_clusters():
    result = graph.run(parse(_TINY + ["--poolers", "hap,diffpool,mean", "--cost-reps", "2"]))
    rows = {r["pooler"]: r for r in result["rows"]}
    assert result["mode"] == "cost" and set(rows) == {"hap", "diffpool", "mean"}
    assert all(len(r["epoch_s"]) == 2 and r["epoch_ms"] > 0 and r["params"] > 0 for r in rows.values())
    assert rows["hap"]["clusters"] == rows["diffpool"]["clusters"] and rows["mean"]["clusters"] is None
    assert result["targets"]["lines"][0].startswith("target: tree-cycle epoch time within 2x of diffpool")
    parts = results.tables_of(result)
    assert [p.name for p in parts] == ["cost"] and "| x diffpool |" in parts[0].table.splitlines()[0]
