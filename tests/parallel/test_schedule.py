"""fastdist.parallel.schedule and .recompute: every schedule and recompute setting trains a pipelined GPT (with
dropout) exactly as torch's Schedule1F1B without recompute does, on 2 ranks and on the 1-stage degenerate
pipeline; the shifted critical path recomputes before each backward and never on the last stage; stage-aware
ratios keep every stage's stash at the first stage's; recompute lowers the activations autograd keeps. What runs
on the ranks is in schedule_ranks.py."""
import pytest
import torch
from helpers import assert_close
from schedule_ranks import CASES, run_cases

from fastdist.distributed import spawn
from fastdist.parallel.cost import BASELINE, MEASURED_VARIANTS
from fastdist.parallel.schedule import SCHEDULES, resolve_recompute, stage_recompute_ratios

EXACT = {"atol": 1e-6, "rtol": 1e-6}


@pytest.fixture(scope="module")
def job():
    return spawn(run_cases, 2, list(CASES), backend="gloo", timeout=300, threads_per_rank=1)


@pytest.fixture(scope="module")
def two_ranks(job):
    return job


@pytest.fixture(scope="module")
def one_rank(job):
    return job[0]["single"]


def test_schedule_names_are_torchs_three_and_the_shifted_critical_path():
    assert sorted(SCHEDULES) == ["1f1b", "gpipe", "interleaved", "shifted_critical_path"]
    assert SCHEDULES["1f1b"] is torch.distributed.pipelining.Schedule1F1B
    assert SCHEDULES["gpipe"] is torch.distributed.pipelining.ScheduleGPipe
    assert SCHEDULES["interleaved"] is torch.distributed.pipelining.ScheduleInterleaved1F1B


@pytest.mark.parametrize("stages", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("r0", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_stage_aware_ratios_stash_what_the_first_stage_stashes(stages, r0):
    ratios = stage_recompute_ratios(r0, stages)
    assert len(ratios) == stages and ratios[0] == pytest.approx(r0) and ratios[-1] == 0.0
    for s, r in enumerate(ratios[:-1], start=1):  # stage s (from 1) stashes S - s microbatches under 1F1B
        want = 1 - (1 - r0) * (stages - 1) / (stages - s)
        assert r == pytest.approx(max(0.0, want))
        if want >= 0:
            assert (stages - s) * (1 - r) == pytest.approx((stages - 1) * (1 - r0))
    assert ratios == sorted(ratios, reverse=True)


def test_stage_aware_ratios_match_the_papers_formula_at_four_stages():
    assert stage_recompute_ratios(0.5, 4) == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert stage_recompute_ratios(0.8, 4) == pytest.approx([0.8, 0.7, 0.4, 0.0])
    assert stage_recompute_ratios(0.7, 1) == [0.0]


@pytest.mark.parametrize("bad", [-0.1, 1.01, float("nan"), "0.5", None, True])
def test_stage_aware_ratios_refuse_an_r0_outside_zero_to_one(bad):
    with pytest.raises(ValueError, match="r0 must be a number in"):
        stage_recompute_ratios(bad, 4)


def test_resolve_recompute_gives_each_mode_its_ratio_and_the_shifted_last_stage_none():
    assert [resolve_recompute("stage_aware", 0.5, s, 4) for s in range(4)] == pytest.approx([0.5, 0.25, 0, 0])
    assert [resolve_recompute("full", 0.5, s, 2) for s in range(2)] == [1.0, 1.0]
    assert [resolve_recompute("full", 0.5, s, 2, "shifted_critical_path") for s in range(2)] == [1.0, 0.0]
    assert resolve_recompute(0.25, 0.5, 0, 2) == 0.25 and resolve_recompute("none", 0.5, 0, 2) == 0.0
    with pytest.raises(ValueError, match="stage_recompute_ratios: num_stages"):
        stage_recompute_ratios(0.5, 0)


@pytest.mark.parametrize("case", sorted(set(CASES) - {"torch"}))
def test_every_schedule_and_recompute_trains_as_torchs_1f1b_on_two_ranks(two_ranks, case):
    for rank, by_case in enumerate(two_ranks):
        want, got = by_case["torch"], by_case[case]
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-6)
        for kind in ("grads", "params"):
            assert set(got[kind]) == set(want[kind])
            for name in want[kind]:
                assert_close(got[kind][name], want[kind][name], f"{case}, rank {rank}, {kind} {name}", **EXACT)
    assert len(two_ranks[1]["torch"]["losses"]) == 2


def test_shifted_critical_path_recomputes_each_microbatch_before_its_backward_and_not_on_the_last_stage(two_ranks):
    first, last = two_ranks[0]["scp_full"], two_ranks[1]["scp_full"]
    assert (first["ratio"], last["ratio"]) == (1.0, 0.0)
    events = [e for e, _ in first["log"]]
    backwards = [i for i, e in enumerate(events) if e == "B"]
    assert len(backwards) == 4 and all(events[i - 1] == "R" for i in backwards)
    assert events.count("R") == 4 and "R" not in [e for e, _ in last["log"]]
    # torch's 1F1B with the same recompute runs it inside the backward, after the gradient arrived
    plain = [e for e, _ in two_ranks[0]["1f1b_full"]["log"]]
    assert all(plain[i + 1] == "R" for i, e in enumerate(plain) if e == "B")


def test_stage_aware_recompute_gives_the_first_of_two_stages_r0_and_the_last_none(two_ranks):
    assert [r["scp_stage_aware"]["ratio"] for r in two_ranks] == [0.5, 0.0]
    assert [r["1f1b_full"]["ratio"] for r in two_ranks] == [1.0, 1.0]


def test_one_stage_pipeline_trains_as_torchs_1f1b_under_every_schedule(one_rank):
    want = one_rank["torch"]
    for case in ("1f1b_full", "gpipe_half", "scp_full"):
        got = one_rank[case]
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-6)
        for name in want["grads"]:
            assert_close(got["grads"][name], want["grads"][name], f"{case}, 1 stage, {name}", **EXACT)
    assert one_rank["scp_full"]["ratio"] == 0.0  # the only stage is the last: nothing to recompute


def test_recompute_lowers_the_activations_autograd_keeps(one_rank):
    peaks = {ratio: peak for ratio, (peak, _) in one_rank["peaks"].items()}
    assert peaks[1.0] < peaks[0.5] < peaks[0.0]


def test_bad_schedule_arguments_are_clear_errors(one_rank):
    errors = one_rank["errors"]
    assert all(errors.values()), errors
    assert "zero_bubble" in errors["name"] and "n_microbatches" in errors["microbatches"]
    assert "'some'" in errors["recompute_mode"] and "1.5" in errors["recompute_float"]
    assert "r0" in errors["stage_aware_r0"] and "nan" in errors["stage_ratio"]
    assert "make_stage" in errors["plain_stage"] and one_rank["plain_ok"] == "Schedule1F1B"


def test_the_measured_comparison_runs_every_variant_at_one_cap_and_predicts_each(two_ranks):
    got = two_ranks[0]["measure"]
    rows = {r["variant"]: r for r in got["rows"]}
    assert set(rows) == set(MEASURED_VARIANTS) and got["r0"] in (0.0, 0.5, 1.0)
    assert rows[BASELINE]["speedup"] == pytest.approx(1.0) and rows[BASELINE]["fits_cap"]
    assert not rows["torch-1f1b"]["fits_cap"] and rows["scp+stage-aware"]["fits_cap"]
    assert rows["scp+stage-aware"]["ratios"] == [got["r0"], 0.0]
    assert rows[BASELINE]["stage_saved_bytes"][0] < rows["torch-1f1b"]["stage_saved_bytes"][0]
    for r in rows.values():
        assert r["time_ms"] > 0 and r["predicted_ms"] > 0 and len(r["samples_ms"]) == 1
    assert two_ranks[1]["measure"]["rows"] == got["rows"]  # every rank returns the same figures


def test_ranks_that_disagree_on_the_schedule_fail_on_every_rank_naming_it(two_ranks):
    for rank in range(2):
        message = two_ranks[rank]["mismatch"]
        assert message is not None and "pipeline schedule" in message and "schedule" in message
        assert "gpipe" in message and "1f1b" in message


def test_a_ddp_wrapped_stage_recomputes_to_the_same_reduced_gradients(two_ranks):
    for rank in range(2):
        plain, recomputed = two_ranks[rank]["ddp"][0.0], two_ranks[rank]["ddp"][1.0]
        for name in plain:
            assert_close(recomputed[name], plain[name], f"rank {rank}, DDP stage, {name}", **EXACT)
            assert_close(plain[name], two_ranks[0]["ddp"][0.0][name], f"rank {rank} vs 0 (reduced), {name}", **EXACT)


def test_interleaved_stages_with_recompute_train_as_two_stages_under_torchs_1f1b(two_ranks):
    ways = {way: {"losses": two_ranks[1]["interleaved"][way]["losses"],
                  "grads": {**two_ranks[0]["interleaved"][way]["grads"], **two_ranks[1]["interleaved"][way]["grads"]}}
            for way in ("interleaved", "torch")}  # the whole model's gradients, from both ranks' stages
    got, want = ways["interleaved"], ways["torch"]
    assert len(want["losses"]) == 4 and got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    assert set(got["grads"]) == set(want["grads"])
    for name in want["grads"]:
        assert_close(got["grads"][name], want["grads"][name], f"interleaved, {name}", atol=1e-5, rtol=1e-5)
