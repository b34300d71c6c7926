"""Parameters read between steps ([Note: a released parameter], [Note: parameters outside a step]); writes between
steps are in test_writes_between_steps.py.

Before: with host placement (and with several ranks, where the payloads go after each step) a callback that read a
weight between steps read freed memory and crashed the process with a segmentation fault."""

import contextlib
import math

import lightning as L
import pytest
import torch
from torch._C import _len_torch_function_stack

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine import ChunkError
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import ManualNet, ParityNet, fit, token_data


def chunked(**kw):
    return ChunkOffloadStrategy(**grouped({**kw, "chunk_numel": 4096, "optimizer_kernel": "loop"}))


class ReadBetweenSteps(L.Callback):
    """Reads ``head.weight``'s metadata, its values and writes into it, between steps; through a reference kept from
    before training too (which the watch on module attributes does not see)."""

    def __init__(self) -> None:
        self.seen, self.errors = [], {}

    def setup(self, trainer, pl_module, stage):
        self.kept = [pl_module.head.weight]  # before the engine is set up

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:  # first thing after the step: no attribute read yet
            for what, op in (("kept read", lambda: self.kept[0].norm()), ("kept", lambda: self.kept[0].mul_(0))):
                with pytest.raises(ChunkError) as e, torch.no_grad():
                    op()
                self.errors[what] = str(e.value)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        w = pl_module.head.weight
        self.seen.append((tuple(w.shape), w.dtype, w.device, w.requires_grad, w.numel()))
        # what code that counts, lists or checks parameters asks (``type()``, ``is_pinned()``... were refused)
        self.seen.append((w.type(), w.is_complex(), w.is_signed(), w.is_pinned(), w.is_inference(), w.dim_order()))
        for what, op in (("read", lambda: torch.isnan(w).all()), ("write", lambda: w.mul_(0))):
            with pytest.raises(ChunkError) as e, torch.no_grad():
                op()
            self.errors[what] = str(e.value)


def test_a_released_parameter_keeps_its_metadata_and_refuses_reads_and_writes_naming_it():
    """Before, a read gave NaN without a word ([Note: released parameters read between steps]); a write was refused
    by the placeholder ([Note: a released parameter]), which still refuses one through a reference kept from before."""
    cb = ReadBetweenSteps()
    fit(chunked(placement="host"), steps=4, callbacks=[cb])
    assert (
        cb.seen
        == [
            ((48, 32), torch.float32, torch.device("cpu"), True, 48 * 32),
            ("torch.FloatTensor", False, True, False, False, (0, 1)),
        ]
        * 4
    )
    assert cb.errors["read"].startswith("isnan read parameter 'head.weight' between steps")
    assert cb.errors["write"].startswith("mul_ wrote into parameter 'head.weight' between steps")
    assert "full_parameters()" in cb.errors["read"] and "the write would be lost" in cb.errors["write"]
    assert cb.errors["kept read"].startswith("norm read parameter 'head.weight' between steps")  # was NaN, silently
    assert cb.errors["kept"].startswith("mul_ wrote into parameter 'head.weight' between steps")


class ReadsAKeptReference(L.Callback):
    """Reads a weight through a list made before training, in ``hook``: the watch on module attributes sees nothing."""

    def __init__(self, hook: str) -> None:
        self.hook, self.errors = hook, []

    def setup(self, trainer, pl_module, stage):
        self.kept = [pl_module.head.weight]

    def __getattribute__(self, name):
        if name == object.__getattribute__(self, "hook"):
            return lambda *a, **k: self._read()
        return object.__getattribute__(self, name)

    def _read(self):
        try:
            self.kept[0].sum()
        except ChunkError as e:
            self.errors.append(str(e))


@pytest.mark.parametrize(
    "hook, where",
    [
        ("on_fit_start", "between steps"),
        ("on_train_batch_end", "between steps"),  # after a micro-batch of an accumulation, and after the step
        ("on_after_backward", "between the backward and the optimizer step"),
        ("on_before_optimizer_step", "between the backward and the optimizer step"),
        ("on_validation_batch_end", "between steps"),
    ],
)
def test_a_released_weight_read_through_a_kept_reference_is_refused_wherever_the_user_code_runs(hook, where):
    """Before: NaN, without a word, in every one of these hooks (the watch sees reads by attribute or iteration)."""
    cb = ReadsAKeptReference(hook)
    val = dict(val_dataloaders=token_data(16, seed=1), limit_val_batches=2, val_check_interval=4)
    fit(chunked(placement="host"), steps=4, callbacks=[cb], accumulate_grad_batches=2, **val)
    calls = {"on_fit_start": 1, "on_before_optimizer_step": 4, "on_validation_batch_end": 4}.get(hook, 8)
    assert len(cb.errors) == calls
    assert all(e.startswith(f"sum read parameter 'head.weight' {where}") for e in cb.errors), cb.errors[0]


class ForwardOutsideAStep(L.Callback):
    """A forward in ``on_train_batch_end`` (a sample generated every step), then a read through a kept reference."""

    def __init__(self) -> None:
        self.after, self.outputs = [], []

    def setup(self, trainer, pl_module, stage):
        self.kept = [pl_module.head.weight]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            self.outputs.append(pl_module(batch[0]))
        self.after.append(_len_torch_function_stack())
        if isinstance(trainer.strategy, ChunkOffloadStrategy):
            with pytest.raises(ChunkError, match="'head.weight' between steps"):
                self.kept[0].sum()


def test_a_forward_outside_a_step_under_the_check_computes_plain_lightning_s_outputs_and_leaves_the_check_on():
    """Its modules' hooks gather what the forward reads while the check looks at every op."""
    ref_cb, got_cb = ForwardOutsideAStep(), ForwardOutsideAStep()
    ref, got = fit("auto", steps=3, callbacks=[ref_cb]), fit(chunked(placement="host"), steps=3, callbacks=[got_cb])
    assert_same_params(ref, got, EXACT)
    for a, b in zip(ref_cb.outputs, got_cb.outputs, strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    assert ref_cb.after == [0] * 3 and got_cb.after == [1] * 3


class ManualSteps(ManualNet):
    """Manual optimization with a step every other micro-batch; whether the check is armed after the backward and
    the step, inside ``training_step``, and a read through a kept reference in ``on_train_batch_end``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.in_step, self.refused = [], []

    def setup(self, stage):
        self.kept = [self.head.weight]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        between = getattr(getattr(self.trainer.strategy, "engine", None), "hooks", None)
        self.in_step.append(between is not None and between.between._mode is not None)  # the check, armed
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if isinstance(self.trainer.strategy, ChunkOffloadStrategy):
            with pytest.raises(ChunkError, match="'head.weight' between steps"):
                self.kept[0].sum()
            self.refused.append(batch_idx)


def test_manual_optimization_is_checked_after_its_training_step_and_not_inside_it():
    """The check went on after the first ``manual_backward``, inside the step, and every later op of the step paid
    for it (a GAN's second forward and backward); after the step it is on."""
    ref, got = fit("auto", steps=6, cls=ManualSteps), fit(chunked(placement="host"), steps=6, cls=ManualSteps)
    assert_same_params(ref, got, EXACT)
    assert got.in_step == [False] * 12 and got.refused == list(range(12))


class ClampsItsScale(ParityNet):
    """CLIP's learned temperature, clamped after every step; under chunk_offload inside ``full_parameters`` given the
    parameter itself (``"one"``) or a list of it (``"list"``)."""

    def __init__(self, given: str = "one", **kw) -> None:
        super().__init__(**kw)
        self.given = given
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x) * self.logit_scale.exp() / 14.0
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        full = getattr(self.trainer.strategy, "full_parameters", None)
        what = self.logit_scale if self.given == "one" else [self.logit_scale]
        with full(what) if full else contextlib.nullcontext(), torch.no_grad():
            self.logit_scale.clamp_(0, 2.62)


@pytest.mark.parametrize("given", ["one", "list"])
def test_full_parameters_of_one_parameter_clamps_it_like_plain_lightning(given):
    """Before, ``full_parameters`` took a module only: a scale on the LightningModule itself meant gathering the
    whole model to clamp one number."""
    run = dict(steps=6, cls=ClampsItsScale, model_kwargs=dict(given=given))
    ref, got = fit("auto", **run), fit(chunked(placement="host"), **run)
    assert_same_params(ref, got, EXACT)
    assert float(got.logit_scale) <= 2.62


class OwnEma(ParityNet):
    """An exponential average of the weights kept by hand, as many research code bases do: a copy taken in
    ``on_fit_start``, updated after every step over ``named_parameters()``; under chunk_offload inside
    ``full_parameters`` when ``block``."""

    def __init__(self, block: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.block = block

    def _full(self):
        full = getattr(self.trainer.strategy, "full_parameters", None)
        return full(writeback=False) if self.block and full else contextlib.nullcontext()

    def on_fit_start(self):
        with self._full():
            self.ema = {n: p.detach().clone() for n, p in self.named_parameters()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with self._full(), torch.no_grad():
            for n, p in self.named_parameters():
                self.ema[n].lerp_(p, 0.1)


@pytest.mark.parametrize("kw", [dict(placement="host"), dict(device_memory_limit=80_000)], ids=["host", "limit"])
def test_an_average_of_the_weights_kept_by_hand_is_refused_naming_the_parameter_and_inside_the_block_is_plain(kw):
    """Before, the average was NaN from its first copy on, without a word; Lightning's own reads of every parameter
    between steps (the model summary, ``zero_grad`` before validation) still pass."""
    with pytest.raises(ChunkError, match=r"clone read parameter '[\w.]+' between steps.*full_parameters\(\)"):
        fit(chunked(**kw), steps=4, cls=OwnEma)
    assert torch._C._len_torch_function_stack() == 0  # the failed fit's teardown took the check out
    run = dict(
        steps=6, val_dataloaders=token_data(16, seed=1), limit_val_batches=2, val_check_interval=2,
        enable_model_summary=True, model_kwargs=dict(block=True), cls=OwnEma,
    )  # fmt: skip
    ref, got = fit("auto", **run), fit(chunked(**kw), **run)
    assert_same_params(ref, got, EXACT)
    for n, v in ref.ema.items():
        torch.testing.assert_close(got.ema[n], v, msg=lambda m: f"{n}: {m}", **EXACT)


class NormBeforeTheStep(ParityNet):
    """A weight's norm taken in ``on_after_backward`` or ``on_before_optimizer_step``, where the gradients are in the
    shards and the parameter may be released; inside ``full_parameters`` when ``block``."""

    def __init__(self, hook: str = "on_after_backward", block: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.hook, self.block, self.norms = hook, block, []

    def _norm(self, hook: str) -> None:
        if hook == self.hook:
            full = getattr(self.trainer.strategy, "full_parameters", None)
            with full(writeback=False) if self.block and full else contextlib.nullcontext():
                self.norms.append(float(self.head.weight.norm()))

    def on_after_backward(self):
        self._norm("on_after_backward")

    def on_before_optimizer_step(self, optimizer):
        self._norm("on_before_optimizer_step")


@pytest.mark.parametrize("hook", ["on_after_backward", "on_before_optimizer_step"])
def test_a_released_weight_read_between_backward_and_the_step_is_refused_and_inside_the_block_is_plain(hook):
    """Before: NaN, without a word."""
    with pytest.raises(ChunkError, match="norm read parameter 'head.weight' between the backward and the optimizer"):
        fit(chunked(placement="host"), steps=2, cls=NormBeforeTheStep, model_kwargs=dict(hook=hook))
    run = dict(steps=4, cls=NormBeforeTheStep, model_kwargs=dict(hook=hook, block=True))
    ref, got = fit("auto", **run), fit(chunked(placement="host"), **run)
    assert got.norms == ref.norms and len(ref.norms) == 4
    assert_same_params(ref, got, EXACT)


class ReadsUnderAMode(L.Callback):
    """A released weight read inside another torch function mode the callback enters and leaves, then after it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch._C import _len_torch_function_stack

        self.stack = [_len_torch_function_stack()]
        with torch.device("cpu"):
            w = pl_module.head.weight
            with pytest.raises(ChunkError, match="'head.weight' between steps"):
                w.sum()
            self.stack.append(_len_torch_function_stack())
        self.stack.append(_len_torch_function_stack())
        with pytest.raises(ChunkError, match="'head.weight' between steps"):
            w.sum()

    def on_before_backward(self, trainer, pl_module, loss):
        from torch._C import _len_torch_function_stack

        self.stack_in_step = _len_torch_function_stack()


def test_the_check_between_steps_leaves_other_torch_function_modes_as_they_were():
    """The check is a mode that goes in under the ones open (it is there as the step ends, with parameters
    released); leaving the user's mode leaves the check, which the next micro-batch removes."""
    cb = ReadsUnderAMode()
    fit(chunked(placement="host"), steps=3, callbacks=[cb])
    assert cb.stack == [1, 2, 1] and cb.stack_in_step == 0 and _len_torch_function_stack() == 0
