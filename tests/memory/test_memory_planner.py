"""plan/apply/optimize: budgets respected in prediction, gradients bitwise equal under any plan, policies differ
exactly where DELTA's filter and director say they should."""
import copy
import itertools
import json

import fastdist.memory as fm
import pytest
import torch
from fastdist.memory import CopyModel, Profile, Segment, plan_from_profile
from memory_models import MLP, loss_of, make

MiB = 1 << 20


def copy_model(bandwidth=1e10, latency=0.0):
    return CopyModel("file", bandwidth, latency, bandwidth, latency)


def synthetic(specs, other=0, backward_ratio=2.0):
    """A Profile from (name, saved MiB, swappable MiB, input MiB, forward seconds) tuples."""
    segments = [Segment(name, int(a * MiB), int(w * MiB), [int(w * MiB)] if w else [], int(i * MiB), t)
                for name, a, w, i, t in specs]
    forward = sum(s.forward_seconds for s in segments)
    return Profile(segments, other, forward, backward_ratio * forward)


def blocks(n=6, saved=8, t=0.01):
    return synthetic([(f"b{i}", saved, saved, 0.5, t) for i in range(n)])


# ---- prediction ----

@pytest.mark.parametrize("policy", fm.planner.POLICIES)
@pytest.mark.parametrize("bandwidth", [1e7, 1e9, 1e12])
def test_every_plan_that_says_it_fits_is_under_its_budget_and_the_others_could_not(policy, bandwidth):
    prof = blocks()
    for frac in [1.0, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.0]:
        budget = int(frac * prof.saved_bytes)
        p = plan_from_profile(prof, budget, copy_model(bandwidth), policy, prefetch_depth=1)
        assert p.unoptimized_peak_bytes == prof.saved_bytes
        if p.fits:
            assert p.predicted_peak_bytes <= budget
        else:
            # nothing else this policy could do: every assignment of its actions the copy engine sustains is over
            allowed = ("keep", "recompute") if policy == "dtr" else fm.planner.ACTIONS
            costs = fm.planner._Costs(prof, copy_model(bandwidth))
            peaks = []
            for combo in itertools.product(allowed, repeat=len(prof.segments)):
                swapped = [i for i, a in enumerate(combo) if a == "swap"]
                if costs.write_total(swapped) <= costs.forward_total and costs.read_total(swapped) <= costs.backward_total:
                    peaks.append(fm.planner._predict_peak(prof, dict(zip([s.name for s in prof.segments], combo)), 1))
            assert min(peaks) > budget
        if frac == 1.0:
            assert set(p.actions.values()) == {"keep"} and p.predicted_overhead_seconds == 0


def test_the_peak_model_is_the_larger_of_the_end_of_forward_and_each_backward_step():
    prof = synthetic([("a", 10, 8, 1, 0.1), ("b", 6, 6, 2, 0.1), ("c", 4, 0, 1, 0.1)], other=3 * MiB)
    peak = fm.planner._predict_peak
    assert peak(prof, {"a": "keep", "b": "keep", "c": "keep"}, 2) == (3 + 10 + 6 + 4) * MiB
    # a swapped: 2 MiB of it stays; end of forward has its 8 MiB storage in flight: 3 + 2 + 6 + 4 + 8
    assert peak(prof, {"a": "swap", "b": "keep", "c": "keep"}, 2) == 23 * MiB
    # b recomputed: end of forward 3 + 10 + 2 + 4 = 19; backward at b: 3 + 10 + (2 + 6) = 21
    assert peak(prof, {"a": "keep", "b": "recompute", "c": "keep"}, 2) == 21 * MiB
    # a swapped, b recomputed: end of forward 3 + 2 + 2 + 4 + 8 = 19; at b: 3 + 2 + 8 = 13; at a: 3 + 2 + 8 = 13
    assert peak(prof, {"a": "swap", "b": "recompute", "c": "keep"}, 2) == 19 * MiB
    # everything off-loaded: c has nothing to swap, so it is recomputed (1 + 4); b and a swapped
    assert peak(prof, {"a": "swap", "b": "swap", "c": "recompute"}, 0) == (3 + 2 + 0 + 1 + 8) * MiB


# ---- the director and the filters ----

def test_dtr_never_swaps_and_delta_swaps_what_the_copy_engine_hides():
    prof = blocks()
    budget = int(0.5 * prof.saved_bytes)
    delta = plan_from_profile(prof, budget, copy_model(1e12), "delta", prefetch_depth=0)
    dtr = plan_from_profile(prof, budget, copy_model(1e12), "dtr", prefetch_depth=0)
    assert delta.fits and dtr.fits
    assert dtr.segments_with("swap") == [] and dtr.segments_with("recompute")
    assert delta.segments_with("recompute") == [] and delta.segments_with("swap")
    assert delta.predicted_overhead_seconds < dtr.predicted_overhead_seconds


def test_delta_recomputes_when_the_copy_engine_is_too_slow_to_hide_a_swap():
    prof = blocks()
    p = plan_from_profile(prof, int(0.5 * prof.saved_bytes), copy_model(1e6), "delta", prefetch_depth=0)
    assert p.fits and p.segments_with("swap") == [] and p.segments_with("recompute")


def test_without_overlap_delta_swaps_iff_two_copies_are_cheaper_than_recomputing():
    # One segment: no forward work after it, no backward work before it: DELTA's 2 bytes / B < recompute rule.
    bandwidth, latency, nbytes = 1e9, 1e-4, 8 * MiB
    two_copies = 2 * (nbytes / bandwidth + latency)
    for recompute, expected in [(two_copies * 1.01, "swap"), (two_copies * 0.99, "recompute")]:
        prof = synthetic([("only", 8, 8, 0.01, recompute)])
        p = plan_from_profile(prof, 4 * MiB, copy_model(bandwidth, latency), "delta", prefetch_depth=0)
        assert p.actions["only"] == expected


def test_delta_evicts_the_largest_stalest_segment_while_dtr_evicts_the_cheapest_to_recompute_per_byte():
    # Recomputing either `big` or `cheap` alone fits 19 MiB. `big` has the largest bytes x staleness
    # (12 MiB x 0.3 s against 6 MiB x 0.45 s): DELTA's pick. `cheap` is nearly free to recompute: DTR's pick.
    prof = synthetic([("cheap", 6, 6, 0.1, 1e-4), ("big", 12, 12, 0.1, 0.05), ("mid", 1, 1, 0.1, 0.05),
                      ("tail", 1, 1, 0.1, 0.05)])
    budget = 19 * MiB
    delta = plan_from_profile(prof, budget, copy_model(1e6), "delta", prefetch_depth=0)
    dtr = plan_from_profile(prof, budget, copy_model(1e6), "dtr", prefetch_depth=0)
    assert delta.fits and dtr.fits
    assert delta.actions == {"cheap": "keep", "big": "recompute", "mid": "keep", "tail": "keep"}
    assert dtr.actions == {"cheap": "recompute", "big": "keep", "mid": "keep", "tail": "keep"}
    assert dtr.predicted_overhead_seconds < delta.predicted_overhead_seconds  # DELTA's filter ignores cost


def test_msps_evicts_the_most_bytes_saved_per_second_of_overhead_first():
    # `big` saves the most bytes but its recomputation costs a lot; `cheap` saves fewer bytes almost for free.
    # Recomputing either alone fits 16 MiB (peaks 9.1 and 15.1 MiB).
    prof = synthetic([("big", 9, 9, 0.1, 0.5), ("cheap", 6, 6, 0.1, 0.001), ("mid", 1, 1, 0.1, 0.01),
                      ("tail", 1, 1, 0.1, 0.01)])
    budget = 16 * MiB
    delta = plan_from_profile(prof, budget, copy_model(1e3), "delta", prefetch_depth=0)
    msps = plan_from_profile(prof, budget, copy_model(1e3), "msps", prefetch_depth=0)
    assert delta.actions["big"] == "recompute" and delta.actions["cheap"] == "keep"
    assert msps.actions["cheap"] == "recompute" and msps.actions["big"] == "keep"
    assert msps.predicted_overhead_seconds < delta.predicted_overhead_seconds


def test_swaps_the_copy_engine_cannot_sustain_in_total_fall_back_to_recompute():
    # Each 8 MiB swap hides behind the later segments' work alone, but all of them together need more
    # copy time than the whole forward pass has.
    prof = blocks(n=6, saved=8, t=0.01)  # 60 ms of forward in total
    copy_s = 0.013  # per 8 MiB swap
    p = plan_from_profile(prof, int(0.4 * prof.saved_bytes), copy_model(8 * MiB / copy_s), "delta", prefetch_depth=0)
    swapped = p.segments_with("swap")
    assert swapped and p.segments_with("recompute")
    assert len(swapped) * copy_s <= prof.forward_seconds
    assert any("infeasible" in note for note in p.notes)


def test_bad_policy_budget_and_segments_are_rejected():
    prof = blocks()
    with pytest.raises(ValueError, match="policy"):
        plan_from_profile(prof, MiB, copy_model(), "lru")
    with pytest.raises(ValueError, match="budget"):
        plan_from_profile(prof, -1, copy_model(), "delta")
    model, x = make("mlp")
    with pytest.raises(ValueError, match="not a submodule"):
        fm.profile(model, x, segments=["blocks.9"])
    with pytest.raises(ValueError, match="nest"):
        fm.profile(model, x, segments=["blocks", "blocks.1"])
    with pytest.raises(ValueError, match="policy"):
        fm.plan(model, x, MiB, policy="lru")


# ---- profiling real models ----

def test_profile_counts_each_saved_storage_once_without_parameters_and_restores_the_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(3)],
                                torch.nn.BatchNorm1d(256))
    x = torch.randn(64, 256)
    model[0][0].weight.grad = torch.full_like(model[0][0].weight, 7.0)
    running = model[3].running_mean.clone()
    prof = fm.profile(model, x, segments=["0", "1", "2"], min_bytes=1)
    act = 64 * 256 * 4
    # block 0 saves x and tanh's output; later blocks' linear input is the previous tanh output (already counted)
    assert [s.saved_bytes for s in prof.segments] == [2 * act, act, act]
    assert [s.input_bytes for s in prof.segments] == [act, act, act]
    assert prof.segments[0].swappable_sizes == [act, act]
    assert prof.other_saved_bytes > 0  # batch norm, outside every segment
    assert all(s.forward_seconds > 0 for s in prof.segments) and prof.backward_seconds > 0
    assert torch.equal(model[0][0].weight.grad, torch.full_like(model[0][0].weight, 7.0))
    assert model[1][0].weight.grad is None and torch.equal(model[3].running_mean, running)


def test_default_segments_are_the_blocks_of_the_first_module_list():
    assert fm.default_segments(MLP(depth=3)) == ["blocks.0", "blocks.1", "blocks.2"]
    model, _ = make("transformer")
    assert fm.default_segments(model) == ["blocks.0", "blocks.1"]


# ---- applying plans ----

def grads_under(model, x, actions=None, tmp_path=None, seed=3):
    model = copy.deepcopy(model)
    applied = None
    if actions is not None:
        prof = Profile([Segment(n) for n in actions], 0, 1.0, 1.0)
        plan = fm.Plan("delta", 0, dict(actions), 0, 0, 0.0, 1.0, True, 4096, 2, "file", prof, {})
        applied = fm.apply(model, plan, path=str(tmp_path))
    torch.manual_seed(seed)
    for _ in range(2):  # two steps: the second runs on the plan's warm state (and accumulates grads)
        loss_of(model(x)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if applied is not None:
        stats = applied.stats()
        applied.remove()
        return grads, stats
    return grads, None


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_gradients_are_bitwise_equal_under_every_mix_of_keep_swap_and_recompute(kind, tmp_path):
    model, x = make(kind)
    names = fm.default_segments(model)
    reference, _ = grads_under(model, x)
    mixes = [["swap"] * len(names), ["recompute"] * len(names),
             [fm.planner.ACTIONS[i % 3] for i in range(len(names))],
             [fm.planner.ACTIONS[(i + 1) % 3] for i in range(len(names))]]
    for mix in mixes:
        grads, stats = grads_under(model, x, dict(zip(names, mix)), tmp_path)
        assert all(torch.equal(a, b) for a, b in zip(reference, grads)), mix
        if "swap" in mix:
            assert stats["tensors_swapped"] > 0


def test_apply_wraps_only_the_planned_segments_and_remove_restores_them(tmp_path):
    model, x = make("mlp")
    prof = Profile([Segment(f"blocks.{i}") for i in range(4)], 0, 1.0, 1.0)
    actions = {"blocks.0": "swap", "blocks.1": "recompute", "blocks.2": "keep", "blocks.3": "keep"}
    plan = fm.Plan("delta", 0, actions, 0, 0, 0.0, 1.0, True, 4096, 2, "file", prof, {})
    applied = fm.apply(model, plan, path=str(tmp_path))
    assert "forward" in vars(model.blocks[0]) and "forward" in vars(model.blocks[1])
    assert "forward" not in vars(model.blocks[2])
    with pytest.raises(ValueError, match="already has a plan"):
        fm.apply(model, plan, path=str(tmp_path))
    with torch.no_grad():  # inference: no hooks, no checkpointing
        model(x)
    assert applied.stats()["tensors_swapped"] == 0
    applied.remove()
    assert not any("forward" in vars(b) for b in model.blocks)
    bad = fm.Plan("delta", 0, {"blocks.0": "evict"}, 0, 0, 0.0, 1.0, True, 4096, 2, "file", prof, {})
    with pytest.raises(ValueError, match="evict"):
        fm.apply(model, bad)


def test_optimize_plans_applies_and_keeps_gradients_equal_and_a_plan_round_trips_through_json(tmp_path):
    model, x = make("transformer")
    reference, _ = grads_under(model, x)
    work = copy.deepcopy(model)
    prof = fm.profile(work, x, min_bytes=4096)
    budget = int(0.7 * prof.saved_bytes)  # both recomputing and swapping can meet it, however the machine is
    applied = fm.optimize(work, x, budget, min_bytes=4096, path=str(tmp_path))
    assert applied.plan.fits and applied.plan.predicted_peak_bytes <= budget
    assert set(applied.plan.actions.values()) - {"keep"}
    restored = fm.Plan.from_state_dict(json.loads(json.dumps(applied.plan.state_dict())))
    assert restored == applied.plan
    torch.manual_seed(3)
    for _ in range(2):
        loss_of(work(x)).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(reference, work.parameters()))
    applied.remove()
    with pytest.raises(ValueError, match="no plan fits"):
        fm.optimize(copy.deepcopy(model), x, 0, min_bytes=4096, path=str(tmp_path))


def test_calibrate_fits_positive_bandwidths_and_caches():
    sizes = (1 << 16, 1 << 18, 1 << 20)
    a = fm.calibrate("file", sizes=sizes, repeats=3, refresh=True)
    assert a.kind == "file" and a.write_bandwidth > 0 and a.read_bandwidth > 0
    assert a.write_latency >= 0 and a.read_latency >= 0 and len(a.samples) == 2 * len(sizes)  # writes and reads
    assert fm.calibrate("file", sizes=(1 << 16,)) is a  # cached per store and path
    assert a.write_seconds(2 * MiB) > a.write_seconds(MiB)
    with pytest.raises(ValueError, match="store"):
        fm.calibrate("disk")


# ---- budgets below what any plan reaches ----

def test_a_plan_reports_the_lowest_peak_it_can_reach_and_the_bytes_it_can_reduce():
    prof = synthetic([(f"b{i}", 8, 8, 0.5, 0.01) for i in range(4)], other=40 * MiB)  # a large head: 40 of 72 MiB
    half = plan_from_profile(prof, int(0.5 * prof.saved_bytes), copy_model(), "delta", prefetch_depth=0)
    assert not half.fits and half.floor_bytes > int(0.5 * prof.saved_bytes)
    assert half.predicted_peak_bytes == half.floor_bytes  # the closest plan is the one returned
    assert half.reducible_bytes == half.unoptimized_peak_bytes - half.floor_bytes
    assert 40 * MiB < half.floor_bytes < prof.saved_bytes  # the head stays; the blocks leave their inputs behind
    assert "DOES NOT FIT: no plan goes below" in half.summary() and "reducible" in half.summary()
    at_floor = plan_from_profile(prof, half.floor_bytes, copy_model(), "delta", prefetch_depth=0)
    assert at_floor.fits and at_floor.floor_bytes == half.floor_bytes


def _language_model():
    from fastdist.testing.models import TransformerLM
    torch.manual_seed(0)
    # the logits ([8, 32, 4096] floats, kept by the loss) outweigh the two blocks' activations
    return TransformerLM(vocab=4096, dim=32, heads=2, layers=2, seq=32), torch.randint(0, 4096, (8, 32))


def test_optimize_on_a_language_model_says_which_budgets_are_reachable_or_applies_the_closest_plan_on_request(
        tmp_path):
    model, x = _language_model()
    lm_loss = lambda logits: logits.float().logsumexp(-1).mean()  # noqa: E731
    half = 1 << 20  # below the logits alone ([8, 32, 4096] floats, 4 MiB), which the loss keeps
    with pytest.raises(ValueError, match=r"can be met; best_effort=True applies the closest plan"):
        fm.optimize(copy.deepcopy(model), x, half, loss_fn=lm_loss, min_bytes=4096, path=str(tmp_path),
                    copy_model=copy_model())
    work = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="best effort"):
        applied = fm.optimize(work, x, half, best_effort=True, loss_fn=lm_loss, min_bytes=4096, path=str(tmp_path),
                              copy_model=copy_model())
    assert not applied.plan.fits and applied.plan.predicted_peak_bytes == applied.plan.floor_bytes
    assert applied.plan.floor_bytes < applied.plan.unoptimized_peak_bytes  # it did reduce what it could
    assert "keep" not in applied.plan.actions.values()
    torch.manual_seed(3)
    reference = copy.deepcopy(model)
    lm_loss(reference(x)).backward()
    torch.manual_seed(3)
    lm_loss(work(x)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), work.parameters()))
    applied.remove()
