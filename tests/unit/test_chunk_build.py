"""Building a chunk (``chunks/build.py``): where its values and its compute copy come from."""

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.chunks import repack
from lightning_chunk.engine.chunks.materialize import DeferredInit
from lightning_chunk.engine.config import DtypePolicy


@pytest.mark.parametrize("deferred", [False, True])
def test_a_host_chunk_s_compute_copy_is_written_from_the_values_and_is_its_master_s(deferred, monkeypatch):
    """[Note: the compute copy from the values]: a host shard's bf16 copy is written from the module's values as the
    master is (each value read twice), not converted from the master on the host; bit for bit the master's in bf16
    either way, deferred or not, and the master the values' own."""
    reads = []
    value = repack.FromModule.value
    monkeypatch.setattr(repack.FromModule, "value", lambda self, i: (reads.append(i), value(self, i))[1])

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))

    want = [p.detach().clone() for p in build().parameters()]
    if deferred:
        with torch.device("meta"):
            model = build()
        torch.manual_seed(0)
        init = DeferredInit.capture(model)
    else:
        model, init = build(), None
    mixed = DtypePolicy(compute_dtype=torch.bfloat16, master_dtype=torch.float32)
    eng = ChunkEngine(model, [], config=ChunkConfig(placement="host", chunk_numel=4160), dtypes=mixed, deferred=init)
    chunks = eng.manager.chunks
    assert len(chunks) == 2 and all(c.low is not None and c.low.dtype == torch.bfloat16 for c in chunks)
    for c in chunks:
        assert torch.equal(c.low, c.master.to(torch.bfloat16))
    assert sorted(reads) == sorted(2 * list(range(len(want))))  # once for the master, once for the copy
    got = eng.full_state_dict()
    eng.teardown()
    for (name, _), w in zip(model.named_parameters(), want, strict=True):
        assert torch.equal(got[name], w), name
