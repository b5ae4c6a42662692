"""Programs the spawn tests run as processes of their own (a parent that is killed, a script without the
`__main__` guard), and the rank functions they spawn.

Run as ``python spawn_programs.py MODE``: MODE ``sleep`` spawns 2 ranks that sleep a minute; ``netsim`` does the
same on a 2-host simulated cluster and first prints the cluster's tag as a JSON line.
"""
import json
import os
import sys
import time

from fastdist.distributed import spawn


def sleep_then_return_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def main(mode: str) -> None:
    if mode == "sleep":
        spawn(sleep_then_return_pid, 2, 60.0, timeout=300)
    elif mode == "netsim":
        from fastdist import netsim
        with netsim.Cluster(2) as cluster:
            print(json.dumps(cluster.tag), flush=True)
            spawn(sleep_then_return_pid, 2, 60.0, cluster=cluster, timeout=300)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])
