"""Sharded checkpoints on one rank: layout, atomicity, ModelCheckpoint options, bad input (consolidating one:
test_consolidate.py)."""

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.cli import main as cli_main
from lightning_chunk.engine.state.checkpoint import (
    CheckpointError,
    check_checkpoint_dir,
    saved_state_dtype,
)
from lightning_chunk.options import grouped
from tests.backward_models import edited
from tests.models import ParityNet, quiet_trainer, token_data

ROOT = Path(__file__).resolve().parents[2]
EXACT = dict(rtol=0, atol=0)


def trainer(strategy, steps, **kw):
    return quiet_trainer(strategy=strategy, max_steps=steps, **{"limit_val_batches": 0, **kw})


def chunk(**kw):
    return ChunkOffloadStrategy(**grouped({**kw, "chunk_numel": 4096, "optimizer_kernel": "loop"}))


def train_and_save(tmp_path, strategy, steps=8, variant="tied", **cb_kw):
    L.seed_everything(11, verbose=False)
    model = ParityNet(variant=variant)
    cb = ModelCheckpoint(dirpath=tmp_path, **({"every_n_train_steps": steps, "filename": "{step}"} | cb_kw))
    trainer(strategy, steps, callbacks=[cb], enable_checkpointing=True).fit(model, token_data())
    return model, cb


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() + str(p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_layout_on_disk(tmp_path):
    train_and_save(tmp_path, chunk())
    ckpt = tmp_path / "step=8.ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    files = [n for n in names if n.endswith(".distcp")]
    assert names == sorted([".metadata", "meta.pt", *files])
    # a few whole chunks a file, one file after another ([Note: a save streams the shards])
    assert len(files) > 1 and files == sorted(f"__0_{g}_0.distcp" for g in range(len(files)))
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    ck = meta["chunk_checkpoint"]
    assert meta["global_step"] == 8 and "loops" in meta and "lr_schedulers" in meta
    assert "state_dict" not in meta and "optimizer_states" not in meta  # those are the shards
    assert (
        ck["world_size"] == 1
        and ck["version"]
        and ck["optimizers"][0]["keys"] == {"exp_avg": {"float32": "float32"}, "exp_avg_sq": {"float32": "float32"}}
    )
    # each state key's dtype by the masters' dtype; a checkpoint of before 2026-11-30 names one for all
    assert saved_state_dtype({"exp_avg": "float32"}, "exp_avg", "bfloat16") is torch.float32
    assert ck["aliases"]["head.weight"] == ck["aliases"]["embed.weight"]  # tied: one parameter
    assert not list(tmp_path.glob(".*partial"))


def test_resume_is_deterministic_and_matches_auto(tmp_path):
    ref_model, _ = train_and_save(tmp_path / "auto", "auto")
    train_and_save(tmp_path / "chunk", chunk(placement="device"))
    runs, states = [], []
    for path, make in [(tmp_path / "auto" / "step=8.ckpt", lambda: "auto")] + [
        (
            tmp_path / "chunk" / "step=8.ckpt",
            lambda: chunk(placement="host", device_memory_limit=120_000, materialize_optimizer_state=True),
        )
    ] * 2:
        strategy = make()
        L.seed_everything(11, verbose=False)
        m = ParityNet(variant="tied")
        t = trainer(strategy, 12)
        t.fit(m, token_data(), ckpt_path=path)
        runs.append(m)
        states.append(t.optimizers[0].state_dict()["state"])
    for a, b, c in zip(*(r.parameters() for r in runs), strict=True):
        torch.testing.assert_close(b, a, **EXACT)  # another placement and a device limit on resume
        torch.testing.assert_close(c, b, **EXACT)  # resuming twice is bit-identical
    for k, st in states[0].items():  # optimizer state too, in parameter shapes after fit
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(states[1][k][name], st[name], **EXACT)


def test_plain_lightning_checkpoint_continues_with_its_optimizer_state(tmp_path):
    train_and_save(tmp_path, "auto")
    out = []
    for strategy in ["auto", chunk(placement="host")]:
        L.seed_everything(11, verbose=False)
        m = ParityNet(variant="tied")
        trainer(strategy, 12).fit(m, token_data(), ckpt_path=tmp_path / "step=8.ckpt")
        out.append(m)
    for a, b in zip(out[0].parameters(), out[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def test_frozen_chunks_save_no_optimizer_state_and_resume_and_consolidate_as_plain_lightning(tmp_path):
    """[Note: state keys a parameter has]: a chunk of frozen parameters (LoRA's base) saves no moments. Before, it
    saved zeros of ``exp_avg`` and ``exp_avg_sq``: 8 bytes a frozen parameter, 56 GB in each save of a 7B base."""
    import torch.distributed.checkpoint as dcp

    from lightning_chunk.consolidate import consolidate

    train_and_save(tmp_path / "auto", "auto", variant="frozen")
    train_and_save(tmp_path / "chunk", chunk(placement="host"), variant="frozen")
    ckpt, plain = tmp_path / "chunk" / "step=8.ckpt", tmp_path / "auto" / "step=8.ckpt"
    frozen = {n for n, p in ParityNet(variant="frozen").named_parameters() if not p.requires_grad}
    saved = {k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if ".optim0." in k}
    chunks = torch.load(ckpt / "meta.pt", weights_only=False)["chunk_checkpoint"]["chunks"]
    whole = [{n for n, *_ in spec["slots"]} <= frozen for spec in chunks]
    assert any(whole) and not all(whole)
    for c, is_frozen in enumerate(whole):
        want = set() if is_frozen else {f"chunk.{c}.optim0.exp_avg", f"chunk.{c}.optim0.exp_avg_sq"}
        assert {k for k in saved if k.startswith(f"chunk.{c}.")} == want, c

    resume_both(plain, ckpt, chunk(placement="host", device_memory_limit=120_000), variant="frozen")
    consolidate(ckpt, tmp_path / "whole.ckpt", with_optimizer=True, progress=False)
    assert_same_optimizer_states(plain, tmp_path / "whole.ckpt")


def resume_both(plain, ckpt, strategy, variant: str) -> None:
    """Plain Lightning from its checkpoint and ``strategy`` from ``ckpt``, each to step 12: the same parameters."""
    runs = []
    for path, s in ((plain, "auto"), (ckpt, strategy)):
        L.seed_everything(11, verbose=False)
        m = ParityNet(variant=variant)
        trainer(s, 12).fit(m, token_data(), ckpt_path=path)
        runs.append(m)
    for a, b in zip(*(r.parameters() for r in runs), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def assert_same_optimizer_states(plain, whole, count: int = 1) -> None:
    """Every optimizer's state in two plain checkpoint files: the same parameters, keys and bits."""
    ref, got = (torch.load(p, weights_only=False)["optimizer_states"] for p in (plain, whole))
    assert len(ref) == len(got) == count
    for a, b in zip(ref, got, strict=True):
        assert a["state"].keys() == b["state"].keys() and a["state"]
        for i, st in a["state"].items():
            assert st.keys() == b["state"][i].keys(), i
            for k, v in st.items():
                torch.testing.assert_close(b["state"][i][k], v, **EXACT)


def test_a_format_1_checkpoint_without_each_parameter_s_keys_resumes_as_before(tmp_path):
    """Format 1 (before 2026-12-07) saved every chunk's state of every key and no per-parameter keys: each parameter
    with state takes every key, as then, and training goes on as plain Lightning's from its own checkpoint."""
    train_and_save(tmp_path / "auto", "auto")
    train_and_save(tmp_path / "chunk", chunk(placement="host"))
    ckpt = tmp_path / "chunk" / "step=8.ckpt"
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    assert meta["chunk_checkpoint"]["format_version"] == 2
    meta["chunk_checkpoint"]["format_version"] = 1
    for om in meta["chunk_checkpoint"]["optimizers"]:
        del om["held"]
    torch.save(meta, ckpt / "meta.pt")
    resume_both(tmp_path / "auto" / "step=8.ckpt", ckpt, chunk(device_memory_limit=120_000), variant="tied")


class SavesAtBatch(L.Callback):
    def __init__(self, path, batch: int) -> None:
        self.path, self.batch = path, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch:  # during fit: a sharded directory under chunk_offload
            trainer.save_checkpoint(self.path)


def test_two_optimizers_over_disjoint_parameters_resume_and_consolidate_as_plain_lightning(tmp_path):
    """Each optimizer saves the state of its own parameters' chunks alone ([Note: state keys a parameter has]):
    GAN-style AdamW and SGD with momentum resume under an evicting limit and consolidate to plain Lightning's two
    states."""
    from lightning_chunk.consolidate import consolidate
    from tests.models import TwoOptimizers

    runs = []
    for name, make in (("ref", lambda: "auto"), ("got", lambda: chunk(device_memory_limit=120_000))):
        L.seed_everything(11, verbose=False)
        trainer(make(), 10, callbacks=[SavesAtBatch(tmp_path / name, 2)]).fit(TwoOptimizers(), token_data())
        L.seed_everything(11, verbose=False)
        m = TwoOptimizers()
        trainer(make(), 12).fit(m, token_data(), ckpt_path=tmp_path / name)
        runs.append(m)
    for a, b in zip(*(r.parameters() for r in runs), strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    consolidate(tmp_path / "got", tmp_path / "whole.ckpt", with_optimizer=True, progress=False)
    assert_same_optimizer_states(tmp_path / "ref", tmp_path / "whole.ckpt", count=2)


def test_save_top_k_and_last_as_a_link(tmp_path):
    train_and_save(
        tmp_path, chunk(), steps=8, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last="link"
    )
    dirs = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert dirs == ["last.ckpt", "step=6.ckpt", "step=8.ckpt"]
    assert (tmp_path / "last.ckpt").is_symlink() and os.readlink(tmp_path / "last.ckpt") == "step=8.ckpt"
    check_checkpoint_dir(tmp_path / "last.ckpt")
    model = ParityNet(variant="tied")
    cb = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(chunk(), 10, callbacks=[cb], enable_checkpointing=True)
    t.fit(model, token_data(), ckpt_path="last")
    assert t.global_step == 10


def test_weights_only_checkpoints(tmp_path):
    train_and_save(tmp_path, chunk(), save_weights_only=True)
    ckpt = tmp_path / "step=8.ckpt"
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    assert meta["chunk_checkpoint"]["optimizers"] == []
    out = trainer(chunk(), 1, limit_val_batches=2).validate(
        ParityNet(variant="tied"), token_data(8), ckpt_path=ckpt, verbose=False
    )
    assert out
    with pytest.raises(KeyError, match="contains only the model"):
        trainer(chunk(), 12).fit(ParityNet(variant="tied"), token_data(), ckpt_path=ckpt)


KILL_SCRIPT = r"""
import os, signal, sys
sys.path.insert(0, {root!r})
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import lightning_chunk.engine.state.save as ckp
from lightning_chunk import ChunkOffloadStrategy
from tests.models import ParityNet, token_data

calls = []
real = ckp._write_meta
def dying_write_meta(meta, target):
    calls.append(target)
    if len(calls) == 3:  # step=2.ckpt and last.ckpt are complete; die inside the save of step=4.ckpt
        os.kill(os.getpid(), signal.SIGKILL)
    real(meta, target)
ckp._write_meta = dying_write_meta

L.seed_everything(11, verbose=False)
cb = ModelCheckpoint(dirpath={out!r}, every_n_train_steps=2, filename="{{step}}", save_top_k=-1, save_last=True)
t = L.Trainer(accelerator="cpu", devices=1, strategy=ChunkOffloadStrategy(chunk_numel=4096), max_steps=8,
              logger=False, enable_progress_bar=False, callbacks=[cb], limit_val_batches=0)
t.fit(ParityNet(variant="tied"), token_data())
print("NOT KILLED")
"""


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_a_save_killed_part_way_leaves_the_previous_checkpoint_and_last_intact(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT.format(root=str(ROOT), out=str(tmp_path / "ck")))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL and "NOT KILLED" not in r.stdout
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == [".step=4.ckpt.partial", "last.ckpt", "step=2.ckpt"]
    assert (ck / ".step=4.ckpt.partial" / "__0_0_0.distcp").exists()  # the shards were written, never finished
    with pytest.raises(CheckpointError, match="meta.pt is missing"):
        check_checkpoint_dir(ck / ".step=4.ckpt.partial")
    model = ParityNet(variant="tied")
    cb = ModelCheckpoint(dirpath=ck)
    t = trainer(chunk(), 6, callbacks=[cb], enable_checkpointing=True)
    t.fit(model, token_data(), ckpt_path="last")  # resumes from the last complete checkpoint (step 2)
    assert t.global_step == 6


def test_bad_input_is_a_clear_error_and_nothing_on_disk_changes(tmp_path, capsys):
    train_and_save(tmp_path / "good", chunk())
    good = tmp_path / "good" / "step=8.ckpt"
    train_and_save(tmp_path / "wider", chunk(), variant="unused")  # has a `branch` the tied model lacks
    wider = tmp_path / "wider" / "step=8.ckpt"
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    empty = tmp_path / "empty.ckpt"
    empty.mkdir()
    truncated = tmp_path / "trunc.ckpt"
    subprocess.run(["cp", "-r", str(good), str(truncated)], check=True)
    shard = truncated / "__0_0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    before = digest(tmp_path)
    cases = [
        (tmp_path / "nowhere.ckpt", ParityNet(variant="tied"), "not found"),  # Lightning checks this one first
        (empty, ParityNet(variant="tied"), "meta.pt is missing"),
        (truncated, ParityNet(variant="tied"), f"shard file '{shard}' is truncated"),
        (good, ParityNet(variant="plain"), "parameters missing from the checkpoint: \\['head.weight'\\]"),
        (wider, ParityNet(variant="plain"), "parameters the model does not have: \\['branch.bias', 'branch.weight'\\]"),
        (good, ParityNet(variant="tied", hidden=32), "shapes differ"),
    ]
    for path, model, match in cases:
        with pytest.raises((CheckpointError, FileNotFoundError), match=match):
            trainer(chunk(), 12).fit(model, token_data(), ckpt_path=path)
    with pytest.raises(Exception):  # noqa: B017 - not a checkpoint: torch.load's error, which depends on the bytes
        trainer(chunk(), 12).fit(ParityNet(variant="tied"), token_data(), ckpt_path=text)
    assert cli_main(["consolidate", str(truncated), str(tmp_path / "out.pt"), "--no-progress"]) == 2
    assert "is truncated" in capsys.readouterr().err
    assert cli_main(["consolidate", str(text), str(tmp_path / "out.pt"), "--no-progress"]) == 2
    assert digest(tmp_path) == before  # nothing already on disk was modified, and nothing half-written appeared


@pytest.mark.parametrize("replace_head", [False, True])
def test_what_on_save_checkpoint_drops_adds_or_replaces_is_what_a_sharded_checkpoint_holds(tmp_path, replace_head):
    """[Note: the state_dict of a sharded save]: a sharded save ignored the state_dict the hooks edited, so the frozen
    weights a LoRA run drops were written anyway and an entry a hook added was lost without a word. Now the frozen
    chunks are not written, the entry comes back to on_load_checkpoint, a replaced value is what loads, and the resumed
    run equals plain Lightning's doing the same."""
    cls = edited(replace_head=replace_head)
    finals, entries = [], []
    for name, make in [("auto", lambda: "auto"), ("chunk", lambda: chunk(placement="host"))]:
        L.seed_everything(11, verbose=False)
        cb = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=6, filename="{step}")
        trainer(make(), 6, callbacks=[cb], enable_checkpointing=True).fit(cls(), token_data())
        L.seed_everything(11, verbose=False)
        m = cls()
        trainer(make(), 10).fit(m, token_data(), ckpt_path=tmp_path / name / "step=6.ckpt")
        finals.append(m.state_dict())
        entries.append(m.loaded_entry)
    for k, v in finals[0].items():
        torch.testing.assert_close(finals[1][k], v, **EXACT, msg=k)
    assert torch.equal(entries[1], torch.tensor([3.0, 4.0]))
    ck = torch.load(tmp_path / "chunk" / "step=6.ckpt" / "meta.pt", weights_only=False)["chunk_checkpoint"]
    frozen = sorted(n for n, p in cls().named_parameters() if not p.requires_grad)
    assert sorted(ck["excluded"]) == frozen and not set(frozen) & set(ck["aliases"])
    written = [c for c in ck["chunks"] if c["written"]]
    assert 0 < len(written) < len(ck["chunks"])  # the frozen blocks' chunks were not written
    # consolidated, it holds what plain Lightning's file holds
    out = tmp_path / "full.pt"
    assert cli_main(["consolidate", str(tmp_path / "chunk" / "step=6.ckpt"), str(out), "--no-progress"]) == 0
    plain = torch.load(tmp_path / "auto" / "step=6.ckpt", weights_only=False)["state_dict"]
    got = torch.load(out, weights_only=False)["state_dict"]
    assert sorted(got) == sorted(plain)
    for k, v in plain.items():
        torch.testing.assert_close(got[k], v, **EXACT, msg=k)


def test_a_strict_load_of_a_checkpoint_without_the_frozen_weights_names_them(tmp_path):
    L.seed_everything(11, verbose=False)
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, filename="{step}")
    trainer(chunk(), 4, callbacks=[cb], enable_checkpointing=True).fit(edited()(), token_data())
    with pytest.raises(RuntimeError, match=r"missing keys \['blocks\.0\.0\.weight'"):
        trainer(chunk(), 6).fit(edited(strict=True)(), token_data(), ckpt_path=tmp_path / "step=4.ckpt")


def test_a_conversion_of_the_offered_state_dict_is_refused_not_ignored(tmp_path):
    """``{k: v.half() ...}`` in on_save_checkpoint turns the meta entries into fp16 meta tensors: a sharded save
    cannot honour it and said nothing; it now names the entry and the ways out, and nothing is written."""

    class Halves(ParityNet):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["state_dict"] = {
                k: v.half() if v.is_floating_point() else v for k, v in checkpoint["state_dict"].items()
            }

    L.seed_everything(11, verbose=False)
    with pytest.raises(CheckpointError, match=r"entry 'embed\.weight' was changed to float16"):
        trainer(
            chunk(), 2, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)], enable_checkpointing=True
        ).fit(Halves(), token_data())
    assert not list(tmp_path.glob("*.ckpt"))


class Tested(ParityNet):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).float().reshape(-1, self.head.out_features), y.reshape(-1))


@pytest.mark.parametrize("limit", [None, 120_000], ids=["resident", "evicting"])
def test_the_best_checkpoint_tests_as_plain_lightning_s(tmp_path, limit):
    """``trainer.test(ckpt_path="best")`` after fit, and a fresh trainer and model given the directory: the losses
    of the weights ``ModelCheckpoint`` kept (the worst of three here, so not the last), as in plain Lightning."""

    def losses(strategy, root):
        L.seed_everything(7, verbose=False)
        best = ModelCheckpoint(dirpath=root, monitor="val_loss", mode="max", save_top_k=1)
        t = trainer(
            strategy(), 12, val_check_interval=4, limit_val_batches=3, callbacks=[best], enable_checkpointing=True
        )
        t.fit(Tested(), token_data(), token_data(24, seed=1))
        test = token_data(24, seed=2)
        out = [t.test(ckpt_path="best", dataloaders=test, verbose=False)[0]["test_loss"]]
        L.seed_everything(3, verbose=False)  # other initial weights: the checkpoint replaces them
        out += [
            trainer(strategy(), 1).test(Tested(), test, ckpt_path=best.best_model_path, verbose=False)[0]["test_loss"]
        ]
        return best.best_model_path, out

    ref_path, ref = losses(lambda: "auto", tmp_path / "ref")
    got_path, got = losses(lambda: chunk(device_memory_limit=limit), tmp_path / "got")
    assert Path(ref_path).name == Path(got_path).name != "epoch=0-step=12.ckpt" and Path(got_path).is_dir()
    assert got == ref
