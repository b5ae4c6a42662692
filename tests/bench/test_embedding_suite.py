"""fastdist-bench embedding: fastdist's sharded tables, DDP with sparse and dense table gradients, TorchRec and the
communication-free step, one run, interleaved; the methods that start from the same weights train the same model."""
import json
import subprocess
import sys

import torch

from fastdist.bench import cli, embedding


def test_the_suite_is_registered_with_a_small_tour_entry():
    assert cli.SUITES["embedding"] == "fastdist.bench.embedding"
    argv = cli.TOUR["embedding"]
    assert argv[argv.index("--ranks") + 1] == "2" and int(argv[argv.index("--rows") + 1]) <= 65536


def test_batches_are_deterministic_and_differ_by_rank():
    config = {"batch": 4, "pooling": 3, "rows": 100, "zipf": 1.1, "tables": 2}
    a, b = embedding.make_batch(config, 0, 5), embedding.make_batch(config, 0, 5)
    assert all(torch.equal(x, y) for x, y in zip(a["ids"], b["ids"]))
    assert not torch.equal(a["ids"][0], embedding.make_batch(config, 1, 5)["ids"][0])
    assert a["ids"][0].numel() == 12 and int(a["ids"][0].max()) < 100


def test_cli_run_times_every_method_and_the_exact_ones_train_alike(tmp_path):
    out, png = tmp_path / "e.json", tmp_path / "e.png"
    cmd = [sys.executable, "-m", "fastdist.bench", "embedding", "--ranks", "2", "--rows", "2048", "--dim", "8",
           "--batch", "16", "--pooling", "4", "--steps", "2", "--warmup", "1", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loopback" in proc.stdout and "vs ddp-sparse" in proc.stdout
    result = json.loads(out.read_text())
    assert png.stat().st_size > 0
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == embedding.METHODS
    for r in rows.values():
        assert len(r["samples_ms"]) == 2 and r["time_ms"] > 0
    for name in ("fastdist", "fastdist-priority", "fastdist-2d", "ddp-sparse"):
        assert rows[name]["loss_diff_vs_ddp_dense"] < 1e-5, name
    # each step's phases are timed on every rank
    assert list(rows["fastdist-2d"]["phases_ms"]) == list(embedding.PHASES)
    assert all(len(v) == 2 for v in rows["fastdist-2d"]["phases_ms"].values())
    # fastdist's tables are split in two; its wire counts what its AlltoAlls really sent, below dense DDP's
    assert rows["fastdist"]["table_bytes"] == rows["ddp-sparse"]["table_bytes"] / 2
    assert 0 < rows["fastdist"]["wire_bytes"] < rows["ddp-dense"]["wire_bytes"]
