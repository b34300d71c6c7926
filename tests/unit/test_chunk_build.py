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


def test_a_chunk_with_a_value_from_a_file_reads_it_once_and_converts_its_master(tmp_path, monkeypatch):
    """[Note: the compute copy from the values]: where one parameter of a chunk comes from a weights file, the copy is
    converted from the master, so the file is read once per value; the copy is still the master's in bf16."""
    from lightning_chunk.engine.files.weights import ModuleWeights, open_weights

    torch.manual_seed(0)
    torch.save({"0.weight": torch.randn(64, 64)}, tmp_path / "part.pt")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    init = DeferredInit.capture(model)
    weights = ModuleWeights(open_weights(tmp_path / "part.pt"), model, strict=False)
    reads = []
    read = ModuleWeights.read
    monkeypatch.setattr(ModuleWeights, "read", lambda self, t, *a: (reads.append(a), read(self, t, *a))[1])
    mixed = DtypePolicy(compute_dtype=torch.bfloat16, master_dtype=torch.float32)
    config = ChunkConfig(placement="host", chunk_numel=8192)
    eng = ChunkEngine(model, [], config=config, dtypes=mixed, deferred=init, weights=weights)
    (chunk,) = [c for c in eng.manager.chunks if any(t.name == "0.weight" for t in c.tensors)]
    assert len(chunk.tensors) > 1 and len(reads) == 1
    assert torch.equal(chunk.low, chunk.master.to(torch.bfloat16))
    assert torch.equal(eng.full_state_dict()["0.weight"], torch.load(tmp_path / "part.pt")["0.weight"])
    eng.teardown()
