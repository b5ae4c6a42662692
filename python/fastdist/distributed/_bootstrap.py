"""The first code each rank of `fastdist.distributed.spawn` runs.

spawn runs this file as a script, by its path, so that it runs before anything slow: neither fastdist nor torch
nor the caller's main module is imported yet. It ties the rank's life to its parent's (a parent killed with SIGKILL
takes its ranks along, even while they are still importing torch), then loads the job the parent wrote, and reports
a failure to load it to the parent instead of dying with a traceback on stderr only.

Arguments: the parent's pid, the job file, the rank, the file descriptor to report through, the file faulthandler
writes the rank's Python stacks to.
"""
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Has the kernel SIGKILL this process when its parent dies, and exits now if the parent is already gone.

    Args:
        parent_pid: the pid of the process that started this one.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl (not Linux): only the check below and the rank's own one remain
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: this process was re-parented
        os._exit(1)


def main() -> None:
    parent_pid, job_path, rank, report_fd, stack_path = sys.argv[1:6]
    die_with_parent(int(parent_pid))
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this script's folder: its modules must not shadow top-level ones
    # Python stacks on SIGUSR1 (spawn's timeout report) and on a crash, from here on, loading included.
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)
    from multiprocessing import connection, current_process
    from multiprocessing import spawn as mp_spawn
    os.set_inheritable(int(report_fd), False)  # a process the rank starts must not keep its report channel open
    conn = connection.Connection(int(report_fd), readable=False)
    # Marks this process as starting, as multiprocessing does in its children: a spawn (or a multiprocessing
    # start) reached while the main module is re-imported raises instead of starting ranks of its own.
    current_process()._inheriting = True
    try:
        with open(job_path, "rb") as f:
            mp_spawn.prepare(pickle.load(f))  # sys.path, the working directory, the main module as __mp_main__
            target, job = pickle.load(f)       # imports fn's module, fastdist and torch
    except BaseException:  # noqa: BLE001 - whatever stopped the start, the parent says it
        conn.send_bytes(pickle.dumps(("start-error", traceback.format_exc(), time.time())))
        os._exit(1)
    del current_process()._inheriting
    target(job, int(rank), int(parent_pid), conn)


if __name__ == "__main__":
    main()
