"""`fastdist-bench compress-kernels`: the TopK and quantization kernels against torch and the copy bandwidth.

Rows (each ours and its torch baseline in the same run, interleaved, warm-up first, median of >= 5 samples):

  topk_compress     fastdist.ops.topk_compress(x, k)  vs  torch.topk(x.abs(), k) + x.gather   (--topk-shape, --ratio)
  topk_decompress   fastdist.ops.topk_decompress      vs  torch.zeros + scatter_
  quantize          fastdist.ops.quantize, 8 and 4 bits, per-row minmax   vs  torch's per-row min/max, round, uint8
                    (torch packs nothing: its 4-bit row is one code per byte)
  dequantize        fastdist.ops.dequantize           vs  torch's (q * scale + zero)

Speeds are also given as GB/s of the bytes the op must move (read + write) and as a fraction of the machine's copy
bandwidth measured in the same run. The CPU acceptance target is topk_compress >= 3x torch on [256, 65536] float32
with k = 10%; on CUDA the target is >= 5x on [64, 1M] and decompress at >= 60% of the copy bandwidth.
"""
import statistics

import torch

import fastdist
from fastdist.bench import report
from fastdist.bench.kernels import copy_bandwidth, kernel_timer, parse_shape
from fastdist.ops import dequantize, quantize, topk_compress, topk_decompress
from fastdist.ops.topk import topk_k

DEFAULT_SHAPES = {"cpu": "256x65536", "cuda": "64x1048576"}
OPS = ["topk_compress", "topk_decompress", "quantize8", "quantize4", "dequantize8"]


def add_arguments(p):
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--topk-shape", default=None, help="rows x d, float32 (default 256x65536 on CPU, 64x1048576 on "
                                                      "CUDA)")
    p.add_argument("--ratio", type=float, default=0.1, help="TopK keeps ceil(ratio * d) per row (default 0.1)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions, >= 5 (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's current)")


def torch_topk(x, k):
    idx = torch.topk(x.abs(), k, dim=1).indices
    return x.gather(1, idx), idx


def torch_decompress(values, indices, d):
    return torch.zeros(values.shape[0], d, dtype=values.dtype, device=values.device).scatter_(1, indices, values)


def torch_quantize_rows(x, bits):
    lo = x.amin(1, keepdim=True)
    hi = x.amax(1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    q = ((x - lo) / scale).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    return q, scale, lo


def torch_dequantize_rows(q, scale, lo):
    return q.float() * scale + lo


def _cases(op, x, k, device):
    """(ours, theirs, bytes moved by ours, check) for one op."""
    rows, d = x.shape
    n = x.numel()
    if op == "topk_compress":
        def check():
            v, i = topk_compress(x, k)
            tv, ti = torch_topk(x, k)
            return torch.equal(i.long(), ti.sort(1).values)
        return (lambda: topk_compress(x, k), lambda: torch_topk(x, k), 4 * n + 8 * rows * k, check)
    if op == "topk_decompress":
        v, i = topk_compress(x, k)
        il = i.long()
        return (lambda: topk_decompress(v, i, d), lambda: torch_decompress(v, il, d), 4 * n + 8 * rows * k,
                lambda: torch.equal(topk_decompress(v, i, d), torch_decompress(v, il, d)))
    bits = 8 if op.endswith("8") else 4
    if op.startswith("quantize"):
        def check():
            packed, scales, zeros = quantize(x, bits, "minmax", d)
            y = dequantize(packed, scales, zeros, bits, "minmax", d, x.shape)
            return bool(((y - x).abs() <= scales.repeat_interleave(d).reshape(rows, d) * 0.5001 + 1e-6).all())
        return (lambda: quantize(x, bits, "minmax", d), lambda: torch_quantize_rows(x, bits),
                4 * n + n * bits // 8, check)
    packed, scales, zeros = quantize(x, bits, "minmax", d)
    q, s, lo = torch_quantize_rows(x, bits)
    return (lambda: dequantize(packed, scales, zeros, bits, "minmax", d, x.shape),
            lambda: torch_dequantize_rows(q, s, lo), 4 * n + n * bits // 8, lambda: True)


def run(args):
    device = args.device
    if device == "cuda" and not fastdist.cuda_kernels_available():
        raise SystemExit("fastdist-bench compress-kernels: --device cuda needs a CUDA device and fastdist built with "
                         "CUDA kernels")
    if args.repeats < 5:
        raise SystemExit("fastdist-bench compress-kernels: --repeats must be >= 5")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise SystemExit(f"fastdist-bench compress-kernels: unknown op(s) {unknown}; choose from {OPS}")
    rows, d = parse_shape(args.topk_shape or DEFAULT_SHAPES[device])
    k = topk_k(args.ratio, d)
    with report.torch_threads(args.threads):
        return _run(args, device, ops, rows, d, k)


def _run(args, device, ops, rows, d, k):
    timer, backend = kernel_timer(device)
    env = report.environment(backend=backend, device=device, ranks=1, network="-")
    progress = report.Progress(1 + len(ops), "compress-kernels")
    copy_gbps, copy_samples = copy_bandwidth(timer, device, args.repeats, args.warmup)
    progress.step("copy")
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(0)).to(device)
    out = []
    for op in ops:
        ours, theirs, nbytes, check = _cases(op, x, k, device)
        if not check():
            raise RuntimeError(f"fastdist-bench compress-kernels: {op} disagrees with its torch reference")
        ours_s, torch_s = timer([ours, theirs], args.repeats, args.warmup)
        t_ours, t_torch = statistics.median(ours_s), statistics.median(torch_s)
        out.append({"op": op, "shape": [rows, d], "k": k if op.startswith("topk") else None,
                    "time_us": t_ours * 1e6, "torch_us": t_torch * 1e6, "speedup": t_torch / t_ours,
                    "gbps": nbytes / t_ours / 1e9, "of_copy": nbytes / t_ours / 1e9 / copy_gbps,
                    "samples_us": [s * 1e6 for s in ours_s], "torch_samples_us": [s * 1e6 for s in torch_s]})
        progress.step(op)
    print(report.format_environment(env))
    print(f"# copy bandwidth {copy_gbps:.1f} GB/s (read + write); x = [{rows}, {d}] float32, k = {k} "
          f"({args.ratio:g} of d); median of {args.repeats}")
    print(format_rows(out))
    return {"suite": "compress-kernels", "env": env, "copy_gbps": copy_gbps, "copy_samples_s": copy_samples,
            "rows": out}


def format_rows(rows):
    headers = ["op", "shape", "ours(us)", "torch(us)", "speed-up", "GB/s", "of copy"]
    table = [[r["op"], "x".join(map(str, r["shape"])), r["time_us"], r["torch_us"], f"{r['speedup']:.2f}x",
              r["gbps"], f"{100 * r['of_copy']:.0f}%"] for r in rows]
    return report.format_table(headers, table, align=["l", "l", "r", "r", "r", "r", "r"])


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["time_us"] / 1e3 for r in rows], 0.4, label="fastdist")
    ax.bar([i + 0.2 for i in xs], [r["torch_us"] / 1e3 for r in rows], 0.4, label="torch")
    for i, r in enumerate(rows):
        ax.text(i, max(r["time_us"], r["torch_us"]) / 1e3, f"{r['speedup']:.1f}x", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["op"] for r in rows], fontsize=8)
    ax.set_ylabel("time per call (ms, median)")
    ax.set_yscale("log")
    ax.legend()
    env = result["env"]
    ax.set_title(f"compress kernels, {env['backend']}, x = {rows[0]['shape']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
