"""CUDA checks: parity, the device limit on real device memory. Skipped cleanly without CUDA."""

import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy
from tests.models import fit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("placement", ["device", "host", "auto"])
def test_parity_on_cuda(placement):
    ref = fit("auto", steps=20, accelerator="gpu", gradient_clip_val=0.05)
    got = fit(ChunkOffloadStrategy(placement=placement, chunk_numel=4096), steps=20, accelerator="gpu",
              gradient_clip_val=0.05)
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(b.cpu(), a.cpu(), **TOL)


def test_model_state_larger_than_the_limit_trains_within_it():
    big = dict(dim=256, hidden=4096, depth=4)  # ~8.4M parameters: 134 MB of params + grads + Adam state
    ref = fit("auto", steps=4, accelerator="gpu", model_kwargs=big)
    n = sum(p.numel() for p in ref.parameters())
    limit = 48 * 2**20
    assert 16 * n > 2 * limit  # parameters, gradients and Adam state do not fit
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    strategy = ChunkOffloadStrategy(device_memory_limit=limit, chunk_numel=1 << 20)
    got = fit(strategy, steps=4, accelerator="gpu", model_kwargs=big)
    stats = strategy.memory_stats()
    peak = torch.cuda.max_memory_allocated() - base
    assert stats["device_chunk_bytes_peak"] <= limit and stats["evictions"] > 0
    # chunk memory stays under the limit; the rest is activations (traced) plus allocator slack
    assert peak <= limit + stats["nonmodel_peak_bytes"] * 1.5 + 16 * 2**20, (peak, stats)
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(b.cpu(), a.cpu(), **TOL)
