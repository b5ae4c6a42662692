"""Cutting a model into pipeline stages without tracing it, and choosing where to cut.

A model whose blocks are an ``nn.ModuleList`` (``TransformerLM.blocks``, nanoGPT's ``transformer.h``, Hugging
Face GPT-2's ``transformer.h``, LLaMA's ``model.layers``) is a sequence of pieces: what its forward runs before
the first block ("pre": embeddings, position terms, masks), each block (with whatever the forward runs between it
and the next), and what it runs after the last block ("post": final norm, head). A stage is a run of consecutive
pieces.

How a stage runs (no tracing). A stage's module is a copy of the user's model in which every module the stage does
not own is replaced by a stub, and whose forward is the user's own forward:

- blocks before the stage pass their hidden state through; the stage's first block takes the activation handed in
  from the previous stage instead of the one the forward computed;
- the first block after the stage stops the forward and hands the hidden state out (an exception caught by the
  stage's forward), so nothing after the cut runs;
- other modules the stage does not own (an embedding on a later stage) replay the outputs they gave, at the
  training shape, when the model was analysed; a parameter used directly by the forward (``self.pos``) that the
  stage does not own becomes a plain tensor there.

So every stage runs the user's forward code, with its masks, position ids and rotary tables computed as the model
computes them, and the stage's parameters keep the user's names. A later stage runs the code before its blocks on
the example batch (cheap: no embedding lookups, those are stubs), which is why the extra inputs of the blocks (a
causal mask, rotary tables) may depend on the batch's shape but not on its values; :func:`analyze` checks that by
running each stage on a second batch and comparing with the whole model, and refuses with the reason. A parameter
used by pieces on two stages (a tied embedding and head) is held by both stages; the engine sums its gradient.

Torch's tracer (``torch.distributed.pipelining.pipeline`` with ``SplitPoint``) was not used: a traced stage bakes
the head counts into its reshapes, so it cannot be given to ``fastdist.tp.parallelize`` afterwards, and tracing
Hugging Face models breaks across versions (Merak's users' first complaint).

Where to cut. :func:`profile_pieces` times every piece's forward and backward in one forward+backward of the whole
model (hooks at the cuts), median of a few repetitions, and counts the bytes autograd saves in each piece.
:func:`split` then chooses the contiguous split minimizing the largest stage cost exactly (dynamic programming over
cut positions), by time or by parameter count; ``split_points=`` overrides it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["Analysis", "PieceCost", "Plan", "StagePlan", "analyze", "build_stage", "check_stage", "cut_activations",
           "is_meta", "make_plan", "materialize_stage", "param_costs", "plan_stages", "probe_stage", "profile_pieces",
           "reset_parameters", "split", "stage_costs", "stage_output"]

BALANCES = ("time", "params")


# ---- finding the blocks ----

def _find_block_list(model: nn.Module, blocks: str | None) -> tuple[str, nn.ModuleList]:
    if blocks is not None:
        try:
            found = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(f"fastdist.parallel: blocks={blocks!r} is not a submodule of {type(model).__name__}") \
                from e
        if not isinstance(found, nn.ModuleList) or len(found) == 0:
            raise ValueError(f"fastdist.parallel: blocks={blocks!r} is a {type(found).__name__}, not a non-empty "
                             "nn.ModuleList")
        return blocks, found
    best = None
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 1:
            continue
        if len({type(b) for b in m}) != 1:  # blocks are alike: a list of mixed modules is not a stack
            continue
        params = sum(p.numel() for p in m.parameters())
        if params and (best is None or params > best[0]):
            best = (params, name, m)
    if best is None:
        raise ValueError(
            f"fastdist.parallel: {type(model).__name__} has no nn.ModuleList of blocks to cut between (a list of "
            "modules of one type holding parameters, as transformer.h or model.layers). Name the list with "
            "blocks='path.to.list', or write the model's blocks as an nn.ModuleList.")
    return best[1], best[2]


def _ancestors(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """The modules from the root down to (not including) the one at ``path``."""
    out, node, prefix = [("", model)], model, []
    for part in path.split(".")[:-1]:
        node = getattr(node, part)
        prefix.append(part)
        out.append((".".join(prefix), node))
    return out


# ---- what one forward shows: who runs in which piece ----

class _CutSignal(Exception):
    """Raised by the stub after a stage's last block: carries the hidden state out of the user's forward."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("fastdist.parallel stage cut")
        self.hidden = hidden


def _hidden_of(args: tuple, kwargs: dict, where: tuple) -> torch.Tensor:
    kind, key = where
    return args[key] if kind == "arg" else kwargs[key]


def _with_hidden(args: tuple, kwargs: dict, where: tuple, hidden: torch.Tensor) -> tuple[tuple, dict]:
    kind, key = where
    if kind == "arg":
        return (*args[:key], hidden, *args[key + 1:]), kwargs
    return args, {**kwargs, key: hidden}


def _find_hidden(args: tuple, kwargs: dict) -> tuple | None:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return ("arg", i)
    for k in ("hidden_states", "x", "hidden", "h"):
        if isinstance(kwargs.get(k), torch.Tensor):
            return ("kw", k)
    return None


def _detach(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


@dataclasses.dataclass
class _TopModule:
    """A module the forward calls directly (not a block, not one of the blocks' ancestors)."""
    path: str
    module: nn.Module
    pieces: list[int]                          # the pieces in which it was called, in call order
    outputs: list[Any]                         # its outputs, in call order (replayed where it is a stub)


class _Tracker(TorchFunctionMode):
    """Which pieces use the parameters the forward touches directly (attributes of the blocks' ancestors)."""

    def __init__(self, watched: dict[int, str], piece: Callable[[], int]):
        super().__init__()
        self.watched, self.piece = watched, piece
        self.used: dict[str, set[int]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            name = self.watched.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if name is not None:
                self.used.setdefault(name, set()).add(self.piece())
        return func(*args, **kwargs)


@dataclasses.dataclass
class Analysis:
    """What :func:`analyze` found: the pieces of a model, and what a stage needs to run its part of the forward.

    Pieces are numbered 0 ("pre"), 1..N (the blocks), N + 1 ("post").
    """
    model: nn.Module
    blocks_path: str
    num_blocks: int
    example_args: tuple                        # the microbatch the stubs were recorded on
    hidden_where: tuple                        # where the hidden state is in a block's arguments
    block_outputs: list[tuple]                 # per block: (output leaves, spec, index of the hidden leaf)
    top_modules: list[_TopModule]
    direct_params: dict[str, set[int]]         # name of a parameter of the blocks' ancestors -> pieces using it
    direct_names: list[str]                    # every parameter the blocks' ancestors hold directly
    cut_shapes: list[tuple[torch.Size, torch.dtype]]   # the hidden state entering block i (i = N: leaving the last)
    output_shape: tuple[torch.Size, torch.dtype]
    piece_names: list[str]
    piece_params: list[int]

    @property
    def num_pieces(self) -> int:
        return self.num_blocks + 2

    def block_path(self, i: int) -> str:
        return f"{self.blocks_path}.{i}"


def stage_output(out: Any) -> torch.Tensor:
    """The one tensor a model's output stands for: itself, its ``logits`` (a Hugging Face output), or the first
    tensor of a tuple, list or dict."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise TypeError(f"fastdist.parallel: the model's output ({type(out).__name__}) holds no tensor")


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def analyze(model: nn.Module, example_args: Sequence[torch.Tensor], blocks: str | None = None) -> Analysis:
    """Runs ``model`` once on ``example_args`` (one microbatch, the shape training will use) and records its pieces.

    Args:
        model: the user's model, unmodified.
        example_args: the forward's positional arguments for one microbatch.
        blocks: the path of the ``nn.ModuleList`` of blocks (default: the largest list of alike modules).

    Raises:
        ValueError: no block list, or the forward does not call the blocks in order, each once, with a
            floating-point hidden state.
    """
    example_args = tuple(example_args)
    path, block_list = _find_block_list(model, blocks)
    n = len(block_list)
    ancestors = _ancestors(model, path)
    ancestor_ids = {id(m) for _, m in ancestors}
    block_index = {id(b): i for i, b in enumerate(block_list)}
    names = {id(m): name for name, m in model.named_modules()}
    state = {"piece": 0, "stack": [], "next_block": 0}
    hidden_where, block_outputs, cut_shapes = [None], [None] * n, [None] * (n + 1)
    tops: dict[int, _TopModule] = {}
    problems = []

    def pre_hook(module, args, kwargs):
        stack = state["stack"]
        top_level = all(id(m) in ancestor_ids for m in stack)
        stack.append(module)
        if not top_level or id(module) in ancestor_ids:
            return
        i = block_index.get(id(module))
        if i is None:
            entry = tops.get(id(module))
            if entry is None:
                entry = tops[id(module)] = _TopModule(names.get(id(module), "?"), module, [], [])
            entry.pieces.append(state["piece"])
            return
        if i != state["next_block"]:
            problems.append(f"block {i} ({path}.{i}) ran when block {state['next_block']} was expected: the "
                            "forward must call every block once, in order")
        state["next_block"] = i + 1
        state["piece"] = i + 1
        where = _find_hidden(args, kwargs)
        if where is None:
            problems.append(f"{path}.{i} got no floating-point tensor argument to use as the hidden state")
            return
        if hidden_where[0] is None:
            hidden_where[0] = where
        h = _hidden_of(args, kwargs, where)
        cut_shapes[i] = (h.shape, h.dtype)

    def post_hook(module, args, kwargs, output):
        state["stack"].pop()
        if state["stack"] and not all(id(m) in ancestor_ids for m in state["stack"]):
            return
        i = block_index.get(id(module))
        entry = tops.get(id(module))
        if entry is not None and id(module) not in ancestor_ids:
            entry.outputs.append(_detach(output))
        if i is not None:
            leaves, spec = pytree.tree_flatten(_detach(output))
            k = next((j for j, t in enumerate(leaves) if isinstance(t, torch.Tensor)
                      and t.shape == cut_shapes[i][0]), None)
            if k is None:
                problems.append(f"{path}.{i} returned no tensor of its hidden state's shape")
                return
            block_outputs[i] = (leaves, spec, k)
            if i == n - 1:
                cut_shapes[n] = (leaves[k].shape, leaves[k].dtype)
                state["piece"] = n + 1

    watched = {}
    for prefix, m in ancestors:
        for pname, p in m.named_parameters(recurse=False):
            watched[id(p)] = f"{prefix}.{pname}" if prefix else pname
    tracker = _Tracker(watched, lambda: state["piece"])
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
    try:
        with torch.no_grad(), _eval_mode(model), tracker:
            out = model(*example_args)
    finally:
        for h in handles:
            h.remove()
    if state["next_block"] != n and not problems:
        problems.append(f"the forward called {state['next_block']} of the {n} blocks of {path}")
    if problems:
        raise ValueError(f"fastdist.parallel: cannot cut {type(model).__name__} between the blocks of {path}: "
                         f"{problems[0]}. Name another list with blocks=, or fix the cut with split_points=.")
    logits = stage_output(out)
    top_list = list(tops.values())
    piece_names, piece_params = _piece_names_and_params(model, path, block_list, top_list, tracker.used)
    return Analysis(model, path, n, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in example_args),
                    hidden_where[0], block_outputs, top_list, tracker.used, list(watched.values()), cut_shapes,
                    (logits.shape, logits.dtype), piece_names, piece_params)


def _piece_names_and_params(model, path, block_list, tops, direct):
    n = len(block_list)
    named = [[] for _ in range(n + 2)]
    params = [0] * (n + 2)
    counted = set()
    for i, b in enumerate(block_list):
        named[i + 1].append(f"{path}.{i}")
        for p in b.parameters():
            params[i + 1] += p.numel()
            counted.add(id(p))
    for t in tops:
        for piece in sorted(set(t.pieces)):
            named[piece].append(t.path)
            params[piece] += sum(p.numel() for p in t.module.parameters() if id(p) not in counted)
    by_name = dict(model.named_parameters())
    for pname, pieces in direct.items():
        for piece in sorted(pieces):
            named[piece].append(pname)
            params[piece] += by_name[pname].numel()
    names = ["pre: " + ", ".join(named[0]) if named[0] else "pre"] + [", ".join(x) for x in named[1:n + 1]]
    names.append("post: " + ", ".join(named[n + 1]) if named[n + 1] else "post")
    return names, params


# ---- profiling the pieces ----

@dataclasses.dataclass
class PieceCost:
    """One piece's measured cost on one microbatch: forward and backward milliseconds (median of the
    repetitions), bytes autograd saves for its backward, its parameters, and the raw samples."""
    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    params: int
    samples_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def time_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def profile_pieces(analysis: Analysis, reps: int = 5, warmup: int = 1) -> list[PieceCost]:
    """Times every piece's forward and backward on this machine in whole-model forward+backward passes.

    Timestamps are taken where the forward enters each block and where the gradient of each block's input
    arrives, so one pass times every piece; the median of ``reps`` passes (after ``warmup``) is kept. Saved bytes
    count what autograd keeps for the backward (each storage once, parameters never). Parameters' gradients and
    the model's buffers are left as they were.
    """
    model, n = analysis.model, analysis.num_blocks
    blocks = model.get_submodule(analysis.blocks_path)
    params = list(model.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    grads = [p.grad for p in params]
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    fwd_t = [[] for _ in range(n + 2)]
    bwd_t = [[] for _ in range(n + 2)]
    saved = [0] * (n + 2)
    state = {"piece": 0, "marks": {}, "grad_marks": {}, "seen": set(), "count_saved": False}

    def enter(i):
        def hook(module, args, kwargs):
            state["marks"][i] = time.perf_counter()
            state["piece"] = i + 1
            h = _hidden_of(args, kwargs, analysis.hidden_where)
            if h.requires_grad:
                h.register_hook(lambda g: state["grad_marks"].__setitem__(i, time.perf_counter()))
        return hook

    def leave(module, args, kwargs, output):
        state["marks"][n] = time.perf_counter()
        state["piece"] = n + 1
        leaves, _ = pytree.tree_flatten(output)
        h = leaves[analysis.block_outputs[n - 1][2]]
        if h.requires_grad:
            h.register_hook(lambda g: state["grad_marks"].__setitem__(n, time.perf_counter()))

    def pack(t):
        if state["count_saved"]:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key[0] not in param_ptrs and key not in state["seen"]:
                state["seen"].add(key)
                saved[state["piece"]] += key[1]
        return t

    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles.append(blocks[n - 1].register_forward_hook(leave, with_kwargs=True))
    try:
        for rep in range(warmup + reps):
            state.update(piece=0, marks={}, grad_marks={}, seen=set(), count_saved=rep == warmup)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = stage_output(model(*analysis.example_args))
            mid = time.perf_counter()
            out.float().sum().backward()
            end = time.perf_counter()
            if rep < warmup:
                continue
            m, g = state["marks"], state["grad_marks"]
            fwd_edges = [start] + [m[i] for i in range(n + 1)] + [mid]
            bwd_edges = [end] + [g.get(i, end) for i in range(n + 1)] + [mid]  # piece p's backward: g[p] -> g[p-1]
            for p in range(n + 2):
                fwd_t[p].append((fwd_edges[p + 1] - fwd_edges[p]) * 1e3)
                bwd_t[p].append((bwd_edges[p] - bwd_edges[p + 1]) * 1e3)
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    return [PieceCost(analysis.piece_names[p], statistics.median(fwd_t[p]), statistics.median(bwd_t[p]),
                      saved[p], analysis.piece_params[p], [f + b for f, b in zip(fwd_t[p], bwd_t[p])])
            for p in range(n + 2)]


def profile_meta_pieces(analysis: Analysis, device: torch.device, reps: int = 5, warmup: int = 1) -> list[PieceCost]:
    """Times every piece of a model built on the meta device, allocating one piece at a time.

    Each piece runs as a stage of its own (:func:`build_stage`: "pre" alone as a first stage, a block as a middle
    stage, "post" alone as a last stage), its tensors allocated on ``device`` with random values (timing needs no
    initialization), on the analysed batch (pre) or a random activation of the cut's shape; forward and backward
    (of the output's sum) are timed, median of ``reps`` after ``warmup``, and the bytes autograd saves are counted
    as :func:`profile_pieces` counts them. Blocks of one structure (class, tensor shapes and dtypes) are timed once.
    At most one piece's tensors exist at a time, so the model never has to fit.

    Raises:
        Exception: a piece that cannot run on its own (a value another piece computes reaches it from the meta
            device); the caller balances by parameters then.
    """
    n = analysis.num_blocks
    blocks = analysis.model.get_submodule(analysis.blocks_path)
    timed: dict[Any, tuple[float, float, int, list[float]]] = {}

    def structure(module):
        return type(module), tuple((k, tuple(t.shape), t.dtype) for k, t in
                                   [*module.named_parameters(), *module.named_buffers()])

    def run(first_block, last_block, index):
        stage = build_stage(analysis, first_block, last_block, index, 3)
        empty: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for sub in stage.modules():
                for slots in (sub._parameters, sub._buffers):
                    for k, t in slots.items():
                        if t is not None and t.is_meta:
                            slots[k] = _empty_like(t, device, empty)
                            (slots[k].normal_(0.0, 0.02) if slots[k].is_floating_point() else slots[k].zero_())
        params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        fwd, bwd, samples, saved = [], [], [], 0
        for rep in range(warmup + reps):
            if index == 0:
                args = analysis.example_args
            else:
                shape, dtype = analysis.cut_shapes[first_block]
                args = (torch.randn(shape, device=device).to(dtype).requires_grad_(dtype.is_floating_point),)
            seen: set = set()

            def pack(t):
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                if key[0] not in params and key not in seen:
                    seen.add(key)
                return t
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = stage(*args)
            mid = time.perf_counter()
            out.float().sum().backward()
            end = time.perf_counter()
            stage.zero_grad(set_to_none=True)
            if rep >= warmup:
                fwd.append((mid - start) * 1e3)
                bwd.append((end - mid) * 1e3)
                samples.append((end - start) * 1e3)
                saved = sum(nbytes for _, nbytes in seen)
        return statistics.median(fwd), statistics.median(bwd), saved, samples

    costs = []
    for p in range(n + 2):
        if p == 0:
            got = run(0, 0, 0)
        elif p == n + 1:
            got = run(n, n, 2)
        else:
            key = structure(blocks[p - 1])
            if key not in timed:
                timed[key] = run(p - 1, p, 1)
            got = timed[key]
        costs.append(PieceCost(analysis.piece_names[p], got[0], got[1], got[2], analysis.piece_params[p], got[3]))
    return costs


# ---- choosing the cuts ----

def stage_costs(costs: Sequence[float], starts: Sequence[int], n: int) -> list[float]:
    """Costs of the stages whose first blocks are ``starts`` (block indices; stage 0 also runs pre, the last
    post): ``costs`` is per piece (pre, blocks, post)."""
    bounds = list(starts) + [n]
    out = []
    for s in range(len(starts)):
        lo, hi = bounds[s] + 1, bounds[s + 1] + 1   # piece indices of the stage's blocks
        if s == 0:
            lo = 0
        if s == len(starts) - 1:
            hi = n + 2
        out.append(sum(costs[lo:hi]))
    return out


def split(costs: Sequence[float], num_stages: int, empty_ends: bool = True) -> list[int]:
    """The first block of every stage, for the contiguous split of the pieces that minimizes the largest stage
    cost (ties: the smallest sum of squared stage costs, then the earliest cuts). Exact, by dynamic programming.

    Every stage but the first and the last has at least one block; the first may hold only "pre" (its first block
    after it is 0) and the last only "post" (it starts at block N), which is what heavy embeddings and LM heads want.

    Args:
        costs: per piece: pre, each block, post (len = blocks + 2).
        num_stages: stages, at most the number of blocks.
        empty_ends: whether the first and last stages may hold no block.

    Returns:
        ``num_stages`` block indices, the first 0.
    """
    n = len(costs) - 2
    if not 1 <= num_stages <= n:
        raise ValueError(f"fastdist.parallel: {num_stages} stages need at least as many blocks; the model has {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(a, b, s, last):  # blocks a..b-1 as stage s
        lo = 0 if s == 0 else a + 1
        hi = n + 2 if last else b + 1
        return prefix[hi] - prefix[lo]

    # best[s][b]: (max cost, sum of squares, starts) of stages 0..s covering blocks 0..b-1
    inf = (float("inf"), float("inf"), ())
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    for b in range(0 if num_stages > 1 and empty_ends else (n if num_stages == 1 else 1), n + 1):
        c = cost(0, b, 0, num_stages == 1)
        best[0][b] = (c, c * c, (0,))
    for s in range(1, num_stages):
        last = s == num_stages - 1
        for b in range(n + 1):
            if last and b != n:
                continue
            cand = inf
            for a in range(0, b + 1 if last and empty_ends else b):  # a middle stage has a block
                prev = best[s - 1][a]
                if prev[0] == float("inf"):
                    continue
                c = cost(a, b, s, last)
                key = (max(prev[0], c), prev[1] + c * c, prev[2] + (a,))
                if key < cand:
                    cand = key
            best[s][b] = cand
    return list(best[num_stages - 1][n][2])


# ---- the plan ----

@dataclasses.dataclass
class StagePlan:
    """One pipeline stage of a :class:`Plan`.

    Attributes:
        index: the stage.
        layers: its pieces, named by the model's module paths.
        params: its parameters (a parameter shared with another stage counts on both).
        time_ms: predicted forward+backward milliseconds per microbatch, recompute included (None: not profiled).
        memory_bytes: predicted peak bytes: parameters and gradients, plus the activations of the microbatches
            it holds under 1F1B (S - s of them) less the recomputed share.
        recompute_ratio: the share of its blocks it recomputes.
        first_block, last_block: its blocks (indices into the block list; last_block is exclusive).
    """
    index: int
    layers: str
    params: int
    time_ms: float | None
    memory_bytes: int
    recompute_ratio: float
    first_block: int
    last_block: int


@dataclasses.dataclass
class Plan:
    """How a model is cut into stages and run. ``str(plan)`` is a table; :func:`fastdist.distributed.fingerprint`
    takes it (the engine checks it is the same on every rank).

    Attributes:
        stages: one :class:`StagePlan` per pipeline stage.
        blocks: the path of the block list.
        balance: "time", "params", or "split_points" (given).
        max_over_mean: the largest predicted stage time over the mean (None: not profiled).
        mesh: (dp, tp, pp).
        schedule, microbatches, recompute: how the engine runs it.
        boundaries: the compressors at the stage boundaries (their configurations), or None.
        boundary_bytes: bytes of the activation crossing each cut, per microbatch.
    """
    stages: list[StagePlan]
    blocks: str
    balance: str
    max_over_mean: float | None
    mesh: tuple[int, int, int] = (1, 1, 1)
    schedule: str = "1f1b"
    microbatches: int = 1
    recompute: str = "none"
    boundaries: str | None = None
    boundary_bytes: list[int] = dataclasses.field(default_factory=list)

    @property
    def split_points(self) -> list[int]:
        """The first block of every stage after the first (what ``split_points=`` takes)."""
        return [s.first_block for s in self.stages[1:]]

    def __str__(self) -> str:
        from fastdist.bench.report import col, fixed, human_bytes, integer, text_table
        columns = [col("stage", "index", integer), col("layers", "layers"), col("params", "params", integer),
                   col("time (ms)", "time_ms", fixed(2)), col("memory", "memory", numeric=True),
                   col("recompute", "recompute_ratio", fixed(2))]
        rows = [{**dataclasses.asdict(s), "memory": human_bytes(s.memory_bytes)} for s in self.stages]
        dp, tp, pp = self.mesh
        if len(self.stages) == 1:
            how = "one stage"
        elif self.max_over_mean is None:
            how = f"balanced by {self.balance}"
        else:
            how = f"balanced by {self.balance} (max/mean stage time {self.max_over_mean:.2f})"
        head = (f"pipeline plan: mesh dp={dp} tp={tp} pp={pp}, schedule {self.schedule}, {self.microbatches} "
                f"microbatches, recompute {self.recompute}, {how}")
        tail = ""
        if self.boundary_bytes:
            tail = "\nactivation per cut: " + ", ".join(human_bytes(b) for b in self.boundary_bytes)
            if self.boundaries:
                tail += f" (compressed: {self.boundaries})"
        return head + "\n" + text_table(columns, rows) + tail


def _compact(names: Sequence[str], blocks_path: str) -> str:
    """'embed + blocks.0-3 + norm, head' from piece names."""
    parts, run = [], []
    for name in names:
        if name.startswith(blocks_path + ".") and name[len(blocks_path) + 1:].split(",")[0].isdigit():
            run.append(int(name[len(blocks_path) + 1:].split(",")[0]))
            continue
        if run:
            parts.append(f"{blocks_path}.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
            run = []
        parts.append(name.split(": ", 1)[1] if ": " in name else name)
    if run:
        parts.append(f"{blocks_path}.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
    return " + ".join(p for p in parts if p not in ("pre", "post"))


def _resolve_split_points(split_points: Sequence[int | str], analysis: Analysis, num_stages: int) -> list[int]:
    n, starts = analysis.num_blocks, [0]
    for p in split_points:
        if isinstance(p, str):
            prefix = analysis.blocks_path + "."
            if not (p.startswith(prefix) and p[len(prefix):].isdigit()):
                raise ValueError(f"fastdist.parallel: split point {p!r} is not a block ({prefix}<i>)")
            p = int(p[len(prefix):])
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"fastdist.parallel: split points are block indices or names, got {p!r}")
        starts.append(p)
    if len(starts) != num_stages:
        raise ValueError(f"fastdist.parallel: {len(starts) - 1} split points make {len(starts)} stages; the mesh has "
                         f"{num_stages} pipeline stages")
    # the first stage may hold only "pre" (a first split point of 0), the last only "post" (a last one of N)
    inner = starts[1:]
    if (any(not 0 <= b <= n for b in inner) or any(a >= b for a, b in zip(inner, inner[1:]))
            or (len(inner) == 1 and inner[0] in (0, n) and n == 0)):
        raise ValueError(f"fastdist.parallel: split points {list(split_points)} must be increasing block indices "
                         f"in 0..{n} (0: the first stage holds only what runs before the blocks; {n}: the last "
                         "only what runs after them)")
    return starts


def make_plan(analysis: Analysis, costs: Sequence[PieceCost], num_stages: int, balance: str = "time",
              split_points: Sequence[int | str] | None = None, recompute_ratios: Sequence[float] | None = None,
              empty_ends: bool = True, **engine: Any) -> Plan:
    """The :class:`Plan` for ``num_stages`` stages from measured piece costs.

    Args:
        analysis: from :func:`analyze`.
        costs: from :func:`profile_pieces`.
        num_stages: pipeline stages.
        balance: "time" (measured forward+backward) or "params".
        split_points: the first block of every stage after the first (indices or ``"blocks.4"`` names):
            overrides ``balance``.
        recompute_ratios: per stage (default 0).
        empty_ends: whether the first stage may hold only "pre" and the last only "post" (no block).
        **engine: the Plan's other fields (mesh, schedule, microbatches, recompute, boundaries).
    """
    n = analysis.num_blocks
    if balance not in BALANCES:
        raise ValueError(f"fastdist.parallel: balance must be one of {BALANCES}, got {balance!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"fastdist.parallel: the number of pipeline stages must be an int >= 1, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"fastdist.parallel: {num_stages} pipeline stages but {type(analysis.model).__name__} has "
                         f"only {n} blocks in {analysis.blocks_path}: use at most {n} stages")
    if split_points is not None:
        starts = _resolve_split_points(split_points, analysis, num_stages)
        balance = "split_points"
        if not empty_ends and num_stages > 1 and (starts[1] == 0 or starts[-1] == n):
            raise ValueError(f"fastdist.parallel: split points {list(split_points)} leave a stage without a block, "
                             "which recompute cannot handle yet: give every stage a block")
    else:
        starts = split([c.time_ms if balance == "time" else c.params for c in costs], num_stages, empty_ends)
    ratios = list(recompute_ratios) if recompute_ratios is not None else [0.0] * num_stages
    times = stage_costs([c.time_ms for c in costs], starts, n)
    fwd = stage_costs([c.forward_ms for c in costs], starts, n)
    acts = stage_costs([c.activation_bytes for c in costs], starts, n)
    params = stage_costs([c.params for c in costs], starts, n)
    bounds = starts + [n]
    elem = analysis.cut_shapes[0][1].itemsize if analysis.cut_shapes[0] else 4
    stages = []
    for s in range(num_stages):
        pieces = list(range(0 if s == 0 else bounds[s] + 1, (n + 2) if s == num_stages - 1 else bounds[s + 1] + 1))
        in_flight = num_stages - s
        r = ratios[s]
        memory = int(2 * params[s] * elem + acts[s] * in_flight * (1 - r))
        stages.append(StagePlan(s, _compact([analysis.piece_names[p] for p in pieces], analysis.blocks_path),
                                int(params[s]), times[s] + r * fwd[s], memory, r, bounds[s], bounds[s + 1]))
    ratio = None
    if any(c.time_ms > 0 for c in costs):
        ratio = max(st.time_ms for st in stages) / statistics.mean(st.time_ms for st in stages)
    else:  # not profiled: no time to predict
        for st in stages:
            st.time_ms = None
    cut_bytes = [analysis.cut_shapes[b][0].numel() * analysis.cut_shapes[b][1].itemsize for b in starts[1:]]
    return Plan(stages, analysis.blocks_path, balance, ratio, boundary_bytes=cut_bytes, **engine)


def plan_stages(model: nn.Module, num_stages: int, example_args: Sequence[torch.Tensor], balance: str = "time",
              split_points: Sequence[int | str] | None = None, blocks: str | None = None, reps: int = 5) -> Plan:
    """The plan for cutting ``model`` into ``num_stages`` pipeline stages, on one process (nothing distributed).

    Args:
        model: the user's model.
        num_stages: pipeline stages.
        example_args: the forward's arguments for one microbatch.
        balance, split_points: as :func:`make_plan`.
        blocks: the block list's path (default: found).
        reps: profiling repetitions.
    """
    analysis = analyze(model, example_args, blocks)
    costs = profile_pieces(analysis, reps=reps) if balance == "time" and split_points is None \
        else param_costs(analysis)
    return make_plan(analysis, costs, num_stages, balance, split_points)


def param_costs(analysis: Analysis) -> list[PieceCost]:
    """Every piece's parameter count as its cost, times left at 0 (what balancing by parameters reads)."""
    return [PieceCost(name, 0.0, 0.0, 0, params) for name, params in zip(analysis.piece_names,
                                                                           analysis.piece_params)]


# ---- building a stage ----

class _PassThrough(nn.Module):
    """A block before the stage: its output, recorded, with the hidden state it was given in place of its own."""

    def __init__(self, leaves: list, spec: Any, index: int, where: tuple, source: Callable | None = None):
        super().__init__()
        self._leaves, self._spec, self._index, self._where = leaves, spec, index, where
        self._source = source  # gives the hidden state to return instead (the stage's incoming activation)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = self._source() if self._source is not None else _hidden_of(args, kwargs, self._where)
        if len(self._leaves) == 1:
            return hidden
        leaves = list(self._leaves)
        leaves[self._index] = hidden
        return pytree.tree_unflatten(leaves, self._spec)


class _Cut(nn.Module):
    """The block after the stage: stops the forward and hands its hidden state out."""

    def __init__(self, where: tuple):
        super().__init__()
        self._where = where

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _CutSignal(_hidden_of(args, kwargs, self._where))


class _Replay(nn.Module):
    """A module another stage owns, run before this stage's blocks: replays its recorded outputs in call order."""

    def __init__(self, path: str, outputs: list):
        super().__init__()
        self._path, self._outputs, self.calls = path, outputs, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.calls >= len(self._outputs):
            raise RuntimeError(f"fastdist.parallel: {self._path} was called more often than when the model was "
                               "analysed; does the forward depend on the batch's values?")
        out = self._outputs[self.calls]
        self.calls += 1
        return out


class _Unreached(nn.Module):
    """A module of a later stage: the cut comes before it."""

    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"fastdist.parallel: {self._path} belongs to a later stage but this stage's forward "
                           "reached it before its cut")


@dataclasses.dataclass
class _StageState:
    index: int
    num_stages: int
    first_block: int
    last_block: int
    first: bool
    last: bool
    user_forward: Callable
    example_args: tuple
    replays: list
    incoming: torch.Tensor | None = None
    cut_after: tuple | None = None  # (last block, its cut hook's id) when the stage ends with the model's last block


def _stage_forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    st: _StageState = self._fastdist_stage
    for r in st.replays:
        r.calls = 0
    if st.cut_after is not None:  # hooks added since (recompute's) must run before the cut
        block, hook_id = st.cut_after
        block._forward_hooks.move_to_end(hook_id)
    if st.first:
        inputs = args
    else:
        if len(args) != 1 or kwargs:
            raise TypeError(f"fastdist.parallel: stage {st.index} takes the previous stage's activation, one tensor")
        inputs, kwargs, st.incoming = st.example_args, {}, args[0]
    try:
        out = st.user_forward(self, *inputs, **kwargs)
    except _CutSignal as cut:
        if st.last:
            raise
        return cut.hidden
    finally:
        st.incoming = None
    if not st.last:
        raise RuntimeError(f"fastdist.parallel: stage {st.index}'s forward returned without reaching its cut")
    return stage_output(out)


def build_stage(analysis: Analysis, first_block: int, last_block: int, index: int, num_stages: int) -> nn.Module:
    """Stage ``index``'s module: a copy of the model holding only what runs blocks ``first_block`` to
    ``last_block - 1`` (and "pre" on stage 0, "post" on the last stage); its forward takes the previous stage's
    activation (stage 0: the batch's inputs) and returns one tensor. Parameters keep the model's names.

    The copy's class is the model's own class with the forward replaced, so ``isinstance`` and attribute reads
    behave as on the model. ``module.pipeline_blocks`` lists the blocks it runs, in order.
    """
    model, n, where = analysis.model, analysis.num_blocks, analysis.hidden_where
    first, last = index == 0, index == num_stages - 1
    owned = set(range(first_block + 1, last_block + 1)) | ({0} if first else set()) | ({n + 1} if last else set())
    blocks = model.get_submodule(analysis.blocks_path)
    memo: dict[int, Any] = {}
    incoming: list[_StageState] = []  # the stage's state, once made: a stage without blocks injects from it

    def inject():
        return incoming[0].incoming

    for i, b in enumerate(blocks):
        if i < first_block:  # a stage holding only "post" hands the activation to it from the last block's place
            source = inject if (i == n - 1 and first_block == n and not first) else None
            memo[id(b)] = _PassThrough(*analysis.block_outputs[i], where, source)
        elif i == last_block and not last:
            memo[id(b)] = _Cut(where)
        elif i > last_block or (i == last_block and last):
            memo[id(b)] = _Unreached(analysis.block_path(i))
    replays = []
    for t in analysis.top_modules:
        if owned & set(t.pieces):
            continue
        if min(t.pieces) <= last_block:   # called before this stage's cut: replay it
            stub = _Replay(t.path, t.outputs)
            replays.append(stub)
            memo[id(t.module)] = stub
        else:
            memo[id(t.module)] = _Unreached(t.path)
    by_name = dict(model.named_parameters(remove_duplicate=False))
    plain = {}
    for pname, pieces in analysis.direct_params.items():
        if not owned & pieces:
            plain[pname] = by_name[pname].detach()
            memo[id(by_name[pname])] = plain[pname]
    for pname in analysis.direct_names:  # one the forward never used stays with stage 0
        if pname not in analysis.direct_params and not first:
            plain[pname] = by_name[pname].detach()
            memo[id(by_name[pname])] = plain[pname]
    stage = copy.deepcopy(model, memo)
    for pname, tensor in plain.items():
        owner_path, _, leaf = pname.rpartition(".")
        owner = stage.get_submodule(owner_path) if owner_path else stage
        owner._parameters.pop(leaf, None)
        object.__setattr__(owner, leaf, tensor)
    stage_blocks = stage.get_submodule(analysis.blocks_path)
    mine = [stage_blocks[i] for i in range(first_block, last_block)]
    state = _StageState(index, num_stages, first_block, last_block, first, last, type(model).forward,
                        analysis.example_args, replays)
    incoming.append(state)
    if last_block == n and not last:  # the stage ends with the last block: cut as it returns, before "post"
        k = analysis.block_outputs[n - 1][2]

        def cut_after(module, args, kwargs, output):
            raise _CutSignal(pytree.tree_leaves(output)[k])
        handle = mine[-1].register_forward_hook(cut_after, with_kwargs=True)
        state.cut_after = (mine[-1], handle.id)
    if not mine:  # no block: the modules it runs stand for them (what recompute counts)
        mine = [stage.get_submodule(t.path) for t in analysis.top_modules
                if owned & set(t.pieces) and any(True for _ in t.module.parameters())]
    elif not first:
        def entry(module, args, kwargs):
            if state.incoming is None:
                return None
            return _with_hidden(args, kwargs, where, state.incoming)
        mine[0].register_forward_pre_hook(entry, with_kwargs=True)
    cls = type(model)
    stage.__class__ = type(f"{cls.__name__}Stage", (cls,), {"forward": _stage_forward,
                                                            "__module__": cls.__module__})
    object.__setattr__(stage, "_fastdist_stage", state)
    object.__setattr__(stage, "pipeline_blocks", mine)
    return stage


def cut_activations(analysis: Analysis, args: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The whole model's hidden state entering every block (and leaving the last: index N) and its output, on
    ``args`` (no gradient, eval mode)."""
    model, n = analysis.model, analysis.num_blocks
    blocks = model.get_submodule(analysis.blocks_path)
    cuts: list[torch.Tensor | None] = [None] * (n + 1)

    def enter(i):
        def hook(module, a, kw):
            cuts[i] = _hidden_of(a, kw, analysis.hidden_where).detach().clone()
        return hook

    def leave(module, a, kw, output):
        cuts[n] = pytree.tree_leaves(output)[analysis.block_outputs[n - 1][2]].detach().clone()

    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles.append(blocks[n - 1].register_forward_hook(leave, with_kwargs=True))
    try:
        with torch.no_grad(), _eval_mode(model):
            out = stage_output(model(*args)).detach()
    finally:
        for h in handles:
            h.remove()
    return cuts, out


def check_stage(analysis: Analysis, stage: nn.Module, reference: tuple[list[torch.Tensor], torch.Tensor],
                args: Sequence[torch.Tensor]) -> str | None:
    """Why stage ``stage`` (from :func:`build_stage`) does not compute its part of the whole model on ``args``
    (``reference`` is :func:`cut_activations` of the same ``args``), or None when it does."""
    st: _StageState = stage._fastdist_stage
    cuts, out = reference
    first, last = st.first_block, st.last_block
    where = f"stage {st.index} ({analysis.blocks_path}.{first}-{last - 1})"
    try:
        with torch.no_grad(), _eval_mode(stage):
            got = stage(*args) if st.first else stage(cuts[first])
    except Exception as e:  # noqa: BLE001 - any failure is a model this way of cutting cannot handle
        return f"{where} failed: {type(e).__name__}: {e}"
    want = out if st.last else cuts[last]
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5):
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
        return (f"{where} does not reproduce the model's {'output' if st.last else 'hidden state'} on a second "
                f"batch (max difference {diff}): the blocks' other inputs (a mask, positions) or the code between "
                "the blocks depend on the batch's values, which a later stage does not see")
    return None



# ---- a model built on the meta device: each rank materializes its own stage ----

def is_meta(model: nn.Module) -> bool:
    """Whether ``model``'s parameters and buffers are on the meta device (all of them; a mix is refused).

    Raises:
        ValueError: some are on the meta device and some are not.
    """
    tensors = [t for t in [*model.parameters(), *model.buffers()]]
    on_meta = sum(t.is_meta for t in tensors)
    if 0 < on_meta < len(tensors):
        where = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta][:3]
        raise ValueError(f"fastdist.parallel: {type(model).__name__} is partly on the meta device ({where} are not): "
                         "build all of it under torch.device('meta'), or none of it")
    return bool(tensors) and on_meta == len(tensors)


def reset_parameters(module: nn.Module) -> None:
    """The default ``init`` of a model built on the meta device: the module's own ``reset_parameters()`` (torch's
    layers; ``nn.MultiheadAttention``'s ``_reset_parameters``), what its constructor ran."""
    fn = getattr(module, "reset_parameters", None)
    if fn is None and isinstance(module, nn.MultiheadAttention):
        fn = module._reset_parameters
    if callable(fn):
        fn()


def _empty_like(t: torch.Tensor, device: torch.device, cache: dict[int, torch.Tensor]) -> torch.Tensor:
    """An uninitialized tensor like ``t`` on ``device`` (a Parameter for a Parameter), one per ``t`` in ``cache``."""
    if id(t) not in cache:
        e = torch.empty_like(t, device=device)
        cache[id(t)] = nn.Parameter(e, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else e
    return cache[id(t)]


class _AnyCall(TorchFunctionMode):
    """Notes whether a function touches any tensor at all (an init that only checks types does not)."""

    def __init__(self):
        super().__init__()
        self.called = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.called = True
        return func(*args, **(kwargs or {}))


def materialize_stage(model: nn.Module, stage: nn.Module, init: Callable[[nn.Module], None] | None, seed: int,
                      device: torch.device) -> list[str]:
    """Allocates the tensors ``stage`` (built from the meta-device ``model``) owns on ``device`` and initializes
    them with the values the whole model would get on one process from
    ``model.to_empty(device=...); torch.manual_seed(seed); model.apply(init)``.

    ``init`` runs on every module of the model in ``apply``'s order (children first), so the random draws of the
    modules other stages own are replayed (on temporary tensors, one module's at a time) and this stage's modules
    draw what they would draw in the whole model. With the default init (each module's ``reset_parameters``) that is
    what building the model normally gives when its constructor builds the layers in the order it registers them.
    A module for which ``init`` touches no tensor (a run on the meta device tells) is skipped, so a model-level
    ``init(model)`` that does nothing costs nothing. The global RNG is left as it was.

    Returns:
        The names of the stage's floating-point tensors ``init`` left unset (filled with NaN before it ran).
    """
    init = init or reset_parameters
    empty: dict[int, torch.Tensor] = {}
    for sub in stage.modules():  # Module.to_empty would give a tied parameter a tensor per module holding it
        for slots in (sub._parameters, sub._buffers):
            for k, t in slots.items():
                if t is not None and t.is_meta:
                    slots[k] = _empty_like(t, device, empty)
    owned = {**dict(stage.named_parameters(remove_duplicate=False)),
             **dict(stage.named_buffers(remove_duplicate=False))}
    with torch.no_grad():
        for t in owned.values():
            if t.is_floating_point():
                t.fill_(float("nan"))
    aliases: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(t), []).append(name)

    def real(t: torch.Tensor, cache: dict) -> torch.Tensor:
        mine = next((owned[n] for n in aliases.get(id(t), ()) if n in owned), None)
        return mine if mine is not None else _empty_like(t, device, cache)

    def run(module: nn.Module) -> None:
        probe = _AnyCall()
        try:
            with torch.no_grad(), probe:
                init(module)
        except Exception:  # noqa: BLE001 - not runnable on the meta device: run it for real
            probe.called = True
        if not probe.called:
            return
        cache: dict[int, torch.Tensor] = {}
        swapped = []
        for sub in module.modules():
            for slots in (sub._parameters, sub._buffers):
                for k, t in slots.items():
                    if t is not None and t.is_meta:
                        swapped.append((slots, k, t))
                        slots[k] = real(t, cache)
        try:
            with torch.no_grad():
                init(module)
        finally:
            for slots, k, t in swapped:
                slots[k] = t

    def visit(module: nn.Module) -> None:  # nn.Module.apply's order
        for child in module.children():
            visit(child)
        run(module)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        visit(model)
    with torch.no_grad():
        return [n for n, t in owned.items() if t.is_floating_point() and bool(torch.isnan(t).any())]


def probe_stage(stage: nn.Module, analysis: Analysis, device: torch.device) -> str | None:
    """Why the materialized stage of a meta-device model cannot run (it cannot be checked against the whole model,
    which exists nowhere), or None: a forward on the analysed batch (stage 0) or on zeros of the cut's shape."""
    st: _StageState = stage._fastdist_stage
    where = f"stage {st.index} ({analysis.blocks_path}.{st.first_block}-{st.last_block - 1})"
    try:
        with torch.no_grad(), _eval_mode(stage):
            if st.first:
                out = stage(*analysis.example_args)
            else:
                shape, dtype = analysis.cut_shapes[st.first_block]
                out = stage(torch.zeros(shape, dtype=dtype, device=device))
    except Exception as e:  # noqa: BLE001 - any failure is a model this stage cannot run
        return (f"{where} of a model built on the meta device failed on a probe batch: {type(e).__name__}: {e}. A "
                "value computed by a module another stage owns (a rotary table, a mask) reaches it from the meta "
                "device: build the model on a real device, or compute such values in the forward")
    want = analysis.output_shape[0] if st.last else analysis.cut_shapes[st.last_block][0]
    if out.is_meta or out.shape != want:
        return (f"{where} of a model built on the meta device gave a {tuple(out.shape)} {out.device} tensor, not "
                f"{tuple(want)}")
    return None
