"""[Note: param groups added while training]: ``optimizer.add_param_group`` mid-fit on one rank, bit-exact with plain
Lightning (the group's parameters unfrozen with it or trainable before it, under a limit, inside accumulation's
boundaries, through a checkpoint); what cannot be followed is refused naming where to add the group instead. Two
ranks: ``tests/distributed`` (case ``unfreeze``)."""

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
from lightning_chunk.engine import ChunkError
from lightning_chunk.options import grouped
from tests import callbacks
from tests.compare import EXACT, assert_same_params
from tests.models import TwoOptimizers, fit, quiet_trainer, token_data
from tests.optimizer_models import HeadAddedLater

LOOP = OffloadOptions(optimizer_kernel="loop")  # torch's own kernel, as plain Lightning steps AdamW on the CPU


@pytest.mark.parametrize(
    "frozen, accumulate, limit",
    [(True, 1, {}), (False, 1, {}), (True, 2, dict(device_memory_limit=90_000, chunk_numel=2048))],
    ids=["unfrozen-with-it", "trainable-before", "accumulating-under-a-limit"],
)
def test_a_param_group_added_mid_fit_trains_as_in_plain_lightning(frozen, accumulate, limit):
    """The head joins the optimizer before step 3 with a learning rate of its own. The next step failed in a zip
    inside the engine ("zip() argument 2 is shorter than argument 1")."""
    kw = dict(steps=8, cls=HeadAddedLater, model_kwargs=dict(frozen=frozen), accumulate_grad_batches=accumulate)
    ref = fit("auto", callbacks=[callbacks.AddHeadGroup(at=3)], **kw)
    strategy = ChunkOffloadStrategy(**grouped({**limit, "optimizer_kernel": "loop"}))
    got = fit(strategy, callbacks=[callbacks.AddHeadGroup(at=3)], **kw)
    assert_same_params(ref, got, EXACT)
    opt = got.trainer_ref.optimizers[0]
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == got.lr / 10
    assert opt.param_groups[1]["params"] == [got.head.weight]  # the module's again after fit, with whole state
    assert int(opt.state[got.head.weight]["step"]) == 8 - 3


class HeadLaterTwoOptimizers(TwoOptimizers):
    """``TwoOptimizers`` (manual optimization, AdamW then SGD a batch, each clipping) with the head frozen and in
    neither; ``AddHeadGroup`` adds it to the AdamW, whose new group takes a number past the SGD's."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.head.requires_grad_(False)

    def configure_optimizers(self):
        adamw, sgd = super().configure_optimizers()
        sgd.param_groups[0]["params"] = [p for p in sgd.param_groups[0]["params"] if p is not self.head.weight]
        return adamw, sgd


class ChunkGroups(L.Callback):
    """Each optimizer's group numbers and each chunk's, at the end of training."""

    def on_train_end(self, trainer, pl_module):
        eng = trainer.strategy.engine
        self.groups = [list(b.groups) for b in eng.bindings]
        self.keys = {
            c.spec.key.group: [eng.manager.names[t.slot.param_index] for t in c.tensors] for c in eng.manager.chunks
        }


def test_a_group_added_to_the_first_of_two_optimizers_trains_as_in_plain_lightning():
    """The AdamW's new group takes number 2, past the SGD's 1: a chunk holds the parameters of one group."""
    kw = dict(steps=12, cls=HeadLaterTwoOptimizers)
    ref = fit("auto", callbacks=[callbacks.AddHeadGroup(at=4)], **kw)
    seen = ChunkGroups()
    limit = dict(device_memory_limit=200_000, chunk_numel=2048, optimizer_kernel="loop")
    got = fit(ChunkOffloadStrategy(**grouped(limit)), callbacks=[callbacks.AddHeadGroup(at=4), seen], **kw)
    assert_same_params(ref, got, EXACT)
    assert not torch.equal(got.head.weight, fit("auto", **kw).head.weight)
    assert seen.groups == [[0, 2], [1]]
    assert seen.keys[2] == ["head.weight"]


def test_a_checkpoint_after_a_group_was_added_resumes_with_it_or_names_the_count(tmp_path):
    """The group's state is saved by parameter name; a run that builds the group in ``configure_optimizers`` resumes
    as plain Lightning does, and one that does not is told how many groups the checkpoint had."""
    paths = {}
    for name, strategy in (("ref", "auto"), ("got", ChunkOffloadStrategy(offload=LOOP))):
        m = fit(strategy, steps=5, cls=HeadAddedLater, callbacks=[callbacks.AddHeadGroup(at=3)])
        paths[name] = str(tmp_path / f"{name}.ckpt")
        m.trainer_ref.save_checkpoint(paths[name])
    resumed = dict(steps=9, cls=HeadAddedLater, model_kwargs=dict(frozen=False, head_group=True))
    ref = fit("auto", ckpt_path=paths["ref"], **resumed)
    got = fit(ChunkOffloadStrategy(offload=LOOP), ckpt_path=paths["got"], **resumed)
    assert_same_params(ref, got, EXACT)
    with pytest.raises(ValueError, match=r"has 2 param groups, the optimizer has 1.*add_param_group"):
        fit(ChunkOffloadStrategy(offload=LOOP), ckpt_path=paths["got"], steps=9, cls=HeadAddedLater)


class AddInsideAccumulation(callbacks.AddHeadGroup):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 3:
            trainer.optimizers[0].add_param_group({"params": [pl_module.head.weight]})


class AddBeforeTheStep(callbacks.AddHeadGroup):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 2:
            optimizer.add_param_group({"params": [pl_module.head.weight]})


class AddTwice(callbacks.AddHeadGroup):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            trainer.optimizers[0].add_param_group({"params": [pl_module.head.weight, pl_module.embed.weight]})


class AddATensor(callbacks.AddHeadGroup):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            trainer.optimizers[0].add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 5))]})


class AddALateParameter(callbacks.AddHeadGroup):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            pl_module.extra = torch.nn.Linear(3, 3)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.extra.parameters())})


@pytest.mark.parametrize(
    "callback, error, match",
    [
        (
            AddInsideAccumulation,
            ChunkError,
            "inside a step whose gradients are being accumulated",
        ),
        (AddBeforeTheStep, ChunkError, "has 2 param groups at this step but had 1 when the step began"),
        (AddTwice, ValueError, "'embed.weight' is in a param group already"),
        (AddATensor, ValueError, r"a tensor of shape \(3, 5\) that is not a parameter of the module"),
        (AddALateParameter, ValueError, r"shape \(3, 3\) that became a parameter of the module after fit began"),
    ],
    ids=["inside-accumulation", "before-the-step", "a-parameter-twice", "not-a-parameter", "a-late-parameter"],
)
def test_a_param_group_that_cannot_be_followed_is_refused_naming_why(callback, error, match):
    """A refused group leaves the optimizer as it was, as torch's ``add_param_group`` refuses: the
    teardown after the error met a group the engine never bound and warned of an ``IndexError``."""
    L.seed_everything(7, verbose=False)
    model = HeadAddedLater(frozen=False)
    accumulate = 2 if callback is AddInsideAccumulation else 1
    trainer = quiet_trainer(
        strategy=ChunkOffloadStrategy(), max_steps=5, callbacks=[callback()], accumulate_grad_batches=accumulate,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as said, pytest.raises(error, match=match):
        warnings.simplefilter("always")
        trainer.fit(model, token_data())
    assert not [w for w in said if "tearing down" in str(w.message)], [str(w.message) for w in said]
    assert len(trainer.optimizers[0].param_groups) == 1


class WithBackbone(HeadAddedLater):
    """What Lightning's ``BackboneFinetuning`` asks of a module: a ``backbone``, frozen by the callback at set-up, and
    an optimizer over the parameters that require grad."""

    def __init__(self, **kw) -> None:
        super().__init__(frozen=False, **kw)

    @property
    def backbone(self):
        return self.blocks

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.1)


def _backbone_fit(strategy, tmp_path, name, steps, **kw):
    """Saved at ``steps`` inside the fit (a sharded directory where the strategy writes one), as ``name``."""
    from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint

    cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)
    saves = ModelCheckpoint(dirpath=tmp_path, filename=name, every_n_train_steps=steps, save_top_k=-1)
    m = fit(strategy, cls=WithBackbone, steps=steps, callbacks=[cb, saves], enable_checkpointing=True, **kw)
    return m, str(tmp_path / f"{name}.ckpt")


@pytest.mark.parametrize(
    "saves",
    [dict(state_dict_type="full"), dict(state_dict_type="sharded"), dict(placement="host")],
    ids=["file", "sharded", "released"],
)
def test_backbone_finetuning_trains_and_resumes_as_in_plain_lightning(tmp_path, saves):
    """[Note: finetuning callbacks]: ``BackboneFinetuning`` froze the backbone at set-up, then unfroze it at epoch 1
    with a param group of its own whose learning rate it raises every epoch. It was refused: it finds the optimizer's
    parameters by identity (a ``KeyError`` on the views) and adds a param group while training. Now it trains as in
    plain Lightning, and a resume after the unfreezing adds its group back before the optimizer state loads. With the
    backbone released between steps (host placement), its check of which parameters the optimizer holds compares
    their placeholders' values, and is not refused."""
    kw = dict(limit_train_batches=4, default_root_dir=str(tmp_path))
    ref, ref_ckpt = _backbone_fit("auto", tmp_path, "ref", 10, **kw)
    chunk = dict(optimizer_kernel="loop", **saves)
    got, got_ckpt = _backbone_fit(ChunkOffloadStrategy(**grouped(chunk)), tmp_path, "got", 10, **kw)
    assert_same_params(ref, got, EXACT)
    groups = got.trainer_ref.optimizers[0].param_groups
    assert len(groups) == 2 and {id(p) for p in groups[1]["params"]} == {id(p) for p in got.blocks.parameters()}
    assert not torch.equal(got.blocks[0][1].weight, fit("auto", steps=0, cls=WithBackbone).blocks[0][1].weight)
    ref, _ = _backbone_fit("auto", tmp_path, "ref2", 18, ckpt_path=ref_ckpt, **kw)
    got, _ = _backbone_fit(ChunkOffloadStrategy(**grouped(chunk)), tmp_path, "got2", 18, ckpt_path=got_ckpt, **kw)
    assert_same_params(ref, got, EXACT)
    assert got.trainer_ref.optimizers[0].param_groups[1]["lr"] == ref.trainer_ref.optimizers[0].param_groups[1]["lr"]
    (cb,) = [c for c in got.trainer_ref.callbacks if type(c).__name__ == "BackboneFinetuning"]
    assert "_store" not in cb.__dict__ and not cb._restarting  # its own methods again after fit, nothing pending
    assert Path(got_ckpt).is_dir() == (saves.get("state_dict_type") != "full")


class BackboneInTheOptimizer(WithBackbone):
    """An optimizer over every parameter, the frozen backbone's too: ``BackboneFinetuning`` then finds the backbone
    in the optimizer, warns, and adds no group; the backbone trains in the group it was in once unfrozen."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_backbone_finetuning_skips_a_backbone_the_optimizer_holds_as_in_plain_lightning(tmp_path, placement):
    """[Note: finetuning callbacks]: its check of which parameters the optimizer holds compares values, and the
    optimizer's views never equal the module's parameters: the backbone was added a second time and refused ("is in
    a param group already"). Now it is skipped with Lightning's warning, and trains as in plain Lightning."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    def run(strategy):
        cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
        return fit(strategy, cls=BackboneInTheOptimizer, steps=8, callbacks=[cb], limit_train_batches=4)

    ref = run("auto")
    with pytest.warns(UserWarning, match="already exist within another group"):
        got = run(ChunkOffloadStrategy(**grouped(dict(optimizer_kernel="loop", placement=placement))))
    assert_same_params(ref, got, EXACT)
    assert len(got.trainer_ref.optimizers[0].param_groups) == 1
    assert not torch.equal(got.blocks[0][1].weight, fit("auto", steps=0, cls=WithBackbone).blocks[0][1].weight)
    from lightning.pytorch.callbacks import BaseFinetuning

    assert (
        BaseFinetuning.__dict__["filter_on_optimizer"].__func__.__module__ == BaseFinetuning.__module__
    )  # Lightning's
