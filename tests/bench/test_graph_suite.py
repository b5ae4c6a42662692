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
    assert (args.folds, args.epochs, args.graphs, args.aux_weight) == (10, 100, None, 1.0)
    assert "hap" in args.poolers and {"diffpool", "mincut", "topk", "sag", "asap", "mean"} <= set(args.poolers)
    assert len(args.datasets) >= 5


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
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "graph", "--datasets", "tree-cycle,house-cycle", "--poolers",
           "hap,diffpool,topk,mean", "--folds", "2", "--epochs", "2", "--graphs", "24", "--hidden", "8",
           "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = {(r["dataset"], r["pooler"]): r for r in result["rows"]}
    assert set(rows) == {(d, p) for d in ("tree-cycle", "house-cycle") for p in ("hap", "diffpool", "topk", "mean")}
    for r in rows.values():
        assert len(r["accs"]) == 2 and 0 <= r["acc_mean"] <= 1 and np.isclose(r["acc_mean"], np.mean(r["accs"]))
        assert len(r["epoch_s"]) == sum(r["epochs_run"]) == 4 and r["params"] > 0
    assert [ref["dataset"] for ref in result["references"]] == ["tree-cycle", "house-cycle"]
    assert any(line.startswith("target: HAP best") for line in result["targets"]["lines"])
    assert "2 folds, up to 2 epochs" in proc.stdout and "degree-histogram LR" in proc.stdout
    parts = results.tables_of(result)
    assert [p.name for p in parts] == ["accuracy", "cost"]
    assert parts[0].table.splitlines()[0] == "| pooler | tree-cycle (%) | house-cycle (%) |"
    assert png.stat().st_size > 0


def test_the_targets_name_where_hap_is_best_and_where_it_is_not():
    def row(d, p, acc, std=0.01, ms=10.0):
        return {"dataset": d, "pooler": p, "acc_mean": acc, "acc_std": std, "epoch_ms": ms}

    rows = [row("a", "hap", 0.9, ms=15), row("a", "diffpool", 0.8, ms=10), row("b", "hap", 0.7, ms=30),
            row("b", "diffpool", 0.75, std=0.1, ms=10)]
    targets = graph._targets(rows)
    assert targets["checks"] == {"best_on_3": False, "a_epoch_2x": True, "b_epoch_2x": False}
    assert "best on 1" in targets["lines"][0] and "b: hap 70.0, best other diffpool 75.0+-10.0" in targets["lines"][0]
