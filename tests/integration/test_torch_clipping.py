"""torch's ``clip_grad_norm_``/``clip_grad_value_`` on ``self.parameters()`` between backward and the step, where a
Lightning user clips by hand (``on_before_optimizer_step``, ``on_after_backward``, after a manual backward):
[Note: gradients read where they are not] in precision.py. The gradients are in the shards there and ``param.grad`` is
``None``: it clipped nothing and returned a norm of 0, and training went on unclipped, silently. Now it raises naming
the ways that work, and each of them trains as plain Lightning does. Two of those ways failed inside the engine in
manual optimization: ``full_parameters`` in ``training_step`` under host placement (the step's watch held the
parameters read inside the block, which then could not let them go), and ``with_grads=True`` in the first step of a
model used in another order than registered (the chunks were listed before the warm-up's repack replaced them)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
from lightning_chunk.engine import ChunkError
from tests.integration.test_user_paths import EXACT, assert_same_params
from tests.models import ParityNet, fit

STEPS = 4


def clip(module: Clips, optimizer) -> None:
    """What the case asks for: torch's function, inside ``full_parameters(with_grads=True)`` or not, or
    Lightning's ``clip_gradients``. Records the norm torch's function returned."""
    how, inside = module.how
    if how == "clip_gradients":
        module.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        return
    strategy = module.trainer.strategy
    full = strategy.full_parameters(with_grads=True) if inside and hasattr(strategy, "full_parameters") else None
    with full or contextlib.nullcontext():
        if how == "norm":
            module.norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), 0.05)))
        else:
            torch.nn.utils.clip_grad_value_(module.parameters(), 1e-3)


class Clips(ParityNet):
    """``how``: what ``clip`` does (torch's function and whether inside the block, or ``clip_gradients``)."""

    manual = False

    def __init__(self, how: tuple[str, bool], **kw) -> None:
        super().__init__(**kw)
        self.how, self.norms = how, []
        self.automatic_optimization = not self.manual


class ClipsBeforeTheStep(Clips):
    def on_before_optimizer_step(self, optimizer):
        clip(self, optimizer)


class ClipsAfterBackward(Clips):
    def on_after_backward(self):
        clip(self, self.trainer.optimizers[0])


class ClipsInManualOptimization(Clips):
    manual = True

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        logits = self(x, use_branch=batch_idx % 3 == 0)  # the "unused" variant's branch: some steps only
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)))
        clip(self, optimizer)
        optimizer.step()


CLASSES = [ClipsBeforeTheStep, ClipsAfterBackward, ClipsInManualOptimization]


def train(strategy, cls, how, variant="plain"):
    return fit(strategy, steps=STEPS, cls=cls, variant=variant, model_kwargs={"how": how})


def chunk() -> ChunkOffloadStrategy:
    return ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop"))


@pytest.mark.parametrize("cls", CLASSES, ids=["before_step", "after_backward", "manual"])
@pytest.mark.parametrize("how", ["norm", "value"])
def test_torch_clipping_outside_full_parameters_raises_naming_what_works(cls, how):
    name = "clip_grad_norm_" if how == "norm" else "clip_grad_value_"
    with pytest.raises(ChunkError, match=rf"torch\.nn\.utils\.{name} found no gradients") as info:
        train(chunk(), cls, (how, False))
    said = str(info.value)
    assert "gradient_clip_val" in said and "self.clip_gradients(" in said and "full_parameters(with_grads=True)" in said


@pytest.mark.parametrize("cls", CLASSES, ids=["before_step", "after_backward", "manual"])
@pytest.mark.parametrize(
    "how, variant",
    [
        (("norm", True), "plain"),
        (("value", True), "plain"),
        (("norm", True), "unused"),
        (("clip_gradients", False), "plain"),
    ],
    ids=["norm_inside", "value_inside", "norm_inside_unused_branch", "clip_gradients"],
)
def test_the_ways_the_error_names_clip_as_plain_lightning_does(cls, how, variant):
    """A parameter without a gradient inside ``full_parameters`` (a branch unused at some steps, registered last and
    used before the head: the first step repacks) is not taken for the gradients being elsewhere."""
    ref = train("auto", cls, how, variant)
    got = train(chunk(), cls, how, variant)
    assert_same_params(ref, got, EXACT)
    assert got.norms == ref.norms and (how[0] != "norm" or min(ref.norms) > 0.05)  # the norms clipping saw


@pytest.mark.parametrize("how", ["group_norms", "total_norm", "manual", "value"])
def test_clipping_over_the_optimizer_s_parameters_on_one_rank_is_plain_lightning_s(how):
    """[Note: a norm over the optimizer's gradient shards]: on one rank the optimizer's views are the parameters
    whole, so torch's functions over ``optimizer.param_groups`` clip as in plain Lightning (two ranks refuse the
    norm: ``test_two_rank_paths.py``)."""
    from tests.optimizer_models import ClipsOptimizerParams

    ref = fit("auto", steps=STEPS, cls=ClipsOptimizerParams, model_kwargs={"how": how})
    got = fit(chunk(), steps=STEPS, cls=ClipsOptimizerParams, model_kwargs={"how": how})
    assert_same_params(ref, got, EXACT)
