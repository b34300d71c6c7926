"""What a user's own code reads inside a step, from the user's side: gradient norms (``grad_norm`` and by hand),
parameters iterated for a penalty, reparametrised weights and references kept to a parameter; one rank against plain
Lightning ([Note: gradients read where they are not])."""

import contextlib
import warnings

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, ReadsGrads, fit, quiet_trainer, token_data

STEPS = 12


class LogsGradNorm(ParityNet):
    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.norms.append(grad_norm(self, norm_type=2))
        with self.trainer.strategy.full_parameters(with_grads=True):
            self.inside.append(grad_norm(self, norm_type=2))


def test_grad_norm_outside_full_parameters_warns_once_and_inside_it_gives_the_norms():
    L.seed_everything(7, verbose=False)
    model = LogsGradNorm()
    model.norms, model.inside = [], []
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=3)
    with pytest.warns(UserWarning, match=r"reads no gradients") as seen:
        trainer.fit(model, token_data())
    assert sum("reads no gradients" in str(w.message) for w in seen) == 1
    assert model.norms == [{}, {}, {}]  # what grad_norm sees outside: nothing, as before, but now said
    assert all(d["grad_2.0_norm_total"] > 0 for d in model.inside)


class SumsGradNorms(ReadsGrads):
    """A norm of the gradients by hand over ``self.parameters()``, as a user logs it: outside the block (nothing to
    read under chunk_offload) and inside it."""

    def __init__(self, manual: bool = False, **kw) -> None:
        super().__init__(manual, **kw)
        self.outside, self.inside = [], []

    def read_grads(self):
        strategy = self.trainer.strategy
        block = strategy.full_parameters(with_grads=True) if hasattr(strategy, "engine") else contextlib.nullcontext()
        with block:
            norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
            self.inside.append(float(torch.stack(norms).norm()))
        # after the block: in a manual step, parameters read after backward are held to the next micro-batch, and
        # full_parameters() refuses to gather while they are (``test_full_parameters_after_parameters_were_...``)
        self.outside.append([n for n, p in self.named_parameters() if p.grad is not None])


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_gradient_read_by_hand_outside_full_parameters_warns_once_naming_it_and_inside_is_plain_lightning_s(manual):
    """[Note: gradients read where they are not]: ``p.grad`` read between backward and the step was ``None`` without
    a word (only ``grad_norm`` said so): a norm summed by hand skipped every parameter."""
    models_ = {}
    loop = OffloadOptions(optimizer_kernel="loop")
    for name, strategy in (("ref", "auto"), ("got", ChunkOffloadStrategy(offload=loop))):
        L.seed_everything(7, verbose=False)
        model = models_[name] = SumsGradNorms(manual=manual, scheduler=False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_trainer(strategy=strategy, max_steps=3, limit_val_batches=0).fit(model, token_data())
        said = [str(w.message) for w in seen if "was read between backward and the optimizer step" in str(w.message)]
        assert len(said) == (name == "got") and (not said or "param.grad of 'embed.weight'" in said[0]), said
    assert models_["got"].outside == [[], [], []] and len(models_["ref"].outside[0]) == 16
    assert models_["got"].inside == pytest.approx(models_["ref"].inside, rel=1e-6)


class ReadsThenGathers(SumsGradNorms):
    def read_grads(self):
        self.outside.append([n for n, p in self.named_parameters() if p.grad is not None])
        with self.trainer.strategy.full_parameters(with_grads=True):
            pass


def test_full_parameters_after_parameters_were_iterated_in_a_manual_step_names_that_read():
    """The parameters a manual step iterates after its backward are held to the next micro-batch: the block refused
    saying it was entered between a forward and its backward, which had ended."""
    from lightning_chunk.engine import ChunkError

    L.seed_everything(7, verbose=False)
    model = ReadsThenGathers(manual=True, scheduler=False)
    with pytest.raises(ChunkError, match=r"16 parameters read by iteration in this training_step are in use"):
        quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=2, limit_val_batches=0).fit(model, token_data())


class L2Penalty(ParityNet):
    """An L2 penalty over ``self.parameters()`` in ``training_step``, and the values recorded there: reads by
    iteration, held for the micro-batch (its backward reads them), not adopted for good."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 2:
            self.seen = [p.detach().clone() for p in self.parameters()]
        return loss + 1e-3 * sum(p.pow(2).sum() for p in self.parameters())


@pytest.mark.parametrize(
    "kw", [dict(placement="host"), dict(device_memory_limit=100_000, chunk_numel=4096)], ids=["host", "evicting_limit"]
)
def test_parameters_iterated_in_training_step_are_read_and_differentiated_like_plain_lightning(kw, caplog):
    ref = fit("auto", steps=STEPS, cls=L2Penalty)
    with caplog.at_level("INFO", logger="lightning_chunk.engine.runtime.hooks"):
        got = fit(ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"})), steps=STEPS, cls=L2Penalty)
    assert_same_params(ref, got, EXACT)
    for a, b in zip(ref.seen, got.seen, strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    assert "is read by" not in caplog.text  # held for each micro-batch, adopted by no module
    if "device_memory_limit" in kw:
        assert got.trainer_ref.strategy.memory_stats()["evictions"] > 0


class Reparametrised(ParityNet):
    """Weight reparametrisations (``torch.nn.utils.parametrize``): weight norm on a block, and an identity
    parametrization on the head, whose ``weight`` is then its ``original`` parameter itself."""

    def build(self) -> None:
        from torch.nn.utils import parametrizations, parametrize

        super().build()
        parametrizations.weight_norm(self.blocks[0][1])
        parametrize.register_parametrization(self.head, "weight", torch.nn.Identity())


@pytest.mark.parametrize(
    "kw", [dict(placement="host"), dict(device_memory_limit=100_000, chunk_numel=4096)], ids=["host", "evicting_limit"]
)
def test_reparametrised_weights_train_like_plain_lightning(kw):
    """[Note: leaf modules]: the identity's ``original`` was let go at its ParametrizationList's end and the head
    read NaN (host placement). A parametrized module is a leaf."""
    ref = fit("auto", steps=STEPS, cls=Reparametrised)
    got = fit(ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"})), steps=STEPS, cls=Reparametrised)
    assert_same_params(ref, got, EXACT)


class CapturedReference(ParityNet):
    """A tied head through a reference kept in a plain list: no module attribute is read, so the watch cannot see
    it; the warm-up's check of every op can."""

    def build(self) -> None:
        super().build()
        del self.head
        self.refs = [self.embed.weight]

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for blk in self.blocks:
            h = h + blk(h)
        return self.norm(h) @ self.refs[0].T


def test_a_released_parameter_read_through_a_kept_reference_fails_at_once_naming_it_and_the_fix():
    """Never NaN: the warm-up's first forward raises, naming the parameter and leaf_modules, before any step."""
    with pytest.raises(
        Exception,
        match=r"matmul read parameter 'embed.weight' while its chunk was released.*"
        r"leaf_modules",
    ) as info:
        fit(ChunkOffloadStrategy(placement="host"), steps=4, cls=CapturedReference)
    assert info.value.__class__.__name__ == "ChunkError"
    ref = fit("auto", steps=STEPS, cls=CapturedReference)  # the fix it names: the root as a leaf
    got = fit(
        ChunkOffloadStrategy(
            placement="host",
            memory=MemoryOptions(leaf_modules=[CapturedReference]),
            offload=OffloadOptions(optimizer_kernel="loop"),
        ),
        steps=STEPS,
        cls=CapturedReference,
    )
    assert_same_params(ref, got, EXACT)


class PenaltyEveryFifth(ParityNet):
    """An L2 penalty through a reference kept in a plain list, on every fifth step only: after the warm-up."""

    def build(self) -> None:
        super().build()
        self.refs = [self.blocks[0][1].weight]

    def penalised(self):
        return self.refs[0]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 1e-3 * self.penalised().pow(2).sum() if batch_idx % 5 == 4 else loss


class PenaltyByAttribute(PenaltyEveryFifth):
    def penalised(self):
        return self.blocks[0][1].weight


class PenaltyOnAView(PenaltyEveryFifth):
    """The kept reference's view (``.T``) read: the view reads no values, the op on it does."""

    def penalised(self):
        return self.refs[0].T


class PenaltyOnAViewByAttribute(PenaltyEveryFifth):
    def penalised(self):
        return self.blocks[0][1].weight.T


@pytest.mark.parametrize(
    "cls, by_attribute",
    [(PenaltyEveryFifth, PenaltyByAttribute), (PenaltyOnAView, PenaltyOnAViewByAttribute)],
    ids=["the_parameter", "a_view"],
)
def test_a_kept_reference_read_only_after_the_warm_up_fails_naming_it_and_never_trains_to_nan(cls, by_attribute):
    """[Note: a parked parameter's class]: the warm-up's check of every op never saw the read, and under an evicting
    limit (always set on a GPU) the step computed with NaN and trained every weight to NaN, silently. The
    parameters' own class is back after fit, and reading by attribute (the fix named) trains as plain Lightning."""
    limit = dict(device_memory_limit=90_000, chunk_numel=2_100, optimizer_kernel="loop")
    with pytest.raises(
        Exception, match=r"pow read parameter 'blocks.0.1.weight' while its chunk was released.*as an attribute"
    ) as info:
        fit(ChunkOffloadStrategy(**grouped(limit)), steps=8, cls=cls)
    assert info.value.__class__.__name__ == "ChunkError"
    ref = fit("auto", steps=8, cls=by_attribute)
    got = fit(ChunkOffloadStrategy(**grouped(limit)), steps=8, cls=by_attribute)
    assert_same_params(ref, got, EXACT)
    assert got.trainer_ref.strategy.memory_stats()["evictions"] > 0
    assert {type(p) for p in got.parameters()} == {torch.nn.Parameter}


# ------------------------------------------------------------------ configure_optimizers returning None
