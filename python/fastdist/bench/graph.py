"""`fastdist-bench graph`: graph-classification accuracy of HAP against PyG's poolers, k-fold cross-validated.

Every pooler (fastdist.graph.POOLERS: HAP, its two ablations and two candidate fixes, PyG's DiffPool, MinCut,
TopK, SAG, ASAP, and global mean pooling without hierarchy) sits in the same GraphClassifier: the same node features,
encoder, hidden size, levels, readout and head, trained with the same optimizer (Adam), learning rate, batch size,
epochs and early stopping. The one searched setting is the weight of the auxiliary losses, and only for the poolers
that have them (AUX_POOLERS: every HAP variant, DiffPool, MinCut): each trains once per weight of --aux-weights
(the same grid for all of them) and the weight with the best validation accuracy (ties: lower validation loss) is
kept, per fold. Protocol, per data set (fastdist.graph.data, generated, no downloads):

  stratified k-fold cross-validation (sklearn StratifiedKFold, shuffled, seeded); in each fold a stratified
  --val-fraction of the training part is the validation split; train up to --epochs, keep the weights of the
  epoch with the best validation accuracy (ties: lower validation loss), stop after --patience epochs without a
  better one; report the test fold's accuracy with those weights. Mean +- std over folds per pooler.

Folds are interleaved: every pooler runs fold f before any runs fold f+1, in an order rotated per fold. Epoch time
is the wall time of one training epoch (median over all epochs of all folds; every epoch's time is in the JSON).
The structure-blind reference (logistic regression on the node count and degree histogram) runs on the same folds.
Defaults are the full protocol (10 folds, 100 epochs, patience 20, 1000 graphs per generated set, all 1797 digits);
--folds/--epochs/--graphs/--datasets/--poolers scale it down, and the caption states the scale that ran.
--merge joins recordings of the same protocol on different data sets (run side by side) into one, whose targets
count over all of their data sets.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import textwrap
import time

import numpy as np
import torch
import torch.nn.functional as F

from fastdist.bench import report
from fastdist.bench.report import col, fixed, integer, text
from fastdist.bench.toolkit import at_least, comma_list, progress, up_to
from fastdist.graph.classifier import AUX_POOLERS, POOLERS, READOUTS
from fastdist.graph.data import DATASETS

__all__ = ["add_arguments", "merge", "plot", "run", "run_fold", "run_searched", "splits", "tables"]


# Neither module imports torch_geometric at import time: the suite lists its choices without it.
POOLER_NAMES = POOLERS
DATASET_NAMES = DATASETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    p.add_argument("--datasets", type=comma_list(choices=DATASET_NAMES), default=list(DATASET_NAMES),
                   help="comma-separated subset of " + ",".join(DATASET_NAMES))
    p.add_argument("--poolers", type=comma_list(choices=POOLER_NAMES), default=list(POOLER_NAMES),
                   help="comma-separated subset of " + ",".join(POOLER_NAMES))
    p.add_argument("--folds", type=at_least(2), default=10, help="cross-validation folds (default 10)")
    p.add_argument("--run-folds", type=at_least(1), default=None,
                   help="run only the first N of the --folds folds (default all); the caption says so")
    p.add_argument("--epochs", type=at_least(1), default=100, help="most training epochs per fold (default 100)")
    p.add_argument("--patience", type=at_least(1), default=20,
                   help="stop after this many epochs without a better validation accuracy (default 20)")
    p.add_argument("--graphs", type=at_least(10), default=None,
                   help="graphs per data set (default: 1000 per generated set, all 1797 digits)")
    p.add_argument("--hidden", type=at_least(1), default=64, help="hidden size of every network (default 64)")
    p.add_argument("--levels", type=at_least(0), default=2, help="pooling levels (default 2)")
    p.add_argument("--encoder", choices=["gcn", "gin"], default="gcn", help="GNN encoder (default gcn)")
    p.add_argument("--readout", choices=READOUTS, default="mean+sum",
                   help="graph readout after every block (default mean+sum: the sum sees the node count)")
    p.add_argument("--features", choices=["degree", "plain"], default="degree",
                   help="node features: the data set's own plus a one-hot degree (default), or its own only (the "
                        "structure sets' constant 1)")
    p.add_argument("--ratio", type=up_to(0.99), default=0.5, help="coarsening ratio per level (default 0.5)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--batch-size", type=at_least(1), default=64, help="graphs per training step (default 64)")
    p.add_argument("--val-fraction", type=up_to(0.5), default=0.1,
                   help="share of each training fold held out for early stopping (default 0.1)")
    p.add_argument("--aux-weights", type=comma_list(at_least(0.0, float)), default=[0.0, 0.1, 1.0],
                   help="weights of the auxiliary losses searched, per fold on the validation split, for every "
                        "pooler that has them (default 0,0.1,1; one value: no search)")
    p.add_argument("--seed", type=int, default=0, help="seeds data, folds, initialization and batching")
    p.add_argument("--threads", type=at_least(1), default=1,
                   help="torch threads (default 1: these graphs are small; more threads mostly wait)")
    p.add_argument("--search-folds", type=at_least(1), default=None,
                   help="search the auxiliary-loss weight on the first N folds only; later folds train once with "
                        "the weight those chose most often (default: search on every fold)")
    p.add_argument("--from-fold", type=at_least(0), default=0,
                   help="start at this fold (0-based) and run to --run-folds: one piece of the run, for --merge")
    p.add_argument("--search-from", metavar="PATH", default=None,
                   help="the piece (its --partial file) whose first --search-folds folds chose the auxiliary-loss "
                        "weights, for a piece that starts after them (--from-fold)")
    p.add_argument("--cost-reps", type=at_least(1), default=None, metavar="N",
                   help="measure cost only: one training epoch of every pooler on the first fold's training part, "
                        "the poolers interleaved (rotated order), one warm-up round and N timed ones, per data set")
    p.add_argument("--partial", metavar="PATH", default=None,
                   help="after every fold, write the result so far, with every fold's runs, to PATH (kept if the "
                        "run is stopped)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run stopped in --partial PATH from its next fold (the same protocol and data "
                        "sets, or an error); folds already there are not run again")
    p.add_argument("--merge", type=comma_list(), default=None, metavar="JSON,JSON,...",
                   help="train nothing: join these recordings (the same protocol on different data sets) into one")


# settings that say which part of a run a recording holds and where it goes, not how it trains
_PIECE_KEYS = ("datasets", "merge", "json", "plot", "partial", "run_folds", "resume", "from_fold", "search_from")


def splits(labels: np.ndarray, folds: int, val_fraction: float, seed: int) -> list[tuple[np.ndarray, ...]]:
    """(train, validation, test) index arrays per fold: StratifiedKFold for test, then a stratified validation
    share of the rest."""
    from sklearn.model_selection import StratifiedKFold, train_test_split

    out = []
    for fold, (rest, test) in enumerate(StratifiedKFold(folds, shuffle=True, random_state=seed).split(labels,
                                                                                                        labels)):
        counts = np.unique(labels[rest], return_counts=True)[1]
        n_val = max(len(counts), round(val_fraction * len(rest)))  # at least one graph per class
        train, val = train_test_split(rest, test_size=n_val, random_state=seed * 1000 + fold,
                                      stratify=labels[rest] if counts.min() >= 2 else None)
        out.append((np.sort(train), np.sort(val), np.sort(test)))
    return out


def _batches(graphs, index, batch_size, gen=None):
    from fastdist.graph.data import collate

    order = index if gen is None else index[torch.randperm(len(index), generator=gen).numpy()]
    return [collate([graphs[i] for i in order[s:s + batch_size]]) for s in range(0, len(order), batch_size)]


@torch.no_grad()
def _evaluate(model, batches):
    model.eval()
    correct = loss = total = 0
    for x, edge_index, batch, y in batches:
        logits, _ = model(x, edge_index, batch, num_graphs=len(y))
        correct += int((logits.argmax(-1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        total += len(y)
    return correct / total, loss / total


def _model(graphs, pooler, args, classes, num_nodes, seed):
    from fastdist.graph import GraphClassifier

    torch.manual_seed(seed)
    model = GraphClassifier(graphs[0].x.shape[1], args.hidden, classes, levels=args.levels, pooler=pooler,
                            encoder=args.encoder, num_nodes=num_nodes, ratio=args.ratio,
                            readout=getattr(args, "readout", "mean"))
    return model, torch.optim.Adam(model.parameters(), lr=args.lr)


def _train_epoch(model, opt, graphs, train, batch_size, gen, aux_weight) -> float:
    """One training epoch (batching included); returns its wall time in seconds."""
    model.train()
    start = time.perf_counter()
    for x, edge_index, batch, y in _batches(graphs, train, batch_size, gen):
        logits, aux = model(x, edge_index, batch, num_graphs=len(y))
        loss = F.cross_entropy(logits, y) + aux_weight * aux if aux_weight else F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def run_fold(graphs, split, pooler: str, args: argparse.Namespace, classes: int, num_nodes: int,
             fold: int, aux_weight: float = 0.0) -> dict:
    """Trains one pooler's classifier on one fold with early stopping; returns its test accuracy and timings.

    Every pooler and every auxiliary-loss weight of one fold starts from the same seed (initialization and batch
    order)."""
    train, val, test = split
    model, opt = _model(graphs, pooler, args, classes, num_nodes, args.seed * 1000 + fold)
    gen = torch.Generator().manual_seed(args.seed * 1000 + fold)
    val_batches = _batches(graphs, val, 256)
    best, best_key, best_epoch, epoch_s = None, None, -1, []
    for epoch in range(args.epochs):
        epoch_s.append(_train_epoch(model, opt, graphs, train, args.batch_size, gen, aux_weight))
        acc, val_loss = _evaluate(model, val_batches)
        key = (acc, -val_loss)
        if best_key is None or key > best_key:
            best, best_key, best_epoch = copy.deepcopy(model.state_dict()), key, epoch
        elif epoch - best_epoch >= args.patience:
            break
    model.load_state_dict(best)
    test_acc, _ = _evaluate(model, _batches(graphs, test, 256))
    return {"fold": fold, "test_acc": test_acc, "val_acc": best_key[0], "val_loss": -best_key[1],
            "best_epoch": best_epoch, "epochs": len(epoch_s), "epoch_s": epoch_s, "aux_weight": aux_weight,
            "params": sum(p.numel() for p in model.parameters())}


def run_searched(graphs, split, pooler: str, args: argparse.Namespace, classes: int, num_nodes: int,
                 fold: int) -> dict:
    """run_fold, for a pooler with auxiliary losses once per weight of args.aux_weights, keeping the run with the
    best validation accuracy (ties: lower validation loss); every run of the search is in its "grid"."""
    if pooler not in AUX_POOLERS:
        return run_fold(graphs, split, pooler, args, classes, num_nodes, fold)
    grid = [run_fold(graphs, split, pooler, args, classes, num_nodes, fold, w) for w in args.aux_weights]
    best = max(grid, key=lambda r: (r["val_acc"], -r["val_loss"]))
    keep = ("aux_weight", "val_acc", "val_loss", "test_acc", "best_epoch", "epochs")
    return best | {"epoch_s": [t for r in grid for t in r["epoch_s"]],
                   "grid": [{k: r[k] for k in keep} for r in grid]}


def _degree_reference(graphs, fold_splits):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from fastdist.graph.data import degree_features

    feats, labels = degree_features(graphs), np.array([g.y for g in graphs])
    accs = []
    for train, val, test in fold_splits:
        fit = np.concatenate([train, val])
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)).fit(feats[fit], labels[fit])
        accs.append(float((model.predict(feats[test]) == labels[test]).mean()))
    return accs


def merge(recordings: list[dict]) -> dict:
    """One result from recordings of the same protocol on different data sets: rows and references joined,
    targets counted over every data set. The environment is the first recording's, its command the merge's.

    Raises:
        ValueError: a recording of another suite, settings other than the data sets that differ, a data set twice.
    """
    if not recordings or any(r.get("suite") != "graph" for r in recordings):
        raise ValueError("graph --merge: give one or more recordings of the graph suite")

    def protocol(r):  # what must agree: everything but the data sets, the output paths and how far each got
        return {k: v for k, v in r["config"].items()
                if k not in _PIECE_KEYS}

    first = recordings[0]
    for r in recordings[1:]:
        diff = sorted(k for k in protocol(first).keys() | protocol(r).keys()
                      if protocol(first).get(k) != protocol(r).get(k))
        if diff:
            raise ValueError(f"graph --merge: the recordings differ in {', '.join(diff)}, not only in data sets")
    datasets = [d for r in recordings for d in r["config"]["datasets"]]
    if len(set(datasets)) < len(datasets):
        recordings = _join_pieces(recordings)
        datasets = [d for r in recordings for d in r["config"]["datasets"]]
    rows = [row for r in recordings for row in r["rows"]]
    env = dict(first["env"])
    env["merged_commands"] = [r["env"].get("command") for r in recordings]
    env["command"] = " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])
    env["load_averages"] = [r["env"].get("load_average") for r in recordings]
    run_folds = {d: r["config"]["run_folds"] for r in recordings for d in r["config"]["datasets"]}
    config = first["config"] | {"datasets": datasets, "merge": None, "json": None, "plot": None, "partial": None,
                                "resume": False, "from_fold": 0, "search_from": None,
                                "run_folds": min(run_folds.values())}
    if len(set(run_folds.values())) > 1:
        config["run_folds_by_dataset"] = run_folds
    return {"suite": "graph", "env": env, "config": config,
            "rows": rows, "references": [ref for r in recordings for ref in r["references"]],
            "targets": _targets(rows)}


def _join_pieces(recordings: list[dict]) -> list[dict]:
    """Recordings with the pieces of one data set (different folds, each with its per-fold "runs") joined into one
    recording per data set, its rows recomputed from all of their folds.

    Raises:
        ValueError: a data set in recordings without per-fold runs, or the same fold of it twice.
    """
    by: dict[str, list[dict]] = {}
    for r in recordings:
        for d in r["config"]["datasets"]:
            by.setdefault(d, []).append(r)
    out = []
    for d, pieces in by.items():
        if len(pieces) == 1 and len(pieces[0]["config"]["datasets"]) == 1:
            out.append(pieces[0])
            continue
        if any(d not in p.get("runs", {}) for p in pieces):
            raise ValueError(f"graph --merge: data set {d} is in more than one recording, and not every one is a "
                             "piece with per-fold runs (a --partial file)")
        runs, refs = {}, {}
        for p in pieces:
            piece = p["runs"][d]
            folds = sorted({r["fold"] for r in next(iter(piece.values()))})
            if set(folds) & set(refs):
                raise ValueError(f"graph --merge: fold(s) {sorted(set(folds) & set(refs))} of {d} are in more than "
                                 "one recording")
            ref = next(x for x in p["references"] if x["dataset"] == d)
            refs.update(zip(folds, ref["accs"]))
            for pooler, fold_runs in piece.items():
                runs.setdefault(pooler, []).extend(fold_runs)
        runs = {pooler: sorted(v, key=lambda r: r["fold"]) for pooler, v in runs.items()}
        row = next(x for p in pieces for x in p["rows"] if x["dataset"] == d)
        rows = _rows(d, runs, row["graphs"], row["classes"], row["mean_nodes"], list(runs))
        accs = [refs[f] for f in sorted(refs)]
        reference = {"dataset": d, "acc_mean": statistics.mean(accs), "acc_std": statistics.pstdev(accs),
                     "accs": accs, "chance": 1 / row["classes"]}
        first = pieces[0]
        out.append({"suite": "graph", "env": first["env"] | {"pieces": [p["env"] for p in pieces]},
                    "config": first["config"] | {"datasets": [d], "run_folds": len(accs)}, "rows": rows,
                    "references": [reference]})
    return out


def run(args: argparse.Namespace) -> dict:
    """Runs the suite (or, with --merge, joins recordings); prints the header and tables; returns the payload."""
    from fastdist.graph import data

    if args.merge:
        recordings = []
        for path in args.merge:
            with open(path) as f:
                recordings.append(json.load(f))
        result = merge(recordings)
        print(report.format_environment(result["env"]))
        print(report.text_parts(tables(result)))
        return result

    env = report.environment(backend="cpu (plain torch + torch_geometric)", device="cpu", ranks=1,
                             network="none (single process)")
    run_folds = min(args.run_folds or args.folds, args.folds)
    done = _resumed(args, env) if args.resume else {}
    searched = _search_runs(args)
    print(report.format_environment(env))
    with report.torch_threads(args.threads):
        env["torch_threads"] = torch.get_num_threads()
        sets = {}
        for name in args.datasets:
            count = args.graphs or (1797 if name == "digits" else 1000)
            graphs = data.make_dataset(name, min(count, 1797) if name == "digits" else count, seed=args.seed)
            if args.features == "degree":
                graphs = data.with_degree(graphs)
            labels = np.array([g.y for g in graphs])
            sets[name] = (graphs, splits(labels, args.folds, args.val_fraction, args.seed)[:run_folds])
        if args.cost_reps:
            result = _cost(env, args, sets)
            print(report.text_parts(tables(result)))
            return result
        bar = progress(len(sets) * (run_folds - min(args.from_fold, run_folds)) * len(args.poolers), "graph")
        for name, (graphs, fold_splits) in sets.items():
            classes = data.num_classes(name)
            num_nodes = round(statistics.mean(g.num_nodes for g in graphs))
            runs = done.setdefault(name, {p: [] for p in args.poolers})
            for fold, split in enumerate(fold_splits):
                if fold < args.from_fold:
                    continue
                if fold in {r["fold"] for r in runs[args.poolers[0]]}:  # done before the run was resumed
                    for pooler in args.poolers:
                        bar.step(f"{name} fold {fold + 1} {pooler} (resumed)")
                    continue
                shift = fold % len(args.poolers)
                for pooler in args.poolers[shift:] + args.poolers[:shift]:
                    if pooler in AUX_POOLERS and args.search_folds is not None and fold >= args.search_folds:
                        chose = [r for r in runs[pooler] + searched.get(name, {}).get(pooler, [])
                                 if r["fold"] < args.search_folds]
                        weight = _searched_weight(chose)
                        runs[pooler].append(run_fold(graphs, split, pooler, args, classes, num_nodes, fold, weight))
                    else:
                        runs[pooler].append(run_searched(graphs, split, pooler, args, classes, num_nodes, fold))
                    bar.step(f"{name} fold {fold + 1} {pooler}")
                if args.partial:  # every fold so far, in case the run is stopped before it ends
                    _write(args.partial, _collect(env, args, run_folds, sets, done, keep_runs=True))
    result = _collect(env, args, run_folds, sets, done, keep_runs=bool(args.partial))
    print(report.text_parts(tables(result)))
    return result


def _cost(env, args, sets):
    """Epoch time per data set and pooler, the poolers interleaved: the epoch-time target's recording. The loss
    includes the auxiliary losses (at the largest weight of --aux-weights), as a training with them does."""
    from fastdist.bench.toolkit import rounds
    from fastdist.graph import data

    rows, weight = [], max(args.aux_weights)
    for name, (graphs, fold_splits) in sets.items():
        classes, num_nodes = data.num_classes(name), round(statistics.mean(g.num_nodes for g in graphs))
        train = fold_splits[0][0]
        models = {p: _model(graphs, p, args, classes, num_nodes, args.seed) for p in args.poolers}
        gen = torch.Generator().manual_seed(args.seed)
        samples: dict[str, list[float]] = {p: [] for p in args.poolers}
        for _, pooler, timed in rounds(args.poolers, 1, args.cost_reps, f"graph cost {name}"):
            seconds = _train_epoch(*models[pooler], graphs, train, args.batch_size, gen,
                                   weight if pooler in AUX_POOLERS else 0.0)
            if timed:
                samples[pooler].append(seconds)
        for pooler in args.poolers:
            model = models[pooler][0]
            rows.append({"dataset": name, "pooler": pooler, "epoch_ms": 1e3 * statistics.median(samples[pooler]),
                         "epoch_s": samples[pooler], "params": sum(p.numel() for p in model.parameters()),
                         "clusters": model.clusters if pooler in AUX_POOLERS else None,
                         "graphs": len(graphs), "train_graphs": len(train), "mean_nodes": num_nodes})
    config = vars(args) | {"run_folds": 1}
    config.pop("func", None)
    return {"suite": "graph", "mode": "cost", "env": env, "config": config, "rows": rows, "references": [],
            "targets": _targets(rows)}


def _collect(env, args, run_folds, sets, done, keep_runs):
    """The result of the folds in `done` ({data set: {pooler: [run per fold]}}); with keep_runs, those runs too,
    so that --resume can continue it."""
    from fastdist.graph import data

    rows, references = [], []
    for name, runs in done.items():
        folds = sorted(r["fold"] for r in runs[args.poolers[0]])
        if folds:
            graphs, fold_splits = sets[name]
            num_nodes = round(statistics.mean(g.num_nodes for g in graphs))
            rows += _rows(name, runs, len(graphs), data.num_classes(name), num_nodes, args.poolers)
            references.append(_reference(name, graphs, [fold_splits[f] for f in folds], data.num_classes(name)))
    result = _result(env, args, run_folds, rows, references)
    if keep_runs:
        result["runs"] = done
    return result


def _search_runs(args) -> dict:
    """{data set: {pooler: runs of the search folds}} from --search-from, for a piece that starts after them.

    Raises:
        ValueError: such a piece without --search-from, or a --search-from without every search fold.
    """
    if args.search_folds is None or args.from_fold < args.search_folds:
        return {}
    if not args.search_from:
        raise ValueError(f"graph --from-fold {args.from_fold}: the auxiliary-loss weights are chosen on the first "
                         f"{args.search_folds} fold(s); name the piece that ran them with --search-from PATH")
    with open(args.search_from) as f:
        runs = json.load(f).get("runs", {})
    out = {}
    for name in args.datasets:
        out[name] = {p: [r for r in runs.get(name, {}).get(p, []) if r["fold"] < args.search_folds]
                     for p in args.poolers if p in AUX_POOLERS}
        short = [p for p, v in out[name].items() if len(v) < args.search_folds]
        if short:
            raise ValueError(f"graph --search-from {args.search_from}: {name} lacks the first {args.search_folds} "
                             f"fold(s) of {', '.join(short)}")
    return out


def _resumed(args, env) -> dict:
    """The runs per data set, pooler and fold of the stopped run in args.partial; notes the resumption in `env`.

    Raises:
        ValueError: no --partial, or it holds another protocol, data sets or poolers.
    """
    if not args.partial:
        raise ValueError("graph --resume: name the stopped run's file with --partial PATH")
    if not os.path.exists(args.partial):
        return {}  # nothing ran yet: start from the first fold
    with open(args.partial) as f:
        stopped = json.load(f)
    ignore = _PIECE_KEYS + ("func",)
    mine = {k: v for k, v in vars(args).items() if k not in ignore} | {"datasets": args.datasets}
    theirs = {k: v for k, v in stopped["config"].items() if k not in ignore} | {
        "datasets": stopped["config"]["datasets"]}
    diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if diff or "runs" not in stopped:
        raise ValueError(f"graph --resume: {args.partial} is another run (it differs in "
                         f"{', '.join(diff) or 'having no per-fold runs'}); resume it with its own flags")
    # when and under what load each part ran: the first start's environment, every later start's date and load
    env["resumed"] = stopped["env"].get("resumed", []) + [{"date": env.get("date"),
                                                            "load_average": env.get("load_average")}]
    for key in ("date", "load_average"):
        env[key] = stopped["env"].get(key, env.get(key))
    return stopped["runs"]


def _searched_weight(searched: list[dict]) -> float:
    """The auxiliary-loss weight the search folds chose most often (ties: the better mean validation accuracy)."""
    by: dict[float, list[float]] = {}
    for r in searched:
        by.setdefault(r["aux_weight"], []).append(r["val_acc"])
    return max(by, key=lambda w: (len(by[w]), statistics.mean(by[w])))


def _rows(name, runs, num_graphs, classes, num_nodes, poolers):
    rows = []
    for pooler in poolers:
        accs = [r["test_acc"] for r in runs[pooler]]
        epochs = [t for r in runs[pooler] for t in r["epoch_s"]]
        rows.append({"dataset": name, "pooler": pooler, "acc_mean": statistics.mean(accs),
                     "acc_std": statistics.pstdev(accs), "accs": accs,
                     "epoch_ms": 1e3 * statistics.median(epochs), "params": runs[pooler][0]["params"],
                     "epochs_run": [r["epochs"] for r in runs[pooler]],
                     "best_epochs": [r["best_epoch"] for r in runs[pooler]], "epoch_s": epochs,
                     "val_accs": [r["val_acc"] for r in runs[pooler]],
                     "aux_weights": [r["aux_weight"] for r in runs[pooler]] if pooler in AUX_POOLERS else None,
                     "grids": [r.get("grid") for r in runs[pooler]] if pooler in AUX_POOLERS else None,
                     "graphs": num_graphs, "classes": classes, "mean_nodes": num_nodes})
    return rows


def _reference(name, graphs, fold_splits, classes):
    ref = _degree_reference(graphs, fold_splits)
    return {"dataset": name, "acc_mean": statistics.mean(ref), "acc_std": statistics.pstdev(ref), "accs": ref,
            "chance": 1 / classes}


def _result(env, args, run_folds, rows, references):
    config = vars(args) | {"run_folds": run_folds}
    config.pop("func", None)
    if rows:
        config["run_folds"] = min(run_folds, min(len(r["accs"]) for r in rows))
    result = {"suite": "graph", "env": env, "config": config, "rows": rows, "references": references}
    result["targets"] = _targets(rows)
    return result


def _write(path, result):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def _targets(rows):
    """HAP's targets: best mean accuracy on >= 3 of >= 5 data sets and never more than one std below the best;
    epoch time within 2x of DiffPool's at the same number of clusters. HAP is "hap"; its ablations and candidate
    fixes are not its competitors, so the best other is the best of the rest."""
    lines, checks = [], {}
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    by = {(r["dataset"], r["pooler"]): r for r in rows}
    if (all((d, "hap") in by for d in datasets) and any(not r["pooler"].startswith("hap") for r in rows)
            and all("acc_mean" in r for r in rows)):
        best_count, within = 0, True
        detail = []
        for d in datasets:
            others = [r for r in rows if r["dataset"] == d and not r["pooler"].startswith("hap")]
            best = max(others, key=lambda r: r["acc_mean"])
            hap = by[(d, "hap")]
            wins = hap["acc_mean"] >= best["acc_mean"]
            best_count += wins
            near = wins or hap["acc_mean"] >= best["acc_mean"] - best["acc_std"]
            within &= near
            detail.append(f"{d}: hap {100 * hap['acc_mean']:.1f}, best other {best['pooler']} "
                          f"{100 * best['acc_mean']:.1f}+-{100 * best['acc_std']:.1f}")
        need = min(3, len(datasets))
        checks["best_on_3"] = best_count >= need and within
        lines.append(f"target: HAP best on >= {need} of {len(datasets)} data sets and within one std of the best "
                     f"elsewhere: {'met' if checks['best_on_3'] else 'NOT met'} (best on {best_count}; "
                     + "; ".join(detail) + ")")
    for d in datasets:
        hap, diff = by.get((d, "hap")), by.get((d, "diffpool"))
        if hap and diff:
            ratio = hap["epoch_ms"] / diff["epoch_ms"]
            checks[f"{d}_epoch_2x"] = ratio <= 2
            lines.append(f"target: {d} epoch time within 2x of diffpool: {'met' if ratio <= 2 else 'NOT met'} "
                         f"({ratio:.2f}x)")
    return {"checks": checks, "lines": lines}


def _scale(c):
    folds = f"{c['run_folds']} of {c['folds']} folds" if c["run_folds"] < c["folds"] else f"{c['folds']} folds"
    if c.get("run_folds_by_dataset"):  # a merge of runs stopped at different folds
        folds = f"of {c['folds']} folds " + ", ".join(f"{n} on {d}" for d, n in c["run_folds_by_dataset"].items())
    graphs = c["graphs"] or "1000 (digits 1797)"
    if "aux_weights" in c:
        weights = c["aux_weights"]
        where = ("per fold" if not c.get("search_folds") else
                 f"on the first {c['search_folds']} fold(s), then kept" if c["search_folds"] > 1 else
                 "on the first fold, then kept")
        aux = (f"auxiliary losses x{weights[0]:g}" if len(weights) == 1 else "auxiliary-loss weight chosen from {"
               + ", ".join(f"{w:g}" for w in weights) + f"}} by validation accuracy {where}")
    else:  # recordings from before the search
        aux = f"auxiliary losses x{c.get('aux_weight', 1.0):g}"
    features = {"degree": "one-hot degree node features, ", "plain": "no degree features, "}[c.get("features",
                                                                                               "plain")]
    return (f"{folds}, up to {c['epochs']} epochs (patience {c['patience']}), {graphs} graphs per set, {features}"
            f"{c['encoder']} encoder, {c.get('readout', 'mean')} readout, hidden {c['hidden']}, {c['levels']} levels, "
            f"ratio {c['ratio']}, {aux}, Adam lr {c['lr']}, batch {c['batch_size']}, {c['threads']} torch "
            "thread(s); mean +- std of test accuracy (%) over folds")


def _cost_part(result: dict) -> report.Part:
    c = result["config"]
    by = {(r["dataset"], r["pooler"]): r for r in result["rows"]}

    def vs_diffpool(r):
        diff = by.get((r["dataset"], "diffpool"))
        return r["epoch_ms"] / diff["epoch_ms"] if diff else None

    cols = [col("data set", "dataset"), col("pooler", "pooler"),
            col("clusters", lambda r: ", ".join(map(str, r["clusters"])) if r.get("clusters") else None),
            col("epoch (ms)", "epoch_ms", fixed(0)), col("fastest (ms)", lambda r: 1e3 * min(r["epoch_s"]), fixed(0)),
            col("x diffpool", vs_diffpool, fixed(2)), col("parameters", "params", integer)]
    caption = (f"One training epoch ({result['rows'][0]['train_graphs']} graphs of the first of {c['folds']} folds, "
               f"batch {c['batch_size']}, hidden {c['hidden']}, {c['levels']} levels, ratio {c['ratio']}, "
               f"{c['encoder']} encoder, {c['readout']} readout, auxiliary losses in the loss at weight "
               f"{max(c['aux_weights']):g}, {c['threads']} torch thread(s)): median of {c['cost_reps']} epochs per "
               "pooler after one warm-up, the poolers interleaved in a rotated order; dense poolers at the same "
               "clusters per level.")
    return report.Part("cost", cols, result["rows"], caption, list(result.get("targets", {}).get("lines", [])))


def tables(result: dict) -> list[report.Part]:
    """The suite's tables of `result` (its JSON payload): accuracy per pooler and data set, then cost."""
    rows = result["rows"]
    if result.get("mode") == "cost":
        return [_cost_part(result)]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    poolers = list(dict.fromkeys(r["pooler"] for r in rows))
    by = {(r["dataset"], r["pooler"]): r for r in rows}
    best = {d: max(r["acc_mean"] for r in rows if r["dataset"] == d) for d in datasets}
    refs = {r["dataset"]: r for r in result.get("references", [])}

    def cell(d):
        def value(row):
            r = row.get(d)
            if r is None:
                return None
            mark = " **" if r["acc_mean"] == best[d] else ""
            return f"{100 * r['acc_mean']:.1f} ± {100 * r['acc_std']:.1f}{mark}"
        return value

    wide = [{"pooler": p} | {d: by.get((d, p)) for d in datasets} for p in poolers]
    wide.append({"pooler": "degree-histogram LR (structure-blind)"} | {d: refs.get(d) for d in datasets})
    acc_cols = [col("pooler", "pooler")] + [col(f"{d} (%)", cell(d), text, numeric=True) for d in datasets]
    caption = _scale(result["config"]) + "; ** marks the best per data set."
    notes = list(result.get("targets", {}).get("lines", []))
    cost_cols = [col("data set", "dataset"), col("pooler", "pooler"), col("epoch (ms)", "epoch_ms", fixed(0)),
                 col("parameters", "params", integer),
                 col("epochs run (mean)", lambda r: statistics.mean(r["epochs_run"]), fixed(1))]
    # columns that old recordings lack come out empty, and the table drops them
    cost_cols += [col("validation (%)", lambda r: 100 * statistics.mean(r["val_accs"]) if "val_accs" in r else None,
                      fixed(1)),
                  col("aux weight per fold", lambda r: ", ".join(f"{w:g}" for w in r["aux_weights"])
                      if r.get("aux_weights") else None)]
    return [report.Part("accuracy", acc_cols, wide, caption, notes),
            report.Part("cost", cost_cols, rows, "Epoch time: median wall time of one training epoch over all "
                        "epochs of all folds (of every run of the auxiliary-weight search).")]


def plot(result: dict, path: str) -> None:
    """Writes grouped bars of mean accuracy (+- std over folds) per data set and pooler to `path` (of epoch time,
    for a --cost-reps recording)."""
    rows = result["rows"]
    if result.get("mode") == "cost":
        datasets = list(dict.fromkeys(r["dataset"] for r in rows))
        poolers = list(dict.fromkeys(r["pooler"] for r in rows))
        by = {(r["dataset"], r["pooler"]): r for r in rows}
        _, fig, ax = report.subplots(figsize=(max(6.0, 1.6 * len(datasets) * math.sqrt(len(poolers))), 4.5))
        report.grouped_bars(ax, datasets, {p: [by[(d, p)]["epoch_ms"] if (d, p) in by else 0 for d in datasets]
                                           for p in poolers}, "training epoch (ms), median")
        ax.legend(fontsize=7, ncol=min(5, len(poolers)))
        ax.grid(True, axis="y", alpha=0.3)
        report.save_figure(fig, path)
        return
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    poolers = list(dict.fromkeys(r["pooler"] for r in rows))
    by = {(r["dataset"], r["pooler"]): r for r in rows}
    refs = {r["dataset"]: r for r in result.get("references", [])}
    _, fig, ax = report.subplots(figsize=(max(6.0, 1.6 * len(datasets) * math.sqrt(len(poolers))), 4.5))

    def percent(key):
        return {p: [100 * by[(d, p)][key] if (d, p) in by else 0 for d in datasets] for p in poolers}

    means = percent("acc_mean")
    positions = report.grouped_bars(ax, datasets, means, "test accuracy (%), mean ± std over folds",
                                    errors=percent("acc_std"))
    if "hap" in poolers:  # HAP's bars outlined
        ax.bar(positions[poolers.index("hap")], means["hap"], 0.8 / len(poolers), fill=False, edgecolor="black")
    for j, d in enumerate(datasets):
        if d in refs:
            ax.hlines(100 * refs[d]["acc_mean"], j - 0.45, j + 0.45, colors="gray", linestyles="dashed",
                      label="degree-histogram LR" if j == 0 else None)
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, ncol=min(5, len(poolers) + 1))
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(textwrap.fill(f"fastdist-bench graph: {_scale(result['config'])}", 100), fontsize=7)
    report.save_figure(fig, path)
