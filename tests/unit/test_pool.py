import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.system import torch_features
from lightning_chunk.engine.tiers.pool import BlockPool
from tests.engine_steps import step, train_beside_torch
from tests.features import needs_swap


@needs_swap
def test_a_released_storage_keeps_its_views_and_gets_a_kept_block_back():
    pool = BlockPool(torch.device("cpu"))
    payload = torch.arange(8.0)
    view = payload[2:4]
    storage = payload.untyped_storage()
    pool.empty(storage)
    assert storage.nbytes() == 0 and pool.pooled_bytes == 32
    other = torch.empty(0)
    pool.fill(other.untyped_storage(), 32)  # the kept block, not a new one
    assert pool.stats()["pool_reused"] == 1 and pool.pooled_bytes == 0
    pool.empty(other.untyped_storage())
    pool.fill(storage, 32)
    payload.fill_(3.0)
    assert view.tolist() == [3.0, 3.0]  # the view sees the storage's new memory
    pool.fill(torch.empty(0).untyped_storage(), 16)  # another size: from the allocator
    assert pool.stats()["pool_allocated"] == 1 and pool.stats()["pool_reused"] == 2
    t = pool.tensor(5, torch.bfloat16)
    assert t.shape == (5,) and t.dtype == torch.bfloat16 and t.untyped_storage().nbytes() == 10
    pool.empty(t.untyped_storage())
    pool.clear()
    assert pool.pooled_bytes == 0 and pool.tensor(5, torch.bfloat16).numel() == 5


def test_the_pool_does_nothing_off_the_host():
    assert not BlockPool(torch.device("meta")).enabled


def _train(pool_on: bool, monkeypatch) -> tuple[dict, dict, dict]:
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", pool_on and torch_features.SWAP_STORAGES)
    torch.manual_seed(0)

    def make():
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    m, ref = make(), make()
    eng, _ = train_beside_torch(m, ref, ChunkConfig(placement="host", chunk_numel=300, check_invariants=True))
    stats = eng.manager.stats()
    stats["payload_bytes"] = sum(c.payload_bytes for c in eng.manager.chunks)
    return eng.full_state_dict(), ref.state_dict(), stats


@needs_swap
def test_host_payloads_come_from_the_pool_and_training_is_unchanged(monkeypatch):
    got, ref, stats = _train(True, monkeypatch)
    without, _, stats_without = _train(False, monkeypatch)
    assert stats_without["pool_reused"] == 0
    assert stats["pool_reused"] > stats["pool_allocated"] > 0  # gathers after the first reuse released blocks
    # a kept block is a payload released earlier, and a gather takes one back before asking the allocator: per
    # block size, the pool holds at most the most payloads of that size ever alive at once (here: each chunk once)
    assert 0 < stats["pool_bytes_peak"] <= stats["payload_bytes"]
    for k, v in ref.items():
        torch.testing.assert_close(got[k], without[k], rtol=0, atol=0)  # the pool changes no bit
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)  # and trains as torch does


def _kept_under_a_limit(monkeypatch, bounded: bool) -> list[int]:
    """Bytes over the limit at each forward moment after the warm-up: the device's chunks, the pool's blocks and the
    traced activations of host placement keeping payloads for backward (empty list: never over)."""
    from lightning_chunk.engine.chunks.chunk import Tier
    from lightning_chunk.engine.schedule.placement import PlacementPolicy, activation_room

    if not bounded:
        monkeypatch.setattr(PlacementPolicy, "pool_room", lambda *a: None)
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    # 8 chunks of 16,640 bytes: three payloads and a little beside the activations at forward's end (with the
    # prefetch reaching a chunk further ahead, [Note: how far ahead to gather], 60,000 left the pool nothing to keep)
    limit = 50_000
    eng = ChunkEngine(
        m,
        [opt],
        config=ChunkConfig(
            placement="host",
            chunk_numel=4160,
            device_memory_limit=limit,
            reshard_after_forward=False,
            check_invariants=True,
        ),
    )
    over: list[int] = []

    def check(*_):
        hooks, mgr = eng.hooks, eng.manager
        if hooks.moments.trace is not None and mgr.pool.pooled_bytes:
            # what the limit leaves beside the chunks and the activations of this moment and the next (the chunks
            # themselves may take more: a payload that releasing after use keeps is never evicted for activations)
            room = max(activation_room(limit, hooks.moments.trace, hooks.moments.position) - mgr.ledger[Tier.DEVICE], 0)
            if mgr.pool.pooled_bytes > room:
                over.append(mgr.pool.pooled_bytes - room)

    for layer in m:
        layer.register_forward_pre_hook(check)  # after the engine's: sees what its plan left
    for i in range(4):
        step(eng, m, opt, torch.randn(8, 64, generator=torch.Generator().manual_seed(i)))
    assert eng.manager.stats()["pool_bytes_peak"] > 0
    return over


@needs_swap
def test_under_a_limit_the_pool_keeps_only_what_the_limit_leaves_beside_chunks_and_activations(monkeypatch):
    """[Note: the pool under a limit]: released blocks kept for reuse are device memory too. Unbounded, the pool held
    the step's payload peak (reached in backward) through the next forward, beside the activations growing there."""
    assert _kept_under_a_limit(monkeypatch, bounded=True) == []
    assert _kept_under_a_limit(monkeypatch, bounded=False)  # the case is one that needs the bound


# In a child, whose heap has no free block of 64 MiB to serve it (a long-lived process's may: no faults either way)
CHILD = r"""
import json, resource, sys
sys.path.insert(0, ROOT)
import torch
from lightning_chunk.engine.system import torch_features
from lightning_chunk.engine.tiers.pool import BlockPool

torch_features.SWAP_STORAGES = False
n = 64 << 20

def refill(pool):
    t = torch.empty(n, dtype=torch.uint8)
    t.fill_(1)
    storage = t.untyped_storage()
    pool.empty(storage)
    if storage.nbytes() == 0:
        pool.fill(storage, n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(2)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(json.dumps({"kept": refill(BlockPool(torch.device("cpu"), lazy=True)), "given": refill(BlockPool("cpu"))}))
"""


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_FREE")
def test_without_swaps_an_emptied_pageable_storage_kept_lazily_faults_nothing_when_written_again():
    """[Note: gradient buffers the kernel may take]: writing it again faults nothing while the host has memory to
    spare; given back to the allocator (its own mapping), every refill faulted its pages in again."""
    code = CHILD.replace("ROOT", repr(str(Path(__file__).resolve().parents[2])))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    faults = json.loads(r.stdout.strip().splitlines()[-1])
    assert faults["given"] > 0 and faults["kept"] * 4 < faults["given"], faults  # small pages: 16,384 against a few


def test_without_swaps_a_lazy_pool_keeps_a_pageable_storage_s_bytes(monkeypatch):
    """Emptied without swaps, a pageable storage keeps its bytes, where its views point, its pages advised free."""
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", False)
    pool = BlockPool(torch.device("cpu"), lazy=True)
    t = torch.ones(1 << 20)
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    pool.empty(storage)
    assert pool.lazy and pool.kept_lazily == 1 and storage.nbytes() == 4 << 20 and storage.data_ptr() == ptr
    t.fill_(3.0)
    assert bool((t == 3.0).all())


def test_a_lazy_pool_advises_only_host_memory_it_cannot_keep_itself(monkeypatch):
    """With swaps the pool keeps blocks itself; off the host there is nothing to advise; a storage without a whole
    page goes to its allocator as before."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", True)
    assert not BlockPool(cpu, lazy=True).lazy
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", False)
    assert not BlockPool(torch.device("meta"), lazy=True).lazy and not BlockPool(cpu).lazy
    pool = BlockPool(cpu, lazy=True)
    small = torch.empty(100, dtype=torch.uint8).untyped_storage()
    pool.empty(small)
    assert pool.kept_lazily == 0 and small.nbytes() == 0


def test_the_gradient_pool_keeps_nothing_lazily_under_a_host_memory_limit(monkeypatch):
    """The advised pages count in the resident set until the kernel takes them, which ``host_memory_limit`` bounds:
    there the buffers go to their allocator as before."""
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", False)

    def lazy(**limit) -> bool:
        m = nn.Linear(8, 8)
        eng = ChunkEngine(m, [torch.optim.Adam(m.parameters())], config=ChunkConfig(placement="host", **limit))
        return eng.manager.grads.host_pool.lazy

    assert lazy() and not lazy(host_memory_limit="1GiB")
