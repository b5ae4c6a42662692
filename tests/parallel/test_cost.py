"""fastdist.parallel.cost: the simulated schedules give the closed forms of GPipe and 1F1B, put recompute where
each schedule runs it, keep the activations each schedule keeps, and price the links; the sweep covers the
paper's scale; the measured check runs end to end on 2 ranks (its job is test_schedule's)."""
import math

import pytest
import torch
from torch import nn

from fastdist.parallel.cost import Link, StageTimes, measure_stage, simulate, sweep

F, B, R = 1.0, 2.0, 1.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "shifted_critical_path"])
@pytest.mark.parametrize("stages,n", [(1, 4), (2, 4), (4, 8), (8, 32)])
def test_without_recompute_every_schedule_takes_n_plus_s_minus_1_slots(schedule, stages, n):
    r = simulate(schedule, StageTimes(F, B), n, num_stages=stages)
    assert r.step_time == pytest.approx((n + stages - 1) * (F + B))
    assert r.bubble[0] == pytest.approx((stages - 1) * (F + B)) and r.recompute == [0.0] * stages


@pytest.mark.parametrize("stages,n", [(2, 4), (4, 8)])
def test_full_recompute_inside_the_backward_lengthens_every_slot(stages, n):
    r = simulate("1f1b", StageTimes(F, B, recompute=R), n, num_stages=stages, recompute="full")
    assert r.step_time == pytest.approx((n + stages - 1) * (F + B + R))
    assert r.exposed_recompute == pytest.approx([n * R] * stages)


def test_shifted_critical_path_takes_recompute_off_the_path_and_the_last_stage_off_recompute():
    t = StageTimes(F, B, recompute=R)
    plain = simulate("1f1b", t, 8, num_stages=4, recompute="full")
    shifted = simulate("shifted_critical_path", t, 8, num_stages=4, recompute="full")
    assert shifted.ratios == [1.0, 1.0, 1.0, 0.0] and shifted.recompute[-1] == 0.0
    assert shifted.step_time < plain.step_time
    assert sum(shifted.exposed_recompute) < sum(plain.exposed_recompute)
    # on the stage, each backward's recompute ends before the backward starts: it ran while waiting
    for s in range(3):
        acts = [a for a in shifted.timeline if a[0] == s]
        for i, (_, kind, mb, start, end) in enumerate(acts):
            if kind == "B":
                assert acts[i - 1][1:3] == ("R", mb) and acts[i - 1][4] <= start + 1e-12


def test_recompute_time_counts_whole_blocks():
    t = StageTimes(F, B, recompute=R, blocks=4)
    assert t.recompute_time(0.3) == pytest.approx(0.5 * R) and t.recompute_time(0.25) == pytest.approx(0.25 * R)
    assert StageTimes(F, B).recompute_time(0.3) == pytest.approx(0.3 * F)


def test_in_flight_microbatches_are_torchs_warmup_under_1f1b_and_all_under_gpipe():
    assert simulate("1f1b", StageTimes(F, B), 8, num_stages=4).peak_in_flight == [4, 3, 2, 1]
    assert simulate("gpipe", StageTimes(F, B), 8, num_stages=4).peak_in_flight == [8] * 4
    assert simulate("1f1b", StageTimes(F, B), 8, num_stages=4).peak_memory == [4.0, 3.0, 2.0, 1.0]


def test_stage_aware_recompute_keeps_the_stages_stash_at_the_first_stages():
    t = StageTimes(F, B, activation_bytes=100.0)
    r = simulate("1f1b", t, 16, num_stages=4, recompute="stage_aware", recompute_ratio=0.5)
    assert r.ratios == pytest.approx([0.5, 0.25, 0.0, 0.0])
    # stash (in flight - 1 kept at 1 - r) plus the microbatch in the backward with its recomputed part
    assert r.peak_memory == pytest.approx([3 * 50 + 100, 2 * 75 + 100, 200, 100])
    shifted = simulate("shifted_critical_path", t, 16, num_stages=4, recompute="stage_aware", recompute_ratio=0.5)
    assert shifted.peak_memory[0] == pytest.approx(4 * 50 + 50)  # one recomputed part held while waiting


def test_a_slow_link_delays_each_boundary_crossing():
    t = StageTimes(F, B, send_bytes=1000.0)
    r = simulate("gpipe", [t, StageTimes(F, B)], 2, link=Link(latency=0.25, bandwidth=4000.0))
    assert r.step_time == pytest.approx(10.0)  # hand-timed: each of the 2 crossings of mb 0 costs 0.5
    assert simulate("gpipe", [t, StageTimes(F, B)], 2).step_time == pytest.approx(9.0)


def test_sweep_covers_the_papers_scale_and_the_bubble_shrinks_with_microbatches():
    configs = (("1f1b", "none", 0.0), ("1f1b", "full", 0.0), ("shifted_critical_path", "stage_aware", 0.5))
    rows = sweep(StageTimes(F, B, recompute=R, blocks=4), stages=(4, 64), microbatches=(8, 64), configs=configs)
    assert {(r["pp"], r["microbatches"]) for r in rows} == {(4, 8), (4, 64), (64, 64)}  # 1F1B needs n >= pp
    assert len(rows) == 3 * len(configs)
    plain = {(r["pp"], r["microbatches"]): r for r in rows if (r["schedule"], r["recompute"]) == ("1f1b", "none")}
    assert plain[4, 64]["bubble_fraction"] < plain[4, 8]["bubble_fraction"]
    assert plain[64, 64]["bubble_fraction"] == pytest.approx(63 / (64 + 63))
    for r in rows:
        assert r["step_time"] >= r["ideal"] - 1e-9
    by = {(r["pp"], r["microbatches"], r["schedule"], r["recompute"]): r["step_time"] for r in rows}
    assert by[64, 64, "shifted_critical_path", "stage_aware"] < by[64, 64, "1f1b", "full"]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="StageTimes.forward"):
        StageTimes(-1.0, B)
    with pytest.raises(ValueError, match="StageTimes.backward"):
        StageTimes(F, math.nan)
    with pytest.raises(ValueError, match="schedule must be one of"):
        simulate("interleaved", StageTimes(F, B), 8, num_stages=2)
    with pytest.raises(ValueError, match="n_microbatches >= 4"):
        simulate("1f1b", StageTimes(F, B), 2, num_stages=4)
    with pytest.raises(ValueError, match="num_stages >= 1"):
        simulate("1f1b", StageTimes(F, B), 2)
    with pytest.raises(ValueError, match="1 links for 2 boundaries"):
        simulate("1f1b", [StageTimes(F, B)] * 3, 4, link=[Link()])
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(bandwidth=0)


def test_measure_stage_times_a_stage_and_weighs_what_it_keeps():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(32, 16)
    t = measure_stage(module, (x,), blocks=3, reps=2)
    assert t.forward > 0 and t.backward > 0 and t.blocks == 3
    assert t.input_bytes == x.numel() * 4 and t.send_bytes == 32 * 16 * 4
    assert t.activation_bytes >= (32 * 16 + 2 * 32 * 64) * 4  # the inputs of both linears and of the GELU
    last = measure_stage(module, (x,), loss_fn=nn.functional.mse_loss, target=torch.zeros(32, 16), reps=1)
    assert last.send_bytes == 0
