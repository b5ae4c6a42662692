"""fastdist-bench: what fastdist buys you on your network.

  fastdist-bench                    a short tour of every suite (4 ranks, simulated 10 Gbit/s if possible)
  fastdist-bench SUITE [opts]       one suite (SUITE below; `fastdist-bench SUITE --help` tells what it measures)
  fastdist-bench --netsim-cleanup   remove simulated-cluster namespaces left by a killed run

Every suite takes --json PATH (raw samples included) and --plot PATH.png.
Under torchrun (`torchrun --nproc-per-node 8 -m fastdist.bench collectives`) the ranks are torchrun's.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from fastdist.bench import report

SUITES = {
    "collectives": "fastdist.bench.collectives",
    "compress": "fastdist.bench.compress",
    "compress-findings": "fastdist.bench.compress_findings",
    "kernels": "fastdist.bench.kernels",
    "moe": "fastdist.bench.moe",
    "sparse": "fastdist.bench.sparse",
    "sparse-lm": "fastdist.bench.sparse_lm",
    "tp": "fastdist.bench.tp",
    "memory": "fastdist.bench.memory",
    "graph": "fastdist.bench.graph",
    "embedding": "fastdist.bench.embedding",
    "admm": "fastdist.bench.admm",
    "adapters": "fastdist.bench.adapters",
    "parallel": "fastdist.bench.parallel",
}

# The no-argument tour: every suite, sized to finish in a few minutes on a 2-core machine.
TOUR = {
    "collectives": ["--ranks", "4", "--net", "10gbit", "--max-size", "16M", "--min-time", "0.1"],
    "kernels": ["--quick"],
    "compress": ["--steps", "5", "--warmup", "2"],
    "sparse": ["--ranks", "2", "--net", "10gbit", "--shape", "8192x256", "--densities", "2"],
    "moe": ["--ranks", "2", "--tokens", "512", "--d-ff", "512", "--steps", "5", "--warmup", "2"],
    "sparse-lm": ["--ranks", "4", "--net", "10gbit", "--steps", "40", "--vocab", "8192", "--dim", "32",
                  "--methods", "dense,agsparse,powersgd,omnireduce,auto,sketch-0.2x+ef"],
    "tp": ["--ranks", "2", "--op-shape", "512,512,512", "--block", "256,4,64,4", "--mlp", "256,256,1024", "--reps", "5",
           "--warmup", "1"],
    "memory": ["--models", "transformer", "--budgets", "50", "--steps", "5", "--warmup", "1"],
    "graph": ["--datasets", "house-cycle", "--poolers", "hap,diffpool,topk,mean", "--folds", "2", "--epochs", "2",
              "--graphs", "100", "--hidden", "16"],
    "embedding": ["--ranks", "2", "--rows", "16384", "--dim", "32", "--batch", "64", "--steps", "5", "--warmup", "1"],
    "admm": ["--tasks", "digits-rows", "--methods", "admm,admm-mb,sgd-momentum+clip,adam+clip", "--epochs", "5",
             "--grid", "2", "--hidden", "16", "--scales", "0.1,10", "--stability-epochs", "3",
             "--stability-tasks", "digits-rows"],
    "adapters": ["--shape", "1024x1024", "--tokens", "1,16,256", "--repeats", "5", "--warmup", "1"],
    "parallel": ["--ranks", "2", "--parts", "pipeline,balance,tp", "--gpt", "4096,64,2,4,32", "--batch", "8",
                 "--microbatches", "4", "--reps", "5", "--warmup", "1", "--tp-block", "128,4,32,4", "--tp-nets",
                 "loopback"],
}


def _suite(name):
    return importlib.import_module(SUITES[name])


def build_parser() -> argparse.ArgumentParser:
    """The fastdist-bench argument parser: the global options and one subcommand per suite."""
    parser = argparse.ArgumentParser(prog="fastdist-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--netsim-cleanup", action="store_true",
                        help="remove the simulated-cluster namespaces (fdsim-*) whose owner process is gone, and exit")
    parser.add_argument("--json", metavar="PATH", help="write results with raw samples to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot to PATH (tour: one per suite)")
    sub = parser.add_subparsers(dest="suite", metavar="SUITE")
    for name in SUITES:
        module = _suite(name)
        # the docstring's first paragraph, after its "`fastdist-bench NAME`: "
        summary = " ".join((module.__doc__ or "").split("\n\n")[0].split()).split(": ", 1)[-1]
        p = sub.add_parser(name, help=summary,
                           description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.add_argument("--json", metavar="PATH", default=argparse.SUPPRESS, help="write results to PATH")
        p.add_argument("--plot", metavar="PATH", default=argparse.SUPPRESS, help="write a PNG plot to PATH")
    return parser


def _run(args, json_path, plot_path):
    """Runs the suite `args` names; writes its JSON and plot where asked; returns its payload."""
    module = _suite(args.suite)
    result = module.run(args)
    if result is None:  # a non-printing rank under torchrun
        return None
    if json_path:
        report.write_json(json_path, result)
        print(f"# wrote {json_path}")
    if plot_path:
        module.plot(result, plot_path)
        print(f"# wrote {plot_path}")
    return result


def tour(json_path: str | None = None, plot_path: str | None = None) -> dict:
    """Runs every suite with its TOUR arguments; returns their payloads by suite name."""
    results = {}
    start = time.monotonic()
    for name, argv in TOUR.items():
        print(f"\n=== fastdist-bench {name} {' '.join(argv)}", flush=True)
        plot_for = plot_path.replace(".png", f"-{name}.png") if plot_path else None
        results[name] = _run(build_parser().parse_args([name, *argv]), None, plot_for)
    print(f"\n# tour finished in {time.monotonic() - start:.0f} s")
    if json_path:
        report.write_json(json_path, {"suite": "tour", "results": results})
        print(f"# wrote {json_path}")
    return results


def main(argv: list[str] | None = None) -> int:
    """The fastdist-bench entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.netsim_cleanup:
        from fastdist import netsim
        removed = netsim.cleanup()
        print(f"fastdist-bench: removed {len(removed)} simulated-cluster namespace(s)"
              + (": " + " ".join(removed) if removed else ""))
        return 0
    if args.suite is None:
        tour(args.json, args.plot)
        return 0
    _run(args, getattr(args, "json", None), getattr(args, "plot", None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
