"""fastdist.comm.hooks.sketch_hook: a DDP comm hook that is lossless in exact mode and keeps its state."""
import copy
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fastdist.comm.hooks import SketchState, sketch_hook
from fastdist.comm.sketch import default_exact_timings
from fastdist.distributed import spawn


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=512, dim=16, sparse=False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim, sparse=sparse)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(1))


def _train(hook_mode, steps=6, error_feedback=False, sparse=False, background=False):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(TinyLM(sparse=sparse), bucket_cap_mb=0.01)  # small buckets: the embedding and the head land apart
    state = None
    if hook_mode is not None:
        state = SketchState(ratio=0.2, mode=hook_mode, seed=5, error_feedback=error_feedback, background=background)
        model.register_comm_hook(state, sketch_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 40 + 30 * rank, (8, 4), generator=g)  # few rows per rank: sparse grads
        target = tokens[:, 0]
        loss = torch.nn.functional.cross_entropy(model(tokens), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"params": params, "losses": losses,
            "state": None if state is None else (pickle.dumps(state), state.state_dict(), state.stats()),
            "exact_runs": None if state is None else {"state": _exact_runs(state.exact_timings),
                                                      "group default": _exact_runs(default_exact_timings())}}


def _exact_runs(timings):
    """Runs of each exact collective recorded in an ExactTimings, over all its configurations."""
    return {name: sum(rates.runs[name] for rates in timings.by_class.values())
            for name in ("allreduce-union", "allgather-local")}


def _sparse_embedding_variants():
    runs = {mode: _train(mode, sparse=True) for mode in (None, "exact", "sketch")}
    runs["dense-exact"] = _train("exact")
    return runs


def test_sparse_embedding_gradients_go_through_the_hook_sparse_and_exact_mode_trains_like_plain_ddp():
    results = spawn(_sparse_embedding_variants, 2, timeout=300)
    for r in results:
        plain = r[None]["params"]
        assert torch.allclose(r["exact"]["params"], plain, atol=1e-6)
        assert torch.allclose(r["dense-exact"]["params"], plain, atol=1e-6)  # same model, dense gradients
        assert r["sketch"]["losses"][-1] < r["sketch"]["losses"][0]
        stats = pickle.loads(r["exact"]["state"][0]).stats()
        assert {b["last_method"] for b in stats.values()} >= {"exact"}
    for mode in (None, "exact", "sketch"):
        assert torch.equal(results[0][mode]["params"], results[1][mode]["params"]), mode


def _all_variants():
    runs = {mode: _train(mode) for mode in (None, "exact", "auto", "sketch")}
    runs["sketch+ef"] = _train("sketch", error_feedback=True)
    return runs


def test_exact_and_auto_hooks_train_like_plain_ddp_and_sketch_still_learns():
    results = spawn(_all_variants, 2, timeout=300)
    for r in results:
        plain = r[None]["params"]
        assert torch.allclose(r["exact"]["params"], plain, atol=1e-6)
        assert torch.allclose(r["auto"]["params"], plain, atol=1e-6)
        for lossy in ("sketch", "sketch+ef"):
            assert r[lossy]["losses"][-1] < r[lossy]["losses"][0], lossy
    # ranks end with identical replicas in every mode
    for mode in (None, "exact", "auto", "sketch", "sketch+ef"):
        assert torch.equal(results[0][mode]["params"], results[1][mode]["params"]), mode


def _background_variants():
    runs = {}
    for mode, sparse in (("exact", False), ("sketch", False), ("auto", True), ("sketch", True)):
        for background in (False, True):
            runs[mode, sparse, background] = _train(mode, sparse=sparse, background=background)
    return runs


def test_background_reduction_trains_to_the_same_bits_as_the_hook_on_the_backward_thread():
    results = spawn(_background_variants, 4, timeout=300)
    for r in results:
        for mode, sparse in (("exact", False), ("sketch", False), ("auto", True), ("sketch", True)):
            same = r[mode, sparse, False], r[mode, sparse, True]
            assert torch.equal(same[0]["params"], same[1]["params"]), (mode, sparse)
            assert same[0]["losses"] == same[1]["losses"], (mode, sparse)
            restored = pickle.loads(same[1]["state"][0])  # the state pickles without its thread and group
            assert restored.background and restored._worker is None


def test_hook_state_counts_steps_per_bucket_pickles_without_its_group_and_round_trips():
    results = spawn(_train, 2, "auto", 4, timeout=300)
    blob, sd, stats = results[0]["state"]
    assert sd["iter"] == 4
    assert len(stats) >= 2 and all(b["calls"] >= 3 for b in stats.values())
    assert {b["last_method"] for b in stats.values()} <= {"exact", "dense", "sketch"}
    restored = pickle.loads(blob)
    assert restored.process_group is None and restored.iter == 4
    assert restored.exact_timings.by_class == {}  # this process's measurements: not saved with the state
    assert restored.state_dict() == sd
    fresh = SketchState(ratio=0.2, mode="auto", seed=5)
    fresh.load_state_dict(sd)
    assert fresh.state_dict() == sd


def test_load_state_dict_restores_the_state_but_keeps_the_constructors_configuration_and_says_what_differs():
    saved = SketchState(ratio=0.2, seed=5, error_feedback=True)
    saved.iter = 7
    saved.calls.calls = 21
    saved.residuals[(0, 1)] = torch.ones(3, 4)
    same = SketchState(ratio=0.2, seed=5, error_feedback=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(saved.state_dict())
    assert (same.iter, same.calls.calls) == (7, 21) and torch.equal(same.residuals[(0, 1)], torch.ones(3, 4))

    other = SketchState(ratio=0.1, mode="exact", background=True, error_feedback=True)
    with pytest.warns(UserWarning, match=r"keeps this state's configuration.*ratio=0.2.*seed=5.*residuals are not"):
        other.load_state_dict(saved.state_dict())
    assert (other.ratio, other.mode, other.background, other.seed) == (0.1, "exact", True, 0)
    assert (other.iter, other.calls.calls, other.residuals) == (7, 21, {})  # a residual of another sketch: dropped


def test_error_feedback_residuals_are_kept_per_bucket_and_survive_pickling():
    results = spawn(_train, 2, "sketch", 3, True, timeout=300)
    blob, sd, stats = results[0]["state"]
    residuals = sd["residuals"]
    assert residuals and all(r is not None and r.shape[0] == 3 for r in residuals.values())
    assert any(r.abs().sum() > 0 for r in residuals.values())  # lossy steps left something to feed back
    for b in stats.values():  # a residual only moves in calls that applied error feedback, and says so
        assert b["ef_calls"] > 0 or residuals[b["parameters"]].abs().sum() == 0
        assert b["last_method"] in ("sketch", "sketch+ef", "exact", "dense")
    restored = pickle.loads(blob)
    for key, r in residuals.items():
        assert torch.equal(restored.residuals[key], r)
    # every rank holds the same residual: they all decoded the same summed sketch
    other = results[1]["state"][1]["residuals"]
    assert all(torch.equal(other[key], r) for key, r in residuals.items())


class Branches(torch.nn.Module):
    """Three layers side by side, summed in a fixed order; `order` is the order forward calls them in. Autograd
    runs backward in the reverse order, and DDP rebuilds its buckets in that order after the first backward: the
    same model and gradients, laid out differently in the buckets."""

    def __init__(self, order, width=16):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(width, width) for _ in range(3))
        self.order = order

    def forward(self, x):
        outs = {name: getattr(self, name)(x) for name in self.order}
        return outs["a"] + outs["b"] + outs["c"]


# (width, bucket_cap_mb): after the first backward DDP rebuilds its buckets in the order the gradients come
# (bias, weight) and closes a bucket at the cap: all in one, or each layer in a bucket of its own, numbered by when
# its gradient came. DDP's first buckets hold all three layers in registration order either way.
EF_BUCKETS = {"one bucket": (16, 25), "a bucket per layer": (64, 0.0157)}


def _ef_run(order, buckets, steps=4, resume_at=None):
    """Trains Branches with the error-feedback sketch hook; returns the parameters, every step's bucket layouts
    and the hook's totals. resume_at: restart from a state_dict (model, hook) before that step, as a resumed run
    does: a new DDP, laid out afresh."""
    rank = dist.get_rank()
    width, cap_mb = EF_BUCKETS[buckets]
    g = torch.Generator().manual_seed(10 + rank)
    inputs = [torch.randn(8, width, generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    model = Branches(order, width)
    names = {}
    layouts = []

    def recording(state, bucket):
        layouts[-1].append([names[id(p)] for p in bucket.parameters()])
        return sketch_hook(state, bucket)

    def build(model, saved=None):
        names.update({id(p): n for n, p in model.named_parameters()})
        state = SketchState(ratio=1.0, mode="sketch", seed=3, error_feedback=True, density_threshold=2.0)
        if saved is not None:
            state.load_state_dict(saved)
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        ddp.register_comm_hook(state, recording)
        return ddp, state, torch.optim.SGD(model.parameters(), lr=0.2)

    ddp, state, opt = build(model)
    for step in range(steps):
        if step == resume_at:
            checkpoint = pickle.loads(pickle.dumps((model.state_dict(), state.state_dict())))
            model = Branches(order, width)
            model.load_state_dict(checkpoint[0])
            ddp, state, opt = build(model, checkpoint[1])
        layouts.append([])
        loss = ddp(inputs[step]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]), "layouts": layouts,
            "ef_calls": sum(b["ef_calls"] for b in state.stats().values()),
            "residual": sum(float(r.abs().sum()) for r in state.residuals.values())}


def _ef_layouts():
    out = {}
    for buckets in EF_BUCKETS:
        runs = out[buckets] = {"backward a, b, c": _ef_run(("c", "b", "a"), buckets),
                               "backward c, b, a": _ef_run(("a", "b", "c"), buckets)}
        if buckets == "one bucket":  # a resumed DDP starts from its first layout again, as the run did
            runs["resumed"] = _ef_run(("c", "b", "a"), buckets, resume_at=2)
    return out


@pytest.fixture(scope="module")
def ef_layouts():
    return spawn(_ef_layouts, 2, backend="gloo", timeout=300)


@pytest.mark.parametrize("buckets", list(EF_BUCKETS))
def test_error_feedback_follows_the_parameters_when_ddp_reorders_its_buckets_and_after_a_resume(ef_layouts, buckets):
    """The reference: the same training with the layers called in the other order (the same gradients, which DDP
    lays out in the reverse order within the bucket, or in buckets numbered the other way round), and with one
    bucket the same training restarted from a checkpoint after two steps. The residual follows the parameters
    through every layout: all end with the same bits."""
    results = [r[buckets] for r in ef_layouts]
    for r in results:
        for run in r.values():
            assert run["layouts"][1] != run["layouts"][0]  # DDP rebuilt its buckets after the first backward
            assert run["ef_calls"] > 0 and run["residual"] > 0  # error feedback applied and left a residual
        ours, other = r["backward a, b, c"]["layouts"][2], r["backward c, b, a"]["layouts"][2]
        assert ours != other and sorted(map(sorted, ours)) == sorted(map(sorted, other))  # same sets, other layout
        if "resumed" in r:
            assert r["resumed"]["layouts"][2] == r["resumed"]["layouts"][0]  # the new DDP's first layout
        for name, run in r.items():
            assert torch.equal(run["params"], r["backward a, b, c"]["params"]), name
    assert torch.equal(results[0]["backward c, b, a"]["params"], results[1]["backward c, b, a"]["params"])


def test_the_hook_times_its_exact_collectives_in_its_state_not_in_the_groups_default():
    for out in spawn(_train, 2, "exact", 3, timeout=300):
        runs = out["exact_runs"]
        assert sum(runs["state"].values()) > 0, runs  # the sparse buckets went exact (the others dense)
        assert runs["group default"] == {"allreduce-union": 0, "allgather-local": 0}, runs


class BagModel(torch.nn.Module):
    """A recommendation-style model: a sparse EmbeddingBag, then dense layers (several parameters per bucket)."""

    def __init__(self, rows=4096, dim=16):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.head = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, ids, offsets):
        return self.head(self.emb(ids, offsets)).squeeze(1)


def _train_bags(hook, background=False, steps=4):
    """Trains BagModel under DDP, plain (hook None) or with sketch_hook(mode="auto", dense_hook=hook); returns the
    parameters, every step's gradients, and which buckets' parameter shapes the dense hook was handed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(BagModel())
    seen, state = [], None

    def counting(dense_state, bucket):  # the user's hook, as DDP would call it
        seen.append(sorted(tuple(p.shape) for p in bucket.parameters()))
        return {"allreduce": allreduce_hook, "fp16": fp16_compress_hook}[hook](dense_state, bucket)

    if hook is not None:
        state = SketchState(mode="auto", dense_hook=counting, background=background)
        model.register_comm_hook(state, sketch_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(steps):
        ids = torch.randint(0, 300 + 200 * rank, (64,), generator=g)  # a few percent of the rows per rank
        offsets = torch.arange(0, 64, 4)
        loss = (model(ids, offsets) - 1).square().mean()
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.to_dense().clone() for p in model.parameters()])
        opt.step()
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]), "grads": grads, "seen": seen,
            "stats": None if state is None else state.stats()}


def _dense_hook_variants():
    return {"ddp": _train_bags(None), "allreduce": _train_bags("allreduce"),
            "allreduce, background": _train_bags("allreduce", background=True), "fp16": _train_bags("fp16")}


@pytest.fixture(scope="module")
def dense_hook_runs():
    return spawn(_dense_hook_variants, 2, timeout=300)


def test_dense_buckets_go_to_the_dense_hook_and_the_sparse_embedding_does_not(dense_hook_runs):
    head_shapes = sorted([(1,), (1, 32), (32,), (32, 16)])
    for r in dense_hook_runs:
        for name in ("allreduce", "allreduce, background", "fp16"):
            seen, stats = r[name]["seen"], r[name]["stats"]
            assert seen and all(shapes == head_shapes or set(shapes) <= set(head_shapes) for shapes in seen), seen
            assert sorted(s for shapes in seen[-len(seen) // 4:] for s in shapes) == head_shapes  # the last step
            methods = {b["last_method"] for b in stats.values()}
            assert methods == {"hook", "exact"}, (name, stats)  # the embedding went the sparse exact way
            # after its first call, the embedding's header rode in its gather of own rows: one collective a step
            assert max(b["folded_calls"] for b in stats.values()) >= 2, stats


def test_with_a_plain_allreduce_dense_hook_every_gradient_equals_ddps(dense_hook_runs):
    for r in dense_hook_runs:
        for name in ("allreduce", "allreduce, background"):
            for step, (ours, ddp) in enumerate(zip(r[name]["grads"], r["ddp"]["grads"])):
                for a, b in zip(ours, ddp):
                    assert torch.equal(a, b), (name, step)
            assert torch.equal(r[name]["params"], r["ddp"]["params"]), name
        # fp16 compresses the dense layers only: close, and the embedding's rows still exact
        assert torch.allclose(r["fp16"]["params"], r["ddp"]["params"], atol=1e-3)
        assert torch.equal(r["fp16"]["grads"][0][0], r["ddp"]["grads"][0][0])
    assert torch.equal(dense_hook_runs[0]["fp16"]["params"], dense_hook_runs[1]["fp16"]["params"])


def test_a_state_with_a_dense_hook_pickles_with_it_and_names_it_in_its_configuration():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state = SketchState(dense_hook=allreduce_hook)
    assert state.config()["dense_hook"].endswith("default_hooks.allreduce_hook")
    assert pickle.loads(pickle.dumps(state)).dense_hook is allreduce_hook
    assert state.state_dict()["dense_hook"] == state.config()["dense_hook"]  # a checkpoint holds its name only
    with pytest.raises(TypeError, match="dense_hook"):
        SketchState(dense_hook="allreduce")


def _dense_hook_on_one_rank():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from fastdist.distributed import MismatchError
    torch.manual_seed(0)
    model = DDP(BagModel())
    model.register_comm_hook(SketchState(dense_hook=allreduce_hook if dist.get_rank() == 1 else None), sketch_hook)
    try:
        model(torch.arange(8), torch.arange(0, 8, 4)).sum().backward()
    except MismatchError as e:
        return str(e)
    return "no error"


def test_a_dense_hook_on_one_rank_only_raises_on_every_rank_naming_it():
    for message in spawn(_dense_hook_on_one_rank, 2, timeout=120):
        assert "dense_hook" in message and "rank 1" in message, message
