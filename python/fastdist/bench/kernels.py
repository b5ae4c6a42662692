"""`fastdist-bench kernels`: fastdist's kernels against the machine's copy bandwidth.

For each op and size: the bytes the op must move (read + written), the median time, the achieved GB/s and
that as a percentage of the copy bandwidth (a STREAM-like `dst.copy_(src)` of 256 MiB, timed interleaved with
every op: the percentage is the median over rounds of the op's GB/s over the copy's in the same round), and the
speed-up over the obvious pure-torch implementation of the same op, timed interleaved with ours. Sizes count
mask elements (bits): pack_bits reads `size` bools and writes size/8 bytes, unpack_bits
the reverse, bitwise_or_reduce ORs --rows bitmaps of `size` bits. On CPU, sizes that fit in the caches run
faster than the copy bandwidth, which is measured out of memory; each CPU sample follows an untimed call
of the same function. On CUDA: CUDA events, and L2 is flushed (256 MiB written) before every timed call.

The count-sketch ops run on an embedding-shaped gradient (--sketch-shape, default 32768 x 1024 float32):
count_sketch and count_sketch_decode with a row support at row densities 0.5 %, 2 % and 10 %, and with element
granularity on a tensor whose values are half non-zero (--sketch-element-shape); nonzero_bitmap reads the whole
tensor. Their GB/s count the values the op must read (nonzero_bitmap: all; count_sketch: the supported rows' with a
row support, all without one) or produce (count_sketch_decode: the supported values; it also zero-fills the rest of
its n x m output; count_sketch_decode_units: the same values, written compactly, as sketch_allreduce uses it).
A sketch has 3 rows and a third as many columns as values sketched (a table as large as the values, what the
issue's "sketch sized at the union's non-zeros" is). The torch peer of count_sketch is sketch_hash +
index_add_ (it stores the hashes, which fastdist's kernel never does); of decode, sketch_hash + gather + median.
"""
import functools
import math
import statistics
import time

import torch

import fastdist
from fastdist.bench import report
from fastdist.ops import (bitwise_or_reduce, count_sketch, count_sketch_decode, count_sketch_decode_units,
                          nonzero_bitmap, pack_bits, sketch_hash, unpack_bits)

SWEEP_OPS = ["pack_bits", "unpack_bits", "bitwise_or_reduce"]  # timed over --sizes
SKETCH_OPS = ["nonzero_bitmap", "count_sketch", "count_sketch_decode", "count_sketch_decode_units"]  # --sketch-shape
OPS = SWEEP_OPS + SKETCH_OPS
SKETCH_ROWS = 3
SKETCH_SEED = 1234
SKETCH_DENSITIES = [0.005, 0.02, 0.10]
QUICK_SKETCH_DENSITIES = [0.02]
COPY_BYTES = 256 << 20
FLUSH_BYTES = 256 << 20
MIN_SAMPLE_S = 2e-3  # on CPU, small sizes repeat inside one sample until it takes this long (timer noise)
DEFAULT_SIZES = {"cpu": [1 << k for k in range(16, 27, 2)], "cuda": [1 << k for k in range(16, 31, 2)]}
QUICK_SIZES = [1 << k for k in range(16, 23, 2)]


def add_arguments(p):
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the kernels run (cuda needs fastdist's CUDA kernels; default cpu)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes in mask elements, e.g. 64K,1M,2^24 "
                        "(default 2^16..2^26 on cpu, 2^16..2^30 on cuda, step x4)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--rows", type=int, default=8, help="bitmaps ORed by bitwise_or_reduce, as ranks (default 8)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions per size, >= 5 (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's current)")
    p.add_argument("--sketch-shape", default=None,
                   help="gradient shape ROWSxCOLS for the count-sketch ops (default 32768x1024; --quick 8192x1024)")
    p.add_argument("--sketch-element-shape", default=None,
                   help="shape for element granularity, half of its values non-zero (default 4096x1024; "
                        "--quick 1024x1024)")
    p.add_argument("--quick", action="store_true",
                   help="short sweep 2^16..2^22, smaller sketch shapes at 2 %% density, 5 repetitions")


def parse_size(text):
    """'64K' -> 65536, '2^20' -> 1048576; K/M/G are binary."""
    text = text.strip().upper()
    if "^" in text:
        base, exp = text.split("^")
        return int(base) ** int(exp)
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(text)


# ---- the obvious pure-torch implementations (the peer column) ----

_POWERS = 1 << torch.arange(8, dtype=torch.uint8)


def torch_pack_bits(mask):
    n = mask.shape[-1]
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, -n % 8))
    return (m.view(*m.shape[:-1], -1, 8) * _POWERS.to(m.device)).sum(-1, dtype=torch.uint8)


def torch_unpack_bits(packed, n):
    bits = (packed.unsqueeze(-1) & _POWERS.to(packed.device)) != 0
    return bits.flatten(-2)[..., :n]


def torch_bitwise_or_reduce(packed):
    return functools.reduce(torch.bitwise_or, packed)


def _units(x, granularity):
    """x as (n units, m values per unit)."""
    n = x.shape[0] if granularity == "row" else x.numel()
    return n, (x.numel() // n if n else 0)


def _sketched_indices(x, support, granularity):
    """Flat indices a count-sketch adds: every value of the supported units (or the non-zeros)."""
    if support is None:
        return (x.reshape(-1) != 0).nonzero().flatten()
    n, m = _units(x, granularity)
    units = torch_unpack_bits(support, n).nonzero().flatten()
    return (units[:, None] * m + torch.arange(m, device=x.device)).flatten()


def torch_count_sketch(x, rows, cols, seed, support, granularity):
    idx = _sketched_indices(x, support, granularity)
    bucket, sign = sketch_hash(idx, rows, cols, seed, max(_units(x, granularity)[1], 1))
    values = x.reshape(-1)[idx].float()
    table = torch.zeros(rows, cols, device=x.device)
    for j in range(rows):
        table[j].index_add_(0, bucket[j], values * sign[j])
    return table


def torch_count_sketch_decode(table, support, n, m, seed):
    units = torch_unpack_bits(support, n).nonzero().flatten()
    idx = (units[:, None] * m + torch.arange(m, device=table.device)).flatten()
    bucket, sign = sketch_hash(idx, table.shape[0], table.shape[1], seed, max(m, 1))
    est = torch.stack([table[j][bucket[j]] * sign[j] for j in range(table.shape[0])])
    out = torch.zeros(n * m, device=table.device)
    out[idx] = est.median(dim=0).values
    return out.reshape(n, m)


def torch_count_sketch_decode_units(table, units, m, seed):
    idx = (units[:, None] * m + torch.arange(m, device=table.device)).flatten()
    bucket, sign = sketch_hash(idx, table.shape[0], table.shape[1], seed, max(m, 1))
    est = torch.stack([table[j][bucket[j]] * sign[j] for j in range(table.shape[0])])
    return est.median(dim=0).values.reshape(units.numel(), m)


def torch_nonzero_bitmap(x, granularity):
    if granularity == "row":
        return torch_pack_bits((x.reshape(x.shape[0], -1) != 0).any(dim=1))
    return torch_pack_bits(x.reshape(-1) != 0)


# ---- timing ----

def _time_cpu(fns, repeats, warmup):
    """Interleaved samples (seconds per call) of each fn: warm-up first, then one sample of each in turn."""
    calls = []  # per fn: calls per sample, from the time of its last warm-up call
    for fn in fns:
        for _ in range(max(warmup, 1)):
            start = time.perf_counter()
            fn()
            last = time.perf_counter() - start
        calls.append(max(1, math.ceil(MIN_SAMPLE_S / max(last, 1e-9))))
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, number, out in zip(fns, calls, samples):
            fn()  # untimed: the other fn's allocations and cache footprint must not be charged to this one
            start = time.perf_counter()
            for _ in range(number):
                fn()
            out.append((time.perf_counter() - start) / number)
    return samples


def _time_cuda(fns, repeats, warmup, flush):
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            flush.zero_()  # evict the inputs from L2 so every call reads from memory
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
    return samples


def kernel_timer(device):
    """(timer, backend label) for kernels on `device`: CUDA events with L2 flushed before every call, or
    interleaved CPU samples."""
    if device == "cuda":
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        return functools.partial(_time_cuda, flush=flush), f"fastdist CUDA kernels on {torch.cuda.get_device_name()}"
    return _time_cpu, f"fastdist CPU kernels, {torch.get_num_threads()} torch threads"


def copy_reference(device):
    """The STREAM-like reference: (a COPY_BYTES dst.copy_(src), the bytes it reads + writes)."""
    src = torch.ones(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * COPY_BYTES


def copy_bandwidth(timer, device, repeats, warmup):
    """The copy bandwidth in GB/s and its samples in seconds."""
    copy, nbytes = copy_reference(device)
    (samples,) = timer([copy], repeats, warmup)
    return nbytes / statistics.median(samples) / 1e9, samples


def _cases(op, size, rows, device):
    """(fastdist fn, torch fn, bytes read + written) for one op and size."""
    g = torch.Generator().manual_seed(size)
    nbytes = (size + 7) // 8
    if op == "pack_bits":
        mask = (torch.rand(size, generator=g) < 0.5).to(device)
        return (lambda: pack_bits(mask)), (lambda: torch_pack_bits(mask)), size + nbytes
    if op == "unpack_bits":
        packed = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).to(device)
        return (lambda: unpack_bits(packed, size)), (lambda: torch_unpack_bits(packed, size)), nbytes + size
    packed = torch.randint(0, 256, (rows, nbytes), generator=g, dtype=torch.uint8).to(device)
    return (lambda: bitwise_or_reduce(packed)), (lambda: torch_bitwise_or_reduce(packed)), (rows + 1) * nbytes


def parse_shape(text):
    rows, cols = (int(v) for v in text.lower().split("x"))
    return rows, cols


def _gradient(shape, density, granularity, device, seed=0):
    """float32 values in [-1, 1), with a fraction `density` of the rows (or of the elements) non-zero."""
    g = torch.Generator().manual_seed(seed)
    if granularity == "row":
        x = torch.zeros(shape)
        rows = torch.rand(shape[0], generator=g) < density
        x[rows] = torch.rand(int(rows.sum()), shape[1], generator=g) * 2 - 1
    else:
        x = (torch.rand(shape, generator=g) * 2 - 1) * (torch.rand(shape, generator=g) < density)
    return x.to(device)


def _sketch_cases(op, shape, element_shape, densities, device):
    """[(label dict, fastdist fn, torch fn, bytes, compare)] for one count-sketch op."""
    cases = []
    configs = [("row", shape, d) for d in densities] + [("element", element_shape, 0.5)]
    for granularity, shp, density in configs:
        x = _gradient(shp, density, granularity, device)
        support = nonzero_bitmap(x, granularity)
        n = shp[0] if granularity == "row" else shp[0] * shp[1]
        m = x.numel() // n
        label = {"shape": f"{shp[0]}x{shp[1]}", "granularity": granularity, "density": density}
        if op == "nonzero_bitmap":
            cases.append((label | {"cols": None}, (lambda x=x, gr=granularity: nonzero_bitmap(x, gr)),
                          (lambda x=x, gr=granularity: torch_nonzero_bitmap(x, gr)), x.numel() * 4, torch.equal))
            continue
        # Row granularity: the row support is given. Element granularity: no support, the non-zeros are sketched.
        sup = support if granularity == "row" else None
        values = int(torch_unpack_bits(support, n).sum()) * m
        cols = max(values // SKETCH_ROWS, 1024)  # a table as large as the values: a sketch "at the union's non-zeros"
        label["cols"] = cols
        if op == "count_sketch":
            cases.append((label, (lambda x=x, c=cols, s=sup, gr=granularity: count_sketch(x, SKETCH_ROWS, c,
                                                                                           SKETCH_SEED, s, gr)),
                          (lambda x=x, c=cols, s=sup, gr=granularity: torch_count_sketch(x, SKETCH_ROWS, c,
                                                                                         SKETCH_SEED, s, gr)),
                          (values if sup is not None else x.numel()) * x.element_size(), _tables_close))
        elif op == "count_sketch_decode_units":
            table = count_sketch(x, SKETCH_ROWS, cols, SKETCH_SEED, support, granularity)
            units = torch_unpack_bits(support, n).nonzero().flatten()
            cases.append((label, (lambda t=table, u=units, m=m: count_sketch_decode_units(t, u, m, SKETCH_SEED)),
                          (lambda t=table, u=units, m=m: torch_count_sketch_decode_units(t, u, m, SKETCH_SEED)),
                          values * 4, torch.equal))
        else:
            table = count_sketch(x, SKETCH_ROWS, cols, SKETCH_SEED, support, granularity)
            cases.append((label, (lambda t=table, s=support, n=n, m=m: count_sketch_decode(t, s, n, m, SKETCH_SEED)),
                          (lambda t=table, s=support, n=n, m=m: torch_count_sketch_decode(t, s, n, m, SKETCH_SEED)),
                          values * 4, torch.equal))
    return cases


def _tables_close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def run(args):
    device = args.device
    if device == "cuda" and not fastdist.cuda_kernels_available():
        raise SystemExit("fastdist-bench kernels: --device cuda needs a CUDA device and fastdist built with CUDA "
                         f"kernels (built with CUDA: {fastdist.cuda_kernels_built()}, "
                         f"device visible: {torch.cuda.is_available()})")
    if args.repeats < 5:
        raise SystemExit("fastdist-bench kernels: --repeats must be >= 5 (speeds are medians of >= 5 samples)")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise SystemExit(f"fastdist-bench kernels: unknown op(s) {unknown}; choose from {OPS}")
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES[device]
    repeats = 5 if args.quick else args.repeats
    sketch = {
        "shape": parse_shape(args.sketch_shape or ("8192x1024" if args.quick else "32768x1024")),
        "element_shape": parse_shape(args.sketch_element_shape or ("1024x1024" if args.quick else "4096x1024")),
        "densities": QUICK_SKETCH_DENSITIES if args.quick else SKETCH_DENSITIES,
    }

    with report.torch_threads(args.threads):
        return _run(args, device, ops, sizes, repeats, sketch)


def _run(args, device, ops, sizes, repeats, sketch):
    timer, backend = kernel_timer(device)
    env = report.environment(backend=backend, device=device, ranks=1, network="-")
    sweep_ops = [op for op in ops if op in SWEEP_OPS]
    sketch_ops = [op for op in ops if op in SKETCH_OPS]
    sketch_cases_per_op = len(sketch["densities"]) + 1
    progress = report.Progress(len(sweep_ops) * len(sizes) + len(sketch_ops) * sketch_cases_per_op, "kernels")
    copy, copy_bytes = copy_reference(device)
    copy_samples = []

    def timed(ours, theirs, nbytes):
        """Interleaved samples of ours, theirs and the copy; the % of copy is the median over rounds of our GB/s over
        the copy's GB/s in the same round, so that drift in a shared machine's memory bandwidth cancels."""
        ours_s, torch_s, copy_s = timer([ours, theirs, copy], repeats, args.warmup)
        copy_samples.extend(copy_s)
        t, t_torch = statistics.median(ours_s), statistics.median(torch_s)
        pct = 100 * statistics.median(nbytes * c / (copy_bytes * o) for o, c in zip(ours_s, copy_s))
        return {"median_s": t, "gbps": nbytes / t / 1e9, "pct_copy": pct, "torch_median_s": t_torch,
                "torch_gbps": nbytes / t_torch / 1e9, "speedup": t_torch / t, "samples_s": ours_s,
                "torch_samples_s": torch_s, "copy_samples_s": copy_s}

    rows = []
    for op in sweep_ops:
        for size in sizes:
            ours, theirs, nbytes = _cases(op, size, args.rows, device)
            if not torch.equal(ours(), theirs()):
                raise RuntimeError(f"fastdist-bench kernels: {op} and its torch reference disagree at size {size}")
            rows.append({"op": op, "size": size, "bytes": nbytes} | timed(ours, theirs, nbytes))
            progress.step(f"{op} {size}")

    sketch_rows = []
    for op in sketch_ops:
        for label, ours, theirs, nbytes, same in _sketch_cases(op, sketch["shape"], sketch["element_shape"],
                                                               sketch["densities"], device):
            if not same(ours(), theirs()):
                raise RuntimeError(f"fastdist-bench kernels: {op} and its torch reference disagree on {label}")
            sketch_rows.append(label | {"op": op, "bytes": nbytes} | timed(ours, theirs, nbytes))
            progress.step(f"{op} {label['granularity']} {label['density']}")

    copy_gbps = copy_bytes / statistics.median(copy_samples) / 1e9
    print(report.format_environment(env))
    print(f"# copy bandwidth {copy_gbps:.1f} GB/s (dst.copy_(src), {report.human_bytes(COPY_BYTES)}, read + write; "
          "median of all rounds, each op's % of copy is against the copy timed in its own rounds)")
    headers = ["op", "size", "bytes moved", "time (us)", "GB/s", "% of copy", "torch GB/s", "speed-up vs torch"]
    table = [[r["op"], r["size"], report.human_bytes(r["bytes"]), r["median_s"] * 1e6, r["gbps"], r["pct_copy"],
              r["torch_gbps"], r["speedup"]] for r in rows]
    if rows:
        print(report.format_table(headers, table, align=["l", "r", "r", "r", "r", "r", "r", "r"]))
    if sketch_rows:
        print(f"# count-sketch ops: {SKETCH_ROWS}-row sketches, GB/s of values read (count_sketch, nonzero_bitmap) "
              "or decoded (count_sketch_decode); row cases pass the row support, element cases none")
        headers = ["op", "shape", "granularity", "density", "cols", "values", "time (us)", "GB/s", "% of copy",
                   "torch GB/s", "speed-up vs torch"]
        table = [[r["op"], r["shape"], r["granularity"], f"{100 * r['density']:g}%",
                  "-" if r["cols"] is None else r["cols"], report.human_bytes(r["bytes"]), r["median_s"] * 1e6,
                  r["gbps"], r["pct_copy"], r["torch_gbps"], r["speedup"]] for r in sketch_rows]
        print(report.format_table(headers, table, align=["l", "l", "l", "r", "r", "r", "r", "r", "r", "r", "r"]))
    if device == "cpu":
        print("# note: every call returns a new tensor; large CPU outputs (tens of MiB) come back from the\n"
              "# allocator as fresh pages, so those rows include first-touch page faults that the copy reference\n"
              "# (into an existing tensor) does not pay; count_sketch takes its tables from a pool of freed ones\n"
              "# (csrc/ops/sketch.cpp). THP_MEM_ALLOC_ENABLE=1 (huge pages for torch's CPU allocations) helps the\n"
              "# largest: count_sketch_decode at 2% took 53 -> 16 ms with it on the 2-core VM.")
    return {"suite": "kernels", "env": env, "copy_gbps": copy_gbps, "copy_samples_s": copy_samples,
            "copy_bytes": COPY_BYTES, "rows": rows, "sketch_rows": sketch_rows}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sketch_rows = result.get("sketch_rows", [])
    panels = (1 if result["rows"] else 0) + (1 if sketch_rows else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(10 * max(panels, 1), 5), squeeze=False)
    axes = list(axes[0])
    env = result["env"]
    title = f"fastdist kernels: {env['backend']}\nfastdist {env['fastdist']}, torch {env['torch']}, {env['date']}"
    if result["rows"]:
        ax = axes.pop(0)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        ops = list(dict.fromkeys(r["op"] for r in result["rows"]))
        for op, color in zip(ops, colors):
            rows = [r for r in result["rows"] if r["op"] == op]
            sizes = [r["size"] for r in rows]
            ax.plot(sizes, [r["gbps"] for r in rows], "o-", color=color, label=f"{op} (fastdist)")
            ax.plot(sizes, [r["torch_gbps"] for r in rows], "x--", color=color, alpha=0.6,
                    label=f"{op} (pure torch)")
        ax.axhline(result["copy_gbps"], color="black", linestyle=":",
                   label=f"copy bandwidth {result['copy_gbps']:.1f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (mask elements)")
        ax.set_ylabel("achieved GB/s (bytes read + written / time)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if sketch_rows:
        ax = axes.pop(0)
        labels = [f"{r['op']}\n{r['granularity']} {100 * r['density']:g}%" for r in sketch_rows]
        pos = range(len(sketch_rows))
        ax.bar([p - 0.2 for p in pos], [r["gbps"] for r in sketch_rows], width=0.4, label="fastdist")
        ax.bar([p + 0.2 for p in pos], [r["torch_gbps"] for r in sketch_rows], width=0.4, label="torch peer")
        ax.axhline(result["copy_gbps"], color="black", linestyle=":",
                   label=f"copy bandwidth {result['copy_gbps']:.1f} GB/s")
        ax.set_xticks(list(pos), labels, fontsize=7, rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("GB/s of values read (decode: values decoded)")
        shapes = ", ".join(dict.fromkeys(f"{r['granularity']} {r['shape']}" for r in sketch_rows))
        ax.set_title(f"count-sketch ops ({shapes}; {env['backend']})", fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
