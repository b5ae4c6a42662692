"""fastdist-bench sparse-lm: the corpus, the model's sparse gradients, and a short convergence run in which the
lossless reducers train exactly like dense DDP and every reducer learns."""
import argparse
import json
import math
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fastdist.bench import sparse_lm
from fastdist.testing import models
from fastdist.testing.corpus import ZipfMarkovCorpus
from fastdist.distributed import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "sparse_embedding_lm.py")


@pytest.fixture(scope="module")
def corpus():
    return ZipfMarkovCorpus(vocab=32768, seed=3)


def _slope(freqs, lo, hi):
    ranks = np.arange(lo, hi) + 1.0
    return np.polyfit(np.log(ranks), np.log(np.asarray(freqs[lo:hi])), 1)[0]


def test_corpus_is_deterministic_per_rank_and_step(corpus):
    again = ZipfMarkovCorpus(vocab=32768, seed=3)
    a = corpus.batch(1, 5, 8, 32)
    assert a.shape == (8, 33) and a.dtype == torch.int64
    assert torch.equal(a, again.batch(1, 5, 8, 32))                    # same (seed, rank, step): same batch
    assert torch.equal(corpus.batch(2, 9, 8, 32), again.batch(2, 9, 8, 32))  # in any order
    assert not torch.equal(a, corpus.batch(2, 5, 8, 32))                # ranks get different shards
    assert not torch.equal(a, corpus.batch(1, 6, 8, 32))                # steps differ
    assert not torch.equal(corpus.heldout(8, 32), corpus.batch(0, 0, 8, 32))
    assert torch.equal(corpus.heldout(8, 32), again.heldout(8, 32))
    assert not torch.equal(a, ZipfMarkovCorpus(vocab=32768, seed=4).batch(1, 5, 8, 32))  # the seed matters
    assert int(a.min()) >= 0 and int(a.max()) < 32768


def test_corpus_token_frequencies_are_zipf_shaped(corpus):
    tokens = torch.cat([corpus.batch(r, s, 8, 32) for r in range(4) for s in range(100)]).flatten()
    freq = torch.bincount(tokens, minlength=corpus.vocab).double()
    freq, _ = (freq / freq.sum()).sort(descending=True)
    p0 = 1.0 / sum((k + 1) ** -1.1 for k in range(corpus.vocab))         # Zipf(1.1) top probability, 0.142
    assert 0.7 * p0 < float(freq[0]) < 1.4 * p0
    assert -1.35 < _slope(freq.numpy(), 1, 200) < -0.9                    # the head of the sample
    stationary, _ = corpus.stationary().sort(descending=True)
    assert abs(float(stationary.sum()) - 1) < 1e-9
    assert -1.25 < _slope(stationary.numpy(), 10, 10000) < -0.95          # and the tail, exactly


def test_corpus_is_learnable_next_token_predictable_from_the_previous(corpus):
    h_unigram, h_rate = corpus.unigram_entropy(), corpus.entropy_rate()
    assert h_rate < 0.5 * h_unigram < math.log(corpus.vocab)
    # the chain's transition rows are distributions, and the stationary distribution is stationary
    rows = corpus.transition_rows(torch.arange(50))
    assert torch.allclose(rows.sum(1), torch.ones(50, dtype=torch.float64))
    small = ZipfMarkovCorpus(vocab=300, successors=6, seed=1)
    full = small.transition_rows(torch.arange(300))
    pi = small.stationary()
    assert torch.allclose(pi @ full, pi, atol=1e-10)
    h = -(full * full.log()).sum(1)
    assert abs(float((pi * h).sum()) - small.entropy_rate()) < 1e-9       # entropy_rate matches its definition
    # empirically: the commonest successor of token 0 follows it far more often than its own frequency
    tokens = torch.cat([corpus.batch(r, s, 8, 32) for r in range(2) for s in range(50)])
    prev, nxt = tokens[:, :-1].flatten(), tokens[:, 1:].flatten()
    after0 = torch.bincount(nxt[prev == 0], minlength=corpus.vocab).double()
    overall = torch.bincount(nxt, minlength=corpus.vocab).double()
    best = int(after0.argmax())
    assert after0[best] / after0.sum() > 3 * overall[best] / overall.sum()


def test_embedding_gradients_are_row_sparse_at_the_expected_density(corpus):
    config = {"vocab": 32768, "exponent": 1.1, "seed": 3, "negatives": 1024, "batch": 8, "seq": 32}
    _, sampler = models.make_data(config)
    torch.manual_seed(0)
    model = models.SparseLM(32768, 16)
    held = corpus.heldout(4, 32)
    assert abs(model.full_loss(held[:, :-1], held[:, 1:]) - math.log(32768)) < 1e-4  # zero output layer
    torch.nn.init.normal_(model.out.weight, std=0.1)  # so that the input embedding gets a gradient too
    inputs, targets, negatives = models.step_batch(corpus, sampler, 0, 0, config)
    model(inputs, targets, negatives, sampler.log_expected).backward()
    emb_rows, out_rows = models.SparseLM.touched_rows(inputs, targets, negatives)
    for grad, rows in ((model.embed.weight.grad, emb_rows), (model.out.weight.grad, out_rows)):
        nonzero = grad.ne(0).any(1).nonzero().flatten()
        assert torch.equal(nonzero, rows)                       # exactly the rows the step looked up
        assert 0.001 < nonzero.numel() / 32768 < 0.05           # row density 0.1 % .. 5 %
    # the dense LSTM gradient is dense
    assert model.lstm.weight_hh_l0.grad.ne(0).float().mean() > 0.9
    # the suite's row-sparse optimizer input is the same gradient
    g = model.out.weight.grad
    assert torch.equal(sparse_lm.row_sparse(g).to_dense(), g)


def test_a_wide_input_embedding_feeds_the_lstm_and_keeps_its_gradient_row_sparse():
    torch.manual_seed(0)
    model = models.SparseLM(512, 16, embed_dim=96)
    assert tuple(model.embed.weight.shape) == (512, 96) and tuple(model.out.weight.shape) == (512, 17)
    assert (model.lstm.input_size, model.lstm.hidden_size) == (96, 16)
    torch.nn.init.normal_(model.out.weight, std=0.1)
    inputs = torch.tensor([[3, 7, 7, 9]])
    targets = torch.tensor([[7, 7, 9, 1]])
    model(inputs, targets, torch.tensor([0, 5, 11]), torch.zeros(512)).backward()
    assert torch.equal(model.embed.weight.grad.ne(0).any(1).nonzero().flatten(), torch.tensor([3, 7, 9]))
    assert tuple(models.SparseLM(512, 16).embed.weight.shape) == (512, 16)  # D defaults to d


def test_embed_dim_option_reaches_the_config_and_the_printed_model_and_defaults_to_dim(capsys):
    parser = argparse.ArgumentParser()
    sparse_lm.add_arguments(parser)
    wide = sparse_lm.make_config(parser.parse_args(["--embed-dim", "1024", "--dim", "32"]))
    assert (wide["embed_dim"], wide["dim"]) == (1024, 32)
    assert sparse_lm.make_config(parser.parse_args(["--dim", "32"]))["embed_dim"] == 32
    with pytest.raises(SystemExit):
        parser.parse_args(["--embed-dim", "0"])
    assert "--embed-dim: '0' is below 1" in capsys.readouterr().err
    caption = sparse_lm.tables({"config": wide, "methods": []})[0].caption
    assert "Embedding(32768, 1024) + LSTM(1024 -> 32) + output embedding (32768, 33)" in caption


def test_row_sparse_adagrad_update_equals_the_dense_update():
    torch.manual_seed(1)
    grads = []
    for _ in range(3):
        g = torch.zeros(100, 7)
        g[torch.randperm(100)[:9]] = torch.randn(9, 7)
        grads.append(g)
    start = torch.randn(100, 7)
    dense_p, sparse_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    dense_opt = torch.optim.Adagrad([dense_p], lr=0.1)
    sparse_opt = torch.optim.Adagrad([sparse_p], lr=0.1)
    for g in grads:
        dense_p.grad, sparse_p.grad = g.clone(), sparse_lm.row_sparse(g.clone())
        dense_opt.step()
        sparse_opt.step()
    assert torch.allclose(dense_p, sparse_p, rtol=0, atol=1e-6)


def test_method_names_and_groups():
    assert sparse_lm.parse_methods("dense,sketch-0.2x+ef", (0.2,)) == ["dense", "sketch-0.2x+ef"]
    assert len(sparse_lm.parse_methods("all", sparse_lm.SKETCH_SIZES)) == 4 + 3 + 8
    assert sparse_lm.parse_methods("sketch", (1.0,)) == ["sketch-1x", "sketch-1x+ef"]
    with pytest.raises(SystemExit, match="unknown method"):
        sparse_lm.parse_methods("dense,topk", (1.0,))


def test_summary_marks_the_pareto_front_and_checks_the_target_on_all_bytes_and_on_the_sparse_matrices():
    def m(name, loss, wire, lossless):  # every method also sends the same 10 bytes of dense gradients
        return {"method": name, "final_loss": loss, "step_s": [1.0] * 5, "wire_bytes": [wire] * 5,
                "sparse_wire_bytes": [wire - 10] * 5, "tx_bytes": None, "chosen": [], "lossless": lossless}
    result = {"config": {"warmup": 1}, "methods": [
        m("dense", 5.0, 1000, True), m("agsparse", 5.0, 100, True), m("omnireduce", 5.0, 80, True),
        m("sketch-0.2x", 5.05, 30, False), m("sketch-0.1x", 5.5, 20, False), m("fp16", 5.2, 500, False),
        m("sketch-0.5x", 5.04, 45, False)]}
    sparse_lm.summarize(result)
    by = {x["method"]: x for x in result["methods"]}
    assert [n for n, x in by.items() if x["pareto"]] == ["omnireduce", "sketch-0.2x", "sketch-0.1x", "sketch-0.5x"]
    assert by["sketch-0.2x"]["bytes_vs_best_lossless_sparse"] == pytest.approx(30 / 80)
    assert by["sketch-0.5x"]["sparse_bytes_vs_best_lossless_sparse"] == pytest.approx(35 / 70)
    all_bytes, sparse_bytes = (n for n in result["notes"] if n.startswith("target"))
    assert "met by sketch-0.2x" in all_bytes and "0.5x" not in all_bytes and "0.1x" not in all_bytes  # 45/80 > 50%
    assert "met by sketch-0.2x, sketch-0.5x" in sparse_bytes and "0.1x" not in sparse_bytes  # 0.1x: 10% worse loss
    parser = argparse.ArgumentParser()
    sparse_lm.add_arguments(parser)
    result["config"] = sparse_lm.make_config(parser.parse_args([]))
    names = [line.split()[0] for line in sparse_lm.tables(result)[1].text().splitlines()[2:-len(result["notes"])]]
    assert names == ["sketch-0.1x", "sketch-0.2x", "sketch-0.5x", "omnireduce", "agsparse", "fp16", "dense"]


def test_short_run_lossless_reducers_train_exactly_like_dense_and_every_reducer_learns(tmp_path):
    out, png = tmp_path / "lm.json", tmp_path / "lm.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "sparse-lm", "--ranks", "2", "--steps", "15",
           "--vocab", "1024", "--dim", "16", "--seq", "8", "--batch", "4", "--negatives", "64",
           "--eval-every", "5", "--methods", "dense,omnireduce,auto,auto-bg,sketch-1x+ef", "--sketch-sizes", "1",
           "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in ("# network", "final loss", "Wire bytes against final loss", "omnireduce", "sketch-1x+ef",
                 "best lossless sparse baseline"):
        assert text in proc.stdout
    result = json.loads(out.read_text())
    assert png.stat().st_size > 10_000
    by = {m["method"]: m for m in result["methods"]}
    dense = by["dense"]
    for name, m in by.items():
        assert len(m["step_s"]) == len(m["wire_bytes"]) == len(m["train_loss"]) == 15   # raw samples kept
        assert [s for s, _ in m["curve"]] == [0, 5, 10, 15]
        assert m["curve"][0][1] == pytest.approx(math.log(1024), abs=1e-4)            # same init everywhere
        assert m["final_loss"] < m["curve"][0][1] - 0.5, name                          # every reducer learns
    for name in ("omnireduce", "auto", "auto-bg"):  # lossless: the reduced gradient is what dense DDP's sees
        for (s1, l1), (s2, l2) in zip(by[name]["curve"], dense["curve"]):
            assert abs(l1 - l2) < 1e-4, (name, s1, l1, l2)
        assert by[name]["lossless"]
        assert set(by[name]["chosen_counts"]["embed"]) <= {"exact", "dense"}
    assert by["omnireduce"]["median_wire_bytes"] < dense["median_wire_bytes"]
    assert abs(by["sketch-1x+ef"]["final_loss"] / dense["final_loss"] - 1) < 0.02      # the 2% convergence target
    cal, cfg = result["calibration"], result["config"]
    assert by["sketch-1x+ef"]["chosen_counts"]["out"] == {"sketch": cfg["steps"] - cfg["warmup"]}  # every timed step
    # the sketch is sized from the calibrated union: r x c = 1.0 x |U| x row width
    ratio = by["sketch-1x+ef"]["ratios"]["embed"]
    assert ratio == pytest.approx(cal["embed"]["union_rows"] / (cfg["vocab"] * cfg["sketch_rows"]))


def _run_example():
    example = runpy.run_path(EXAMPLE, run_name="sparse_embedding_lm")
    log, final = example["main"](["--steps", "5", "--vocab", "4096", "--dim", "16", "--negatives", "256"])
    return log, final, dist.get_rank()


def test_example_script_trains_under_spawn():
    results = spawn(_run_example, 2, timeout=180)
    (log0, final0, _), (_, final1, _) = results
    assert [step for step, *_ in log0] == list(range(5))
    assert all(set(how.split("/")) <= {"exact", "dense", "sketch"} and how for _, _, how, _ in log0), log0
    assert all(len(how.split("/")) == 2 for _, _, how, _ in log0[1:]), log0  # after DDP's re-bucketing
    assert all(sent > 0 for *_, sent in log0)
    assert final0 == final1 and math.isfinite(final0) and final0 < math.log(4096)   # identical replicas, learnt
