"""Tables of recorded benchmark results, generated from bench/*.json into the docs.

A docs page holds generated blocks between two markers; the prose around them is written by hand:

    <!-- results:sparse-4r-1gbit -->
    (generated: source, environment, tables)
    <!-- /results -->

The name after ``results:`` is a recorded file's path under the bench folder without ``.json``, optionally
followed by ``#part`` to show one of its tables (``kernels-cpu#sketch``); ``results:index`` lists every
recorded file and the pages that show it.

    python -m fastdist.bench.results [BENCH_DIR] [DOCS_DIR]           rewrite the blocks (make docs)
    python -m fastdist.bench.results [BENCH_DIR] [DOCS_DIR] --check   change nothing; exit 1 with a diff if stale

The check also fails when a marker names no recorded file or part, when a recorded file has no renderer for
its suite, and when a recorded file is shown on no page. Files that are not suite results are skipped only
when listed in ``NOT_SUITE_RESULTS`` with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import statistics
import sys
from typing import Any, Callable, Iterable, Sequence

NOT_SUITE_RESULTS: dict[str, str] = {}
"""Recorded JSON files (names relative to the bench folder) that are not suite results, with the reason."""

INDEX = "index"
_BLOCK = re.compile(r"(<!-- results:(?P<name>[^\s>]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
_START = re.compile(r"<!-- results:(?P<name>[^\s>]+) -->")

Row = dict[str, Any]


# ---- cell formats: one per column, so a column never mixes 101.9 with 82.590 ----

def fixed(digits: int) -> Callable[[Any], str]:
    """A number with `digits` decimals."""
    return lambda v: f"{v:.{digits}f}"


def times(digits: int = 2) -> Callable[[Any], str]:
    """A ratio written as a factor: 1.38x."""
    return lambda v: f"{v:.{digits}f}x"


def percent(digits: int = 1, signed: bool = False) -> Callable[[Any], str]:
    """A fraction written as a percentage: 0.0123 -> 1.2 (the header carries the %)."""
    sign = "+" if signed else ""
    return lambda v: f"{100 * v:{sign}.{digits}f}"


def scaled(divisor: float, digits: int) -> Callable[[Any], str]:
    """A number divided by `divisor` (a unit change: bytes -> MiB), with `digits` decimals."""
    return lambda v: f"{v / divisor:.{digits}f}"


def scientific(digits: int = 2) -> Callable[[Any], str]:
    """A number in scientific notation, zero written as 0."""
    return lambda v: "0" if v == 0 else f"{v:.{digits}e}"


def integer(v: Any) -> str:
    """A count."""
    return str(int(v))


def text(v: Any) -> str:
    """Any value as it reads."""
    return str(v)


KIB, MIB = 2 ** 10, 2 ** 20


@dataclasses.dataclass(frozen=True)
class Column:
    """One table column: its header (with the unit), how a row gives its value, and the value's format.

    A value of None is written as ``-``; a column whose values are all None is left out (older recordings
    lack some fields).
    """

    header: str
    value: Callable[[Row], Any]
    fmt: Callable[[Any], str] = text
    numeric: bool = True


def col(header: str, key: str | Callable[[Row], Any], fmt: Callable[[Any], str] = text,
        numeric: bool | None = None) -> Column:
    """A column reading `key` from each row (a field name, or a function of the row)."""
    value = key if callable(key) else (lambda r, k=key: r.get(k))
    return Column(header, value, fmt, numeric if numeric is not None else fmt not in (text,))


def markdown_table(columns: Sequence[Column], rows: Iterable[Row]) -> str:
    """A Markdown table: numbers right-aligned, text left-aligned."""
    rows = list(rows)
    values = [[c.value(r) for c in columns] for r in rows]
    keep = [i for i, c in enumerate(columns) if any(v[i] is not None for v in values)]
    header = "| " + " | ".join(columns[i].header for i in keep) + " |"
    rule = "|" + "|".join("---:" if columns[i].numeric else "---" for i in keep) + "|"
    body = ["| " + " | ".join("-" if v[i] is None else columns[i].fmt(v[i]) for i in keep) + " |" for v in values]
    return "\n".join([header, rule] + body)


@dataclasses.dataclass(frozen=True)
class Part:
    """One named part of a recorded file's block: an optional caption, a table, optional notes under it."""

    name: str
    table: str
    caption: str = ""
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        out = [self.caption, self.table, "\n".join(f"- {n}" for n in self.notes)]
        return "\n\n".join(s for s in out if s)


# ---- the suites ----

def _shape(r: Row) -> str:
    shape = r["shape"]
    return shape if isinstance(shape, str) else "x".join(map(str, shape))


def _network_rate(net: str) -> str:
    m = re.search(r"([\d.]+ [MG]bit/s)", net or "")
    return m.group(1) if m else (net or "-")


def _collectives(d: dict) -> list[Part]:
    columns = [col("collective", "collective"), col("size (B)", "size", integer), col("count", "count", integer),
               col("dtype", "dtype"), col("time (us)", "time_us", fixed(1)), col("algbw (GB/s)", "algbw", fixed(4)),
               col("busbw (GB/s)", "busbw", fixed(4)), col("wire (B/rank)", "wire_bytes", integer),
               col("tx (B/rank)", "tx_bytes", integer), col("wrong", "wrong", integer)]
    return [Part("collectives", markdown_table(columns, d["rows"]))]


def _kernels(d: dict) -> list[Part]:
    """One part per op family: 'bitpack' and 'sketch' in recordings that kept the sketch ops in `sketch_rows`,
    each row's `family` in recordings that cover every family in `rows`."""
    caption = f"Copy bandwidth (median over the run): {d['copy_gbps']:.1f} GB/s."
    timing = [col("time (us)", lambda r: 1e6 * r["median_s"], fixed(1)), col("GB/s", "gbps", fixed(2)),
              col("of copy (%)", "pct_copy", fixed(1)), col("torch (GB/s)", "torch_gbps", fixed(3)),
              col("vs torch", "speedup", times(1))]
    if "sketch_rows" in d:
        bitpack = [col("op", "op"), col("elements", "size", integer), col("moved (MiB)", "bytes", scaled(MIB, 2))]
        sketch = [col("op", "op"), col("shape", _shape), col("granularity", "granularity"),
                  col("density (%)", "density", percent(1)), col("cols", "cols", integer),
                  col("values (MiB)", "bytes", scaled(MIB, 2))]
        return [Part("bitpack", markdown_table(bitpack + timing, d["rows"]), caption),
                Part("sketch", markdown_table(sketch + timing, d["sketch_rows"]), caption)]
    columns = [col("op", "op"), col("input", "case"), col("moved (MiB)", "bytes", scaled(MIB, 2))] + timing
    families = dict.fromkeys(r["family"] for r in d["rows"])
    return [Part(f, markdown_table(columns, [r for r in d["rows"] if r["family"] == f]), caption) for f in families]


def _compress_kernels(d: dict) -> list[Part]:
    columns = [col("op", "op"), col("shape", _shape), col("k", "k", integer),
               col("fastdist (us)", "time_us", fixed(0)), col("torch (us)", "torch_us", fixed(0)),
               col("vs torch", "speedup", times(2)), col("GB/s", "gbps", fixed(2)),
               col("of copy (%)", "of_copy", percent(0))]
    caption = f"Copy bandwidth: {d['copy_gbps']:.1f} GB/s."
    return [Part("kernels", markdown_table(columns, d["rows"]), caption)]


def _compress(d: dict) -> list[Part]:
    c = d["config"]
    caption = (f"{d['env'].get('ranks')} stages (one rank each), activation [{c['batch']}, {c['seq']}, "
               f"{c['hidden']}] float32 per boundary; median of {c['steps']} steps after {c['warmup']} warm-up.")
    columns = [col("method", "method"), col("step (ms)", "time_ms", fixed(1)), col("vs none", "speedup", times(2)),
               col("link, model (ms)", "link_ms_model", fixed(1)),
               col("fwd (B/boundary)", "fwd_wire_bytes", integer), col("bwd (B/boundary)", "bwd_wire_bytes", integer),
               col("tx (B/boundary)", "tx_bytes", integer),
               col("fwd ratio", lambda r: r["dense_bytes"] / r["fwd_wire_bytes"], times(1))]
    return [Part("pipeline", markdown_table(columns, d["rows"]), caption)]


def _compress_findings(d: dict) -> list[Part]:
    c = d["config"]
    parts = []
    for task in c["tasks"]:
        metric = "test accuracy" if task == "cnn" else "held-out loss (nats)"
        caption = (f"{task}: {c['epochs']} epochs, {c['train']} training samples, seed {c['seed']}; "
                   f"{'higher' if task == 'cnn' else 'lower'} is better.")
        columns = [col("row", "row"), col(f"{metric}, compressed inference", "compressed", fixed(3)),
                   col(f"{metric}, uncompressed inference", "uncompressed", fixed(3)),
                   col("train loss, last epoch", "train_loss_last_epoch", fixed(3)),
                   col("diverged", lambda r: "yes" if r["diverged"] else "no", numeric=False),
                   col("time (s)", "seconds", fixed(1))]
        parts.append(Part(task, markdown_table(columns, [r for r in d["rows"] if r["task"] == task]), caption))
    return parts


def _per_step(r: Row, value: float) -> float:
    return value / max(1, len(r["samples_ms"]) // len(r["rounds"]))


def _plan(r: Row) -> str | None:
    plan = r.get("plan")
    if not plan:
        return None
    n = {a: sum(1 for v in plan["actions"].values() if v == a) for a in ("keep", "swap", "recompute")}
    return f"{n['keep']}/{n['swap']}/{n['recompute']}" + ("" if plan["fits"] else " (no fit)")


def _memory(d: dict) -> list[Part]:
    c = d["config"]
    caption = (f"{c['threads']} torch thread per run, {c['rounds']} rounds x {c['steps']} timed steps, policy "
               f"{c['policy']}, min_bytes {c['min_bytes'] // KIB} KiB, prefetch depth {c['depth']}; swapped and copy "
               "figures per timed step.")

    def prefetcher(key: str, scale: float) -> Callable[[Row], float | None]:
        return lambda r: _per_step(r, scale * r["prefetcher"][key]) if r.get("prefetcher") else None

    columns = [col("model", "model"), col("config", "config"), col("batch", "batch", integer),
               col("step (ms)", "step_ms", fixed(0)), col("overhead (%)", "overhead", percent(1, signed=True)),
               col("activation peak (MiB)", lambda r: r["activation_peak_bytes"] / MIB, fixed(1)),
               col("saved (%)", "memory_saved", percent(1, signed=True)),
               col("swapped (MiB/step)", prefetcher("bytes_swapped", 1 / MIB), fixed(0)),
               col("copy (ms/step)", prefetcher("copy_seconds", 1e3), fixed(1)),
               col("exposed (ms/step)", prefetcher("exposed_wait_seconds", 1e3), fixed(2)),
               col("copy hidden (%)", "hidden_fraction", percent(1)),
               col("plan keep/swap/recompute", _plan, numeric=False)]
    notes = tuple(line.lstrip("# ") for line in (d.get("targets") or {}).get("lines", []))
    return [Part("memory", markdown_table(columns, d["rows"]), caption, notes)]


def _moe(d: dict) -> list[Part]:
    c = d["config"]
    ranks = d["env"].get("ranks")
    caption = (f"d_model {c['d_model']}, d_ff {c['d_ff']}, {c['experts_per_rank'] * ranks} experts "
               f"({c['experts_per_rank']}/rank), top-{c['k']}, {c['tokens']} tokens/rank, Zipf {c['zipf']} drifting "
               f"every {c['drift_every']} steps; median of {c['steps']} steps after {c['warmup']} warm-up.")
    columns = [col("method", "method"), col("fwd+bwd (ms)", "time_ms", fixed(1)),
               col("vs dropless", "speedup_vs_dropless", times(2)),
               col("tokens/rank max/mean", "tokens_max_over_mean", fixed(2)),
               col("a2a bytes max/mean", "a2a_max_over_mean", fixed(2)),
               col("std tokens/rank before", "std_before", fixed(0)), col("after", "std_after", fixed(0)),
               col("dropped", "dropped", integer), col("replicas", "replicas", integer),
               col("predicted (ms)", "predicted_ms", fixed(1)),
               col("model error, medians (%)", "model_error_of_medians", percent(1)),
               col("model error, per step (%)", "model_error", percent(1))]
    rows = d["rows"]
    notes = [f"cost model: mean error {100 * statistics.mean(r['model_error_of_medians'] for r in rows):.1f}% over "
             f"the {len(rows)} methods (median predicted vs median measured), "
             f"{100 * statistics.mean(r['model_error'] for r in rows):.1f}% per step."]
    layout = d.get("layout")
    if layout:
        notes.append(f"moe_layout, {layout['assignments']} assignments, {layout['threads']} threads "
                     f"({layout['device']}): fastdist {layout['fastdist']['median_ms']:.2f} ms, torch sort/bincount "
                     f"{layout['torch']['median_ms']:.2f} ms ({layout['speedup']:.1f}x).")
    parts = [Part("layer", markdown_table(columns, rows), caption, tuple(notes))]
    if d.get("projection"):
        methods = ("dropless", "shadow", "prophet")
        proj = [col("ranks", "ranks", integer), col("experts", "experts", integer)]
        proj += [col(f"{m} (ms)", lambda r, m=m: r["predicted_ms"][m], fixed(1)) for m in methods]
        proj += [col("prophet vs dropless", "prophet_vs_dropless", times(2)),
                 col("prophet vs shadow", "prophet_vs_shadow", times(2)),
                 col("tokens max/mean, dropless", lambda r: r["tokens_max_over_mean"]["dropless"], fixed(2)),
                 col("tokens max/mean, prophet", lambda r: r["tokens_max_over_mean"]["prophet"], fixed(2))]
        parts.append(Part("projection", markdown_table(proj, d["projection"]),
                          "Projection from the calibrated cost model (not measured): Zipf popularity over a random "
                          "expert order."))
    return parts


def _sparse(d: dict) -> list[Part]:
    c = d["config"]
    size = c.get("sketch_size", c.get("sketch_ratio"))
    sizing = (f"{c['sketch_rows']} rows holding {size} x the union's values in all" if "sketch_size" in c
              else f"{c['sketch_rows']} rows of {size} x the union's values each")
    caption = (f"Gradient {c['rows']} x {c['dim']} float32, Zipf({c['zipf']}) rows, seed {c['seed']}; sketch "
               f"{sizing}; PowerSGD rank {c['powersgd_rank']}; median of {c['reps']} after {c['warmup']} warm-up.")

    def note(r: Row) -> str:
        notes = []
        if r["method"] == "auto":
            notes.append("chose " + ", ".join(r["ran"]))
            if r.get("explore_ms") is not None:
                notes.append(f"explored {r['explore_ms']:.0f} ms")
        if r.get("sketch_shape"):
            notes.append("x".join(map(str, r["sketch_shape"])))
        if r.get("topk_k"):
            notes.append(f"k={r['topk_k']}")
        return ", ".join(notes)

    columns = [col("method", "method"), col("rows, local (%)", "density", percent(1)),
               col("union (%)", "density_union", percent(2)), col("time (ms)", "time_ms", fixed(1)),
               col("vs dense", "speedup", times(2)), col("wire (MiB/rank)", "wire_bytes", scaled(MIB, 2)),
               col("tx (MiB/rank)", "tx_bytes", scaled(MIB, 2)), col("rel. error", "rel_error", scientific(2)),
               col("eff. algbw (GB/s)", "algbw", fixed(3)), col("note", note, numeric=False)]
    return [Part("sparse", markdown_table(columns, d["rows"]), caption)]


def _reduced_as(r: Row) -> str | None:
    counts = r.get("chosen_counts") or {}
    return "; ".join(f"{m}: " + ", ".join(f"{how} x{n}" for how, n in c.items()) for m, c in counts.items()) or None


def _sparse_lm(d: dict) -> list[Part]:
    c = d["config"]
    embed = c.get("embed_dim") or c["dim"]
    caption = (f"Embedding({c['vocab']}, {embed}) + LSTM({embed} -> {c['dim']}) + output embedding "
               f"({c['vocab']}, {c['dim'] + 1}), sampled softmax ({c['negatives']} negatives), {c['optimizer']} "
               f"lr {c['lr']}; {c['batch']} x {c['seq']} tokens per rank and step, {c['steps']} steps, seed {c['seed']}.")
    lossless = col("lossless", lambda r: "yes" if r["lossless"] else "no", numeric=False)
    methods = d["methods"]
    main = [col("method", "method"), col("final loss", "final_loss", fixed(3)),
            col("vs dense (%)", "loss_vs_dense", percent(2, signed=True)),
            col("step (ms)", lambda r: 1e3 * r["median_step_s"], fixed(1)),
            col("vs dense", "speedup_vs_dense", times(2)),
            col("wire (KiB/rank/step)", "median_wire_bytes", scaled(KIB, 1)),
            col("tx (KiB/rank/step)", "median_tx_bytes", scaled(KIB, 1)), lossless,
            col("reduced as (steps)", _reduced_as, numeric=False)]
    pareto = [col("method", "method"), col("wire (KiB/rank/step)", "median_wire_bytes", scaled(KIB, 1)),
              col("of best lossless sparse (%)", "bytes_vs_best_lossless_sparse", percent(1)),
              col("V-row matrices (KiB/rank/step)", "median_sparse_wire_bytes", scaled(KIB, 1)),
              col("of best lossless sparse (%)", "sparse_bytes_vs_best_lossless_sparse", percent(1)),
              col("final loss", "final_loss", fixed(3)),
              col("vs dense (%)", "loss_vs_dense", percent(2, signed=True)), lossless,
              col("Pareto", lambda r: "*" if r["pareto"] else "", numeric=False)]
    by_bytes = sorted(methods, key=lambda r: r["median_wire_bytes"])
    return [Part("methods", markdown_table(main, methods), caption),
            Part("pareto", markdown_table(pareto, by_bytes),
                 "Wire bytes against final loss, by bytes (V-row matrices: the two embeddings' bytes alone).",
                 tuple(d.get("notes", ())))]


def _tp(d: dict) -> list[Part]:
    parts = []
    for run in d["runs"]:
        where = f"{run['label']}, {_network_rate(run['network'])}"
        if run.get("op_rows"):
            base = run["op_rows"][0]["time_ms"]
            columns = [col("chunks k", lambda r: f"{r['k']} ({r['chunks']})" if r["k"] == "auto" else r["k"],
                           numeric=False),
                       col("time (ms)", "time_ms", fixed(1)), col("vs k=1", lambda r: base / r["time_ms"], times(2)),
                       col("predicted (ms)", "predicted_ms", fixed(1)),
                       col("model error (%)", lambda r: r["predicted_ms"] / r["time_ms"] - 1, percent(0, signed=True))]
            gemm = ", ".join(f"k={g['k']} {g['time_ms']:.1f} ms" for g in run.get("gemm_rows") or [])
            shape = "x".join(map(str, d["op_shape"]))
            parts.append(Part(f"op-{run['net']}", markdown_table(columns, run["op_rows"]),
                              f"Row-parallel op {shape}, {where}; median of {d['op_reps']}.",
                              (f"the GEMMs alone (no collective): {gemm}",) if gemm else ()))
        if run.get("block_rows"):
            times_ = {r["variant"]: r["time_ms"] for r in run["block_rows"]}

            def baseline(r: Row) -> float:
                return times_["megatron+recompute" if "+" in r["variant"] else "megatron"]

            columns = [col("GPT block", "variant"), col("fwd+bwd (ms)", "time_ms", fixed(1)),
                       col("vs Megatron", lambda r: baseline(r) / r["time_ms"], times(2))]
            shape = ", ".join(f"{k} {v}" for k, v in zip(("hidden", "heads", "seq", "batch"), d["block"]))
            parts.append(Part(f"block-{run['net']}", markdown_table(columns, run["block_rows"]),
                              f"GPT block ({shape}), {where}; median of {d['reps']}; +recompute rows against "
                              "Megatron with checkpointing."))
    return parts


RENDERERS: dict[str, Callable[[dict], list[Part]]] = {
    "collectives": _collectives,
    "compress": _compress,
    "compress-findings": _compress_findings,
    "compress-kernels": _compress_kernels,
    "kernels": _kernels,
    "memory": _memory,
    "moe": _moe,
    "sparse": _sparse,
    "sparse-lm": _sparse_lm,
    "tp": _tp,
}
"""Suite name (the JSON's ``suite`` field) -> its tables."""


# ---- recorded files, blocks, pages ----

def _command(env: dict) -> str:
    words = env.get("command", "").split()
    if words and words[0] in ("__main__.py", "cli.py"):
        words[0] = "fastdist-bench"
    return " ".join(words)


def environment_line(env: dict) -> str:
    """The recorded environment header in one line."""
    fields = [env.get("date"), f"fastdist {env.get('fastdist')}", f"torch {env.get('torch')}", env.get("backend"),
              env.get("device"), f"ranks {env.get('ranks')}", env.get("network"),
              f"{env.get('host_cpus')} host CPUs, {env.get('torch_threads')} torch threads",
              f"CUDA kernels: {'yes' if env.get('cuda_kernels') else 'no'}"]
    return " · ".join(str(f) for f in fields if f)


@dataclasses.dataclass
class Recorded:
    """One recorded result file and its rendered parts."""

    name: str
    path: str
    data: dict
    parts: list[Part]

    def block(self, part: str | None, link: str) -> str:
        head = (f"*Generated by `make docs` from [bench/{self.name}.json]({link}); edit the prose around it, not "
                f"this block.* Command: `{_command(self.data['env'])}`  \n{environment_line(self.data['env'])}")
        shown = self.parts if part is None else [p for p in self.parts if p.name == part]
        return "\n\n".join([head] + [p.render() for p in shown]) + "\n"


def load_results(bench_dir: str) -> tuple[dict[str, Recorded], list[str], list[str]]:
    """Every recorded JSON under `bench_dir`, rendered.

    Returns:
        (recorded files by name, skipped files with their reasons, errors).
    """
    recorded, skipped, errors = {}, [], []
    for root, _, files in sorted(os.walk(bench_dir)):
        for f in sorted(files):
            if not f.endswith(".json"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, bench_dir).replace(os.sep, "/")
            if rel in NOT_SUITE_RESULTS:
                skipped.append(f"{rel}: {NOT_SUITE_RESULTS[rel]}")
                continue
            with open(path) as fh:
                data = json.load(fh)
            suite = data.get("suite") if isinstance(data, dict) else None
            if suite not in RENDERERS:
                errors.append(f"{path}: no renderer for suite {suite!r} (add one to RENDERERS, or list the file in "
                              "NOT_SUITE_RESULTS with the reason it is not a suite result)")
                continue
            name = rel[:-len(".json")]
            recorded[name] = Recorded(name, path, data, RENDERERS[suite](data))
    return recorded, skipped, errors


def _pages(docs_dir: str) -> list[str]:
    return sorted(os.path.join(root, f) for root, _, files in os.walk(docs_dir) for f in files if f.endswith(".md"))


def _index(recorded: dict[str, Recorded], shown: dict[str, list[str]], doc: str) -> str:
    columns = [col("recorded file", lambda r: f"[{r.name}.json]({os.path.relpath(r.path, os.path.dirname(doc))})",
                   numeric=False),
               col("suite", lambda r: r.data["suite"]), col("date", lambda r: r.data["env"].get("date")),
               col("ranks", lambda r: r.data["env"].get("ranks"), integer),
               col("network", lambda r: r.data["env"].get("network")),
               col("shown on", lambda r: ", ".join(
                   f"[{os.path.basename(p)}]({os.path.relpath(p, os.path.dirname(doc))})"
                   for p in shown.get(r.name, [])), numeric=False)]
    return ("*Generated by `make docs` from the recorded files in bench/.*\n\n"
            + markdown_table(columns, recorded.values()) + "\n")


def render_docs(bench_dir: str, docs_dir: str) -> tuple[dict[str, tuple[str, str]], list[str], list[str]]:
    """Each docs page's current and regenerated text.

    Returns:
        ({page path: (current text, regenerated text)}, skipped recorded files with reasons, errors).
    """
    recorded, skipped, errors = load_results(bench_dir)
    pages = {p: open(p).read() for p in _pages(docs_dir)}
    shown: dict[str, list[str]] = {}
    for page, content in pages.items():
        if content.count("<!-- results:") != content.count("<!-- /results -->"):
            errors.append(f"{page}: a results marker without its end marker (or the reverse)")
        for m in _START.finditer(content):
            name = m.group("name").split("#")[0]
            if name != INDEX:
                shown.setdefault(name, []).append(page)

    out = {}
    for page, content in pages.items():
        def fill(m: re.Match, page: str = page) -> str:
            name, _, part = m.group("name").partition("#")
            if name == INDEX:
                body = _index(recorded, shown, page)
            elif name not in recorded:
                errors.append(f"{page}: marker names {m.group('name')!r}, but {bench_dir}/{name}.json is not a "
                              "recorded suite result")
                return m.group(0)
            elif part and part not in [p.name for p in recorded[name].parts]:
                errors.append(f"{page}: {name}.json has no part {part!r} (it has "
                              f"{', '.join(p.name for p in recorded[name].parts)})")
                return m.group(0)
            else:
                body = recorded[name].block(part or None, os.path.relpath(recorded[name].path, os.path.dirname(page)))
            return m.group(1) + body + m.group(4)
        out[page] = (content, _BLOCK.sub(fill, content))
    for name in recorded:
        if name not in shown:
            errors.append(f"{bench_dir}/{name}.json is shown on no page in {docs_dir}: add a "
                          f"<!-- results:{name} --> block where its findings are discussed")
    return out, skipped, errors


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate (or, with --check, verify) the results blocks of the docs. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m fastdist.bench.results", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_dir", nargs="?", default="bench", help="recorded results (default: bench)")
    parser.add_argument("docs_dir", nargs="?", default="docs", help="pages with results blocks (default: docs)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff when stale")
    args = parser.parse_args(argv)

    pages, skipped, errors = render_docs(args.bench_dir, args.docs_dir)
    for s in skipped:
        print(f"skipped {s}")
    stale = [p for p, (old, new) in pages.items() if old != new]
    for page in stale:
        old, new = pages[page]
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       f"{page} (in the tree)", f"{page} (from {args.bench_dir})"))
        else:
            with open(page, "w") as f:
                f.write(new)
            print(f"updated {page}")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if args.check and stale:
        print(f"{len(stale)} page(s) stale: run `make docs`", file=sys.stderr)
    return 1 if errors or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
