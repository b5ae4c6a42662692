"""What the tests of fastdist.tp run on each rank. One spawned job per world size runs all of it
(tests/tp/conftest.py), so the suite pays the start-up of a multi-process job twice instead of once per test.

Each rank-side function returns plain values (tensors, records, messages) and asserts nothing: the tests compare
them with what the single-process layers compute from the same seeded inputs (the ``*_case`` functions, which
both sides call)."""
import json
import os
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
from fastdist.distributed import MismatchError
from fastdist.tp import (
    ColumnParallelLinear,
    CostModel,
    GPTBlock,
    OverlappedTransformerBlock,
    RowParallelLinear,
    count_collectives,
    parallelize,
)
from torch.utils.checkpoint import checkpoint
from user_models_on_ranks import ON_RANKS as USER_MODELS_ON_RANKS
from user_models_on_ranks import value_error_message

CHUNKS = [1, 2, 3, 4, 8]
TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}
HIDDEN, HEADS, SEQ = 16, 4, 5
CALIBRATION_SHAPE = (64, 32, 32)  # rows, in_features, out_features
COLLECTIVES_ROWS, COLLECTIVES_FEATURES = 6, 8  # the input of the Column -> Row pair whose collectives are logged


def shard(t, world, rank, dim):
    """Rank ``rank``'s part of ``t`` split ``world`` ways along ``dim``; all of ``t`` when ``dim`` is None."""
    return t if dim is None else t.chunk(world, dim=dim)[rank]


# ---- the cases: seeded inputs and single-process layers ----

def mlp_case(world, sequence_parallel):
    """(fc1, fc2, x, residual, output weights): ragged 9 x 3 = 27 tokens (not a multiple of any chunk count > 1);
    under sequence parallelism the sequence (dim 0) must split over the ranks, so 9 * world rows of 3."""
    hidden, ffn = 12, 8 * world
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    seq = 9 * world if sequence_parallel else 9
    return fc1, fc2, torch.randn(seq, 3, hidden), torch.randn(seq, 3, hidden), torch.randn(seq, 3, hidden)


def gather_split_case(world):
    """(a, b, x): a column-parallel linear whose output is gathered, then a row-parallel one on a replicated input."""
    torch.manual_seed(1)
    a, b = torch.nn.Linear(10, 4 * world), torch.nn.Linear(4 * world, 6)
    return a, b, torch.randn(11, 10)


def reference_block(seed=3):
    """A GPTBlock with biases and norms larger than their defaults, so that a missing term would show."""
    torch.manual_seed(seed)
    block = GPTBlock(HIDDEN, HEADS)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return block


def oases_case():
    """(x, output weights): a batch of 3 sequences, so the sub-batches are ragged (2 and 1)."""
    torch.manual_seed(4)
    return torch.randn(3, SEQ, HIDDEN), torch.randn(3, SEQ, HIDDEN)


def parallelize_case():
    """(x, output weights) for the parallelized block."""
    torch.manual_seed(5)
    return torch.randn(2, SEQ, HIDDEN), torch.randn(2, SEQ, HIDDEN)


# ---- on the ranks: linears ----

def mlp(sequence_parallel):
    """{k: output and gradients} of Column(gelu fused) -> Row for every chunk count, this rank's parts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fc1, fc2, x, residual, weight_out = mlp_case(world, sequence_parallel)
    rows = 0 if sequence_parallel else None
    results = {}
    for k in CHUNKS:
        col = ColumnParallelLinear.from_linear(fc1, None, overlap_chunks=k, sequence_parallel=sequence_parallel,
                                               activation="gelu_tanh")
        row = RowParallelLinear.from_linear(fc2, None, overlap_chunks=k, sequence_parallel=sequence_parallel)
        xs = shard(x, world, rank, rows).clone().requires_grad_()
        rs = shard(residual, world, rank, rows).clone().requires_grad_()
        out = row(col(xs), residual=rs)
        (out * shard(weight_out, world, rank, rows)).sum().backward()
        results[k] = {"output": out.detach(), "input_grad": xs.grad, "residual_grad": rs.grad,
                      "column_weight_grad": col.weight.grad, "column_bias_grad": col.bias.grad,
                      "row_weight_grad": row.weight.grad, "row_bias_grad": row.bias.grad}
    return results


def gather_split():
    """The gathered column output, the row output on the replicated input, and their gradients."""
    world = dist.get_world_size()
    a, b, x = gather_split_case(world)
    col = ColumnParallelLinear.from_linear(a, None, gather_output=True, overlap_chunks=3)
    row = RowParallelLinear.from_linear(b, None, input_is_parallel=False, overlap_chunks=2)
    xs = x.clone().requires_grad_()
    gathered = col(xs)
    out = row(gathered)
    out.square().sum().backward()
    return {"gathered": gathered.detach(), "output": out.detach(), "input_grad": xs.grad,
            "column_weight_grad": col.weight.grad, "row_weight_grad": row.weight.grad}


def collectives_issued():
    """{(sequence_parallel, k): ([(kind, phase, site, numel)], most in flight)} of one step of Column -> Row."""
    world = dist.get_world_size()
    out = {}
    torch.manual_seed(2)
    for sp in (False, True):
        for k in (1, 3):
            col = ColumnParallelLinear(COLLECTIVES_FEATURES, 4 * world, None, overlap_chunks=k, sequence_parallel=sp)
            row = RowParallelLinear(4 * world, COLLECTIVES_FEATURES, None, overlap_chunks=k, sequence_parallel=sp)
            x = torch.randn(COLLECTIVES_ROWS, COLLECTIVES_FEATURES, requires_grad=True)
            with count_collectives() as log:
                row(col(x)).sum().backward()
            out[sp, k] = [(r.kind, r.phase, r.site, r.numel) for r in log.records], log.max_in_flight
    return out


def bad_shapes():
    """{case: the ValueError's message (None if none was raised)} for each bad configuration and input."""
    world = dist.get_world_size()
    row = RowParallelLinear(8, 8, None, overlap_chunks=4)
    sp = RowParallelLinear(8, 8, None, overlap_chunks=1, sequence_parallel=True)
    return {
        "column_out": value_error_message(lambda: ColumnParallelLinear(8, 5, None)),
        "row_in": value_error_message(lambda: RowParallelLinear(7, 8, None)),
        "bad_chunks": value_error_message(lambda: RowParallelLinear(8, 8, None, overlap_chunks=0)),
        "gather_and_sp": value_error_message(lambda: ColumnParallelLinear(8, 8, None, gather_output=True,
                                                               sequence_parallel=True)),
        "m_below_k": value_error_message(lambda: row(torch.randn(3, 8 // world))),
        "features": value_error_message(lambda: row(torch.randn(5, 3))),
        "sp_rows": value_error_message(lambda: sp(torch.randn(3, 8 // world))),
    }


def auto_chunks():
    """The uncalibrated model's chunk counts, and the error when the ranks' models choose differently."""
    rank = dist.get_rank()
    out = {}
    row = RowParallelLinear(8, 8, None, overlap_chunks="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row(torch.randn(10, 4))
    out["uncalibrated_warnings"] = [str(w.message) for w in caught]
    out["uncalibrated"] = row.chunks_for(10)
    row(torch.randn(3, 4))
    out["few_rows"] = row.chunks_for(3)
    # Ranks whose calibrations differ must not silently issue different collectives.
    mine = CostModel(alpha=1e-6 if rank == 0 else 1.0, beta=5e7, gemm_rate=1e8, world_size=2)
    odd = RowParallelLinear(8, 8, None, overlap_chunks="auto", cost_model=mine)
    try:
        odd(torch.randn(64, 4))
        out["mismatch"] = None
    except MismatchError as e:
        out["mismatch"] = str(e)
    return out


def _raised(make):
    """(exception type name, message) of what ``make()`` raises; None when it raises nothing."""
    try:
        make()
    except Exception as e:  # noqa: BLE001 - the test compares the type and the message
        return type(e).__name__, str(e)
    return None


def token_mismatch():
    """{case: what this rank's call raised} when the ranks pass different token counts (rank r: 10 + 2r rows), and
    the output of a matching call afterwards (the group still works)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 10 + 2 * rank
    torch.manual_seed(7)
    row_fixed = RowParallelLinear(8, 8, None, overlap_chunks=2)
    row_auto = RowParallelLinear(8, 8, None, overlap_chunks="auto",
                                 cost_model=CostModel(alpha=1e-5, beta=1e9, gemm_rate=1e9, world_size=world))
    column = ColumnParallelLinear(8, 8, None, overlap_chunks=1)
    row_sp = RowParallelLinear(8, 8, None, overlap_chunks=1, sequence_parallel=True)
    out = {
        "row_fixed_chunks": _raised(lambda: row_fixed(torch.randn(rows, 8 // world))),
        "row_auto_chunks": _raised(lambda: row_auto(torch.randn(rows, 8 // world))),
        "column": _raised(lambda: column(torch.randn(rows, 8)).sum().backward()),
        "row_sequence_parallel": _raised(lambda: row_sp(torch.randn(2 * rows, 8 // world))),
    }
    row_fixed(torch.randn(10, 8 // world))  # 10 rows everywhere: seen (and its chunk count cached) on every rank
    out["after_a_matching_call"] = _raised(lambda: row_fixed(torch.randn(rows, 8 // world)))
    bad_features = 8 // world + (1 if rank == 1 else 0)  # rank 1 alone passes a wrong width
    out["bad_input_on_one_rank"] = _raised(lambda: row_fixed(torch.randn(10, bad_features)))
    x = torch.randn(6, 8 // world)
    out["matching_output"] = row_fixed(x).detach()
    return out


def compiled_case(world):
    """(fc1, fc2, x, x sequence-parallel): the MLP run eagerly and under torch.compile."""
    torch.manual_seed(8)
    return (torch.nn.Linear(12, 8 * world), torch.nn.Linear(8 * world, 12), torch.randn(6, 3, 12),
            torch.randn(6 * world, 3, 12))


def compiled_against_eager():
    """{"eager" | "compiled": outputs and gradients} of one step of two Column -> Row MLPs (2 chunks each, one
    sequence-parallel), run eagerly and as one torch.compile(fullgraph=True) function."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fc1, fc2, x, x_sp = compiled_case(world)
    col = ColumnParallelLinear.from_linear(fc1, None, overlap_chunks=2, activation="gelu_tanh")
    row = RowParallelLinear.from_linear(fc2, None, overlap_chunks=2)
    col_sp = ColumnParallelLinear.from_linear(fc1, None, overlap_chunks=2, sequence_parallel=True)
    row_sp = RowParallelLinear.from_linear(fc2, None, overlap_chunks=2, sequence_parallel=True)
    layers = {"col": col, "row": row, "col_sp": col_sp, "row_sp": row_sp}

    def step(x, x_sp):
        return row(col(x), residual=x), row_sp(torch.relu(col_sp(x_sp)))

    out = {}
    for mode, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        xs, xs_sp = x.clone().requires_grad_(), shard(x_sp, world, rank, 0).clone().requires_grad_()
        y, y_sp = fn(xs, xs_sp)
        (y.square().sum() + y_sp.square().sum()).backward()
        out[mode] = {"output": y.detach(), "output_sp": y_sp.detach(), "input_grad": xs.grad,
                     "input_grad_sp": xs_sp.grad,
                     **{f"{name}.{p}": getattr(layer, p).grad.clone() for name, layer in layers.items()
                        for p in ("weight", "bias")}}
        for layer in layers.values():
            layer.zero_grad(set_to_none=True)
    return out


# ---- on the ranks: blocks ----

def oases_block():
    """{recompute: output, input gradient and this rank's parameter gradients} of the Oases block."""
    ref = reference_block()
    x, weight = oases_case()
    results = {}
    for recompute in (False, True):
        block = OverlappedTransformerBlock.from_block(ref, None, recompute=recompute)
        xs = x.clone().requires_grad_()
        out = block(xs)
        (out * weight).sum().backward()
        results[recompute] = {"output": out.detach(), "input_grad": xs.grad,
                              **{name: p.grad for name, p in block.named_parameters()}}
    return results


def oases_state_dict():
    """An Oases block loaded from a GPTBlock's state_dict: its keys, its output, and the full state it gathers."""
    ref = reference_block()
    x, _ = oases_case()
    block = OverlappedTransformerBlock(HIDDEN, HEADS, None)
    block.load_state_dict(ref.state_dict())
    with torch.no_grad():
        out = block(x)
    gathered = GPTBlock(HIDDEN, HEADS)
    gathered.load_state_dict(block.full_state_dict())
    return {"keys": sorted(block.state_dict()), "output": out, "gathered": gathered.state_dict()}


def parallelized_block():
    """{k: layer types, output, input gradient and some parameter gradients} of parallelize(GPTBlock)."""
    x, weight = parallelize_case()
    results = {}
    for k in (1, 3):
        block = parallelize(reference_block(), None, overlap_chunks=k)
        xs = x.clone().requires_grad_()
        out = block(xs)
        (out * weight).sum().backward()
        results[k] = {"qkv_type": type(block.attn.qkv).__name__, "fc2_type": type(block.mlp.fc2).__name__,
                      "output": out.detach(), "input_grad": xs.grad, "fc1_weight_grad": block.mlp.fc1.weight.grad,
                      "proj_weight_grad": block.attn.proj.weight.grad, "ln1_weight_grad": block.ln1.weight.grad}
    return results


def _step_log(forward, x):
    with count_collectives() as log:
        forward(x).sum().backward()
    return log


def block_collective_counts():
    """All-reduced volume per layer per step, in activations ([tokens, hidden]), by phase, for 2-layer models."""
    torch.manual_seed(6)
    x = torch.randn(4, SEQ, HIDDEN, requires_grad=True)
    activation = x[..., 0].numel() * HIDDEN
    out = {}

    megatron = [parallelize(reference_block(s), None, overlap_chunks=1) for s in (1, 2)]

    def megatron_ckpt(h):
        for b in megatron:
            h = checkpoint(b, h, use_reentrant=False)
        return h

    def megatron_plain(h):
        for b in megatron:
            h = b(h)
        return h

    for name, fwd in {"megatron_checkpoint": megatron_ckpt, "megatron": megatron_plain}.items():
        log = _step_log(fwd, x)
        out[name] = {p: log.numel("all_reduce", p) / activation / 2 for p in ("forward", "backward", "recompute")}
        out[f"{name}_token_counts"] = {p: log.count("token_count", p) / 2 for p in ("forward", "backward", "recompute")}
    for recompute in (False, True):
        blocks = [OverlappedTransformerBlock.from_block(reference_block(s), None, recompute=recompute)
                  for s in (1, 2)]

        def oases(h, blocks=blocks):
            for b in blocks:
                h = b(h)
            return h

        log = _step_log(oases, x)
        out[f"oases_recompute={recompute}"] = {p: log.numel("all_reduce", p) / activation / 2
                                               for p in ("forward", "backward", "recompute")}
        out[f"oases_recompute={recompute}_max_in_flight"] = log.max_in_flight
        out[f"oases_recompute={recompute}_calls"] = log.count()
    return out


def oases_issue_order():
    """(site, rows) of every all-reduce of one Oases step with batch 3 (sub-batches A = 2, B = 1 sequences)."""
    block = OverlappedTransformerBlock.from_block(reference_block(), None, recompute=True)
    x = torch.randn(3, SEQ, HIDDEN, requires_grad=True)
    with count_collectives() as log:
        block(x).sum().backward()
    return [(r.site, r.numel // (SEQ * HIDDEN)) for r in log.records]


# ---- on the ranks: the cost model ----

def calibrated_model_state():
    """The state and repr of a CostModel calibrated on these ranks."""
    model = CostModel.calibrate(None, shapes=(CALIBRATION_SHAPE,), sizes=[4096, 65536, 262144], reps=2)
    return model.state_dict(), repr(model)


def calibration_cache():
    """Sources, states and the file's keys of models calibrated with a cache file: measured, then loaded, then
    another calibration's measured and added beside it."""
    path = os.path.join(tempfile.gettempdir(), f"fastdist-tp-cost-{os.environ['MASTER_PORT']}.json")
    kwargs = {"shapes": (CALIBRATION_SHAPE,), "sizes": [4096, 65536], "reps": 2}
    try:
        first = CostModel.calibrate(None, cache=path, **kwargs)
        again = CostModel.calibrate(None, cache=path, **kwargs)
        other = CostModel.calibrate(None, cache=path, **{**kwargs, "sizes": [4096]})
        dist.barrier()
        with open(path) as f:
            keys = sorted(json.load(f)["models"])
        loaded = CostModel.load(path, first.key)
        dist.barrier()
    finally:
        if dist.get_rank() == 0 and os.path.exists(path):
            os.remove(path)
    return {"sources": [first.source, again.source, other.source], "first": first.state_dict(),
            "again": again.state_dict(), "loaded": loaded.state_dict(), "keys": keys, "other_key": other.key}


# ---- the runner ----

ON_RANKS = {
    "mlp": lambda: mlp(False),
    "mlp_sp": lambda: mlp(True),
    "gather_split": gather_split,
    "collectives": collectives_issued,
    "bad_shapes": bad_shapes,
    "auto_chunks": auto_chunks,
    "oases_block": oases_block,
    "oases_state_dict": oases_state_dict,
    "parallelized_block": parallelized_block,
    "block_counts": block_collective_counts,
    "oases_order": oases_issue_order,
    "calibrate": calibrated_model_state,
    "calibration_cache": calibration_cache,
    "token_mismatch": token_mismatch,
    "compiled": compiled_against_eager,
    **USER_MODELS_ON_RANKS,
}


def run_on_ranks(names):
    """Runs the named functions in order on this rank; {name: ("ok", value) or ("error", traceback)}."""
    results = {}
    for name in names:
        try:
            results[name] = ("ok", ON_RANKS[name]())
        except Exception:  # noqa: BLE001 - reported to the test that reads the value
            results[name] = ("error", traceback.format_exc())
    return results
