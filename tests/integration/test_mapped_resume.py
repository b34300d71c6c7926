"""A plain checkpoint file resumed under chunk_offload is memory-mapped, not read whole into every rank
([Note: a plain checkpoint mapped] in ``lightning_chunk/checkpointing.py``)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine.memory import consolidate
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import fit


class OwnIO(TorchCheckpointIO):
    """A user's own CheckpointIO: its reader is used as it is."""


PLUGINS = {"default": lambda: None, "async": lambda: [AsyncCheckpointIO()], "own": lambda: [OwnIO()]}


@pytest.fixture
def loads(monkeypatch) -> list[dict]:
    seen, real = [], torch.load

    def load(f, *args, **kwargs):
        seen.append({"path": str(getattr(f, "path", f)), **kwargs})  # fsspec's opened local file has a path
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return seen


@pytest.mark.parametrize("io", ["default", "async", "own"])
def test_a_local_file_is_mapped_unless_the_user_reads_it_otherwise(tmp_path, loads, io):
    first = fit("auto", steps=4, variant="tied")
    first.trainer_ref.save_checkpoint(tmp_path / "plain.ckpt")
    ref = fit("auto", steps=8, variant="tied", ckpt_path=str(tmp_path / "plain.ckpt"))
    loads.clear()
    strategy = ChunkOffloadStrategy(**grouped(dict(optimizer_kernel="loop", placement="host")))
    got = fit(strategy, steps=8, variant="tied", ckpt_path=str(tmp_path / "plain.ckpt"), plugins=PLUGINS[io]())
    assert_same_params(ref, got, EXACT)
    mine = [c for c in loads if "plain.ckpt" in c["path"]]
    assert len(mine) == 1 and mine[0].get("mmap", False) is (io != "own"), mine


def test_the_loaded_optimizer_state_keeps_no_tensor_of_the_checkpoint(monkeypatch):
    """A ``step`` kept by reference kept a mapped checkpoint mapped (its pages resident) for the whole fit."""
    step, moment = torch.tensor(4.0), torch.arange(6.0)

    class One:
        params, names = [torch.nn.Parameter(torch.zeros(6))], ["w"]

        def lookup(self, p):
            return None, type("Info", (), {"numel": 6, "offset": 0})()

    monkeypatch.setattr(consolidate, "_pieces", lambda mgr, chunk, info: (0, 6))
    out = consolidate.local_optimizer_state(One(), {0: One.params[0]}, {0: {"step": step, "exp_avg": moment}})
    assert torch.equal(out[0]["step"], step) and torch.equal(out[0]["exp_avg"], moment)
    assert out[0]["step"].untyped_storage().data_ptr() != step.untyped_storage().data_ptr()
    assert out[0]["exp_avg"].untyped_storage().data_ptr() != moment.untyped_storage().data_ptr()
