"""fastdist-bench compress-findings: every row builds, the data are deterministic, and a tiny run fills the table."""
import argparse

import torch

from fastdist.bench import cli, compress_findings as findings
from fastdist.compress import AQSGD, Boundary, ErrorFeedback
from fastdist.testing.shapes import shapes_dataset


def test_every_row_builds_its_boundary():
    for row in findings.ROWS:
        b = findings.boundary_for(row, samples=16)
        assert isinstance(b, Boundary)
    assert findings.boundary_for("none", 16).fwd is None
    assert isinstance(findings.boundary_for("aqsgd-topk30", 16).fwd, AQSGD)
    assert isinstance(findings.boundary_for("topk10+ef", 16).fwd, ErrorFeedback)
    assert findings.boundary_for("topk10-independent", 16).backward_mask == "independent"
    assert cli.SUITES["compress-findings"] == "fastdist.bench.compress_findings"


def test_shapes_dataset_is_deterministic_balanced_and_separable_by_class():
    x, y = shapes_dataset(800, seed=3)
    x2, y2 = shapes_dataset(800, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.shape == (800, 1, 16, 16)
    counts = torch.bincount(y, minlength=8)
    assert counts.min() > 60
    # the class means differ: a nearest-class-mean classifier beats chance by far on the training set
    means = torch.stack([x[y == c].mean(0).flatten() for c in range(8)])
    pred = torch.cdist(x.flatten(1), means).argmin(1)
    assert (pred == y).float().mean() > 0.3


def test_a_tiny_run_fills_both_inference_columns(capsys):
    p = argparse.ArgumentParser()
    findings.add_arguments(p)
    result = findings.run(p.parse_args(["--tasks", "cnn,gpt", "--rows", "none,aqsgd-q4", "--epochs", "2",
                                        "--train", "128"]))
    rows = result["rows"]
    assert [(r["task"], r["row"]) for r in rows] == [(t, r) for t in ("cnn", "gpt")
                                                     for r in ("none", "aqsgd-q4")]
    for r in rows:
        assert 0 <= r["compressed"] and 0 <= r["uncompressed"] and not r["diverged"]
    none = [r for r in rows if r["row"] == "none"]
    assert all(r["compressed"] == r["uncompressed"] for r in none)  # nothing to compress
    assert "uncompressed inference" in capsys.readouterr().out
