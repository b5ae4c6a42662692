"""Timers shared by the calibrations and the benchmark suites.

Single process: `time_fn` runs a function after a warm-up and keeps every sample (`Timing.median` is what the
callers report: the typical run, which a step shared with other work meets, rather than the hardware's best).
Several ranks: `together` starts the clock on every rank at once (after a barrier) and stops it when this rank's
device work is done; `time_ranks` repeats that, and by default keeps per repetition the slowest rank's time,
since a collective call lasts until its slowest rank is done. `all_max`/`all_sum` reduce a few numbers across
ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["Stopwatch", "Timing", "all_max", "all_sum", "sync", "time_fn", "time_ranks", "together"]


def sync(device: torch.device | str | None) -> None:
    """Waits for the work queued on `device` (a CUDA device); a no-op for the CPU or None."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce(values: Sequence[float], device: torch.device | str | None, op: dist.ReduceOp,
                group: dist.ProcessGroup | None) -> list[float]:
    if not values:
        return []
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_max(values: Sequence[float], device: torch.device | str | None = None,
            group: dist.ProcessGroup | None = None) -> list[float]:
    """The element-wise maximum of `values` over the ranks of `group` (every rank gets it). A collective.

    Args:
        values: The same number of floats on every rank (none: nothing is exchanged).
        device: Where the exchange tensor lives: the group's device (CUDA for NCCL), None for the CPU.
        group: The process group; None is the default group.
    """
    return _all_reduce(values, device, dist.ReduceOp.MAX, group)


def all_sum(values: Sequence[float], device: torch.device | str | None = None,
            group: dist.ProcessGroup | None = None) -> list[float]:
    """The element-wise sum of `values` over the ranks of `group`, as `all_max` does the maximum. A collective."""
    return _all_reduce(values, device, dist.ReduceOp.SUM, group)


@dataclasses.dataclass(frozen=True)
class Timing:
    """The kept samples of a timed function, in seconds, in the order they were taken."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median sample (seconds)."""
        return statistics.median(self.samples)


def time_fn(fn: Callable[[], object], reps: int = 5, warmup: int = 1,
            device: torch.device | str | None = None) -> Timing:
    """Times `fn` in this process: `warmup` untimed calls, then `reps` timed ones.

    Args:
        fn: What to time; called with no arguments.
        reps: Timed calls (>= 1).
        warmup: Untimed calls first (>= 0).
        device: A CUDA device to synchronize before the clock stops (None: the CPU, nothing to wait for).

    Returns:
        The `reps` samples.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"time_fn: needs reps >= 1 and warmup >= 0, got reps {reps}, warmup {warmup}")
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return Timing(tuple(samples))


@dataclasses.dataclass
class Stopwatch:
    """What `together` measured: this rank's seconds from the common start to its work being done."""

    seconds: float = 0.0


@contextlib.contextmanager
def together(device: torch.device | str | None = None,
             group: dist.ProcessGroup | None = None) -> Iterator[Stopwatch]:
    """Times the block on this rank, every rank of `group` starting the clock together. A collective.

    The queued device work is drained and the ranks meet in a barrier before the clock starts; the clock stops
    when the block's device work is done. The yielded Stopwatch holds the seconds once the block has left.
    """
    sync(device)
    dist.barrier(group=group)
    watch = Stopwatch()
    start = time.perf_counter()
    yield watch
    sync(device)
    watch.seconds = time.perf_counter() - start


def time_ranks(fn: Callable[[], object], reps: int = 5, warmup: int = 1, device: torch.device | str | None = None,
               group: dist.ProcessGroup | None = None, slowest: bool = True) -> Timing:
    """Times `fn` on every rank of `group`, each repetition started together (see `together`). A collective.

    Args:
        fn: What to time; called with no arguments on every rank.
        reps: Timed repetitions (>= 1).
        warmup: Untimed repetitions first (>= 0), each also started together.
        device: The group's device, synchronized around each repetition (None: the CPU).
        group: The process group; None is the default group.
        slowest: Keep the slowest rank's time per repetition (every rank gets the same samples); False keeps
            this rank's own, for a caller that reduces many figures across ranks at once.

    Returns:
        The `reps` samples.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"time_ranks: needs reps >= 1 and warmup >= 0, got reps {reps}, warmup {warmup}")
    samples = []
    for i in range(warmup + reps):
        with together(device, group) as watch:
            fn()
        if i >= warmup:
            samples.append(watch.seconds)
    return Timing(tuple(all_max(samples, device, group) if slowest else samples))
