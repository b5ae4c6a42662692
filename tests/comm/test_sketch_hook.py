"""fastdist.comm.hooks.sketch_hook: a DDP comm hook that is lossless in exact mode and keeps its state."""
import pickle

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
    fresh = SketchState()
    fresh.load_state_dict(sd)
    assert fresh.state_dict() == sd


def test_error_feedback_residuals_are_kept_per_bucket_and_survive_pickling():
    results = spawn(_train, 2, "sketch", 3, True, timeout=300)
    blob, sd, _ = results[0]["state"]
    residuals = {i: b["residual"] for i, b in sd["buckets"].items()}
    assert residuals and all(r is not None and r.shape[0] == 3 for r in residuals.values())
    assert any(r.abs().sum() > 0 for r in residuals.values())  # lossy steps left something to feed back
    for i, r in residuals.items():  # a residual only moves in calls that applied error feedback, and says so
        b = sd["buckets"][i]
        assert b["ef_calls"] > 0 or r.abs().sum() == 0
        assert b["last_method"] in ("sketch", "sketch+ef", "exact", "dense")
    restored = pickle.loads(blob)
    for i, r in residuals.items():
        assert torch.equal(restored.buckets[i].residual, r)
    # every rank holds the same residual: they all decoded the same summed sketch
    other = results[1]["state"][1]["buckets"]
    assert all(torch.equal(other[i]["residual"], r) for i, r in residuals.items())


def test_the_hook_times_its_exact_collectives_in_its_state_not_in_the_groups_default():
    for out in spawn(_train, 2, "exact", 3, timeout=300):
        runs = out["exact_runs"]
        assert sum(runs["state"].values()) > 0, runs  # the sparse buckets went exact (the others dense)
        assert runs["group default"] == {"allreduce-union": 0, "allgather-local": 0}, runs
