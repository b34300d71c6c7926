"""A resume's optimizer state is read at the first step, after the warm-up repack ([Note: optimizer state read after
the warm-up] in engine/state/load.py): the run it continues is the same bit for bit, what reads the state before
that step reads it first, and a checkpoint changed in between is refused."""

import shutil

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_chunk.engine.errors import CheckpointError
from tests.integration.test_checkpoints import EXACT, chunk, train_and_save, trainer
from tests.models import ParityNet, token_data

LIMIT = dict(device_memory_limit=120_000)  # shards on the host until the warm-up's trace places them


class Watch(Callback):
    """What the optimizer holds after the restore and after the first step."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.seen["tensors at start"] = sum(torch.is_tensor(v) for st in opt.state.values() for v in st.values())
        self.seen["lr at start"] = [g["lr"] for g in opt.param_groups]

    def on_train_batch_end(self, trainer, *args):
        if "tensors after a step" not in self.seen:
            opt = trainer.optimizers[0]
            self.seen["tensors after a step"] = sum(
                torch.is_tensor(v) for st in opt.state.values() for v in st.values()
            )


def resume(path, strategy, steps=12, callbacks=()):
    L.seed_everything(11, verbose=False)
    m = ParityNet(variant="tied")
    t = trainer(strategy, steps, callbacks=list(callbacks))
    t.fit(m, token_data(), ckpt_path=path)
    return m, t


def test_the_state_waits_for_the_first_step_and_the_run_goes_on_as_plain_lightning_s(tmp_path):
    """Nothing per parameter is in memory between the restore and the first step; the learning rate the scheduler
    had lowered is back at once; the resumed run ends where plain Lightning's resume of its own checkpoint does, bit
    for bit."""
    train_and_save(tmp_path, chunk(**LIMIT))
    train_and_save(tmp_path / "auto", "auto")
    straight, _ = resume(tmp_path / "auto" / "step=8.ckpt", "auto")
    watch = Watch()
    resumed, _ = resume(tmp_path / "step=8.ckpt", chunk(**LIMIT), callbacks=[watch])
    assert watch.seen["tensors at start"] == 0
    assert watch.seen["lr at start"] == [5e-3, 5e-3]  # StepLR halved it at step 5; the groups load at the restore
    assert watch.seen["tensors after a step"] > 0
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


class SaveAtStart(Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("target", ["another", "the same"])
def test_a_save_before_the_first_step_holds_the_state_it_resumed_from(tmp_path, target):
    """A save before the first step reads the state first, also when it replaces the checkpoint it resumed from
    (``last.ckpt``): resumed again, it ends where the first resume does."""
    train_and_save(tmp_path, chunk(**LIMIT))
    first = tmp_path / "step=8.ckpt"
    shutil.copytree(first, tmp_path / "kept.ckpt")
    ref, _ = resume(tmp_path / "kept.ckpt", chunk(**LIMIT))
    again = tmp_path / "again.ckpt" if target == "another" else first
    resume(first, chunk(**LIMIT), steps=9, callbacks=[SaveAtStart(again)])
    out, _ = resume(again, chunk(**LIMIT))
    for a, b in zip(ref.parameters(), out.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


class ReplaceAtStart(Callback):
    def __init__(self, path, other) -> None:
        self.path, self.other = path, other

    def on_train_start(self, trainer, pl_module):
        self.path.rename(self.path.with_name("moved"))
        self.other.rename(self.path)


def test_a_checkpoint_replaced_before_the_first_step_is_refused_naming_it(tmp_path):
    train_and_save(tmp_path, chunk(**LIMIT))
    train_and_save(tmp_path / "other", chunk(**LIMIT), steps=4)
    path = tmp_path / "step=8.ckpt"
    with pytest.raises(CheckpointError, match="changed between the restore and the first optimizer step"):
        resume(path, chunk(**LIMIT), callbacks=[ReplaceAtStart(path, tmp_path / "other" / "step=4.ckpt")])


def test_a_fit_resumed_with_no_step_left_keeps_the_state_for_a_save_after_it(tmp_path):
    """Resumed at its last step, a fit steps no more: its end reads the state, and ``save_checkpoint`` after ``fit``
    writes it."""
    train_and_save(tmp_path, chunk(**LIMIT))
    shutil.copytree(tmp_path / "step=8.ckpt", tmp_path / "kept.ckpt")
    ref, _ = resume(tmp_path / "kept.ckpt", chunk(**LIMIT))
    _, t = resume(tmp_path / "step=8.ckpt", chunk(**LIMIT), steps=8)
    t.save_checkpoint(tmp_path / "after.ckpt")
    out, _ = resume(tmp_path / "after.ckpt", chunk(**LIMIT))
    for a, b in zip(ref.parameters(), out.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def test_with_the_defaults_accumulation_and_a_reordered_model_it_goes_on_as_plain_lightning_s(tmp_path):
    """The defaults a user gets (automatic chunk size) under a device limit, a model used in another order than
    registered (the resumed warm-up repacks every piece), two micro-batches a step, saved in the middle: the state
    read after that repack continues as plain Lightning's resume does, bit for bit, optimizer state included."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_chunk import ChunkOffloadStrategy
    from lightning_chunk.options import grouped
    from tests.models import ReorderedNet

    def fit(strategy, steps, ckpt_dir=None, ckpt_path=None):
        L.seed_everything(11, verbose=False)
        m = ReorderedNet(variant="tied", dim=64, hidden=256, depth=3)
        cbs = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, filename="{step}")] if ckpt_dir else []
        t = trainer(strategy, steps, callbacks=cbs, enable_checkpointing=bool(cbs), accumulate_grad_batches=2)
        t.fit(m, token_data(), ckpt_path=ckpt_path)
        return m, t

    def chunked():
        return ChunkOffloadStrategy(
            **grouped(
                dict(
                    device_memory_limit=700_000,
                    chunk_numel_min=4096,
                    optimizer_kernel="loop",
                    materialize_optimizer_state=True,  # the state after fit, to compare
                )
            )
        )

    fit("auto", 4, ckpt_dir=tmp_path / "auto")
    fit(chunked(), 4, ckpt_dir=tmp_path / "chunk")
    ref, rt = fit("auto", 8, ckpt_path=tmp_path / "auto" / "step=4.ckpt")
    got, gt = fit(chunked(), 8, ckpt_path=tmp_path / "chunk" / "step=4.ckpt")
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    want, have = rt.optimizers[0].state_dict()["state"], gt.optimizers[0].state_dict()["state"]
    assert want.keys() == have.keys()
    for k, st in want.items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(have[k][name], st[name], **EXACT)
