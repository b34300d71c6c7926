"""Tensors handed to collectives live on the process group's device (NCCL takes device tensors only).

No process group here: a ``Collectives`` that claims two ranks on a ``meta`` device stands in for NCCL
on a machine whose compute device is not the host. Its transport is stubbed; the device check is the
real one, so any engine path that hands it a host tensor raises ``CollectiveDeviceError``.
"""

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.comm.collectives import CollectiveDeviceError, Collectives
from lightning_chunk.engine.comm.group import shard_ranks
from lightning_chunk.engine.optim.scaler import DynamicLossScaler


class FakeDeviceComm(Collectives):
    """Two ranks whose collectives take ``meta`` tensors; every all-reduce returns zeros on the host."""

    def __init__(self) -> None:
        base = Collectives.local()
        self.__dict__.update(base.__dict__)
        self.world_size, self._tag_device = 2, torch.device("meta")
        self.seen: list[torch.device] = []

    def all_reduce(self, t, op="sum", *, what="all_reduce", shards=False):
        self._check_device(what, t)  # the real check
        self.seen.append(t.device)
        return torch.zeros(t.shape, dtype=t.dtype)


def test_the_device_check_names_the_tensor_device_and_the_group_device():
    comm = FakeDeviceComm()
    with pytest.raises(CollectiveDeviceError, match=r"the gradient norm was handed a tensor on cpu.*meta tensors"):
        comm._check_device("the gradient norm", torch.zeros(1))
    comm._check_device("fine", torch.zeros(1, device="meta"))


def trained_engine():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=128))
    with eng.micro_batch(training=True):
        loss = m(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    eng.prepare_step()  # the vote and the attachment happen here, on the real one-rank collectives
    return eng


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_norm_clipping_all_reduces_on_the_group_device(norm_type):
    """Before: the local norm went to the all-reduce as a CPU tensor, which NCCL rejects."""
    eng = trained_engine()
    comm = FakeDeviceComm()
    eng.manager.comm = comm
    eng.clip_grad_norm_(1.0, norm_type)
    assert comm.seen == [torch.device("meta")]


def test_the_fp16_overflow_vote_runs_on_the_group_device():
    eng = trained_engine()
    comm = FakeDeviceComm()
    DynamicLossScaler().unscale_and_check(eng.grads(), comm)
    assert comm.seen == [torch.device("meta")]


@pytest.mark.parametrize("size", [3, 1, "rack"])
def test_shard_groups_that_do_not_tile_the_ranks_are_refused(size):
    """[Note: replicas of the shard group]: the strategy resolves the size with ``shard_ranks`` before any group is
    made, so every rank raises the same error at set-up and none waits in ``new_group``."""
    with pytest.raises(ValueError, match=f"shard_size={size!r} is not allowed with 4 ranks; it must divide"):
        shard_ranks(size, 4, 2)
    assert shard_ranks("node", 4, 2) == 2 and shard_ranks(2, 4, 4) == 2
    assert shard_ranks(None, 4, 2) == shard_ranks(8, 4, 2) == shard_ranks("node", 4, 4) == 4  # every rank
