"""`fastdist-bench kernels`: every op family against its pure-torch path and the machine's copy bandwidth.

Each row is one op on one input: bytes moved, median time, GB/s, that as a percentage of a STREAM-like 256 MiB
`dst.copy_(src)` timed in the same interleaved rounds (the median over rounds of the ratio, so a shared machine's
drift cancels), and the speed-up over the op's torch path, against which every op is checked first. On CPU each
sample follows an untimed call of the same function, and inputs that fit in the caches beat the copy; on CUDA:
CUDA events, L2 flushed (256 MiB written) before every timed call.

Bytes moved, per op (read + write; the sketch ops count the values sketched or decoded, the measure their targets
are set in), and the torch path each is timed against:

  bitpack (--sizes, in mask elements)
    pack_bits                  size + size/8         bool mask * bit weights, summed per byte
    unpack_bits                size/8 + size         packed & bit weights != 0
    bitwise_or_reduce          (rows + 1) * size/8   functools.reduce(torch.bitwise_or) over --rows bitmaps
  sketch (an embedding-shaped float32 gradient, --sketch-shape, with a row support at row densities 0.5, 2 and 10 %;
          element granularity on --sketch-element-shape, half of its values non-zero; 3-row sketches with a third
          as many columns as values sketched, a table as large as the values)
    nonzero_bitmap             4 * numel             any(!= 0) per row (or element), packed as above
    count_sketch               4 * values sketched   sketch_hash + index_add_ (it stores the hashes; ours never does)
    count_sketch_decode        4 * values decoded    sketch_hash + gather + median, into a zero n x m output
    count_sketch_decode_units  4 * values decoded    the same, written compactly (what sketch_allreduce uses)
  topk (x = --shape float32 rows, k = ceil(--ratio * cols) per row)
    topk_compress              4 n + 8 rows k        torch.topk(x.abs()) + gather
    topk_decompress            8 rows k + 4 n        torch.zeros + scatter_
  quantize (x as above, 8 and 4 bits, one minmax group per row)
    quantize                   4 n + n bits/8        per-row min/max, round, uint8 (one code per byte: no packing)
    dequantize                 n bits/8 + 4 n        codes unpacked with shifts, q * scale + zero
  moe (T * k = --layout-size assignments, k = 2, 64 experts of Zipf-like popularity)
    moe_layout                 8 Tk + 25 Tk + 16 E   stable sort + bincount + cumsum (int64 ids in; int64 permutation,
                                                     row_of_slot, position, bool keep, int64 counts, offsets out)
  epilogue (x and a residual of --shape, a bias of its columns)
    bias_epilogue              12 n + 4 cols         eager act(x + bias) + residual, for gelu_tanh and gelu_erf
"""
import argparse
import functools
import math
import statistics
import time
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

import fastdist
from fastdist.bench import report
from fastdist.bench.report import MIB, col, fixed, scaled, times
from fastdist.bench.toolkit import at_least, comma_list, parse_size, progress, shape_type
from fastdist.ops import (bias_epilogue, bitwise_or_reduce, count_sketch, count_sketch_decode,
                          count_sketch_decode_units, dequantize, moe_layout, nonzero_bitmap, pack_bits, quantize,
                          sketch_hash, topk_compress, topk_decompress, unpack_bits)
from fastdist.ops.topk import topk_k

FAMILIES = {
    "bitpack": ["pack_bits", "unpack_bits", "bitwise_or_reduce"],
    "sketch": ["nonzero_bitmap", "count_sketch", "count_sketch_decode", "count_sketch_decode_units"],
    "topk": ["topk_compress", "topk_decompress"],
    "quantize": ["quantize", "dequantize"],
    "moe": ["moe_layout"],
    "epilogue": ["bias_epilogue"],
}
OPS = [op for ops in FAMILIES.values() for op in ops]
FAMILY_OF = {op: family for family, ops in FAMILIES.items() for op in ops}
SKETCH_ROWS = 3
SKETCH_SEED = 1234
SKETCH_DENSITIES = [0.005, 0.02, 0.10]
QUANTIZE_BITS = [8, 4]
MOE_K, MOE_EXPERTS = 2, 64
ACTIVATIONS = {"gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
               "gelu_erf": torch.nn.functional.gelu}
COPY_BYTES = 256 << 20
FLUSH_BYTES = 256 << 20
MIN_SAMPLE_S = 2e-3  # on CPU, small inputs repeat inside one sample until it takes this long (timer noise)
# (full run, --quick) per option; a dict where CPU and CUDA differ
DEFAULTS = {
    "sizes": ({"cpu": [1 << k for k in range(16, 27, 2)], "cuda": [1 << k for k in range(16, 31, 2)]},
              [1 << 16, 1 << 22]),
    "sketch_shape": ((32768, 1024), (8192, 1024)),
    "sketch_element_shape": ((4096, 1024), (1024, 1024)),
    "densities": (SKETCH_DENSITIES, [0.02]),
    "shape": ({"cpu": (256, 65536), "cuda": (64, 1 << 20)}, (64, 65536)),
    "layout_size": (1 << 20, 1 << 18),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the suite's options to `p`."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the kernels run (cuda needs fastdist's CUDA kernels; default cpu)")
    p.add_argument("--family", type=comma_list(str, list(FAMILIES)), default=None,
                   help="comma-separated families (default all): " + ",".join(FAMILIES))
    p.add_argument("--ops", type=comma_list(str, OPS), default=None,
                   help="comma-separated ops (default all of the families chosen): " + ",".join(OPS))
    p.add_argument("--sizes", type=comma_list(parse_size), default=None,
                   help="bitpack sizes in mask elements, e.g. 64K,1M,2^24 (default 2^16..2^26 on cpu, 2^16..2^30 on "
                        "cuda, step x4; --quick 2^16,2^22)")
    p.add_argument("--rows", type=int, default=8, help="bitmaps ORed by bitwise_or_reduce, as ranks (default 8)")
    p.add_argument("--sketch-shape", type=shape_type(2), default=None,
                   help="gradient ROWSxCOLS for the sketch ops (default 32768x1024; --quick 8192x1024)")
    p.add_argument("--sketch-element-shape", type=shape_type(2), default=None,
                   help="shape for element granularity, half of its values non-zero (default 4096x1024; "
                        "--quick 1024x1024)")
    p.add_argument("--shape", type=shape_type(2), default=None,
                   help="float32 ROWSxCOLS for topk, quantize and bias_epilogue (default 256x65536 on cpu, "
                        "64x1048576 on cuda; --quick 64x65536)")
    p.add_argument("--ratio", type=float, default=0.1, help="TopK keeps ceil(ratio * cols) per row (default 0.1)")
    p.add_argument("--layout-size", type=parse_size, default=None,
                   help="T * k assignments for moe_layout (default 2^20; --quick 2^18)")
    p.add_argument("--repeats", type=at_least(5), default=7,
                   help="timed repetitions per case, >= 5: speeds are medians of >= 5 samples (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per case (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's current)")
    p.add_argument("--quick", action="store_true", help="small inputs (see each option), 5 repetitions")


# ---- the pure-torch paths (the peer column) ----

_POWERS = 1 << torch.arange(8, dtype=torch.uint8)


def torch_pack_bits(mask: Tensor) -> Tensor:
    """pack_bits in torch: each group of 8 bools times the bit weights, summed into a byte."""
    n = mask.shape[-1]
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, -n % 8))
    return (m.view(*m.shape[:-1], -1, 8) * _POWERS.to(m.device)).sum(-1, dtype=torch.uint8)


def torch_unpack_bits(packed: Tensor, n: int) -> Tensor:
    """unpack_bits in torch: each byte ANDed with the bit weights, the first `n` bits kept."""
    bits = (packed.unsqueeze(-1) & _POWERS.to(packed.device)) != 0
    return bits.flatten(-2)[..., :n]


def torch_bitwise_or_reduce(packed: Tensor) -> Tensor:
    """bitwise_or_reduce in torch: the rows ORed one after another."""
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


def torch_count_sketch(x: Tensor, rows: int, cols: int, seed: int, support: Tensor | None, granularity: str) -> Tensor:
    """count_sketch in torch: the hashes stored by sketch_hash, then one index_add_ per sketch row."""
    idx = _sketched_indices(x, support, granularity)
    bucket, sign = sketch_hash(idx, rows, cols, seed, max(_units(x, granularity)[1], 1))
    values = x.reshape(-1)[idx].float()
    table = torch.zeros(rows, cols, device=x.device)
    for j in range(rows):
        table[j].index_add_(0, bucket[j], values * sign[j])
    return table


def torch_count_sketch_decode_units(table: Tensor, units: Tensor, m: int, seed: int) -> Tensor:
    """count_sketch_decode_units in torch: sketch_hash, a gather per sketch row, the median of the estimates."""
    idx = (units[:, None] * m + torch.arange(m, device=table.device)).flatten()
    bucket, sign = sketch_hash(idx, table.shape[0], table.shape[1], seed, max(m, 1))
    est = torch.stack([table[j][bucket[j]] * sign[j] for j in range(table.shape[0])])
    return est.median(dim=0).values.reshape(units.numel(), m)


def torch_count_sketch_decode(table: Tensor, support: Tensor, n: int, m: int, seed: int) -> Tensor:
    """count_sketch_decode in torch: the supported units decoded into a zero [n, m] tensor."""
    units = torch_unpack_bits(support, n).nonzero().flatten()
    out = torch.zeros(n, m, device=table.device)
    out[units] = torch_count_sketch_decode_units(table, units, m, seed)
    return out


def torch_nonzero_bitmap(x: Tensor, granularity: str) -> Tensor:
    """nonzero_bitmap in torch: any non-zero per row (or element), packed."""
    if granularity == "row":
        return torch_pack_bits((x.reshape(x.shape[0], -1) != 0).any(dim=1))
    return torch_pack_bits(x.reshape(-1) != 0)


def torch_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """topk_compress in torch: torch.topk of the magnitudes, then the values gathered (descending magnitude)."""
    idx = torch.topk(x.abs(), k, dim=1).indices
    return x.gather(1, idx), idx


def torch_topk_decompress(values: Tensor, indices: Tensor, d: int) -> Tensor:
    """topk_decompress in torch: the values scattered into zeros [rows, d] (int64 indices)."""
    return torch.zeros(values.shape[0], d, dtype=values.dtype, device=values.device).scatter_(1, indices, values)


def torch_quantize_rows(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row minmax quantize in torch: (one uint8 code per value, scale [rows, 1], zero point [rows, 1])."""
    lo = x.amin(1, keepdim=True)
    hi = x.amax(1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    q = ((x - lo) / scale).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    return q, scale, lo


def torch_dequantize_rows(packed: Tensor, scale: Tensor, lo: Tensor, bits: int, shape: tuple[int, ...]) -> Tensor:
    """Codes packed least-significant-bit first (fastdist.ops.quantize's layout), unpacked and scaled per row."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = ((packed[:, None] >> shifts) & (2**bits - 1)).reshape(shape)
    return codes.float() * scale + lo


def torch_moe_layout(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(counts, permutation, row_of_slot, position) of a dropless layout by stable sort, as moe_layout defines them."""
    tokens, k = ids.shape
    flat = ids.t().reshape(-1)  # priority order: choice-major
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0) - counts
    rows = torch.arange(flat.numel(), device=ids.device)
    slot = (order % tokens) * k + order // tokens
    row_of_slot, position = torch.empty_like(slot), torch.empty_like(slot)
    row_of_slot[slot] = rows
    position[slot] = rows - offsets[flat[order]]
    return counts, slot, row_of_slot.view(tokens, k), position.view(tokens, k)


# ---- the cases: each op on its inputs, with its torch path and its bytes moved ----

class Case(NamedTuple):
    op: str
    label: str  # the input, as the table shows it
    config: dict  # the input, as the JSON stores it
    ours: Callable
    theirs: Callable
    nbytes: int
    agree: Callable  # agree(ours(), theirs()) -> bool


def _case(op: str, label: str, config: dict, nbytes: int, ours: Callable, theirs: Callable, *args: Any,
          agree: Callable = torch.equal) -> Case:
    """A Case whose op and torch path take the same arguments."""
    return Case(op, label, config, partial(ours, *args), partial(theirs, *args), nbytes, agree)


def _close(tolerance: float) -> Callable:
    return partial(torch.allclose, rtol=tolerance, atol=tolerance)


def _bitpack_cases(op, inputs, device):
    for size in inputs["sizes"]:
        g = torch.Generator().manual_seed(size)
        nbytes = (size + 7) // 8
        if op == "pack_bits":
            mask = (torch.rand(size, generator=g) < 0.5).to(device)
            yield _case(op, f"{size} bits", {"size": size}, size + nbytes, pack_bits, torch_pack_bits, mask)
        elif op == "unpack_bits":
            packed = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).to(device)
            yield _case(op, f"{size} bits", {"size": size}, nbytes + size, unpack_bits, torch_unpack_bits, packed, size)
        else:
            packed = torch.randint(0, 256, (inputs["rows"], nbytes), generator=g, dtype=torch.uint8).to(device)
            yield _case(op, f"{inputs['rows']} x {size} bits", {"size": size, "rows": inputs["rows"]},
                        (inputs["rows"] + 1) * nbytes, bitwise_or_reduce, torch_bitwise_or_reduce, packed)


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


def _sketch_cases(op, inputs, device):
    configs = [("row", inputs["sketch_shape"], density) for density in inputs["densities"]]
    configs.append(("element", inputs["sketch_element_shape"], 0.5))
    for granularity, shape, density in configs:
        x = _gradient(shape, density, granularity, device)
        support = nonzero_bitmap(x, granularity)
        n, m = _units(x, granularity)
        config = {"shape": f"{shape[0]}x{shape[1]}", "granularity": granularity, "density": density, "cols": None}
        label = f"{config['shape']} {granularity} {100 * density:g}%"
        if op == "nonzero_bitmap":
            yield _case(op, label, config, x.numel() * 4, nonzero_bitmap, torch_nonzero_bitmap, x, granularity)
            continue
        units = torch_unpack_bits(support, n).nonzero().flatten()
        values = units.numel() * m
        cols = max(values // SKETCH_ROWS, 1024)  # a table as large as the values sketched
        config["cols"], label = cols, f"{label} cols {cols}"
        if op == "count_sketch":
            # Row granularity: the row support is given. Element granularity: no support, the non-zeros are sketched.
            sup = support if granularity == "row" else None
            yield _case(op, label, config, (values if sup is not None else x.numel()) * x.element_size(), count_sketch,
                        torch_count_sketch, x, SKETCH_ROWS, cols, SKETCH_SEED, sup, granularity, agree=_close(1e-4))
            continue
        table = count_sketch(x, SKETCH_ROWS, cols, SKETCH_SEED, support, granularity)
        if op == "count_sketch_decode_units":
            yield _case(op, label, config, values * 4, count_sketch_decode_units, torch_count_sketch_decode_units,
                        table, units, m, SKETCH_SEED)
        else:
            yield _case(op, label, config, values * 4, count_sketch_decode, torch_count_sketch_decode, table, support,
                        n, m, SKETCH_SEED)


def _matrix(inputs, device):
    return torch.randn(inputs["shape"], generator=torch.Generator().manual_seed(0)).to(device)


def _topk_cases(op, inputs, device):
    x = _matrix(inputs, device)
    rows, d = x.shape
    k = topk_k(inputs["ratio"], d)
    config, label, nbytes = {"shape": f"{rows}x{d}", "k": k}, f"{rows}x{d} k={k}", 4 * x.numel() + 8 * rows * k
    if op == "topk_compress":
        def agree(ours, theirs):  # ours come in ascending index order, torch's in descending magnitude
            idx, order = theirs[1].sort(1)
            return torch.equal(ours[1].long(), idx) and torch.equal(ours[0], theirs[0].gather(1, order))
        yield _case(op, label, config, nbytes, topk_compress, torch_topk, x, k, agree=agree)
    else:
        values, indices = topk_compress(x, k)
        indices64 = indices.long()  # torch's scatter_ takes int64 only
        yield Case(op, label, config, partial(topk_decompress, values, indices, d),
                   partial(torch_topk_decompress, values, indices64, d), nbytes, torch.equal)


def _quantize_cases(op, inputs, device):
    x = _matrix(inputs, device)
    rows, d = x.shape
    for bits in QUANTIZE_BITS:
        config, label = {"shape": f"{rows}x{d}", "bits": bits}, f"{rows}x{d} {bits}-bit"
        nbytes = 4 * x.numel() + x.numel() * bits // 8
        if op == "quantize":
            def agree(ours, theirs, bits=bits):  # rounding ties may differ from torch's: check the error bound
                packed, scales, zeros = ours
                y = dequantize(packed, scales, zeros, bits, "minmax", d, x.shape)
                return torch.equal(scales, theirs[1].flatten()) and bool(
                    ((y - x).abs() <= scales[:, None] * 0.5001 + 1e-6).all())
            yield Case(op, label, config, partial(quantize, x, bits, "minmax", d),
                       partial(torch_quantize_rows, x, bits), nbytes, agree)
        else:
            packed, scales, zeros = quantize(x, bits, "minmax", d)
            yield Case(op, label, config, partial(dequantize, packed, scales, zeros, bits, "minmax", d, x.shape),
                       partial(torch_dequantize_rows, packed, scales[:, None], zeros[:, None], bits, x.shape), nbytes,
                       _close(1e-6))


def _moe_cases(op, inputs, device):
    tokens = inputs["layout_size"] // MOE_K
    popularity = 1.0 / torch.arange(1, MOE_EXPERTS + 1, dtype=torch.float64) ** 1.2
    ids = torch.multinomial(popularity.float(), tokens * MOE_K, replacement=True,
                            generator=torch.Generator().manual_seed(0)).view(tokens, MOE_K).to(device)

    def agree(ours, theirs):
        counts, _, _, permutation, row_of_slot, position, _ = ours
        return all(map(torch.equal, (counts, permutation, row_of_slot, position), theirs))
    yield Case(op, f"{tokens * MOE_K} assignments, {MOE_EXPERTS} experts",
               {"assignments": tokens * MOE_K, "k": MOE_K, "experts": MOE_EXPERTS},
               partial(moe_layout, ids, MOE_EXPERTS, 1, -1), partial(torch_moe_layout, ids, MOE_EXPERTS),
               33 * tokens * MOE_K + 16 * MOE_EXPERTS, agree)


def _epilogue_cases(op, inputs, device):
    x = _matrix(inputs, device)
    g = torch.Generator().manual_seed(1)
    bias, residual = torch.randn(x.shape[1], generator=g).to(device), torch.randn(x.shape, generator=g).to(device)
    rows, d = x.shape
    for activation, act in ACTIVATIONS.items():
        yield Case(op, f"{rows}x{d} {activation} +bias +residual",
                   {"shape": f"{rows}x{d}", "activation": activation},
                   lambda a=activation: bias_epilogue(x, bias, residual, a), lambda f=act: f(x + bias) + residual,
                   12 * x.numel() + 4 * d, _close(1e-5))


CASES = {"bitpack": _bitpack_cases, "sketch": _sketch_cases, "topk": _topk_cases, "quantize": _quantize_cases,
         "moe": _moe_cases, "epilogue": _epilogue_cases}


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


def kernel_timer(device: str) -> tuple[Callable, str]:
    """(timer, backend label) for kernels on `device`: CUDA events with L2 flushed before every call, or
    interleaved CPU samples."""
    if device == "cuda":
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        return functools.partial(_time_cuda, flush=flush), f"fastdist CUDA kernels on {torch.cuda.get_device_name()}"
    return _time_cpu, f"fastdist CPU kernels, {torch.get_num_threads()} torch threads"


def inputs_from(args: argparse.Namespace) -> dict:
    """The inputs of every family, from the arguments and the defaults for the device and --quick."""
    chosen = {"rows": args.rows, "ratio": args.ratio}
    for name, (full, quick) in DEFAULTS.items():
        default = quick if args.quick else full
        given = getattr(args, name, None)
        if given is None:
            given = default[args.device] if isinstance(default, dict) else default
        chosen[name] = given
    return chosen


def run(args: argparse.Namespace) -> dict:
    """Runs the suite in this process; prints the header and one table per family; returns the JSON payload."""
    device = args.device
    if device == "cuda" and not fastdist.cuda_kernels_available():
        raise SystemExit("fastdist-bench kernels: --device cuda needs a CUDA device and fastdist built with CUDA "
                         f"kernels (built with CUDA: {fastdist.cuda_kernels_built()}, "
                         f"device visible: {torch.cuda.is_available()})")
    ops = [op for op in OPS if op in (args.ops or OPS) and FAMILY_OF[op] in (args.family or FAMILIES)]
    if not ops:
        raise SystemExit(f"fastdist-bench kernels: none of --ops {','.join(args.ops)} is in --family "
                         f"{','.join(args.family)}")
    with report.torch_threads(args.threads):
        return _run(device, ops, inputs_from(args), 5 if args.quick else args.repeats, args.warmup)


def _run(device, ops, chosen, repeats, warmup):
    timer, backend = kernel_timer(device)
    env = report.environment(backend=backend, device=device, ranks=1, network="-")
    src = torch.ones(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_bytes = 2 * COPY_BYTES  # read + write
    bar = progress(len(ops), "kernels")
    rows = []
    for op in ops:
        for case in CASES[FAMILY_OF[op]](op, chosen, device):
            if not case.agree(case.ours(), case.theirs()):
                raise RuntimeError(f"fastdist-bench kernels: {op} and its torch path disagree on {case.label}")
            ours_s, torch_s, copy_s = timer([case.ours, case.theirs, lambda: dst.copy_(src)], repeats, warmup)
            t, t_torch = statistics.median(ours_s), statistics.median(torch_s)
            pct = 100 * statistics.median(case.nbytes * c / (copy_bytes * s) for s, c in zip(ours_s, copy_s))
            rows.append({"op": op, "family": FAMILY_OF[op], "case": case.label} | case.config | {
                "bytes": case.nbytes, "median_s": t, "gbps": case.nbytes / t / 1e9, "pct_copy": pct,
                "torch_median_s": t_torch, "torch_gbps": case.nbytes / t_torch / 1e9, "speedup": t_torch / t,
                "samples_s": ours_s, "torch_samples_s": torch_s, "copy_samples_s": copy_s})
        bar.step(op)
    copy_samples = [c for r in rows for c in r["copy_samples_s"]]
    copy_gbps = copy_bytes / statistics.median(copy_samples) / 1e9
    print(report.format_environment(env))
    print(f"# copy bandwidth {copy_gbps:.1f} GB/s (dst.copy_(src), {report.human_bytes(COPY_BYTES)}, read + write; "
          "median of all rounds, each op's % of copy is against the copy timed in its own rounds)")
    result = {"suite": "kernels", "env": env, "copy_gbps": copy_gbps, "copy_samples_s": copy_samples,
              "copy_bytes": COPY_BYTES, "rows": rows}
    print(report.text_parts(tables(result)))
    if device == "cpu":
        print("# note: every call returns a new tensor; large CPU outputs (tens of MiB) come back from the\n"
              "# allocator as fresh pages, so those rows include first-touch page faults that the copy reference\n"
              "# (into an existing tensor) does not pay; count_sketch takes its tables from a pool of freed ones\n"
              "# (csrc/ops/sketch.cpp). THP_MEM_ALLOC_ENABLE=1 (huge pages for torch's CPU allocations) helps.")
    return result


TIMING_COLUMNS = [col("time (us)", lambda r: 1e6 * r["median_s"], fixed(1)), col("GB/s", "gbps", fixed(2)),
                  col("of copy (%)", "pct_copy", fixed(1)), col("torch (GB/s)", "torch_gbps", fixed(3)),
                  col("vs torch", "speedup", times(1))]
"""The timing columns of every kernels table (recordings of older row layouts share them)."""


def copy_caption(result: dict) -> str:
    """The copy bandwidth every table of `result` is measured against."""
    return f"Copy bandwidth (median over the run): {result['copy_gbps']:.1f} GB/s."


def tables(result: dict) -> list[report.Part]:
    """One table per op family of `result` (its JSON payload), printed by `run` and shown in the docs."""
    columns = [col("op", "op"), col("input", "case"), col("moved (MiB)", "bytes", scaled(MIB, 2))] + TIMING_COLUMNS
    rows = result["rows"]
    return [report.Part(f, columns, [r for r in rows if r["family"] == f], copy_caption(result))
            for f in dict.fromkeys(r["family"] for r in rows)]


def plot(result: dict, path: str) -> None:
    """Writes the suite's figure of `result` (its JSON payload) to `path` as PNG."""
    rows = result["rows"]
    plt, fig, ax = report.subplots(figsize=(10, 1.5 + 0.28 * len(rows)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    family_color = {family: colors[i % len(colors)] for i, family in enumerate(FAMILIES)}
    pos = range(len(rows))[::-1]
    ax.barh(pos, [r["pct_copy"] for r in rows], color=[family_color[r["family"]] for r in rows])
    for p, r in zip(pos, rows):
        ax.text(r["pct_copy"], p, f" {r['pct_copy']:.1f}%, {r['speedup']:.1f}x torch", va="center", fontsize=7)
    ax.set_yticks(list(pos), [f"{r['op']} {r['case']}" for r in rows], fontsize=7)
    ax.axvline(100, color="black", linestyle=":", label=f"copy bandwidth {result['copy_gbps']:.1f} GB/s")
    ax.set(xscale="log", xlabel="% of the copy bandwidth timed in the same rounds (bytes moved / time; log scale)")
    env = result["env"]
    ax.set_title(f"fastdist kernels: {env['backend']}\nfastdist {env['fastdist']}, torch {env['torch']}, "
                 f"{env['date']}", fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    report.save_figure(fig, path)
