"""Rank functions of test_disagreement.py: each case runs one distributed API with one argument changed on one rank.

A case is ``fn(rank, group) -> value``: it builds and calls the API on ``group`` (a fresh group per case, with a short
timeout, so that a case that leaves collectives unmatched cannot reach into the next one and a hang shows up as that
case's timeout error). `run_cases` runs the named cases of one API in turn and returns, per case, what happened on
this rank: ("mismatch", message), ("ok", value) or ("error", "Type: message"). The test body compares the ranks.
"""
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fastdist.comm import sketch_allreduce
from fastdist.comm.hooks import SketchState, sketch_hook
from fastdist.distributed import MismatchError

CASE_TIMEOUT_S = 15  # a case's group gives up after this long: a hang becomes an error in that case's report

# api -> {case name: (fn, the field the MismatchError must name or None: must agree, ranks raising their own error)}
CASES: dict[str, dict] = {}


def case(api: str, name: str, field: str | None, own_error: tuple = ()):
    """Registers ``fn(rank, group)`` as case ``name`` of ``api``; ``field``: what the MismatchError names (None: the
    change must not matter, every rank returns the same value); ``own_error``: ranks given an invalid input, which
    raise their own ValueError naming ``field`` while the others raise MismatchError."""
    def register(fn):
        CASES.setdefault(api, {})[name] = (fn, field, own_error)
        return fn
    return register


def run_cases(api: str, names: list[str]) -> dict:
    """Runs the cases ``names`` of ``api`` on this rank, each on a group of its own, and reports each outcome."""
    out = {}
    for name in names:
        group = dist.new_group(list(range(dist.get_world_size())),
                               timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S))
        fn = CASES[api][name][0]
        try:
            out[name] = ("ok", fn(dist.get_rank(), group))
        except MismatchError as e:
            out[name] = ("mismatch", str(e))
        except ValueError as e:
            out[name] = ("ValueError", str(e))
        except Exception as e:  # noqa: BLE001 - reported to the test body, which names the case
            out[name] = ("error", f"{type(e).__name__}: {e}"[:2000])
        dist.barrier()  # on the default group: the next case starts together
    return out


# --- sketch_allreduce -------------------------------------------------------------------------------------------

SKETCH_BASE = dict(mode="auto", ratio=0.25, rows=3, seed=1, op="sum", granularity="row", lossless_slack=2.0,
                   dense_fraction=0.5, max_sketch_load=1.0, exact_collective="auto")


def _gradient(rank, rows=64, dim=4, dtype=torch.float32):
    g = torch.zeros(rows, dim, dtype=dtype)
    g[torch.arange(rank, rows, 5)] = torch.arange(1.0, 1.0 + dim, dtype=dtype) * (rank + 1)
    return g


def _sketch_case(change, tensor_change=None):
    def fn(rank, group):
        kwargs = dict(SKETCH_BASE)
        x = _gradient(rank)
        if rank == 1:
            kwargs.update(change)
            if tensor_change is not None:
                x = tensor_change(x)
        out = []
        for _ in range(2):  # the second call too: nothing lingers after the first
            y = x.clone() if not x.is_sparse else x
            y = sketch_allreduce(y, group=group, **kwargs)
            y = y.result() if kwargs.get("async_op") else y
            out.append(y.to_dense() if y.is_sparse else y)
        return out
    return fn


for _field, _value in (("mode", "exact"), ("ratio", 0.5), ("rows", 5), ("seed", 2), ("op", "avg"),
                       ("granularity", "element"), ("lossless_slack", 0.5), ("dense_fraction", 0.05),
                       ("max_sketch_load", 4.0), ("exact_collective", "allreduce-union")):
    case("sketch_allreduce", _field, _field)(_sketch_case({_field: _value}))
case("sketch_allreduce", "cols", "cols")(_sketch_case({"ratio": None, "cols": 7}))
case("sketch_allreduce", "shape", "shape")(_sketch_case({}, lambda x: torch.cat([x, x[:1]])))
case("sketch_allreduce", "dtype", "dtype")(_sketch_case({}, lambda x: x.double()))
case("sketch_allreduce", "sparse", "sparse")(_sketch_case({}, lambda x: x.to_sparse(1)))
case("sketch_allreduce", "async_op", None)(_sketch_case({"async_op": True}))


@case("sketch_allreduce", "residual on one rank", "residual")
def _residual_on_one_rank(rank, group):
    residual = torch.zeros(3, 64) if rank == 1 else None
    return sketch_allreduce(_gradient(rank), mode="sketch", cols=64, seed=3, residual=residual, group=group)


@case("sketch_allreduce", "residual contents", "residual")
def _residual_contents(rank, group):
    residual = torch.zeros(3, 64)
    residual[0, 0] = float(rank)  # a residual that drifted on one rank: the ranks would return different sums
    return sketch_allreduce(_gradient(rank), mode="sketch", cols=64, seed=3, residual=residual, group=group)


@case("sketch_allreduce", "skipped call", "call number")
def _skipped_call(rank, group):
    # a loop that numbers its calls by step: rank 1 skips step 0, so its step 1 meets rank 0's step 0 (same sizes)
    out = []
    for step in range(3):
        if rank == 1 and step == 0:
            continue
        out.append(sketch_allreduce(_gradient(rank) * (step + 1), mode="exact", group=group, step=step))
    return out


@case("sketch_allreduce", "added call", "call number")
def _added_call(rank, group):
    # rank 0 reduces step 0 twice: its second call meets rank 1's step 1
    out = []
    for step in [0] * (1 + (rank == 0)) + [1, 2]:
        out.append(sketch_allreduce(_gradient(rank) * (step + 1), mode="exact", group=group, step=step))
    return out


@case("sketch_allreduce", "count restored from another step", "call number")
def _count_restored(rank, group):
    from fastdist.comm import default_call_counter
    counter = default_call_counter(group)
    if rank == 1:
        counter.load_state_dict({"calls": 7})
    return [sketch_allreduce(_gradient(rank), mode="exact", group=group)]


@case("sketch_allreduce", "one rank's count of timed exact choices", None)
def _skewed_timed_choices(rank, group):
    # disjoint supports: the gather of own rows is a candidate, so auto times both exact collectives, then re-times
    # the slower one every EXACT_REPROBE_EVERY-th timed call; one rank's count is off by one here (e.g. its
    # ExactTimings came from elsewhere): the header carries the counts, so the ranks still choose alike
    from fastdist.comm import ExactTimings, sketch
    timings, out = ExactTimings(), []
    for call in range(sketch.EXACT_EXPLORE_CALLS + 3):
        if call == sketch.EXACT_EXPLORE_CALLS and rank == 1:
            for rates in timings.by_class.values():
                rates.timed_choices = sketch.EXACT_REPROBE_EVERY - 1
        x = _gradient(rank)
        sketch_allreduce(x, mode="exact", timings=timings, group=group)
        out.append(x)
    return out


# --- SketchState + sketch_hook under DDP ------------------------------------------------------------------------

HOOK_BASE = dict(ratio=0.25, rows=3, seed=0, mode="auto", density_threshold=0.5, start_iter=0, error_feedback=False,
                 exact_collective="auto", background=False)


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 8)
        self.out = torch.nn.Linear(8, 64)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(1))


def _train_with_hook(rank, group, state, steps=2, change_later=None):
    torch.manual_seed(0)
    model = DDP(_TinyLM(), process_group=group, bucket_cap_mb=0.001)
    model.register_comm_hook(state, sketch_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if step == 1 and change_later and rank == 1:  # a setting changed on one rank after the checked first call
            for k, v in change_later.items():
                setattr(state, k, v)
        tokens = torch.randint(0, 16 + 8 * rank, (4, 3), generator=g)
        loss = torch.nn.functional.cross_entropy(model(tokens), tokens[:, 0])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _hook_case(change, background=False):
    def fn(rank, group):
        kwargs = dict(HOOK_BASE, background=background)
        if rank == 1:
            kwargs.update(change)
        return _train_with_hook(rank, group, SketchState(process_group=group, **kwargs))
    return fn


for _field, _value in (("ratio", 0.5), ("rows", 5), ("seed", 3), ("mode", "exact"), ("density_threshold", 0.05),
                       ("start_iter", 1), ("error_feedback", True), ("exact_collective", "allreduce-union"),
                       ("background", True), ("lossless_slack", 0.5), ("max_sketch_load", 4.0)):
    case("SketchState", _field, _field)(_hook_case({_field: _value}))
    if _field != "background":
        case("SketchState", f"{_field} (background)", _field)(_hook_case({_field: _value}, background=True))


@case("SketchState", "iter", "iter")
def _restored_at_another_step(rank, group):
    state = SketchState(process_group=group, **HOOK_BASE)
    if rank == 1:  # restored from another step's checkpoint
        state.load_state_dict(dict(state.state_dict(), iter=5))
    return _train_with_hook(rank, group, state)


for _background in (False, True):
    _suffix = " (background)" if _background else ""
    for _field, _value in (("ratio", 0.5), ("mode", "exact"), ("density_threshold", 0.05)):
        def _changed_later(rank, group, field=_field, value=_value, background=_background):
            state = SketchState(process_group=group, **dict(HOOK_BASE, background=background))
            return _train_with_hook(rank, group, state, steps=3, change_later={field: value})
        case("SketchState", f"{_field} changed after the first step{_suffix}", _field)(_changed_later)


# --- compress: StageBoundary and send/recv (rank 0 -> rank 1) ---------------------------------------------------

def _link_step(rank, group, fwd, bwd, backward_mask="reuse", check_every=1, steps=2, ends=(0, 1)):
    from fastdist.compress import StageBoundary
    link = StageBoundary(*ends, fwd=fwd, bwd=bwd, backward_mask=backward_mask, group=group, check_every=check_every)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        if rank == 0:
            y = torch.randn(8, 32, generator=g).requires_grad_()
            link.send(y).backward()
            out.append(y.grad)
        else:
            x = link.recv()
            (x.square().sum()).backward()
            out.append(x.detach())
    return out


def _link_case(change, ends=None):
    def fn(rank, group):
        from fastdist.compress import Quantize, TopK
        kwargs = dict(fwd=TopK(0.25), bwd=Quantize(8), backward_mask="reuse", check_every=1)
        if rank == 1:
            kwargs.update({k: v() if callable(v) else v for k, v in change.items()})
        if ends is not None:
            kwargs["ends"] = ends[rank]
        return [True for _ in _link_step(rank, group, **kwargs)]
    return fn


def _quantize(bits):
    from fastdist.compress import Quantize
    return lambda: Quantize(bits)


def _topk(ratio):
    from fastdist.compress import TopK
    return lambda: TopK(ratio)


case("StageBoundary", "fwd ratio", "fwd.ratio")(_link_case({"fwd": _topk(0.5)}))
case("StageBoundary", "fwd kind", "fwd")(_link_case({"fwd": _quantize(8)}))
case("StageBoundary", "bwd bits", "bwd.bits")(_link_case({"bwd": _quantize(4)}))
case("StageBoundary", "bwd none", "bwd")(_link_case({"bwd": None}))
case("StageBoundary", "backward_mask", "backward_mask")(_link_case({"backward_mask": "independent"}))
case("StageBoundary", "check_every", None)(_link_case({"check_every": 3}))
case("StageBoundary", "ends", "ends")(_link_case({}, ends={0: (0, 1), 1: (1, 0)}))


def _send_recv_case(change):
    def fn(rank, group):
        from fastdist.compress import recv, send
        make = {"topk": _topk(0.25), "quantize": _quantize(8)}
        kind, arg = change if rank == 1 else ("topk", 0.25)
        compressor = _topk(arg)() if kind == "topk" else _quantize(arg)()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
        del make
        if rank == 0:
            send(x, 1, compressor, group=group)
            return [True]
        return [recv(0, compressor, group=group)]
    return fn


# one-way: the sender cannot learn of a mismatch, the receiver raises (RECEIVER_ONLY in the test)
case("send/recv", "ratio", "compressor config")(_send_recv_case(("topk", 0.5)))
case("send/recv", "kind", "compressor config")(_send_recv_case(("quantize", 8)))


# --- moe: MoELayer and data_parallel ------------------------------------------------------------------------------

MOE_BASE = dict(d_model=8, d_ff=16, num_experts=4, k=2, capacity_factor=1.25, dropless=True, activation="gelu",
                balance="none", plan_interval=1, max_replicas_per_rank=2, aux_loss_coef=0.01, min_capacity=4,
                replan_gain=0.03, planner_budget=None)


def _moe_cost():
    from fastdist.moe import CostModel
    return CostModel(d_model=8, d_ff=16, a2a_alpha_s=1e-5, a2a_bytes_per_s=1e9, flops_per_s=1e9, p2p_bytes_per_s=1e10)


def _moe_tokens(rank, count=12, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(count, 8, generator=g).to(dtype)


def _moe_case(change, base=None, tokens=None, dtype=None, steps=2):
    def fn(rank, group):
        from fastdist.moe import MoELayer
        kwargs = dict(MOE_BASE, **(base or {}))
        if rank == 1:
            kwargs.update(change)
        kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}
        torch.manual_seed(0)
        layer = MoELayer(group=group, **kwargs)
        x = _moe_tokens(rank, count=tokens if tokens and rank == 1 else 12)
        if dtype is not None and rank == 1:
            layer, x = layer.to(dtype), x.to(dtype)
        for _ in range(steps):
            y = layer(x)
            (y.float().square().sum() + layer.aux_loss).backward()
        return [True]
    return fn


for _field, _value in (("d_ff", 32), ("num_experts", 6), ("k", 1), ("dropless", False), ("activation", "relu"),
                       ("plan_interval", 2), ("min_capacity", 2), ("aux_loss_coef", 0.1)):
    case("MoELayer", _field, _field)(_moe_case({_field: _value}))
case("MoELayer", "capacity_factor", "capacity_factor")(_moe_case({"capacity_factor": 2.0}, base={"dropless": False}))
case("MoELayer", "balance", "balance")(_moe_case({"balance": "prophet"}, base={"cost_model": _moe_cost}))
case("MoELayer", "cost_model", "cost_model")(_moe_case({"cost_model": _moe_cost}))
for _field, _value in (("max_replicas_per_rank", 1), ("replan_gain", 0.5), ("planner_budget", 3)):
    case("MoELayer", _field, _field)(_moe_case({_field: _value}, base={"balance": "prophet", "cost_model": _moe_cost}))
case("MoELayer", "dtype", "dtype")(_moe_case({}, dtype=torch.float64))
case("MoELayer", "tokens per rank", None)(_moe_case({}, tokens=20))


def _moe_skipped_only_layer(rank, group):
    from fastdist.moe import MoELayer
    layer = MoELayer(group=group, **MOE_BASE)
    for step in range(2):
        if rank == 1 and step == 0:
            continue
        layer(_moe_tokens(rank)).sum().backward()
    return [True]


case("MoELayer", "skipped call of the only layer", "skipped or added a call")(_moe_skipped_only_layer)


@case("MoELayer", "skipped step of the only layer, steps numbered", "MoELayer call")
def _moe_skipped_numbered_step(rank, group):
    from fastdist.moe import MoELayer, step
    layer = MoELayer(group=group, **MOE_BASE)
    for i in range(3):
        if rank == 1 and i == 0:
            continue
        with step(i):
            layer(_moe_tokens(rank)).sum().backward()
    return [True]


def _data_parallel_case(change):
    def fn(rank, group):
        from fastdist.moe import MoELayer, data_parallel
        kwargs = dict(bucket_cap_mb=25)
        if rank == 1:
            kwargs.update(change)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoELayer(group=group, **MOE_BASE), torch.nn.Linear(8, 8))
        ddp = data_parallel(model, process_group=group, **kwargs)
        for _ in range(2):
            ddp(_moe_tokens(rank)).square().sum().backward()
        return [torch.cat([p.grad.flatten() for p in model[0].parameters()])]
    return fn


case("data_parallel", "bucket_cap_mb", "bucket_cap_mb")(_data_parallel_case({"bucket_cap_mb": 0.0001}))
case("data_parallel", "find_unused_parameters", "find_unused_parameters")(
    _data_parallel_case({"find_unused_parameters": True}))
case("data_parallel", "gradient_as_bucket_view", None)(_data_parallel_case({"gradient_as_bucket_view": True}))


# --- tp: the parallel linears, OverlappedTransformerBlock and parallelize ---------------------------------------------

TP_BASE = dict(hidden=16, ffn=32, overlap_chunks=1, sequence_parallel=False, bias=True, gather_output=False,
               activation="none", input_is_parallel=True, tokens=8, dtype=torch.float32, input_dtype=None)


def _tp_case(change):
    def fn(rank, group):
        from fastdist.tp import ColumnParallelLinear, RowParallelLinear
        c = dict(TP_BASE)
        if rank == 1:
            c.update({k: v() if callable(v) else v for k, v in change.items()})
        torch.manual_seed(0)
        fc1 = ColumnParallelLinear(c["hidden"], c["ffn"], group, gather_output=c["gather_output"],
                                   overlap_chunks=c["overlap_chunks"], sequence_parallel=c["sequence_parallel"],
                                   activation=c["activation"], bias=c["bias"], dtype=c["dtype"])
        fc2 = RowParallelLinear(c["ffn"], c["hidden"], group, input_is_parallel=c["input_is_parallel"],
                                overlap_chunks=c["overlap_chunks"], sequence_parallel=c["sequence_parallel"],
                                bias=c["bias"], dtype=c["dtype"])
        x = torch.randn(c["tokens"], c["hidden"], generator=torch.Generator().manual_seed(3))
        x = x.to(c["input_dtype"] or c["dtype"]).requires_grad_()
        h = fc1(x)
        if c["gather_output"]:  # the full width back to this rank's slice, as the row-parallel input
            h = h.chunk(dist.get_world_size(group), -1)[dist.get_rank(group)]
        y = fc2(h if c["input_is_parallel"] else torch.cat([h] * dist.get_world_size(group), -1))
        y.square().sum().backward()
        return [y.detach().float()]
    return fn


def _tp_cost(chunks):
    from fastdist.tp import CostModel

    class Fixed(CostModel):
        def choose_chunks(self, shape, op="row", world_size=None, dtype=torch.float32):
            return chunks

    return lambda: Fixed(alpha=1e-5, beta=1e9, gemm_rate=1e9)


for _field, _value in (("overlap_chunks", 2), ("sequence_parallel", True), ("bias", False), ("dtype", torch.float64),
                       ("gather_output", True), ("activation", "gelu_tanh"), ("ffn", 64)):
    case("tp linears", _field, _field if _field not in ("ffn",) else "out_features")(_tp_case({_field: _value}))
case("tp linears", "tokens", "rows")(_tp_case({"tokens": 10}))
case("tp linears", "input dtype", "dtype", own_error=(1,))(_tp_case({"input_dtype": torch.float64}))


@case("tp linears", "cost_model (auto)", "overlap_chunks")
def _tp_auto_cost_models(rank, group):
    from fastdist.tp import ColumnParallelLinear
    layer = ColumnParallelLinear(16, 32, group, overlap_chunks="auto", cost_model=_tp_cost(1 + rank)())
    x = torch.randn(8, 16, requires_grad=True)
    layer(x).sum().backward()
    return [True]


def _block_case(change):
    def fn(rank, group):
        from fastdist.tp import OverlappedTransformerBlock
        c = dict(hidden=16, heads=2, mlp_ratio=4, eps=1e-5, dtype=torch.float32, seq=4)
        if rank == 1:
            c.update(change)
        block = OverlappedTransformerBlock(c["hidden"], c["heads"], group, mlp_ratio=c["mlp_ratio"], eps=c["eps"],
                                           dtype=c["dtype"])
        x = torch.randn(2, c["seq"], c["hidden"], generator=torch.Generator().manual_seed(0), dtype=c["dtype"])
        return [block(x).detach().float()]
    return fn


for _field, _value in (("heads", 4), ("mlp_ratio", 2), ("eps", 1e-6), ("dtype", torch.float64)):
    case("OverlappedTransformerBlock", _field, _field)(_block_case({_field: _value}))
case("OverlappedTransformerBlock", "sequence length", "seq")(_block_case({"seq": 6}))


def _parallelize_case(change):
    def fn(rank, group):
        import sys
        import os
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tp"))
        from user_models import GPTConfig, NanoGPTStack
        from fastdist.tp import parallelize
        c = dict(overlap_chunks=1, plan=None, n_head=2)
        if rank == 1:
            c.update(change)
        torch.manual_seed(0)
        model = NanoGPTStack(GPTConfig(n_embd=16, n_head=c["n_head"], n_layer=1, block_size=8, dropout=0.0, bias=True))
        parallelize(model, group=group, plan=c["plan"], overlap_chunks=c["overlap_chunks"])
        x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
        return [model(x).detach()]
    return fn


case("parallelize", "overlap_chunks", "overlap_chunks")(_parallelize_case({"overlap_chunks": 2}))
case("parallelize", "plan", "plan")(_parallelize_case({"plan": {"h.0.mlp.c_fc": "colwise",
                                                                  "h.0.mlp.c_proj": "rowwise"}}))
case("parallelize", "heads", "n_head")(_parallelize_case({"n_head": 4}))


@case("OverlappedTransformerBlock", "input dtype", "dtype")
def _block_input_dtype(rank, group):
    from fastdist.tp import OverlappedTransformerBlock
    block = OverlappedTransformerBlock(16, 2, group)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    return [block(x.double() if rank == 1 else x).detach()]
