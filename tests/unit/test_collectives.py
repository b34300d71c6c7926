"""Tensors handed to collectives live on the process group's device (NCCL takes device tensors only).

No process group here: a ``Collectives`` that claims two ranks on a ``meta`` device stands in for NCCL
on a machine whose compute device is not the host. Its transport is stubbed; the device check is the
real one, so any engine path that hands it a host tensor raises ``CollectiveDeviceError``.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.comm.collectives import CollectiveDeviceError, Collectives
from lightning_chunk.engine.comm.group import shard_ranks
from lightning_chunk.engine.comm.replicas import ReplicaSums, spare_slice
from lightning_chunk.engine.errors import ChunkError
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


def test_replicas_sum_a_shard_once_a_step_with_what_their_group_accumulated():
    """[Note: replicas summed once a step], with two replicas whose all-reduce doubles: a micro-batch that does not
    step lands its shard unsummed and owes it; the next adds the owed accumulation into what it lands first, so the
    one all-reduce covers both, and its sum replaces the shard. A step with a shard still owed is refused."""
    summed = []
    comm = SimpleNamespace(replicas=object(), all_rank=3, replicate=lambda t, chunk: summed.append(chunk) or t.mul_(2))
    sums = ReplicaSums(SimpleNamespace(comm=comm))
    chunk = SimpleNamespace(chunk_id=5, shard_range=(4, 8), capacity_numel=8, grad_payload=torch.zeros(8))
    sums.defer = True
    out, shard = torch.full((4,), 1.0), torch.full((4,), 3.0)
    assert sums.land(chunk, out, shard, add=True) and sums.owed == {5} and summed == []
    with pytest.raises(ChunkError, match=r"\[rank 3\] .* chunks \[5\] summed within this rank's shard group only"):
        sums.refuse_owed()
    sums.defer = False
    assert not sums.land(chunk, out, shard, add=True)  # out replaces the shard
    assert out.tolist() == [8.0] * 4 and sums.owed == set() and summed == [5]
    sums.refuse_owed()
    out = torch.full((4,), 1.0)
    assert sums.land(chunk, out, shard, add=True) and out.tolist() == [2.0] * 4  # not owed: summed, then added
    assert ReplicaSums(SimpleNamespace(comm=SimpleNamespace(replicas=None))).land(chunk, out, shard, add=True)
    assert spare_slice(4, 8, 8) == slice(0, 4) and spare_slice(0, 4, 8) == slice(4, 8)
