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
