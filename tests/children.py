"""The environment of a child process a test starts: one that starts its own ranks through Lightning's launcher (as
a user runs a script with ``devices=2``), and the base of ``Ranks``' and ``Zygotes``' ranks (tests/faults/common.py),
which then set their rank variables and one thread each.

[Note: a child's thread count]
Lightning's launchers give each rank ``cores // ranks`` threads only where ``OMP_NUM_THREADS`` is unset
(``_set_num_threads_if_needed``), and a launcher run in this process sets it to every core ([Note: the thread count a
test leaves behind] in ``conftest.py``). A test that fits on one rank and then launches two (writing the start
weights, a checkpoint to resume, a reference) would hand ``OMP_NUM_THREADS=2`` to both ranks: four spinning threads on
two cores, where every wait on a collective costs a time slice. The two-rank parity launch took 239 s so against
159 s with each rank's one thread (2026-11-27; an accumulation case 9.8 s against 2.4). So the variable is dropped,
with the launch variables a parent's process group left behind, and the launcher decides as it does for a user.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading

DIST_VARS = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
)


def child_env() -> dict[str, str]:
    """``os.environ`` without a parent's launch variables and without ``OMP_NUM_THREADS`` ([Note: a child's thread
    count])."""
    return {k: v for k, v in os.environ.items() if k not in DIST_VARS and k != "OMP_NUM_THREADS"}


def run_with_peak(cmd: list[str], *, timeout: float, **kw) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``cmd`` to its end with its output captured as text: its result and its own peak resident set in bytes,
    raising ``subprocess.TimeoutExpired`` as ``subprocess.run`` does once it is killed at ``timeout``. The peak is
    ``wait4``'s for that child alone; ``getrusage(RUSAGE_CHILDREN)`` gives the largest of every child the test process
    ever waited for, so a test reading it passes or fails by what ran before it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, **kw)
        expired = threading.Event()
        timer = threading.Timer(timeout, lambda: (expired.set(), child.kill()))
        timer.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)
        finally:
            timer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if expired.is_set():
            raise subprocess.TimeoutExpired(cmd, timeout, out.read(), err.read())
        return subprocess.CompletedProcess(cmd, child.returncode, out.read(), err.read()), usage.ru_maxrss * 1024
