"""The bench toolkit: argument types accept their grammar and name what they reject; the timers warm up, keep
every sample and take the median; the multi-rank timer keeps the slowest rank's time."""
import argparse
import io
import os
import time

import pytest
import tqdm

from fastdist.bench import launch, report, toolkit
from fastdist.distributed import spawn, timing


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("64K", 64 << 10), ("16M", 16 << 20), ("1G", 1 << 30), ("2T", 2 << 40), ("1.5M", 3 << 19),
    ("1KiB", 1024), ("64kb", 64 << 10), ("4096B", 4096), (" 64m ", 64 << 20), ("2^20", 1 << 20), ("0", 0),
])
def test_parse_size_reads_plain_counts_binary_units_and_powers(text, expected):
    assert toolkit.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "x", "-1", "1.5", "4096iB", "64Q", "1.5K2", "2^", "M"])
def test_parse_size_rejects_other_text_naming_it_and_the_grammar(text):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        toolkit.parse_size(text)
    assert repr(text) in str(e.value)
    assert "2^20" in str(e.value) or "whole number" in str(e.value)


@pytest.mark.parametrize("text, expected", [
    ("8192x256", (8192, 256)), ("512,512,512", (512, 512, 512)), ("3*4", (3, 4)), ("7", (7,)), ("2X3", (2, 3)),
])
def test_parse_shape_reads_x_or_comma_separated_positive_ints(text, expected):
    assert toolkit.parse_shape(text) == expected


@pytest.mark.parametrize("text, ndim, why", [
    ("0x4", None, ">= 1"), ("ax2", None, "positive integers"), ("", None, "positive integers"),
    ("4x-2", None, "positive integers"), ("32768", 2, "expected 2 dimensions, got 1"),
])
def test_parse_shape_rejects_bad_shapes_saying_why(text, ndim, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        toolkit.parse_shape(text, ndim)


def test_shape_type_fixes_the_number_of_dimensions_for_argparse():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=toolkit.shape_type(3))
    assert p.parse_args(["--shape", "2,3,4"]).shape == (2, 3, 4)
    with pytest.raises(SystemExit):
        p.parse_args(["--shape", "2x3"])


def test_comma_list_converts_each_item_in_order_and_drops_empty_ones():
    assert toolkit.comma_list()("a, b,,c,") == ["a", "b", "c"]
    assert toolkit.comma_list(float)("0.5,2") == [0.5, 2.0]
    assert toolkit.comma_list(int, choices=[1, 2, 8])("8,1") == [8, 1]


def test_comma_list_names_the_bad_item_and_the_allowed_set():
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown item 'c' in 'a,c'; choose from a, b"):
        toolkit.comma_list(choices=["a", "b"])("a,c")
    with pytest.raises(argparse.ArgumentTypeError, match=r"bad item 'x' in '1,x'"):
        toolkit.comma_list(int)("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match="at least one"):
        toolkit.comma_list()(" , ")


def test_comma_list_errors_reach_argparse_as_a_usage_error(capsys):
    p = argparse.ArgumentParser(prog="suite")
    p.add_argument("--methods", type=toolkit.comma_list(choices=["dense", "sketch"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--methods", "dense,skecth"])
    assert "unknown item 'skecth'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, accepted", [
    (["--net", "loopback"], True), (["--net", "2.5gbit"], True), (["--delay", "50us"], True),
    (["--net", "1gbt"], False), (["--net", "fast"], False), (["--delay", "5xs"], False), (["--delay", "-1ms"], False)])
def test_a_suites_network_and_delay_are_checked_when_parsed_not_when_the_ranks_start(argv, accepted, capsys):
    p = argparse.ArgumentParser(prog="suite")
    launch.add_launch_arguments(p, timeout=60)
    if accepted:
        assert getattr(p.parse_args(argv), argv[0][2:]) == argv[1]
    else:
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert f"argument {argv[0]}:" in capsys.readouterr().err


def test_the_environment_header_shows_the_hosts_load_average():
    env = report.environment(backend="gloo", device="cpu", ranks=2, network="loopback")
    assert len(env["load_average"].split()) == 3
    assert "# load_average" in report.format_environment(env)


class _Clock:
    """perf_counter stand-in: every call of the timed function advances it by the next duration."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def perf_counter(self):
        return self.now

    def work(self):
        self.now += self.durations[self.calls]
        self.calls += 1


def test_time_fn_runs_the_warm_up_untimed_then_keeps_every_timed_sample(monkeypatch):
    clock = _Clock([100.0, 100.0, 3.0, 1.0, 2.0, 5.0, 4.0])  # two slow warm-up calls, then five timed
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    result = toolkit.time_fn(clock.work, reps=5, warmup=2)
    assert clock.calls == 2 + 5
    assert result.samples == (3.0, 1.0, 2.0, 5.0, 4.0)
    assert result.median == 3.0


def test_time_fn_rejects_no_repetitions():
    with pytest.raises(ValueError, match="reps >= 1"):
        toolkit.time_fn(lambda: None, reps=0)


def _sleep_by_rank(slowest):
    import torch.distributed as dist

    seconds = 0.01 if dist.get_rank() == 0 else 0.25
    return toolkit.time_ranks(lambda: time.sleep(seconds), reps=3, warmup=1, slowest=slowest).samples


def test_time_ranks_keeps_the_slowest_ranks_time_per_repetition_or_this_ranks_own():
    slowest = spawn(_sleep_by_rank, 2, True, timeout=120)
    own = spawn(_sleep_by_rank, 2, False, timeout=120)
    assert slowest[0] == slowest[1] and len(slowest[0]) == 3
    assert min(slowest[0]) >= 0.25                     # rank 0's quick calls count as long as rank 1's
    assert max(own[0]) < 0.25 <= min(own[1])           # each rank's own samples


def test_text_table_gives_each_column_its_own_format_and_leaves_out_columns_without_values():
    columns = [report.col("method", "method"), report.col("time (ms)", "time_ms", report.fixed(1)),
               report.col("rel. error", "err", report.scientific(2)), report.col("tx (B)", "tx", report.integer)]
    rows = [{"method": "a", "time_ms": 101.9, "err": 1.7e-4, "tx": None},
            {"method": "b", "time_ms": 82.59, "err": 0.012, "tx": None}]
    lines = report.text_table(columns, rows).splitlines()
    assert lines[0].split("  ") == ["method", "time (ms)", "rel. error"]  # tx has no value in any row
    assert lines[1].split() == ["a", "101.9", "1.70e-04"]
    assert lines[2].split() == ["b", "82.6", "1.20e-02"]   # the same decimals all the way down


def test_text_table_right_aligns_number_columns_and_left_aligns_text():
    columns = [report.col("name", "name"), report.col("speed-up", "speedup", report.times(2)),
               report.col("x", "x", report.integer)]
    rows = [{"name": "long-name", "speedup": 1.5, "x": 3}, {"name": "a", "speedup": None, "x": 10}]
    assert report.text_table(columns, rows).splitlines() == ["name       speed-up   x",
                                                             "long-name     1.50x   3",
                                                             "a                 -  10"]


class _Log(io.StringIO):
    def isatty(self):
        return False


def test_progress_off_a_terminal_writes_a_line_every_interval_and_the_last(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    log = _Log()
    bar = toolkit.progress(100, "suite", stream=log, interval=5.0)
    for i in range(100):
        clock[0] += 0.5  # 50 s of steps: one line per 5 s at most
        bar.step(f"step {i}")
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("suite:") and "0/100" in lines[0]
    assert 100 // 10 <= len(lines) - 1 <= 100 // 10 + 1        # every 10th step, and the last
    assert "100/100" in lines[-1] and "step 99" in lines[-1]
    assert all("\r" not in line for line in lines)


def test_a_disabled_progress_bar_writes_nothing():
    log = _Log()
    bar = toolkit.progress(3, "suite", enabled=False, stream=log)
    for _ in range(3):
        bar.step("x")
    assert log.getvalue() == ""


def test_rounds_runs_every_method_once_per_repetition_marks_the_warm_up_and_counts_every_step(monkeypatch):
    log = _Log()
    monkeypatch.setattr(toolkit, "progress", lambda total, desc, enabled=True: toolkit.Bar(
        total=total, desc=desc, file=log, disable=not enabled))
    seen = list(toolkit.rounds(["a", "b", "c"], warmup=1, reps=2, desc="suite"))
    assert seen == [(it, name, it >= 1) for it, name, _ in toolkit.interleave(["a", "b", "c"], 1, 2)]
    assert [name for it, name, _ in seen if it == 1] == ["b", "c", "a"]  # the order rotates every repetition
    assert "9/9" in log.getvalue()


def test_grouped_bars_puts_each_series_side_by_side_in_one_group_per_label():
    _, fig, ax = report.subplots()
    positions = report.grouped_bars(ax, ["x", "y"], {"s1": [1.0, 2.0], "s2": [3.0, 4.0]}, "ms",
                                    errors={"s1": [0.1, 0.1], "s2": [0.2, 0.2]})
    assert positions == [pytest.approx([-0.2, 0.8]), pytest.approx([0.2, 1.2])]  # 0.8 wide groups, 0.4 a bar
    assert [t.get_text() for t in ax.get_xticklabels()] == ["x", "y"]
    assert [b.get_height() for b in ax.patches] == [1.0, 2.0, 3.0, 4.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["s1", "s2"]
    report.save_figure(fig, os.devnull)
