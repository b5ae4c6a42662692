"""What every benchmark suite prints and writes: environment header, tables, JSON."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

import fastdist


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
    keys = ["fastdist", "torch", "backend", "device", "ranks", "network", "cuda_kernels", "host_cpus", "date"]
    return "\n".join(f"# {k:<13} {env[k]}" for k in keys if k in env)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], formats: Mapping[str, str] | None = None,
                 align: Sequence[str] | None = None) -> str:
    """A fixed-width text table in which every column has one number format.

    Args:
        headers: Column titles; a column of numbers names its unit in its title ("time(ms)").
        rows: Cells: numbers, or text (pre-formatted numbers, "-" for none).
        formats: Format specs by header ("time(us)": ".1f"). A float column without one gets one spec for all of
            its cells from its smallest non-zero magnitude (`column_format`); ints print whole.
        align: 'l' or 'r' per column; by default a column of numbers (or of text that starts like one: "1.20x",
            "+3%"; "-" for none) is right-aligned, any other left.

    Returns:
        The table, header first, without a trailing newline.
    """
    formats = dict(formats or {})
    unknown = sorted(set(formats) - set(headers))
    if unknown:
        raise ValueError(f"format_table: formats for unknown columns {unknown}; the columns are {list(headers)}")
    columns = list(zip(*rows)) if rows else [() for _ in headers]
    specs = [formats.get(h) or column_format(col) for h, col in zip(headers, columns)]
    cells = [[_cell(v, spec) for v, spec in zip(row, specs)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if align is None:
        align = ["r" if all(_is_number(v) or _NUMBER_LIKE.match(str(v)) for v in col if v not in ("-", "")) else "l"
                 for col in columns]

    def line(values):
        return "  ".join(v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def column_format(values: Sequence[Any]) -> str:
    """One format spec for a column's floats: three significant digits on its smallest non-zero magnitude (at
    most three decimals), scientific when that is below 0.001; "" (plain str) for a column without floats."""
    magnitudes = [abs(v) for v in values if isinstance(v, float) and math.isfinite(v) and v != 0]
    if not magnitudes:
        return ".1f" if any(isinstance(v, float) for v in values) else ""
    smallest = min(magnitudes)
    if smallest < 1e-3:
        return ".2e"
    return f".{min(3, max(0, 2 - math.floor(math.log10(smallest))))}f"


_NUMBER_LIKE = re.compile(r"[-+]?\.?\d")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v: Any, spec: str) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else format(v, spec or "g")
    if _is_number(v) and spec and not spec.endswith(("d", "s")):
        return format(v, spec)
    return str(v)


def set_speedups(rows: list[dict], baseline: str, key: str = "speedup", time: str = "time_ms") -> None:
    """Sets each row's `key` to the baseline method's `time` over its own (None when no row is the baseline)."""
    base = next((r for r in rows if r["method"] == baseline), None)
    for r in rows:
        r[key] = base[time] / r[time] if base else None


def times_text(x: float | None) -> str:
    """A ratio as '1.25x'; '-' for None."""
    return "-" if x is None else f"{x:.2f}x"


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


def save_figure(fig: Any, path: str, dpi: int = 120) -> None:
    """Lays out `fig`, writes it to `path` as PNG and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_json(path: str, payload: dict) -> None:
    """Writes `payload` to `path` as JSON, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
