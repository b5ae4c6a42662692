"""What every benchmark suite prints and writes: environment header, tables, JSON."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

import fastdist

Row = dict[str, Any]


# ---- cell formats: one per column, so a column never mixes 101.9 with 82.590 ----

def fixed(digits: int) -> Callable[[Any], str]:
    """A number with `digits` decimals."""
    return lambda v: f"{v:.{digits}f}"


def times(digits: int = 2) -> Callable[[Any], str]:
    """A ratio written as a factor: 1.38x."""
    return lambda v: f"{v:.{digits}f}x"


def percent(digits: int = 1, signed: bool = False) -> Callable[[Any], str]:
    """A fraction written as a percentage: 0.0123 -> 1.2 (the header carries the %)."""
    sign = "+" if signed else ""
    return lambda v: f"{100 * v:{sign}.{digits}f}"


def scaled(divisor: float, digits: int) -> Callable[[Any], str]:
    """A number divided by `divisor` (a unit change: bytes -> MiB), with `digits` decimals."""
    return lambda v: f"{v / divisor:.{digits}f}"


def scientific(digits: int = 2) -> Callable[[Any], str]:
    """A number in scientific notation, zero written as 0."""
    return lambda v: "0" if v == 0 else f"{v:.{digits}e}"


def integer(v: Any) -> str:
    """A count."""
    return str(int(v))


def text(v: Any) -> str:
    """Any value as it reads."""
    return str(v)


KIB, MIB = 2 ** 10, 2 ** 20


@dataclasses.dataclass(frozen=True)
class Column:
    """One table column: its header (with the unit), how a row gives its value, and the value's format.

    A value of None is written as ``-``; a column whose values are all None is left out (older recordings
    lack some fields).
    """

    header: str
    value: Callable[[Row], Any]
    fmt: Callable[[Any], str] = text
    numeric: bool = True


def col(header: str, key: str | Callable[[Row], Any], fmt: Callable[[Any], str] = text,
        numeric: bool | None = None) -> Column:
    """A column reading `key` from each row (a field name, or a function of the row)."""
    value = key if callable(key) else (lambda r, k=key: r.get(k))
    return Column(header, value, fmt, numeric if numeric is not None else fmt not in (text,))


def _cells(columns: Sequence[Column], rows: Iterable[Row]) -> tuple[list[Column], list[list[str]]]:
    values = [[c.value(r) for c in columns] for r in rows]
    keep = [i for i, c in enumerate(columns) if any(v[i] is not None for v in values)]
    return [columns[i] for i in keep], [["-" if v[i] is None else columns[i].fmt(v[i]) for i in keep] for v in values]


def markdown_table(columns: Sequence[Column], rows: Iterable[Row]) -> str:
    """A Markdown table: numbers right-aligned, text left-aligned."""
    kept, cells = _cells(columns, rows)
    rule = "|" + "|".join("---:" if c.numeric else "---" for c in kept) + "|"
    lines = ["| " + " | ".join(line) + " |" for line in [[c.header for c in kept]] + cells]
    return "\n".join([lines[0], rule] + lines[1:])


def text_table(columns: Sequence[Column], rows: Iterable[Row]) -> str:
    """The same table as `markdown_table`, as fixed-width text for the terminal (no trailing newline)."""
    kept, cells = _cells(columns, rows)
    lines = [[c.header for c in kept]] + cells
    widths = [max(len(line[i]) for line in lines) for i in range(len(kept))]
    return "\n".join("  ".join(v.rjust(w) if c.numeric else v.ljust(w) for v, w, c in zip(line, widths, kept)).rstrip()
                     for line in lines)


@dataclasses.dataclass(frozen=True)
class Part:
    """One named table of a suite's result: an optional caption, the columns and rows, optional notes under it.

    A suite prints its parts as text (`text_parts`); the docs show them as Markdown (fastdist.bench.results).
    """

    name: str
    columns: Sequence[Column]
    rows: Sequence[Row]
    caption: str = ""
    notes: Sequence[str] = ()

    @property
    def table(self) -> str:
        """The table in Markdown."""
        return markdown_table(self.columns, self.rows)

    def markdown(self) -> str:
        """Caption, table and notes (as a list) in Markdown."""
        out = [self.caption, self.table, "\n".join(f"- {n}" for n in self.notes)]
        return "\n\n".join(s for s in out if s)

    def text(self) -> str:
        """Caption and notes as '# ' lines around the text table."""
        return "\n".join([f"# {self.caption}"] * bool(self.caption) + [text_table(self.columns, self.rows)]
                         + [f"# {n}" for n in self.notes])


def text_parts(parts: Iterable[Part]) -> str:
    """A suite's tables as text, a blank line between two."""
    return "\n\n".join(p.text() for p in parts)


def yes_no(flag: Any) -> str:
    """A flag as 'yes' or 'no'."""
    return "yes" if flag else "no"


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the block (None or 0: left as it is), restored after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def environment(*, backend: str, device: str, ranks: int, network: str) -> dict:
    """The environment header of a run, as a dict (also stored in the JSON)."""
    return {
        "fastdist": fastdist.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": backend,
        "device": device,
        "ranks": ranks,
        "network": network,
        "cuda_kernels": fastdist.cuda_kernels_available(),
        "host_cpus": os.cpu_count(),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),  # other work on the host skews timings
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }


def launch_environment(launch: Any) -> dict:
    """The environment of a multi-rank run (a `fastdist.bench.launch.Launch`), printed as the header and returned
    for the JSON."""
    env = environment(backend=launch.backend, device="cuda" if launch.backend == "nccl" else "cpu",
                      ranks=launch.world, network=launch.network)
    print(format_environment(env))
    return env


def format_environment(env: dict) -> str:
    """The environment header as '# key value' lines."""
    keys = ["fastdist", "torch", "backend", "device", "ranks", "network", "cuda_kernels", "host_cpus", "load_average",
            "date"]
    return "\n".join(f"# {k:<13} {env[k]}" for k in keys if k in env)


def set_speedups(rows: list[dict], baseline: str, key: str = "speedup", time: str = "time_ms") -> None:
    """Sets each row's `key` to the baseline method's `time` over its own (None when no row is the baseline)."""
    base = next((r for r in rows if r["method"] == baseline), None)
    for r in rows:
        r[key] = base[time] / r[time] if base else None


def human_bytes(n: float) -> str:
    """A byte count with a binary unit: 1536 -> '1.5KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}B"


def subplots(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """(pyplot, figure, axes) from `plt.subplots(*args, **kwargs)` on matplotlib's file-only Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **kwargs)
    return plt, fig, axes


def grouped_bars(ax: Any, groups: Sequence[Any], series: Mapping[str | None, Sequence[float]], ylabel: str,
                 title: str = "", rotation: float = 0, errors: Mapping[str | None, Sequence[float]] | None = None,
                 **style: Any) -> list[list[float]]:
    """Bars of each series ({label: a value per group}) side by side in one group per entry of `groups`.

    Args:
        ax: The matplotlib axes.
        groups: The x tick labels, one per group.
        series: The bars; a legend is drawn when a label is not None.
        ylabel, title: The axes' labels.
        rotation: Of the tick labels, in degrees.
        errors: Per series, the error bars' half-lengths.
        style: Passed to every `ax.bar` (color, ...).

    Returns:
        Each series' bar positions, to draw on them.
    """
    width = 0.8 / max(len(series), 1)
    positions = []
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(values))]
        ax.bar(xs, values, width, label=label, **({"yerr": errors[label], "capsize": 2} if errors else {}), **style)
        positions.append(xs)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups], rotation=rotation, fontsize=8,
                  ha="right" if rotation else "center")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if any(label is not None for label in series):
        ax.legend(fontsize=8)
    return positions


def save_figure(fig: Any, path: str, title: str = "", dpi: int = 120) -> None:
    """Lays out `fig` under `title` (if any), writes it to `path` as PNG and frees it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_json(path: str, payload: dict) -> None:
    """Writes `payload` to `path` as JSON, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
