"""What every benchmark suite shares: argument types for sizes, shapes and comma lists, the timers, progress, the
interleaved order of a suite's methods, and the check of their outputs against a reference across ranks.

The timers live in `fastdist.distributed.timing` (the library's calibrations use them too, without importing
the bench package) and are re-exported here. Each argument type raises `argparse.ArgumentTypeError` with the
offending text and the grammar it expected, so a bad flag ends in argparse's usage message, not a traceback.
"""
from __future__ import annotations

import argparse
import random
import re
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from decimal import Decimal
from typing import Any, TextIO

import torch
import torch.distributed as dist
import tqdm

from fastdist.distributed.timing import Stopwatch, Timing, all_max, all_sum, sync, time_fn, time_ranks, together

__all__ = ["SHAPE_GRAMMAR", "SIZE_GRAMMAR", "Bar", "Stopwatch", "Timing", "all_max", "all_sum", "at_least",
           "comma_list", "interleave", "parse_shape", "parse_size", "progress", "rank_device", "relative_error",
           "rounds", "shape_type", "sync", "time_fn", "time_interleaved", "time_ranks", "together", "up_to",
           "worst_errors"]

SIZE_GRAMMAR = ("a byte count such as 4096, 64K, 1.5M, 16MiB, 1GB or 2^20 (K/M/G/T are binary, "
                "an optional 'iB' or 'B' follows, case-insensitive)")
SHAPE_GRAMMAR = "positive integers joined by 'x' or ',', such as 8192x256 or 512,512,512"

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(?P<base>\d+)\s*\^\s*(?P<exp>\d+)"
                   r"|(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?:(?P<unit>[KMGT])I?)?B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parses a size such as '64K' into a whole number (bytes or elements, as the flag says).

    Args:
        text: A plain count ('4096'), a number with a binary unit ('64K', '1.5M', '16MiB', '1GB'), or a power
            ('2^20'). Case-insensitive; surrounding spaces are ignored.

    Returns:
        The size as an int (>= 0).

    Raises:
        argparse.ArgumentTypeError: `text` does not follow the grammar, or names a fraction of a byte.
    """
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected {SIZE_GRAMMAR}")
    if match["base"] is not None:
        return int(match["base"]) ** int(match["exp"])
    value = Decimal(match["number"]) * _UNITS[(match["unit"] or "").upper()]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"bad size {text!r}: {value} is not a whole number; expected {SIZE_GRAMMAR}")
    return int(value)


def parse_shape(text: str, ndim: int | None = None) -> tuple[int, ...]:
    """Parses a shape such as '8192x256' or '512,512,512' into a tuple of positive ints.

    Args:
        text: Positive integers joined by 'x' (or '*') or by ','.
        ndim: The number of dimensions required; None accepts any number >= 1.

    Returns:
        The shape as a tuple of ints, each >= 1.

    Raises:
        argparse.ArgumentTypeError: `text` is not such a list, has a dimension < 1, or has not `ndim` entries.
    """
    parts = [p.strip() for p in re.split(r"[x*,]", text.strip().lower())]
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: expected {SHAPE_GRAMMAR}")
    shape = tuple(int(p) for p in parts)
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: every dimension must be >= 1")
    if ndim is not None and len(shape) != ndim:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: expected {ndim} dimensions, got {len(shape)}")
    return shape


def shape_type(ndim: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse `type` that parses a shape of exactly `ndim` dimensions (see `parse_shape`)."""

    def shape(text: str) -> tuple[int, ...]:
        return parse_shape(text, ndim)

    shape.__name__ = f"shape{ndim}d"
    return shape


def _checked(kind: Callable[[str], Any], ok: Callable[[Any], bool], name: str, fails: str) -> Callable[[str], Any]:
    """An argparse `type`: `kind(text)`, which `ok` must accept; else an error saying `text` `fails`."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} {fails}")
        return value

    parse.__name__ = f"{kind.__name__} {name}"
    return parse


def at_least(low: float, kind: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """An argparse `type`: `kind(text)`, which must be >= `low` (e.g. repetitions >= 1)."""
    return _checked(kind, lambda v: v >= low, f">= {low}", f"is below {low}")


def up_to(high: float, kind: Callable[[str], Any] = float) -> Callable[[str], Any]:
    """An argparse `type`: `kind(text)`, which must lie in (0, `high`] (a fraction, a percentage)."""
    return _checked(kind, lambda v: 0 < v <= high, f"in (0, {high}]", f"is not in (0, {high}]")


def network(text: str) -> str:
    """An argparse `type` for --net: 'loopback' or a link rate netsim can shape ('1gbit', '100mbit', ...)."""
    if text == "loopback":
        return text
    from fastdist import netsim  # netsim is only needed when a suite takes a network
    try:
        netsim.parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad network {text!r}: 'loopback' or a link rate ({e})") from None
    return text


def delay(text: str) -> str:
    """An argparse `type` for --delay: a one-way latency netsim can add ('50us', '1ms', '0.2s')."""
    from fastdist import netsim
    try:
        netsim.parse_delay(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def comma_list(item_type: Callable[[str], Any] = str,
               choices: Collection[Any] | None = None) -> Callable[[str], list[Any]]:
    """An argparse `type` for a comma-separated list: 'a,b,c' -> [item_type('a'), ...].

    Empty items (a trailing comma, spaces) are dropped; an empty list is an error.

    Args:
        item_type: Converts one stripped item; a ValueError or ArgumentTypeError from it names the item.
        choices: When given, every converted item must be one of these.

    Returns:
        A function from the flag's text to the list of converted items, in the order given.
    """

    def parse(text: str) -> list[Any]:
        items = []
        for raw in (p.strip() for p in text.split(",")):
            if not raw:
                continue
            try:
                item = item_type(raw)
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise argparse.ArgumentTypeError(f"bad item {raw!r} in {text!r}: {e}") from None
            if choices is not None and item not in choices:
                allowed = ", ".join(str(c) for c in choices)
                raise argparse.ArgumentTypeError(f"unknown item {raw!r} in {text!r}; choose from {allowed}")
            items.append(item)
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r}: give at least one comma-separated item")
        return items

    parse.__name__ = "comma_list"
    return parse


class Bar(tqdm.tqdm):
    """A tqdm bar that a suite advances one step at a time, with a note on what the step was."""

    monitor_interval = 0  # no monitor thread: steps come from the suite's own loop

    def step(self, note: str = "") -> None:
        """Counts one step done; `note` (shortened to a line) says which. The last step closes the bar."""
        self.set_postfix_str(note[:120], refresh=False)
        self.update()
        if self.total is not None and self.n >= self.total:
            self.close()


class _Lines:
    """A stream that is not a terminal, as tqdm sees it: each redraw (tqdm starts it with a carriage return)
    becomes one line, and a redraw identical to the line before is dropped."""

    def __init__(self, stream: TextIO):
        self.stream, self.last = stream, None

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line and line != self.last:
            self.stream.write(line + "\n")
            self.last = line

    def flush(self) -> None:
        self.stream.flush()


def progress(total: int, desc: str, *, enabled: bool = True, stream: TextIO | None = None,
             interval: float = 5.0) -> Bar:
    """A progress bar on stderr for `total` steps (results go to stdout, so the two never mix).

    On a terminal the bar is redrawn in place. Otherwise (a log, a pipe) it writes its first line, then at most
    one line every `interval` seconds, and the last.

    Args:
        total: Steps expected.
        desc: What runs, shown first on the line (the suite's name).
        enabled: False gives a silent bar, e.g. on every rank but the one that prints.
        stream: Where to draw; stderr by default.
        interval: Seconds between lines when `stream` is not a terminal.

    Returns:
        The bar; call `step(note)` after each step.
    """
    stream = stream or sys.stderr
    tty = stream.isatty()
    return Bar(total=total, desc=desc, file=stream if tty else _Lines(stream), mininterval=0.1 if tty else interval,
               miniters=1, dynamic_ncols=tty, disable=not enabled)


def rank_device() -> torch.device:
    """This rank's device in the default process group: its current CUDA device under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def interleave(names: Sequence[Any], warmup: int, reps: int, shuffle: bool = False) -> Iterator[tuple[int, Any, str]]:
    """The order in which a suite runs its methods: every name once per repetition, the order rotated each time
    (no method always runs first or after the same one), `warmup` untimed repetitions first.

    Args:
        shuffle: A fresh order every repetition instead (seeded by it: the same on every rank), where a method's
            time depends a little on what ran before it: a rotation gives it the same predecessor every time.

    Yields:
        (repetition, name, phase): phase is "warm-up" or "rep N" (N from 1), for the progress note.
    """
    names = list(names)
    for it in range(warmup + reps):
        shift = it % len(names)
        order = random.Random(it).sample(names, len(names)) if shuffle else names[shift:] + names[:shift]
        for name in order:
            yield it, name, "warm-up" if it < warmup else f"rep {it - warmup + 1}"


def rounds(names: Sequence[Any], warmup: int, reps: int, desc: str, *, enabled: bool = True,
           shuffle: bool = False, bar: Bar | None = None) -> Iterator[tuple[int, Any, bool]]:
    """`interleave` with a progress bar over the whole run, for a suite's loop over its methods.

    Args:
        desc: The bar's description, and the start of each step's note when `bar` is given.
        bar: A bar of the caller's that these rounds advance (one bar over several loops); by default a new one.

    Yields:
        (repetition, name, timed): timed is False for the warm-up repetitions. The bar counts the step (noting
        its phase and name) when the loop's body is done with it.
    """
    prefix = f"{desc} " if bar is not None else ""
    bar = bar or progress((warmup + reps) * len(names), desc, enabled=enabled)
    for it, name, phase in interleave(names, warmup, reps, shuffle):
        yield it, name, it >= warmup
        bar.step(f"{prefix}{phase} {name}")


def time_interleaved(calls: dict[str, Callable[[], object]], warmup: int, reps: int, desc: str, *,
                     shuffle: bool = False, device: torch.device | str | None = None,
                     slowest_rank: bool = True) -> dict[str, list[float]]:
    """{name: the slowest rank's seconds per timed repetition} of `calls` (name -> callable) run by `rounds`, every
    rank starting each call together; the bar is drawn on rank 0. A collective.

    Args:
        shuffle: As for `interleave`.
        device: Where the calls run (CUDA is synchronized around each).
        slowest_rank: False: this rank's own seconds (for ranks that run different work, e.g. pipeline stages).
    """
    samples: dict[str, list[float]] = {n: [] for n in calls}
    for _, name, timed in rounds(list(calls), warmup, reps, desc, enabled=dist.get_rank() == 0, shuffle=shuffle):
        with together(device) as watch:
            calls[name]()
        if timed:
            samples[name].append(watch.seconds)
    if not slowest_rank:
        return samples
    slowest = all_max([t for n in calls for t in samples[n]], device)  # a step lasts until its slowest rank is done
    return {n: slowest[i * reps:(i + 1) * reps] for i, n in enumerate(calls)}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|."""
    return float((got.detach() - want.detach()).abs().max() / want.detach().abs().max().clamp_min(1e-30))


def worst_errors(errors: dict[str, float], tolerance: float, what: str,
                 device: torch.device | str | None = None) -> dict[str, float]:
    """{name: the largest of the ranks' errors}; raises RuntimeError on every rank, naming `what` and the
    variants, when one exceeds `tolerance` (or is NaN). A collective."""
    errors = dict(zip(errors, all_max(list(errors.values()), device)))
    bad = {n: e for n, e in errors.items() if not e <= tolerance}
    if bad:
        raise RuntimeError(f"fastdist-bench: {what} by more than {tolerance:g} (relative): "
                           + ", ".join(f"{n} {e:.2e}" for n, e in bad.items()))
    return errors
