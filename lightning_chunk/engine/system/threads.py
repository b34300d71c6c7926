"""The engine's own threads (the host step's worker, a background save's writer) take their rank's cores and GPU.

[Note: the engine's own threads]
A new thread starts with torch's defaults, not its rank's. Its OpenMP regions (the one-pass kernel's, a large
``clone``) use every core of the machine, whatever ``torch.set_num_threads`` said on the thread that set it: eight
ranks of a node would each run a team as large as the node. And it starts on GPU 0, where a bare
``torch.cuda.synchronize()`` waits for GPU 0, not for this rank's copy, and pinned buffers, a synchronisation or an
unregistration make a CUDA context of their own (memory of GPU 0 that rank 0's limit never counted). So each such
thread enters its rank first: the thread count the training thread had when the thread's owner was made, and the
rank's GPU by index (a bare ``cuda`` is refused by ``set_device``; ``ChunkManager`` names its device by index).
"""

from __future__ import annotations

import torch


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the GPU current on this thread (the rank's, where the engine is
    built), so that the engine's own threads can be given it by index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def enter_rank(device: torch.device, threads: int) -> None:
    """Called first on an engine thread: ``threads`` for torch's intra-op pool, ``device`` current if a GPU."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
