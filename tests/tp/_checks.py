"""Rank-side checks of fastdist.tp, run together in one spawned job per world size (tests/tp/conftest.py), so
that the suite pays the start-up of a multi-process job twice instead of once per test. Each check raises
(AssertionError or the library's error) on failure or returns data the tests assert on."""
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
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

CHUNKS = [1, 2, 3, 4, 8]
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _close(got, want, what):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {dist.get_rank()}: {what}: {m}")


def _shards(t, world, rank, dim):
    return t.chunk(world, dim=dim)[rank]


def _mlp_matches_reference(sequence_parallel):
    """Column(gelu fused) -> Row over every chunk count, ragged tokens; compares every output and gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, ffn = 12, 8 * world
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    # Ragged: 9 x 3 = 27 tokens (not a multiple of any chunk count > 1); under SP the sequence (dim 0) must split
    # over the ranks, so 9 * world rows of 3.
    seq = 9 * world if sequence_parallel else 9
    x = torch.randn(seq, 3, hidden)
    residual = torch.randn(seq, 3, hidden)
    weight_out = torch.randn(seq, 3, hidden)
    xr, rr = x.clone().requires_grad_(), residual.clone().requires_grad_()
    ref = F.gelu(fc1(xr), approximate="tanh")
    ref = fc2(ref) + rr
    (ref * weight_out).sum().backward()
    for k in CHUNKS:
        col = ColumnParallelLinear.from_linear(fc1, None, overlap_chunks=k, sequence_parallel=sequence_parallel,
                                               activation="gelu_tanh")
        row = RowParallelLinear.from_linear(fc2, None, overlap_chunks=k, sequence_parallel=sequence_parallel)
        xs = _shards(x, world, rank, 0) if sequence_parallel else x
        rs = _shards(residual, world, rank, 0) if sequence_parallel else residual
        xs, rs = xs.clone().requires_grad_(), rs.clone().requires_grad_()
        out = row(col(xs), residual=rs)
        want = _shards(ref.detach(), world, rank, 0) if sequence_parallel else ref.detach()
        _close(out, want, f"k={k} output")
        w = _shards(weight_out, world, rank, 0) if sequence_parallel else weight_out
        (out * w).sum().backward()
        want_gx = _shards(xr.grad, world, rank, 0) if sequence_parallel else xr.grad
        want_gr = _shards(rr.grad, world, rank, 0) if sequence_parallel else rr.grad
        _close(xs.grad, want_gx, f"k={k} input grad")
        _close(rs.grad, want_gr, f"k={k} residual grad")
        _close(col.weight.grad, _shards(fc1.weight.grad, world, rank, 0), f"k={k} column weight grad")
        _close(col.bias.grad, _shards(fc1.bias.grad, world, rank, 0), f"k={k} column bias grad")
        _close(row.weight.grad, _shards(fc2.weight.grad, world, rank, 1), f"k={k} row weight grad")
        _close(row.bias.grad, fc2.bias.grad, f"k={k} row bias grad")
    return True


def _gather_and_split_match_reference():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    a, b = torch.nn.Linear(10, 4 * world), torch.nn.Linear(4 * world, 6)
    x = torch.randn(11, 10)
    xr = x.clone().requires_grad_()
    ref = b(a(xr))
    ref.square().sum().backward()
    col = ColumnParallelLinear.from_linear(a, None, gather_output=True, overlap_chunks=3)
    row = RowParallelLinear.from_linear(b, None, input_is_parallel=False, overlap_chunks=2)
    xs = x.clone().requires_grad_()
    mid = col(xs)
    assert mid.shape == (11, 4 * world)
    out = row(mid)
    _close(out, ref.detach(), "output")
    out.square().sum().backward()
    _close(xs.grad, xr.grad, "input grad")
    _close(col.weight.grad, _shards(a.weight.grad, world, rank, 0), "column weight grad")
    _close(row.weight.grad, _shards(b.weight.grad, world, rank, 1), "row weight grad")
    return True


def _collectives_issued():
    world = dist.get_world_size()
    out = {}
    torch.manual_seed(2)
    for sp in (False, True):
        for k in (1, 3):
            col = ColumnParallelLinear(8, 4 * world, None, overlap_chunks=k, sequence_parallel=sp)
            row = RowParallelLinear(4 * world, 8, None, overlap_chunks=k, sequence_parallel=sp)
            x = torch.randn(6, 8, requires_grad=True)
            with count_collectives() as log:
                row(col(x)).sum().backward()
            out[sp, k] = [(r.kind, r.phase, r.site, r.numel) for r in log.records], log.max_in_flight
    return out


def _bad_shapes():
    world = dist.get_world_size()
    messages = {}
    for name, make in {
        "column_out": lambda: ColumnParallelLinear(8, 5, None),
        "row_in": lambda: RowParallelLinear(7, 8, None),
        "bad_chunks": lambda: RowParallelLinear(8, 8, None, overlap_chunks=0),
        "gather_and_sp": lambda: ColumnParallelLinear(8, 8, None, gather_output=True, sequence_parallel=True),
    }.items():
        with pytest.raises(ValueError) as e:
            make()
        messages[name] = str(e.value)
    row = RowParallelLinear(8, 8, None, overlap_chunks=4)
    with pytest.raises(ValueError) as e:
        row(torch.randn(3, 8 // world))
    messages["m_below_k"] = str(e.value)
    with pytest.raises(ValueError) as e:
        row(torch.randn(5, 3))
    messages["features"] = str(e.value)
    sp = RowParallelLinear(8, 8, None, overlap_chunks=1, sequence_parallel=True)
    with pytest.raises(ValueError) as e:
        sp(torch.randn(3, 8 // world))
    messages["sp_rows"] = str(e.value)
    return messages


def _auto_chunks():
    rank = dist.get_rank()
    out = {}
    row = RowParallelLinear(8, 8, None, overlap_chunks="auto")  # the uncalibrated default model: 4 chunks
    row(torch.randn(10, 4))
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


# ---- blocks ----

HIDDEN, HEADS, SEQ = 16, 4, 5


def _reference_block(seed=3):
    torch.manual_seed(seed)
    block = GPTBlock(HIDDEN, HEADS)
    with torch.no_grad():  # larger than default biases and norms, so a missing term would show
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return block


def _compare_block(block, ref, world, rank, what, x, weight):
    xr = x.clone().requires_grad_()
    ref.zero_grad()
    want = ref(xr)
    (want * weight).sum().backward()
    xs = x.clone().requires_grad_()
    got = block(xs)
    _close(got, want.detach(), f"{what} output")
    (got * weight).sum().backward()
    _close(xs.grad, xr.grad, f"{what} input grad")
    return xr.grad


def _param_grads_of_oases(block):
    return {n: getattr(block, n).grad for n in ("ln1_weight", "ln1_bias", "qkv_weight", "qkv_bias", "proj_weight",
                                                "proj_bias", "ln2_weight", "ln2_bias", "fc1_weight", "fc1_bias",
                                                "fc2_weight", "fc2_bias")}


def _oases_block_matches_reference():
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _reference_block()
    torch.manual_seed(4)
    x = torch.randn(3, SEQ, HIDDEN)  # batch 3: ragged sub-batches of 2 and 1
    weight = torch.randn(3, SEQ, HIDDEN)
    for recompute in (False, True):
        block = OverlappedTransformerBlock.from_block(ref, None, recompute=recompute)
        _compare_block(block, ref, world, rank, f"oases recompute={recompute}", x, weight)
        grads = _param_grads_of_oases(block)

        def rows(t):
            return t.chunk(world, 0)[rank]

        def cols(t):
            return t.chunk(world, 1)[rank]

        want = {"ln1_weight": ref.ln1.weight.grad, "ln1_bias": ref.ln1.bias.grad,
                "qkv_weight": rows(ref.attn.qkv.weight.grad), "qkv_bias": rows(ref.attn.qkv.bias.grad),
                "proj_weight": cols(ref.attn.proj.weight.grad), "proj_bias": ref.attn.proj.bias.grad,
                "ln2_weight": ref.ln2.weight.grad, "ln2_bias": ref.ln2.bias.grad,
                "fc1_weight": rows(ref.mlp.fc1.weight.grad), "fc1_bias": rows(ref.mlp.fc1.bias.grad),
                "fc2_weight": cols(ref.mlp.fc2.weight.grad), "fc2_bias": ref.mlp.fc2.bias.grad}
        for name, g in grads.items():
            _close(g, want[name], f"oases recompute={recompute} grad of {name}")
    return True


def _parallelized_block_matches_reference():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    x = torch.randn(2, SEQ, HIDDEN)
    weight = torch.randn(2, SEQ, HIDDEN)
    for k in (1, 3):
        ref = _reference_block()
        block = parallelize(_reference_block(), None, overlap_chunks=k)
        assert isinstance(block.attn.qkv, ColumnParallelLinear) and isinstance(block.mlp.fc2, RowParallelLinear)
        _compare_block(block, ref, world, rank, f"parallelize k={k}", x, weight)
        _close(block.mlp.fc1.weight.grad, ref.mlp.fc1.weight.grad.chunk(world, 0)[rank], f"k={k} fc1 weight grad")
        _close(block.attn.proj.weight.grad, ref.attn.proj.weight.grad.chunk(world, 1)[rank],
               f"k={k} proj weight grad")
        _close(block.ln1.weight.grad, ref.ln1.weight.grad, f"k={k} ln1 weight grad")
    return True


def _step_log(layers, forward, x):
    with count_collectives() as log:
        forward(x).sum().backward()
    return log


def _block_collective_counts():
    """All-reduced volume per layer per step, in activations ([tokens, hidden]), by phase, for 2-layer models."""
    torch.manual_seed(6)
    x = torch.randn(4, SEQ, HIDDEN, requires_grad=True)
    activation = x[..., 0].numel() * HIDDEN
    out = {}

    megatron = [parallelize(_reference_block(s), None, overlap_chunks=1) for s in (1, 2)]

    def megatron_ckpt(h):
        for b in megatron:
            h = checkpoint(b, h, use_reentrant=False)
        return h

    def megatron_plain(h):
        for b in megatron:
            h = b(h)
        return h

    for name, fwd in {"megatron_checkpoint": megatron_ckpt, "megatron": megatron_plain}.items():
        log = _step_log(2, fwd, x)
        out[name] = {p: log.numel("all_reduce", p) / activation / 2 for p in ("forward", "backward", "recompute")}
    for recompute in (False, True):
        blocks = [OverlappedTransformerBlock.from_block(_reference_block(s), None, recompute=recompute)
                  for s in (1, 2)]

        def oases(h, blocks=blocks):
            for b in blocks:
                h = b(h)
            return h

        log = _step_log(2, oases, x)
        out[f"oases_recompute={recompute}"] = {p: log.numel("all_reduce", p) / activation / 2
                                               for p in ("forward", "backward", "recompute")}
        out[f"oases_recompute={recompute}_max_in_flight"] = log.max_in_flight
        out[f"oases_recompute={recompute}_calls"] = log.count()
    return out


def _oases_issue_order():
    """(site, rows) of every all-reduce of one Oases step with batch 3 (sub-batches A = 2, B = 1 sequences)."""
    block = OverlappedTransformerBlock.from_block(_reference_block(), None, recompute=True)
    x = torch.randn(3, SEQ, HIDDEN, requires_grad=True)
    with count_collectives() as log:
        block(x).sum().backward()
    return [(r.site, r.numel // (SEQ * HIDDEN)) for r in log.records]


# ---- cost model ----

def _calibrated_model_state():
    model = CostModel.calibrate(None, shapes=((64, 32, 32),), sizes=[4096, 65536, 262144], reps=2)
    return model.state_dict(), repr(model)


# ---- the runner ----

CHECKS = {
    "mlp": lambda: _mlp_matches_reference(False),
    "mlp_sp": lambda: _mlp_matches_reference(True),
    "gather_split": _gather_and_split_match_reference,
    "collectives": _collectives_issued,
    "bad_shapes": _bad_shapes,
    "auto_chunks": _auto_chunks,
    "oases_block": _oases_block_matches_reference,
    "parallelized_block": _parallelized_block_matches_reference,
    "block_counts": _block_collective_counts,
    "oases_order": _oases_issue_order,
    "calibrate": _calibrated_model_state,
}


def run_checks(names):
    """Runs the named checks in order on this rank; {name: ("ok", value) or ("error", traceback)}."""
    results = {}
    for name in names:
        try:
            results[name] = ("ok", CHECKS[name]())
        except Exception:  # noqa: BLE001 - reported to the test that owns the check
            results[name] = ("error", traceback.format_exc())
    return results
