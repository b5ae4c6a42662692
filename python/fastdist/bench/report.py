"""What every benchmark suite prints and writes: environment header, tables, progress, JSON."""
import contextlib
import datetime
import json
import os
import platform
import sys
import time

import torch

import fastdist


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op thread count set to `n` inside the block (None or 0: left as it is), restored after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def environment(*, backend, device, ranks, network):
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


def format_environment(env):
    keys = ["fastdist", "torch", "backend", "device", "ranks", "network", "cuda_kernels", "host_cpus", "date"]
    return "\n".join(f"# {k:<13} {env[k]}" for k in keys if k in env)


def format_table(headers, rows, align=None):
    """Fixed-width text table; numbers right-aligned, text left-aligned (or per `align` 'l'/'r')."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if align is None:
        align = ["r" if rows and isinstance(rows[0][i], (int, float)) else "l" for i in range(len(headers))]

    def line(values):
        return "  ".join(v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def _cell(v):
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 0.01:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}B"


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total, desc, stream=None):
        self.total, self.desc, self.done = max(int(total), 1), desc, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.monotonic()

    def step(self, what=""):
        self.done += 1
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        frac = self.done / self.total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        msg = f"{self.desc} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {what}"
        if self.tty:
            self.stream.write("\r" + msg[:160].ljust(160) + ("\n" if self.done >= self.total else ""))
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()


def write_json(path, payload):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
