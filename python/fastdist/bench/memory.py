"""`fastdist-bench memory`: activation memory and step time of swap / recompute plans against their peers.

Models (CPU): a small transformer (pre-norm encoder blocks, token embedding, LM head) and a small CNN
(residual conv blocks). Configurations, each run in its own process (so that peak memory is the process's own):

  none          plain training step (forward + backward)
  checkpoint    torch.utils.checkpoint (non-reentrant) on every block
  save_on_cpu   torch.autograd.graph.save_on_cpu(pin_memory=True) around forward (on a CPU machine this
                copies every saved tensor to another CPU tensor: no saving, the copy's cost only)
  swap          fastdist.memory.SwapPrefetcher around forward (every saved tensor >= --min-bytes swapped)
  fastdist-P    fastdist.memory.plan(policy=--policy) at a budget of P % of the unoptimized saved activation
                bytes (as profiled), installed with fastdist.memory.apply

Memory: the step's activation peak, VmHWM over the timed steps (reset after warm-up through /proc/self/clear_refs)
minus the resident size before them; children run with MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns freed
large blocks to the OS. On CUDA: torch.cuda.max_memory_allocated minus the allocation before. Time: median step
over every round (each configuration once per round, in a fresh process, the order rotated); overhead against
`none`. Prefetcher runs also show copy time, exposed wait and the hidden fraction 1 - exposed/copy.

GPU (--device cuda --memory-cap GIB --scale gpt --models resnet50,transformer): each run caps its CUDA memory
with torch.cuda.set_per_process_memory_fraction, searches the largest batch whose step fits (doubling, then
bisection; fastdist plans are made at the default batch and kept) and reports throughput at that batch.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
from torch import nn

from fastdist.bench import report
from fastdist.bench.peers import checkpointed
from fastdist.bench.report import KIB, MIB, col, fixed, integer, percent
from fastdist.testing.models import ResidualCNN, ResNet50, TransformerLM
from fastdist.bench.toolkit import at_least, comma_list, progress, sync, time_fn, up_to

CONFIGS = ["none", "checkpoint", "save_on_cpu", "swap", "fastdist"]
MODELS = ["transformer", "cnn", "resnet50"]
DEFAULT_MODELS = ["transformer", "cnn"]
DEFAULT_BUDGETS = [70, 50, 30]
SIZES = {  # model -> scale -> dims
    "transformer": {"small": dict(vocab=2048, dim=256, heads=4, layers=6, seq=256, batch=8),
                    "tiny": dict(vocab=256, dim=64, heads=2, layers=3, seq=64, batch=4),
                    "gpt": dict(vocab=32000, dim=1024, heads=16, layers=4, seq=1024, batch=4)},
    "cnn": {"small": dict(channels=48, blocks=6, image=64, batch=16),
            "tiny": dict(channels=8, blocks=3, image=32, batch=4),
            "gpt": dict(channels=128, blocks=8, image=128, batch=32)},
    "resnet50": {"small": dict(image=224, batch=8), "tiny": dict(image=64, batch=2), "gpt": dict(image=224, batch=8)},
}


def build(model: str, scale: str, device: torch.device | str, seed: int = 0) -> tuple[nn.Module, Callable, int,
          Callable]:
    """(network, make_batch(b) -> (inputs, targets), default batch size, loss_fn(output, targets))."""
    dims = SIZES[model][scale]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if model == "transformer":  # an encoder stack: no positions, no causal mask
        net = TransformerLM(dims["vocab"], dims["dim"], dims["heads"], dims["layers"])

        def make_batch(b):
            tokens = torch.randint(0, dims["vocab"], (b, dims["seq"] + 1), generator=gen)
            return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    else:
        net = ResidualCNN(dims["channels"], dims["blocks"]) if model == "cnn" else ResNet50()
        classes = 10 if model == "cnn" else 1000

        def make_batch(b):
            return (torch.randn(b, 3, dims["image"], dims["image"], generator=gen).to(device),
                    torch.randint(0, classes, (b,), generator=gen).to(device))

    def loss_fn(out, targets):  # per token for the transformer, per image for the CNNs
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    return net.to(device), make_batch, dims["batch"], loss_fn


def largest_batch(fits: Callable[[int], bool], limit: int) -> int:
    """The largest b in [1, limit] with fits(b), for a monotone fits: doubling, then bisection. 0 if none."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---- one configuration, in its own process ----

def status_kib(field: str) -> int:
    """A /proc/self/status field in KiB (VmRSS, VmHWM, ...)."""
    return int(re.search(rf"^{field}:\s+(\d+)", open("/proc/self/status").read(), re.MULTILINE).group(1))


def trim_heap() -> None:
    """Collects garbage and returns the freed heap to the OS (glibc), so that the next RSS reading starts low."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def _checkpoint_every_block(net):
    for block in net.blocks:
        forward = block.forward
        block.forward = lambda *a, f=forward: checkpointed(f, *a)


def run_config(spec: dict) -> dict:
    """Runs one configuration (dict from the parent) and returns its measurements."""
    import fastdist.memory as fm

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    net, make_batch, batch_size, loss_fn = build(spec["model"], spec["scale"], device)
    config = spec["config"]
    out = {"model": spec["model"], "config": spec["name"], "memory_capped": bool(spec.get("memory_cap_bytes"))}
    context, prefetcher = contextlib.nullcontext, None
    inputs, targets = make_batch(batch_size)
    if config == "checkpoint":
        _checkpoint_every_block(net)
    elif config == "save_on_cpu":
        context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    elif config == "swap":
        prefetcher = fm.SwapPrefetcher(min_bytes=spec["min_bytes"], prefetch_depth=spec["depth"], path=spec["swap_dir"])
        context = lambda: prefetcher  # noqa: E731
    elif config == "fastdist":
        prof = fm.profile(net, inputs, loss_fn=lambda o: loss_fn(o, targets), min_bytes=spec["min_bytes"])
        budget = int(spec["budget"] * prof.saved_bytes)
        copy = fm.calibrate(path=spec["swap_dir"])
        plan = fm.plan_from_profile(prof, budget, copy, spec["policy"], spec["depth"], spec["min_bytes"])
        applied = fm.apply(net, plan, path=spec["swap_dir"])
        prefetcher = applied.prefetcher
        out["plan"] = {"actions": plan.actions, "fits": plan.fits, "budget_bytes": budget,
                       "predicted_peak_bytes": plan.predicted_peak_bytes, "unoptimized_saved_bytes": prof.saved_bytes,
                       "predicted_overhead": plan.predicted_overhead, "summary": plan.summary(),
                       "copy_model": {k: v for k, v in copy.to_dict().items() if k != "samples"}}

    def step(batch):
        with context():
            loss = loss_fn(net(batch[0]), batch[1])
        loss.backward()
        sync(device)

    if spec.get("memory_cap_bytes"):  # GPU: the largest batch that fits under the cap, then time that batch
        batch_size = _largest_fitting_batch(spec, device, net, make_batch, step)
        if batch_size == 0:
            out.update(batch=0, step_ms=float("nan"), samples_ms=[], base_bytes=0, peak_bytes=0,
                       activation_peak_bytes=0, samples_per_s=0.0)
            return out
        inputs, targets = make_batch(batch_size)
    out["batch"] = batch_size
    batch = (inputs, targets)
    for _ in range(spec["warmup"]):
        step(batch)
    if prefetcher is not None:
        prefetcher.synchronize()
        prefetcher.reset_stats()
    trim_heap()
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        base = status_kib("VmRSS") * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            out["hwm_reset"] = True
        except OSError:  # some sandboxes forbid it: the peak then includes set-up, which the row says
            out["hwm_reset"] = False
    samples = time_fn(lambda: step(batch), reps=spec["steps"], warmup=0, device=device).samples
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else status_kib("VmHWM") * 1024)
    out.update(step_ms=1e3 * statistics.median(samples), samples_ms=[1e3 * s for s in samples],
               base_bytes=base, peak_bytes=peak, activation_peak_bytes=peak - base,
               samples_per_s=batch_size / statistics.median(samples))
    if prefetcher is not None:
        prefetcher.synchronize()
        out["prefetcher"] = prefetcher.stats()
        prefetcher.close()
    return out


def _largest_fitting_batch(spec, device, net, make_batch, step):
    """Caps this process's CUDA memory and searches the largest batch whose training step (twice) fits."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, spec["memory_cap_bytes"] / total), device)

    def fits(b):
        try:
            batch = make_batch(b)
            step(batch)
            step(batch)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            batch = None
            net.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()

    return largest_batch(fits, spec["max_batch"])


def _worker_main(spec_json):
    result = run_config(json.loads(spec_json))
    print("RESULT " + json.dumps(result), flush=True)


# ---- the suite ----

def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    p.add_argument("--models", type=comma_list(choices=MODELS), default=DEFAULT_MODELS,
                   help="comma-separated subset of " + ",".join(MODELS) + " (default transformer,cnn)")
    p.add_argument("--configs", type=comma_list(choices=CONFIGS), default=CONFIGS,
                   help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--budgets", type=comma_list(up_to(100, int)), default=DEFAULT_BUDGETS,
                   help="fastdist plan budgets, percent of the unoptimized saved activation bytes (default 70,50,30)")
    p.add_argument("--policy", choices=["delta", "dtr", "msps"], default="delta", help="planner policy (default delta)")
    p.add_argument("--scale", choices=["small", "tiny", "gpt"], default="small",
                   help="model sizes: tiny (tests), small (CPU), gpt (GPU: a GPT block stack, ResNet-50 at 224)")
    p.add_argument("--steps", type=at_least(1), default=5,
                   help="timed steps per configuration, >= 5 for a claim (default 5)")
    p.add_argument("--warmup", type=at_least(1), default=2, help="untimed steps first (default 2)")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="run every configuration this many times, interleaved, in fresh processes (default 1)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads per run; the rest of the cores are left to the I/O threads (default cpus/2)")
    p.add_argument("--min-bytes", type=int, default=1 << 18, help="prefetcher min_bytes (default 256 KiB)")
    p.add_argument("--depth", type=int, default=2, help="prefetch depth (default 2)")
    p.add_argument("--swap-dir", default=None, help="directory of the file store (default: the temp directory)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the models run (default cpu)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per configuration (default 900)")
    p.add_argument("--memory-cap", type=float, default=None, metavar="GIB",
                   help="CUDA only: cap each run's memory (set_per_process_memory_fraction) and search the largest "
                        "batch that fits, then report throughput at it")
    p.add_argument("--max-batch", type=int, default=4096, help="upper end of the batch search (default 4096)")


def _configurations(args):
    """(name, configuration, budget fraction or None) of every run: fastdist once per budget."""
    return [(f"fastdist-{b}", c, b / 100) if c == "fastdist" else (c, c, None)
            for c in args.configs for b in (args.budgets if c == "fastdist" else [None])]


def _run_child(spec, timeout):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "fastdist.bench.memory", json.dumps(spec)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"fastdist-bench memory: configuration {spec['name']} on {spec['model']} failed "
                           f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run(args: argparse.Namespace) -> dict | None:
    """Runs the suite in this process (each configuration in a child); prints the header and tables; returns the
    JSON payload."""
    models, configs = args.models, _configurations(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    if args.memory_cap is not None and args.device != "cuda":
        raise ValueError("--memory-cap needs --device cuda (a CPU process has no memory fraction to set)")
    env = report.environment(backend="file store" if args.device == "cpu" else "pinned store", device=args.device,
                             ranks=1, network="none (single process)")
    print(report.format_environment(env))
    print(f"# threads       {args.threads} torch threads per run; models at scale {args.scale}")
    runs = {}
    bar = progress(args.rounds * len(models) * len(configs), "memory")
    for round_ in range(args.rounds):
        for model in models:
            shift = round_ % len(configs)  # rotate the order each round: no configuration always runs first
            for name, config, budget in configs[shift:] + configs[:shift]:
                spec = dict(vars(args), model=model, name=name, config=config, budget=budget,
                            memory_cap_bytes=int(args.memory_cap * 2**30) if args.memory_cap else None)
                runs.setdefault((model, name), []).append(_run_child(spec, args.timeout))
                bar.step(f"round {round_ + 1} {model} {name}")
    rows = [_merge_rounds(runs[(model, name)]) for model in models for name, _, _ in configs]
    _derive(rows)
    result = {"suite": "memory", "env": env, "config": vars(args) | {"configs": [c[0] for c in configs]},
              "rows": rows, "targets": _targets(rows)}
    print(report.text_parts(tables(result)))
    return result


def _merge_rounds(results):
    """One row per configuration: step time = median of every timed step of every round (each round is its own
    process); memory and batch = median over rounds; prefetcher stats and plan from the last round."""
    row = dict(results[-1])
    samples = [t for r in results for t in r["samples_ms"]]
    if samples:
        row["samples_ms"] = samples
        row["step_ms"] = statistics.median(samples)
    for key in ("activation_peak_bytes", "peak_bytes", "base_bytes", "batch", "samples_per_s"):
        row[key] = statistics.median(r[key] for r in results)
    row["rounds"] = [{k: r[k] for k in ("step_ms", "activation_peak_bytes", "batch")} for r in results]
    return row


def _derive(rows):
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["config"] == "none"), None)
        r["overhead"] = r["step_ms"] / base["step_ms"] - 1 if base else None
        r["memory_saved"] = (1 - r["activation_peak_bytes"] / base["activation_peak_bytes"]
                             if base and base["activation_peak_bytes"] > 0 else None)
        p = r.get("prefetcher")
        r["hidden_fraction"] = p["hidden_fraction"] if p and p["copy_seconds"] > 0 else None


def _per_step(r, value):
    return value / max(1, len(r["samples_ms"]) // len(r["rounds"]))


def _plan(r):
    plan = r.get("plan")
    if not plan:
        return None
    n = {a: sum(1 for v in plan["actions"].values() if v == a) for a in ("keep", "swap", "recompute")}
    return f"{n['keep']}/{n['swap']}/{n['recompute']}" + ("" if plan["fits"] else " (no fit)")


def _prefetcher(key, scale):
    return lambda r: _per_step(r, scale * r["prefetcher"][key]) if r.get("prefetcher") else None


def tables(result: dict) -> list[report.Part]:
    """The suite's table of `result` (its JSON payload), printed by `run` and shown in the docs."""
    c = result["config"]
    caption = (f"{c['threads']} torch thread per run, {c['rounds']} rounds x {c['steps']} timed steps, policy "
               f"{c['policy']}, min_bytes {c['min_bytes'] // KIB} KiB, prefetch depth {c['depth']}; swapped and copy "
               "figures per timed step.")
    columns = [col("model", "model"), col("config", "config"), col("batch", "batch", integer),
               col("step (ms)", "step_ms", fixed(0)), col("overhead (%)", "overhead", percent(1, signed=True)),
               col("activation peak (MiB)", lambda r: r["activation_peak_bytes"] / MIB, fixed(1)),
               col("saved (%)", "memory_saved", percent(1, signed=True)),
               col("swapped (MiB/step)", _prefetcher("bytes_swapped", 1 / MIB), fixed(0)),
               col("copy (ms/step)", _prefetcher("copy_seconds", 1e3), fixed(1)),
               col("exposed (ms/step)", _prefetcher("exposed_wait_seconds", 1e3), fixed(2)),
               col("copy hidden (%)", "hidden_fraction", percent(1)),
               col("plan keep/swap/recompute", _plan, numeric=False)]
    notes = [line.lstrip("# ") for line in (result.get("targets") or {}).get("lines", [])]
    return [report.Part("memory", columns, result["rows"], caption, notes)]


def _targets(rows):
    """The memory targets: hidden copy time >= 80 % on the transformer, and at 50 % budget overhead <= 15 %
    and below both checkpoint and save_on_cpu."""
    lines, checks = [], {}
    hidden = [r["hidden_fraction"] for r in rows if r["model"] == "transformer" and r["hidden_fraction"] is not None]
    if hidden:
        checks["hidden_ge_80"] = min(hidden) >= 0.8
        lines.append(f"# target: prefetcher hides >= 80% of its copy time on the transformer: "
                     f"{'met' if checks['hidden_ge_80'] else 'NOT met'} (min {100 * min(hidden):.0f}%)")
    for model in sorted({r["model"] for r in rows}):
        ours = next((r for r in rows if r["model"] == model and r["config"] == "fastdist-50"), None)
        peers = {c: next((r for r in rows if r["model"] == model and r["config"] == c), None)
                 for c in ("checkpoint", "save_on_cpu")}
        if ours is None or ours["overhead"] is None:
            continue
        ok = ours["overhead"] <= 0.15 and all(p is None or ours["overhead"] < p["overhead"] for p in peers.values())
        checks[f"{model}_50"] = ok
        peer_text = ", ".join(f"{c} {100 * p['overhead']:+.1f}%" for c, p in peers.items() if p is not None)
        lines.append(f"# target: {model} at a 50% budget, overhead <= 15% and below the peers: "
                     f"{'met' if ok else 'NOT met'} (fastdist {100 * ours['overhead']:+.1f}%; {peer_text})")
    for model in sorted({r["model"] for r in rows if r.get("memory_capped")}):
        base = next((r for r in rows if r["model"] == model and r["config"] == "none"), None)
        ours = [r for r in rows if r["model"] == model and r["config"].startswith("fastdist-") and r["batch"]]
        if base is None or not base["batch"] or not ours:
            continue
        best = max(ours, key=lambda r: r["batch"])
        ratio = best["batch"] / base["batch"]
        loss = 1 - best["samples_per_s"] / base["samples_per_s"]  # throughput (samples/s) at each one's batch
        ok = ratio >= 2 and loss <= 0.2
        checks[f"{model}_max_batch"] = ok
        lines.append(f"# target: {model} >= 2x the largest batch at <= 20% throughput loss: "
                     f"{'met' if ok else 'NOT met'} ({best['config']}: batch {best['batch']} vs {base['batch']}, "
                     f"{ratio:.2f}x; throughput {100 * -loss:+.1f}%)")
    return {"checks": checks, "lines": lines}


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    rows = result["rows"]
    models = sorted({r["model"] for r in rows}, key=MODELS.index)
    plt, fig, axes = report.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    cmap = plt.get_cmap("tab10")
    names = list(dict.fromkeys(r["config"] for r in rows))
    for ax, model in zip(axes[0], models):
        for i, name in enumerate(names):
            r = next((r for r in rows if r["model"] == model and r["config"] == name), None)
            if r is None:
                continue
            ax.scatter(r["activation_peak_bytes"] / MIB, r["step_ms"], color=cmap(i % 10), s=60, label=name)
            ax.annotate(name, (r["activation_peak_bytes"] / MIB, r["step_ms"]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
        ax.set(xlabel="activation peak (MiB, VmHWM over the step minus RSS before)", ylabel="step time (ms, median)",
               title=model)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    report.save_figure(fig, path, f"fastdist-bench memory: {result['env']['device']}")


if __name__ == "__main__":
    _worker_main(sys.argv[1])
