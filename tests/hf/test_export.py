"""``lightning-chunk consolidate --format hf``: a sharded checkpoint of a trained Hugging Face model becomes a
``save_pretrained`` directory that ``from_pretrained`` loads with no missing or unexpected tensor and the same
logits as the trained module; bad input is refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("transformers")

from lightning_chunk import (
    ChunkOffloadStrategy,  # noqa: E402
    MemoryOptions,  # noqa: E402
)
from lightning_chunk.engine.files.safetensors_file import StreamingSafetensors  # noqa: E402
from lightning_chunk.engine.state.checkpoint import CheckpointError  # noqa: E402
from lightning_chunk.hf import export_hf  # noqa: E402
from tests.hf.models import ROOT, Batches, load_example, save_pretrained  # noqa: E402
from tests.models import quiet_trainer  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """GPT-2 (tied head), Llama (untied, rotary buffers) and Mixtral (3D experts, saved expert by expert) fine-tuned 4
    steps under a device limit, with the sharded checkpoint taken at the end."""
    example = load_example()
    root = tmp_path_factory.mktemp("trained")
    out = {}
    for kind in ("gpt2", "llama", "mixtral"):
        L.seed_everything(0, verbose=False)
        model = example.CausalLM(pretrained=str(save_pretrained(kind, root / f"{kind}.pre")), lr=1e-2, warmup_steps=1)
        trainer = quiet_trainer(
            max_steps=4,
            limit_val_batches=0,
            strategy=ChunkOffloadStrategy(
                device_memory_limit=3_000_000, memory=MemoryOptions(chunk_numel=32768 if kind == "mixtral" else 16384)
            ),
            callbacks=[ModelCheckpoint(dirpath=root / kind, filename="last")],
            enable_checkpointing=True,
        )
        trainer.fit(model, Batches())
        out[kind] = (model, root / kind / "last.ckpt")
    return out


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(trained, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    model, ckpt = trained[kind]
    out = export_hf(ckpt, tmp_path / "hf", max_shard_size="100KB", progress=False)
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) >= 3  # sharded at 100 KB
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    torch.testing.assert_close(logits(loaded.eval(), x), logits(model.hf_model, x), rtol=0, atol=0)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    if kind == "gpt2":  # the tied head is written once, as the embedding: from_pretrained ties it again
        assert "lm_head.weight" not in weight_map and "transformer.wte.weight" in weight_map
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    else:
        assert "lm_head.weight" in weight_map
    loaded.save_pretrained(tmp_path / "resaved", max_shard_size="100KB")  # Mixtral's experts: one by one
    resaved = json.loads((tmp_path / "resaved" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(resaved)
    assert ("model.layers.0.block_sparse_moe.experts.3.w2.weight" in weight_map) == (kind == "mixtral")


def test_export_in_bf16_through_the_command_line(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from lightning_chunk.cli import main

    model, ckpt = trained["llama"]
    assert main(["consolidate", "--format", "hf", str(ckpt), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert f"wrote {tmp_path / 'bf16'}" in capsys.readouterr().out
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    for (n, a), (_, b) in zip(model.hf_model.named_parameters(), loaded.named_parameters(), strict=True):
        torch.testing.assert_close(b, a.detach().to(torch.bfloat16), rtol=0, atol=0, msg=n)


def test_a_config_that_does_not_match_the_checkpoint_is_refused_and_nothing_is_written(trained, tmp_path):
    _, ckpt = trained["llama"]
    other = save_pretrained("llama", tmp_path / "other", num_hidden_layers=3, intermediate_size=96)
    with pytest.raises(CheckpointError) as e:
        export_hf(ckpt, tmp_path / "out", config=other, progress=False)
    msg = str(e.value)
    assert "does not match checkpoint" in msg and "nothing was written" in msg
    assert "missing from the checkpoint (9): model.layers.2." in msg  # the third layer's tensors
    assert "model.layers.0.mlp.down_proj.weight: (64, 128) in the checkpoint, (64, 96) in the config's model" in msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("case", ["no_config", "exists", "inside", "bad_dtype", "with_optimizer"])
def test_bad_export_input_is_one_clear_message(trained, tmp_path, case, capsys):
    from lightning_chunk.cli import main

    _, ckpt = trained["gpt2"]
    args = [str(ckpt), str(tmp_path / "out")]
    if case == "no_config":  # a checkpoint of a module that did not save its config
        import shutil

        copy = tmp_path / "copy.ckpt"
        shutil.copytree(ckpt, copy)
        meta = torch.load(copy / "meta.pt", weights_only=False)
        meta.pop("hf_config")
        torch.save(meta, copy / "meta.pt")
        args, needle = [str(copy), str(tmp_path / "out")], "holds no Hugging Face config"
    elif case == "exists":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "mine.txt").write_text("keep me")
        needle = "exists; name a new one, or pass --force"
    elif case == "inside":
        args, needle = [str(ckpt), str(ckpt / "hf")], "is inside the checkpoint"
    elif case == "bad_dtype":
        args, needle = args + ["--dtype", "int8"], "dtype='int8' is not a floating-point torch dtype"
    else:
        args, needle = args + ["--with-optimizer"], "--with-optimizer applies to --format lightning only"
    assert main(["consolidate", "--format", "hf", "--no-progress", *args]) == 2  # what the console command exits with
    err = capsys.readouterr().err
    assert needle in err and err.startswith("lightning-chunk: error:"), err
    if case == "exists":
        assert os.listdir(tmp_path / "out") == ["mine.txt"]
    else:
        assert not (tmp_path / "out").exists()


def test_streaming_safetensors_matches_safetensors_own_reader(tmp_path):
    """Files laid out from declarations and written one tensor at a time read back exactly with safetensors."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(5, 3, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 9, (2, 2), generator=g),
        "d": torch.tensor(1.5),
        "e": torch.zeros(0, 4),
    }
    w = StreamingSafetensors(tmp_path, max_shard_bytes=64)
    for k, v in tensors.items():
        w.add(k, tuple(v.shape), v.dtype)
    w.open()
    with pytest.raises(RuntimeError, match="written out of order"):
        w.write("b", tensors["b"])
    for k, v in tensors.items():
        w.write(k, v)
    paths = w.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(paths) == 3 and set(index["weight_map"]) == set(tensors)
    read = {}
    for p in paths[:-1]:
        read.update(load_file(p))
    for k, v in tensors.items():
        torch.testing.assert_close(read[k], v, rtol=0, atol=0)


MEMORY_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
import torch
from lightning_chunk.engine.state.checkpoint import read_meta
from lightning_chunk.hf import _config, _meta_model, export_hf


def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


_meta_model(_config(None, read_meta({ckpt!r}), None))  # transformers' lazy imports of this architecture, before
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark (VmHWM) to the current RSS
before = rss("VmRSS:")
export_hf({ckpt!r}, {out!r}, progress=False)
print("GROWTH", rss("VmHWM:") - before)
"""


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_export_streams_with_bounded_memory(tmp_path):
    """A 12-layer Llama of 126 MB in fp32, one layer a chunk: exporting it holds about two chunks, not the model."""
    from transformers import AutoModelForCausalLM

    from lightning_chunk import ChunkConfig, ChunkEngine
    from lightning_chunk.engine.state.checkpoint import save_sharded
    from lightning_chunk.hf import HF_CONFIG_KEY
    from tests.hf.models import config

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure peak memory of one phase")
    cfg = config(
        "llama",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    chunk_numel = sum(p.numel() for p in model.model.layers[0].parameters())
    engine = ChunkEngine(model, [], config=ChunkConfig(placement="host", chunk_numel=chunk_numel))
    assert len(engine.manager.chunks) >= 12
    save_sharded(engine, tmp_path / "big.ckpt", {HF_CONFIG_KEY: cfg.to_dict()}, with_optimizer=False)
    engine.teardown()
    script = tmp_path / "mem.py"
    script.write_text(MEMORY_SCRIPT.format(root=str(ROOT), ckpt=str(tmp_path / "big.ckpt"), out=str(tmp_path / "hf")))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    growth = int(r.stdout.split("GROWTH")[1])
    chunk_bytes = chunk_numel * 4
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    print(
        f"export growth {growth / 2**20:.1f} MiB, chunk {chunk_bytes / 2**20:.1f} MiB, "
        f"model {model_bytes / 2**20:.1f} MiB"
    )
    assert growth < 3 * chunk_bytes + 8 * 2**20, (growth / 2**20, chunk_bytes / 2**20)
    assert growth < model_bytes / 4
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for (n, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


def test_export_of_the_average_chunk_ema_kept(tmp_path):
    """``--ema`` ([Note: a sharded EMA]): the weights ChunkEMA averaged, the ones the model holds after fit."""
    from transformers import AutoModelForCausalLM

    from lightning_chunk import ChunkEMA
    from lightning_chunk.cli import main

    example = load_example()
    L.seed_everything(0, verbose=False)
    model = example.CausalLM(pretrained=str(save_pretrained("gpt2", tmp_path / "pre")), lr=1e-2, warmup_steps=1)
    quiet_trainer(
        max_steps=3,
        limit_val_batches=0,
        strategy=ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=16384)),
        callbacks=[
            ChunkEMA(decay=0.5),  # before the checkpoint: the step-3 average is in it
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="last"),
        ],
        enable_checkpointing=True,
    ).fit(model, Batches())
    assert (
        main(
            [
                "consolidate",
                "--format",
                "hf",
                str(tmp_path / "last.ckpt"),
                str(tmp_path / "hf"),
                "--ema",
                "--no-progress",
            ]
        )
        == 0
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    torch.testing.assert_close(logits(loaded, x), logits(model.hf_model, x), rtol=0, atol=0)


def test_export_of_an_average_a_checkpoint_does_not_hold_is_refused(trained, tmp_path):
    with pytest.raises(CheckpointError, match="holds no average of the weights"):
        export_hf(trained["llama"][1], tmp_path / "hf", progress=False, ema=True)
    assert not (tmp_path / "hf").exists()
