"""Two-rank cases about checkpoints, each against DDP doing the same: written in the background during fit and
resumed, saved at 2 ranks and resumed at 1 (and back), the defaults resumed, a state_dict the LightningModule edits,
a save after fit, a sharded EMA saved and resumed; and ``BackboneFinetuning`` resumed after its unfreezing, where DDP is
no reference."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests import backward_models, models
from tests.distributed.harness import DEVICE_BYTES, chunk_strategy, trainer
from tests.distributed.resume_common import RESUME_VARIANTS, final_state, resume_fit, resume_strategy
from tests.models import ParityNet, token_data


class LogsRank(ParityNet):
    def validation_step(self, batch, batch_idx):
        self.log("rank_mean", float(self.global_rank), sync_dist=True)


def _finish(out: Path, case: str, rank: int, saved: dict) -> None:
    """Rank 0 saves what the test compares; every rank says the case is done."""
    if rank == 0:
        torch.save(saved, out / f"{case}.pt")
    print(f"CASE-DONE {case} rank={rank}", flush=True)


def run_resume(out: Path) -> None:
    """8 steps with checkpoints written during fit at steps 4 and 8 (collectives on every rank, rank 0 writes),
    resumed from step 4 to 12. chunk_offload writes them in the background (Lightning's ``AsyncCheckpointIO``),
    so step 4's is written while steps 5 to 8 train. Each rank counts the elements of saved chunks it asked to
    read, against those the checkpoint holds."""
    import shutil

    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_chunk.engine.state import saved_chunks

    read = {"asked": 0, "saved": 0}
    whole = saved_chunks.load_chunk

    def counting(path, key, numel, dtype, span=None):
        read["asked"] += numel if span is None else span[1] - span[0]
        read["saved"] += numel
        return whole(path, key, numel, dtype, span)

    saved_chunks.load_chunk = counting

    from lightning.pytorch.callbacks import ModelCheckpoint

    results, loaded = {}, {}
    for name, make in [
        ("ddp", lambda: "ddp"),
        (
            "chunk",
            lambda: chunk_strategy(placement="host", chunk_numel=4096, materialize_optimizer_state=True),
        ),
    ]:
        ckdir = out / f"ckpt_{name}"
        L.seed_everything(11, verbose=False)
        model = LogsRank()
        cb = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=4, save_top_k=-1, filename="{step}")
        plugins = [AsyncCheckpointIO()] if name == "chunk" else []
        t = trainer(make(), steps=8, callbacks=[cb], enable_checkpointing=True, limit_val_batches=1.0, plugins=plugins)
        t.fit(model, token_data())
        metrics = t.validate(model, dataloaders=token_data(8), verbose=False)
        L.seed_everything(11, verbose=False)
        resumed = LogsRank()
        t2 = trainer(make(), steps=12)
        t2.fit(resumed, token_data(), ckpt_path=ckdir / "step=4.ckpt")
        opt = {f"opt.{k}.{n}": v for k, st in t2.optimizers[0].state_dict()["state"].items() for n, v in st.items()}
        results[name] = ({**{k: v.clone() for k, v in resumed.state_dict().items()}, **opt}, metrics[0]["rank_mean"])
        if t2.global_rank == 0:  # as a user reads the model back: [Note: load_from_checkpoint on a directory]
            saved_chunks.load_chunk = whole  # a whole read of every chunk, not the resume's reads counted above
            loaded[name] = LogsRank.load_from_checkpoint(ckdir / "step=4.ckpt").state_dict()
            saved_chunks.load_chunk = counting
            shutil.rmtree(ckdir, ignore_errors=True)
    rank = t2.global_rank
    if rank == 0:
        torch.save({"ref": results["ddp"][0], "got": results["chunk"][0], "loaded": loaded}, out / "resume.pt")
    (out / f"resume.rank{rank}.json").write_text(json.dumps({k: v[1] for k, v in results.items()}))
    (out / f"resume.read{rank}.json").write_text(json.dumps(read))
    print(f"CASE-DONE resume rank={rank}", flush=True)


def reshard_strategy(**kw):
    return chunk_strategy(**{**kw, "chunk_numel": 4096})


def run_reshard_save(out: Path) -> None:
    """2 ranks, 8 steps: a DDP checkpoint (plain file) and a chunk_offload one (sharded directory)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name, make in [("ddp", lambda: "ddp"), ("chunk", lambda: reshard_strategy(placement="host"))]:
        L.seed_everything(11, verbose=False)
        cb = ModelCheckpoint(dirpath=out / f"from2_{name}", every_n_train_steps=8, filename="{step}")
        t = trainer(make(), steps=8, callbacks=[cb], enable_checkpointing=True)
        t.fit(ParityNet(variant="tied"), token_data())
    print(f"CASE-DONE reshard_save rank={t.global_rank}", flush=True)


def run_reshard_resume(out: Path) -> None:
    """2 ranks resume 1-rank checkpoints (written by the test) to step 12: DDP from the plain file,
    chunk_offload from the sharded directory, with another placement and a device limit. Frozen layers: their
    chunks saved no optimizer state ([Note: state keys a parameter has])."""
    results = {}
    for name, make, path in [
        ("ddp", lambda: "ddp", out / "from1_auto" / "step=8.ckpt"),
        (
            "chunk",
            lambda: reshard_strategy(placement="auto", device_memory_limit=120_000),
            out / "from1_chunk" / "step=8.ckpt",
        ),
    ]:
        L.seed_everything(11, verbose=False)
        model = ParityNet(variant="frozen")
        t = trainer(make(), steps=12)
        t.fit(model, token_data(), ckpt_path=path)
        results[name] = model.state_dict()
    _finish(out, "reshard_resume", t.global_rank, {"ref": results["ddp"], "got": results["chunk"]})


def run_resume_defaults(out: Path) -> None:
    results, held = {}, {}
    t, _ = resume_fit("ddp", out / "from2_ddp", 8)
    for v in RESUME_VARIANTS:
        resume_fit(resume_strategy(v), out / f"from2_{v}", 8)
    for src in ("from2", "from1"):
        ref_ckpt = out / ("from2_ddp" if src == "from2" else "from1_auto") / "step=8.ckpt"
        t, m = resume_fit("ddp", None, 12, ckpt_path=ref_ckpt)
        results[f"{src}.ddp"] = final_state(t, m)
        for v in RESUME_VARIANTS:
            DEVICE_BYTES.clear()
            t, m = resume_fit(resume_strategy(v), None, 12, ckpt_path=out / f"{src}_{v}" / "step=8.ckpt")
            results[f"{src}.{v}"] = final_state(t, m)
            held[f"{src}.{v}"] = list(DEVICE_BYTES)
    (out / f"resume_defaults.bytes{t.global_rank}.json").write_text(json.dumps(held))
    _finish(out, "resume_defaults", t.global_rank, results)


def run_edited_checkpoint(out: Path) -> None:
    """[Note: the state_dict of a sharded save] on two ranks: the frozen weights dropped in on_save_checkpoint, an
    entry added, the head's value replaced; 6 steps saved, resumed to 10, against DDP doing the same. The defaults
    (automatic chunk size, auto placement) under a device limit below half the parameter bytes, on LoRA's shape
    (adapters registered after the blocks, used between them)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    cls = backward_models.edited(replace_head=True)
    kw = dict(dim=64, hidden=512, depth=3)
    limit = int(sum(p.numel() * p.element_size() for p in cls(**kw).parameters()) * 0.5)
    results = {}
    for name, make in [
        ("ddp", lambda: DDPStrategy()),
        (
            "chunk",
            lambda: chunk_strategy(device_memory_limit=limit, chunk_numel_min=4096),
        ),
    ]:
        L.seed_everything(11, verbose=False)
        first = cls(**kw)
        cb = ModelCheckpoint(dirpath=out / f"edited_{name}", every_n_train_steps=6, filename="{step}")
        trainer(make(), steps=6, callbacks=[cb], enable_checkpointing=True).fit(first, token_data())
        L.seed_everything(11, verbose=False)
        model, strategy = cls(**kw), make()
        t = trainer(strategy, steps=10)
        t.fit(model, token_data(), ckpt_path=out / f"edited_{name}" / "step=6.ckpt")
        results[name] = {
            "state": model.state_dict(),
            "entry": model.loaded_entry,
            "evictions": 0 if name == "ddp" else strategy.memory_stats()["evictions"],
        }
    _finish(out, "edited_checkpoint", t.global_rank, results)


def run_save_after_fit(out: Path) -> None:
    """``trainer.save_checkpoint()`` after ``fit`` (and after a ``validate`` that followed it), then a resume from that
    file to step 12 ([Note: optimizer state after fit]): DDP's and chunk_offload's with the defaults. After the save,
    what the optimizer itself holds: DDP's whole state; with the defaults, a read that raises; with
    ``materialize_optimizer_state=True``, DDP's state on every rank."""
    from lightning_chunk.engine import ChunkError

    results: dict = {}
    for name, make in [
        ("ddp", lambda: "ddp"),
        ("chunk", lambda: chunk_strategy()),
        ("whole", lambda: chunk_strategy(materialize_optimizer_state=True)),
    ]:
        path = out / f"save_after_fit_{name}.ckpt"
        L.seed_everything(11, verbose=False)
        model = ParityNet()
        t = trainer(make(), steps=8, limit_val_batches=2)
        t.fit(model, token_data(), token_data(n=16, seed=1))
        t.validate(model, token_data(n=16, seed=1), verbose=False)
        optimizer = t.optimizers[0]
        try:
            held: Any = optimizer.state_dict()
        except ChunkError as e:
            held = str(e)
        results.setdefault("held", {})[name] = held
        if name == "chunk":
            with contextlib.suppress(ChunkError):  # the first parameter's state: raises as state_dict did
                results["held"]["chunk_param"] = optimizer.state[model.embed.weight]
        if name == "whole":
            continue
        t.save_checkpoint(path)
        L.seed_everything(11, verbose=False)
        resumed = ParityNet()
        trainer(make(), steps=12).fit(resumed, token_data(), ckpt_path=path)
        results[name] = {"resumed": resumed.state_dict(), "saved": torch.load(path, weights_only=False)}
    held = results["held"]
    torch.save(held, out / f"save_after_fit.held.rank{t.global_rank}.pt")
    _finish(out, "save_after_fit", t.global_rank, {"ref": results["ddp"], "got": results["chunk"]})


HOST_LIMIT = "100kB"  # run_ema's "files": below the shards' bytes, so some go to disk; given to rank 1 alone


def run_ema(out: Path) -> None:
    """[Note: a sharded EMA] on two ranks: ChunkEMA against DDP with Lightning's EMAWeightAveraging, validating with
    the average every 3 steps; saved at step 4 and resumed to 8 on two ranks (the test resumes the same checkpoints
    on one); "files": under a host limit, given to rank 1 alone and agreed by both, the average in files and the
    shards on disk ([Note: the average under a host limit]; rank 0 once kept its average in memory)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

    from lightning_chunk import ChunkEMA

    results = {}
    # every rank takes the smallest limit ([Note: one limit for every rank]), so rank 0 keeps its average in files too
    host_limit = HOST_LIMIT if int(os.environ.get("RANK", 0)) == 1 else None
    try:  # without disk_dir: refused on rank 0 too, under the limit it agreed on (once rank 1 alone refused)
        t = trainer(chunk_strategy(placement="host", host_memory_limit=host_limit), steps=1, callbacks=[ChunkEMA()])
        t.fit(models.LogsValLoss(), token_data())
    except ValueError as e:
        print(f"EMA-REFUSED rank={t.global_rank}: {e}", flush=True)
    for name, make, ema in [
        ("ddp", lambda: DDPStrategy(), lambda: EMAWeightAveraging(decay=0.8)),
        (
            "chunk",
            lambda: chunk_strategy(placement="host"),
            lambda: ChunkEMA(decay=0.8),
        ),
        (
            "files",
            lambda: chunk_strategy(placement="host", host_memory_limit=host_limit, disk_dir=str(out / "scratch")),
            lambda: ChunkEMA(decay=0.8),
        ),
    ]:
        val = dict(limit_val_batches=2, val_check_interval=3)
        L.seed_everything(7, verbose=False)
        model = models.LogsValLoss()
        trainer(make(), steps=8, callbacks=[ema()], **val).fit(model, token_data(), token_data(16, seed=1))
        L.seed_everything(7, verbose=False)
        cb = ModelCheckpoint(dirpath=out / f"ema_{name}", every_n_train_steps=4, filename="{step}")
        trainer(make(), steps=4, callbacks=[ema(), cb], enable_checkpointing=True, **val).fit(
            models.LogsValLoss(), token_data(), token_data(16, seed=1)
        )
        L.seed_everything(7, verbose=False)
        resumed = models.LogsValLoss()
        t = trainer(make(), steps=8, callbacks=[ema()], **val)
        t.fit(resumed, token_data(), token_data(16, seed=1), ckpt_path=out / f"ema_{name}" / "step=4.ckpt")
        results[name] = {"state": model.state_dict(), "val": model.val_losses, "resumed": resumed.state_dict()}
        stats = t.strategy.memory_stats() if name != "ddp" else {}
        results[name].update({k: v for k, v in stats.items() if k.startswith(("ema", "disk_s"))})
    # the defaults a user gets, on a model used in another order than registered: the automatic chunk size, a
    # device limit (payloads evicted and gathered again), accumulation, validation with the average every 2 steps,
    # saved at step 3 and resumed to 6; under the limit and without it alike, and as DDP to sharded accumulation's
    # rounding (ROUNDING["accumulate"])
    kw = dict(dim=64, hidden=512, depth=3)
    limit = int(sum(p.numel() * p.element_size() for p in models.ReorderedNet(**kw).parameters()) * 0.9)
    for name, make, ema in [
        ("ddp", lambda: DDPStrategy(), lambda: EMAWeightAveraging(decay=0.8)),
        (
            "limited",
            lambda: chunk_strategy(device_memory_limit=limit, chunk_numel_min=4096),
            lambda: ChunkEMA(decay=0.8),
        ),
        (
            "free",
            lambda: chunk_strategy(chunk_numel_min=4096),
            lambda: ChunkEMA(decay=0.8),
        ),
        (  # the head alone in the first chunk (3,072 of 34,000): rank 1's shard of it is padding, and the resume
            # reads no average for it there ([Note: the same averages on every rank]); it hung before its repack
            "padded",
            lambda: chunk_strategy(chunk_numel=34_000),
            lambda: ChunkEMA(decay=0.8),
        ),
    ]:
        val = dict(limit_val_batches=2, val_check_interval=2, accumulate_grad_batches=2)
        L.seed_everything(7, verbose=False)
        first = models.ReorderedNet(**kw)
        cb = ModelCheckpoint(dirpath=out / f"ema_hard_{name}", every_n_train_steps=3, filename="{step}")
        trainer(make(), steps=3, callbacks=[ema(), cb], enable_checkpointing=True, **val).fit(
            first, token_data(), token_data(16, seed=1)
        )
        L.seed_everything(7, verbose=False)
        resumed, strategy = models.ReorderedNet(**kw), make()
        t = trainer(strategy, steps=6, callbacks=[ema()], **val)
        t.fit(resumed, token_data(), token_data(16, seed=1), ckpt_path=out / f"ema_hard_{name}" / "step=3.ckpt")
        results[f"hard_{name}"] = {
            "state": resumed.state_dict(),
            "evictions": 0 if name == "ddp" else strategy.memory_stats()["evictions"],
        }
    _finish(out, "ema", t.global_rank, results)


def run_save_inside_a_step(out: Path) -> None:
    """[Note: a save inside a step] on two ranks run as NCCL: chunk_offload asked for a checkpoint when backward has
    returned at step 4 (the chunks stepped in it), DDP at the start of the next batch, where the deferred save is
    written; each resumed to step 10. The automatic chunk size under device limits that differ by rank, on a model
    used in another order than it is registered."""
    rank = int(os.environ.get("RANK", 0))
    limit = 250_000 + 40_000 * rank
    cls = backward_models.ReorderedSavesInsideAStep
    results = {}
    for name, make, where, at in [
        ("ddp", lambda: DDPStrategy(), "batch_start", backward_models.AT + 1),
        ("chunk", lambda: chunk_strategy(device_memory_limit=limit), "after_backward", backward_models.AT),
    ]:
        path = out / f"save_inside_a_step_{name}.ckpt"
        L.seed_everything(7, verbose=False)
        trainer(make(), steps=backward_models.AT + 2).fit(cls(where, path, at=at), token_data())
        L.seed_everything(7, verbose=False)
        resumed = cls("none")
        t = trainer(make(), steps=10)
        t.fit(resumed, token_data(), ckpt_path=path)
        results[name] = resumed.state_dict()
    _finish(out, "save_inside_a_step", t.global_rank, {"ref": results["ddp"], "got": results["chunk"]})


def run_backbone_resume(out: Path) -> None:
    """[Note: finetuning callbacks]: ``BackboneFinetuning`` unfreezes the backbone at epoch 1 (step 4) with a param
    group of its own; a sharded checkpoint at step 6 resumes to step 10, its group added back as it loads (inside
    the sharded load, whose repack is collective). With the shards on the host and under a device limit (other chunks,
    another repack), and on both ranks: the same bits. DDP is no reference here: its reducer, built while the backbone
    was frozen, never averages the backbone's gradients, and its ranks end with different backbones."""
    from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint

    from tests.integration.test_added_param_groups import WithBackbone

    rank = int(os.environ.get("RANK", 0))
    saved: dict = {}
    for name, kw in (("host", dict(placement="host")), ("limit", dict(device_memory_limit=100_000, chunk_numel=2048))):
        for steps, ckpt in ((6, None), (10, str(out / f"backbone_{name}.ckpt"))):
            L.seed_everything(7, verbose=False)
            model = WithBackbone()
            callbacks = [
                BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5),
                ModelCheckpoint(dirpath=out, filename=f"backbone_{name}", every_n_train_steps=6, save_top_k=-1),
            ]
            t = trainer(
                chunk_strategy(**kw), steps=steps, callbacks=callbacks, limit_train_batches=4, enable_checkpointing=True
            )
            t.fit(model, token_data(), ckpt_path=ckpt)
        groups = t.optimizers[0].param_groups
        saved[name] = {"state": model.state_dict(), "groups": len(groups), "dir": Path(ckpt).is_dir()}
    torch.save(saved, out / f"backbone_resume.rank{rank}.pt")
    print(f"CASE-DONE backbone_resume rank={rank}", flush=True)
