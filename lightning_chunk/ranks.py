"""What each rank's process is given at start: its process group's device, its barrier's device, its threads.

[Note: every rank's thread count]
The launcher starts the other ranks only where the cluster environment does not (the launcher checks), and in every
rank it gives torch its share of the cores (``cores // ranks`` threads) unless ``OMP_NUM_THREADS`` says otherwise. So
it is made in every rank, as DDPStrategy makes it, not only where it starts processes, as FSDPStrategy does: there a
rank the launcher started (its environment copied before the launcher set the variable in rank 0) kept torch's
default, every core: on two CPU ranks three threads on two cores where DDP's ranks had one each, and a slower fit.

torchrun sets ``OMP_NUM_THREADS=1`` in every rank it starts unless the variable is set already (it says so in a
warning), a default meant for ranks that only launch GPU kernels. Here the host Adam, the one-pass kernel and the
host-side gradient adds of every rank run on the host: an offloaded 13B on 8 ranks moves about 50 GB a step per rank
through host memory, several seconds on one core where ``cores // 8`` take a fraction. So where torchrun started the
rank (``TORCHELASTIC_RUN_ID`` is set) and the variable is torchrun's ``1``, the rank takes its share of the cores its
process may run on, ``cores // LOCAL_WORLD_SIZE``; ``LIGHTNING_CHUNK_NUM_THREADS`` sets the count outright (``1``
keeps torchrun's).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

THREADS = "LIGHTNING_CHUNK_NUM_THREADS"


def threads_for_rank(env: Mapping[str, str], cores: int) -> int | None:
    """The intra-op thread count this rank should take, or None to leave torch's as it is
    ([Note: every rank's thread count])."""
    if env.get(THREADS):
        try:
            n = int(env[THREADS])
        except ValueError:
            raise ValueError(f"{THREADS}={env[THREADS]!r} is not a whole number of threads") from None
        if n < 1:
            raise ValueError(f"{THREADS}={n} must be at least 1")
        return n
    if "TORCHELASTIC_RUN_ID" in env and env.get("OMP_NUM_THREADS") == "1":
        local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
        return max(1, cores // max(local, 1))
    return None


def cores_here() -> int:
    """The cores this process may run on (its affinity: a container's or a job's share), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def take_rank_threads() -> None:
    n = threads_for_rank(os.environ, cores_here())
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)


def process_group_device(root_device: torch.device) -> torch.device | None:
    """``init_process_group``'s ``device_id``: the rank's GPU, as DDPStrategy passes it. Without it torch guesses the
    GPU of the first NCCL collective as ``rank % local device count``: right for ranks numbered node by node, a hang or
    "duplicate GPU" error otherwise."""
    return root_device if root_device.type == "cuda" else None


def barrier_device_ids(root_device: torch.device, backend: str) -> list[int] | None:
    """``barrier``'s ``device_ids`` on NCCL (the same guess otherwise); other backends take none, as in DDPStrategy."""
    return [root_device.index or 0] if root_device.type == "cuda" and backend == "nccl" else None
