"""[Note: buffers as DDP syncs them]: which forwards broadcast rank 0's buffers, DDP's rule, and the broadcast
itself (one per dtype, values from rank 0). The 2-rank run against DDP is in tests/distributed."""

from __future__ import annotations

import contextlib

import torch

from lightning_chunk.engine.comm.buffers import BufferSync


class FakeComm:
    """Two ranks seen from rank 1: ``broadcast`` returns rank 0's values (twice this rank's)."""

    world_size = all_size = 2

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def broadcast(self, t: torch.Tensor, *, what: str) -> torch.Tensor:
        self.sizes.append(t.numel())
        return t * 2


def test_forwards_that_broadcast_follow_ddp():
    module = torch.nn.BatchNorm1d(3)
    comm = FakeComm()
    sync = BufferSync(module, comm)
    sync.enabled = True
    synced = []
    # (grad enabled, accumulating): a micro-batch that steps, two accumulating ones, evaluation twice, training
    for grad, accumulating in [
        (True, False),
        (True, True),
        (True, True),
        (True, False),
        (False, False),
        (False, False),
        (True, False),
        (True, False),
    ]:
        before = len(comm.sizes)
        with contextlib.nullcontext() if grad else torch.no_grad():
            sync.before_forward(accumulating=accumulating)
        synced.append(len(comm.sizes) > before)
    # the first forward syncs; a forward after an accumulating one or an evaluation one does not
    assert synced == [True, True, False, False, True, False, False, True]


def test_broadcast_is_one_collective_a_dtype_and_writes_rank_0_s_values():
    module = torch.nn.BatchNorm1d(3)
    module.running_mean.fill_(1.5)
    comm = FakeComm()
    BufferSync(module, comm).broadcast()
    assert sorted(comm.sizes) == [1, 6]  # num_batches_tracked (int64); running_mean and running_var (float32)
    assert module.running_mean.tolist() == [3.0] * 3 and module.running_var.tolist() == [2.0] * 3


def test_nothing_is_broadcast_when_disabled():
    comm = FakeComm()
    sync = BufferSync(torch.nn.BatchNorm1d(3), comm)
    sync.before_forward(accumulating=False)
    assert comm.sizes == []
