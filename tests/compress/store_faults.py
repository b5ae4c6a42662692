"""Store faults that used to kill the process (SIGBUS), run in a child process so that a crash fails the test instead
of taking pytest with it. The child prints what it raised as one JSON line.

`python store_faults.py CASE DIRECTORY`; :func:`run` starts it, optionally inside a tiny tmpfs (a private mount
namespace, so nothing is mounted where other processes can see it).
"""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

TINY_FS_BYTES = 64 << 10


def _mmap_store_on_a_full_disk(directory):
    from fastdist.compress import MmapStore
    store = MmapStore(os.path.join(directory, "m.bin"), capacity=64)
    store.put(torch.arange(64), torch.ones(64, 1024))  # 256 KiB of entries on a 64 KiB file system


def _mmap_store_truncated_while_open(directory, prefetch=False):
    from fastdist.compress import MmapStore
    path = os.path.join(directory, "m.bin")
    store = MmapStore(path, capacity=8)
    ids = torch.arange(4)
    store.put(ids, torch.ones(4, 1024))
    os.truncate(path, 4096)  # another process cuts the file down to its header
    if prefetch:
        store.prefetch(ids)
    store.get(ids)


def _file_store_on_a_full_disk(directory):
    from fastdist.memory.store import FileStore
    store = FileStore(directory)
    slot, copy = store.write(torch.ones(1 << 16).untyped_storage(), lambda copy: None)  # 256 KiB
    copy.wait()


CASES = {
    "mmap-full-disk": _mmap_store_on_a_full_disk,
    "mmap-truncated": _mmap_store_truncated_while_open,
    "mmap-truncated-prefetch": lambda directory: _mmap_store_truncated_while_open(directory, prefetch=True),
    "file-store-full-disk": _file_store_on_a_full_disk,
}


def run_on_a_full_disk(case: str, directory: str) -> dict:
    """:func:`run` on a tiny tmpfs; skips the test where none can be mounted (no user or mount namespaces)."""
    try:
        probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True,
                               text=True, check=False)
    except FileNotFoundError:
        pytest.skip("a tiny file system needs unshare (util-linux)")
    if probe.returncode != 0:
        pytest.skip(f"a tiny file system needs user and mount namespaces: {probe.stderr.strip()}")
    return run(case, directory, tiny_fs=True)


def run(case: str, directory: str, tiny_fs: bool = False) -> dict:
    """Runs `case` in a child process on `directory` (mounted as a 64 KiB tmpfs first when `tiny_fs`).

    Returns:
        {"returncode": ..., "raised": exception type name or None, "message": ..., "signal": name or None}.
    """
    child = [sys.executable, os.path.abspath(__file__), case, directory]
    if tiny_fs:
        script = f'mount -t tmpfs -o size={TINY_FS_BYTES} none "$1" && shift && exec "$@"'
        child = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", directory, *child]
    proc = subprocess.run(child, capture_output=True, text=True, timeout=120, check=False)
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"raised": None, "message": None}
    report["returncode"] = proc.returncode
    report["signal"] = signal.Signals(-proc.returncode).name if proc.returncode < 0 else None
    report["stderr"] = proc.stderr[-2000:]
    return report


if __name__ == "__main__":
    name, where = sys.argv[1], sys.argv[2]
    try:
        CASES[name](where)
    except Exception as e:  # the report names what was raised; the test decides whether it is right
        print(json.dumps({"raised": type(e).__name__, "message": str(e),
                          "is_oserror": isinstance(e, OSError)}))
    else:
        print(json.dumps({"raised": None, "message": None}))
