"""``lightning-chunk consolidate`` of a one-rank sharded checkpoint: one plain file that loads strictly and equals the
trained model, with its optimizer state; never over a file already there unless forced; memory bounded by a few
chunks whatever the model's size."""

import os
import pickle
import subprocess
import sys

import lightning as L
import pytest
import torch
import torch.nn as nn
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_chunk.cli import main as cli_main
from lightning_chunk.consolidate import consolidate, read_checkpoint
from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.state.checkpoint import save_sharded
from tests.compare import assert_same_params
from tests.integration.test_checkpoints import EXACT, ROOT, chunk, train_and_save, trainer
from tests.models import ParityNet, token_data


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_consolidate_output_loads_strict_and_equals_the_trained_model(tmp_path):
    model, _ = train_and_save(tmp_path, chunk())
    out = tmp_path / "full.pt"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_chunk",
            "consolidate",
            str(tmp_path / "step=8.ckpt"),
            str(out),
            "--with-optimizer",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "consolidating" in r.stderr  # the progress bar
    full = torch.load(out, weights_only=False)
    plain = ParityNet(variant="tied")
    plain.load_state_dict(full["state_dict"], strict=True)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    assert len(full["optimizer_states"][0]["state"]) == len(list(plain.parameters()))
    t = trainer("auto", 10)
    t.fit(ParityNet(variant="tied"), token_data(), ckpt_path=out)  # a plain checkpoint, optimizer included
    assert t.global_step == 10


def test_consolidate_refuses_to_overwrite_an_existing_output_unless_forced(tmp_path, capsys):
    train_and_save(tmp_path, chunk())
    ckpt, out = str(tmp_path / "step=8.ckpt"), tmp_path / "full.pt"
    out.write_text("a file of mine")
    assert cli_main(["consolidate", ckpt, str(out), "--no-progress"]) == 2
    assert "exists; name a new one, or pass --force" in capsys.readouterr().err
    assert out.read_text() == "a file of mine"  # untouched
    assert cli_main(["consolidate", ckpt, str(out), "--no-progress", "--force"]) == 0
    assert "state_dict" in torch.load(out, weights_only=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing left beside it


MEMORY_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_chunk.consolidate import consolidate, read_checkpoint
import torch


def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


torch.zeros(1)  # torch's own lazy set-up
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark (VmHWM) to the current RSS
before = rss("VmRSS:")
consolidate({ckpt!r}, {out!r}, progress=False)
print("GROWTH", rss("VmHWM:") - before)
"""


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_consolidate_streams_with_bounded_memory(tmp_path):
    width, depth = 1024, 24  # 24 chunks of one Linear each: 24 * 4 MiB of fp32
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    chunk_numel = width * width + width
    engine = ChunkEngine(model, [], config=ChunkConfig(placement="host", chunk_numel=chunk_numel))
    assert len(engine.manager.chunks) >= 20
    save_sharded(engine, tmp_path / "big.ckpt", {"epoch": 0}, with_optimizer=False)
    engine.teardown()  # parameters are plain again (their payloads were released: never read them before)
    script = tmp_path / "mem.py"
    script.write_text(MEMORY_SCRIPT.format(root=str(ROOT), ckpt=str(tmp_path / "big.ckpt"), out=str(tmp_path / "o.pt")))
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure peak memory of one phase")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    growth = int(r.stdout.split("GROWTH")[1])
    chunk_bytes = chunk_numel * 4
    model_bytes = depth * chunk_bytes
    # peak RSS growth while consolidating: 3 chunks (read buffer, chunk, one parameter's copy) + a fixed
    # overhead, against 24 chunks if the model were held whole (measured: ~3.6 chunks of 4 MiB)
    assert growth < 3 * chunk_bytes + 8 * 2**20, (growth / 2**20, chunk_bytes / 2**20)
    assert growth < model_bytes / 4
    full = torch.load(tmp_path / "o.pt", weights_only=True)
    plain = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    plain.load_state_dict(full["state_dict"], strict=True)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def test_a_sharded_directory_validates_and_resumes_under_plain_lightning_as_its_file_would(tmp_path, monkeypatch):
    """[Note: load_from_checkpoint on a directory]: ``Trainer().validate(model, ckpt_path=dir)`` and a fit resumed from
    the directory under ``strategy="auto"`` failed with ``IsADirectoryError``. Now the directory reads as the plain file
    ``consolidate --with-optimizer`` writes: the same loss, and a resume to the bits of plain Lightning resumed from its
    own file; a validation never reads the optimizer state."""
    import lightning_chunk.consolidate as consolidate_module

    train_and_save(tmp_path, chunk(device_memory_limit=90_000), steps=8)
    ckpt, read = str(tmp_path / "step=8.ckpt"), []
    real = consolidate_module.plain_optimizer_states
    monkeypatch.setattr(consolidate_module, "plain_optimizer_states", lambda *a: read.append(1) or real(*a))

    def validate(path):
        return trainer("auto", 8, limit_val_batches=1.0).validate(
            ParityNet("tied"), token_data(16), path, verbose=False
        )

    def resumed(path):
        L.seed_everything(11, verbose=False)
        model = ParityNet(variant="tied")
        trainer("auto", 14).fit(model, token_data(), ckpt_path=path)
        return model

    loss = validate(ckpt)
    assert not read
    got = resumed(ckpt)
    assert read == [1]
    out = consolidate(ckpt, tmp_path / "full.pt", with_optimizer=True, progress=False)
    assert loss == validate(out)
    states = torch.load(out, weights_only=False)["optimizer_states"]
    loaded = read_checkpoint(ckpt)  # as a hook that moves the whole checkpoint, or pickles it, meets it
    for seen in (loaded, apply_to_collection(loaded, torch.Tensor, torch.clone), pickle.loads(pickle.dumps(loaded))):
        assert [s["param_groups"] for s in seen["optimizer_states"]] == [s["param_groups"] for s in states]
        torch.testing.assert_close(
            [s["state"] for s in seen["optimizer_states"]], [s["state"] for s in states], **EXACT
        )
    assert_same_params(resumed(out), got, EXACT)
    (tmp_path / "plain").mkdir()
    train_and_save(tmp_path / "plain", "auto", steps=8)  # plain Lightning, resumed from its own file
    assert_same_params(resumed(str(tmp_path / "plain" / "step=8.ckpt")), got, EXACT)
