"""What a user's own step does, from the user's side against plain Lightning on one rank: complex weights, a
training_step that returns None, gradients zeroed in place, hooks on the optimizer's step, a deep copy of the
model between steps. The paths a user takes first are in test_user_paths.py."""

import contextlib
import copy

import lightning as L
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
from lightning_chunk.engine import ChunkError
from lightning_chunk.options import grouped
from tests.backward_models import ZeroesInPlace
from tests.compare import EXACT, assert_same_params, relative_update_error
from tests.models import ParityNet, fit

STEPS = 12


# ------------------------------------------------------------------ complex weights
class SpectralMixer(ParityNet):
    """A Fourier layer after a 3-element parameter, its complex weight kept as is (``variant="complex"``) or as its
    real pair read through ``torch.view_as_complex`` (``variant="pair"``), as Fourier neural operators train; in
    fp32 whatever the payload's dtype, as torch's FFTs and complex numbers have no bf16."""

    def build(self) -> None:
        super().build()
        self.scale = torch.nn.Parameter(torch.ones(3))
        w = torch.randn(self.shape["dim"] // 2 + 1, dtype=torch.cfloat)
        self.spectral = torch.nn.Parameter(torch.view_as_real(w).clone() if self.variant == "pair" else w)

    def forward(self, x, use_branch=True):
        h = self.embed(x) * self.scale.mean()
        w = torch.view_as_complex(self.spectral.float()) if self.variant == "pair" else self.spectral
        h = h + torch.fft.irfft(torch.fft.rfft(h.float(), dim=-1) * w, n=h.shape[-1], dim=-1).to(h.dtype)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))

    def configure_optimizers(self):  # one group: the pair has two dimensions where the complex weight has one
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


def test_a_complex_weight_is_refused_naming_its_real_pair_which_trains_as_plain_lightning_trains_the_complex_one():
    """[Note: aligned parameters]: the pair after an odd-sized parameter sat at an odd offset in its chunk, and
    ``torch.view_as_complex`` raised "Tensor must have a storage_offset divisible by 2"."""
    with pytest.raises(TypeError, match=r"'spectral' is complex.*torch.view_as_complex\(self.spectral.float\(\)\)"):
        fit(ChunkOffloadStrategy(), steps=1, cls=SpectralMixer, variant="complex")
    ref = fit("auto", steps=STEPS, cls=SpectralMixer, variant="complex")
    got = fit(
        ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop")),
        steps=STEPS,
        cls=SpectralMixer,
        variant="pair",
    )
    for (n, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, torch.view_as_real(a) if a.is_complex() else a, rtol=0, atol=0, msg=n)
    # in bf16-mixed the pair's payload is bf16 and the advice's .float() makes it complex: plain Lightning's update
    # to bf16's rounding (3.2% here, where plain Lightning's bf16-mixed is 2.8% off its fp32)
    init = fit("auto", steps=0, cls=SpectralMixer, variant="pair")
    ref = fit("auto", steps=STEPS, cls=SpectralMixer, variant="pair", precision="bf16-mixed")
    got = fit(ChunkOffloadStrategy(), steps=STEPS, cls=SpectralMixer, variant="pair", precision="bf16-mixed")
    assert relative_update_error(ref, got, init) < 0.05


# ------------------------------------------------------------------ a training_step that returns None
class SkipsBatches(ParityNet):
    """Skips batches 0 and 3 as a user skips a bad one: ``None`` from ``training_step``, no backward."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in (0, 3) else loss


@pytest.mark.parametrize("acc", [1, 2])
@pytest.mark.parametrize(
    "kw", [dict(placement="host"), dict(device_memory_limit=100_000, chunk_numel=4000)], ids=["host", "limit"]
)
def test_a_training_step_returning_none_skips_its_batch_as_plain_lightning_does(kw, acc):
    """Under accumulation Lightning still steps when the last micro-batch returns ``None``, with what the others
    left (it skips only under a loss scaler); chunk_offload skipped the step. And the first batch's forward, with
    no backward in the warm-up, stayed alive ([Note: a saved tensor held without its graph]): the warm-up counted
    its activations beside the next step's and refused this limit, which holds the step at 75,904 bytes."""
    ref = fit("auto", steps=6, cls=SkipsBatches, accumulate_grad_batches=acc)
    got = fit(
        ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"})),
        steps=6,
        cls=SkipsBatches,
        accumulate_grad_batches=acc,
    )
    assert_same_params(ref, got, EXACT)


# ------------------------------------------------------------------ gradients zeroed, not set to None
@pytest.mark.parametrize("acc", [1, 2])
def test_gradients_zeroed_in_place_step_an_unused_branch_as_plain_lightning_does(acc):
    """With ``zero_grad(set_to_none=False)`` a branch unused in a step keeps a zero gradient, and AdamW moves it
    (moments, weight decay). The default stepped in backward, where a stepped chunk keeps no gradient: the branch
    stood still from the second step, and the whole model drifted from the fourth. An overridden
    ``optimizer_zero_grad`` now keeps the step after backward ([Note: stepping in backward by default])."""
    ref = fit("auto", steps=8, cls=ZeroesInPlace, variant="unused", accumulate_grad_batches=acc)
    got = fit(
        ChunkOffloadStrategy(offload=OffloadOptions(optimizer_kernel="loop")),
        steps=8,
        cls=ZeroesInPlace,
        variant="unused",
        accumulate_grad_batches=acc,
    )
    assert_same_params(ref, got, EXACT)


# ------------------------------------------------------------------ hooks on the optimizer's step
class StepHooked(ParityNet):
    """Counts its optimizer's steps with torch's step hooks (an average kept by a post-hook, a step logger)."""

    def configure_optimizers(self):
        out = super().configure_optimizers()
        self.step_calls = {"pre": 0, "post": 0}

        def count(when):
            return lambda *_: self.step_calls.__setitem__(when, self.step_calls[when] + 1)

        out["optimizer"].register_step_pre_hook(count("pre"))
        out["optimizer"].register_step_post_hook(count("post"))
        return out


def test_step_hooks_on_the_optimizer_run_once_a_step_as_in_plain_lightning():
    """The default stepped each chunk in backward, one ``step()`` a chunk: the hooks ran 5 times a step here, each
    with some chunks stepped and the others not (30 against 6). Hooks now keep the step after backward
    ([Note: stepping in backward by default])."""
    kw = dict(steps=6, cls=StepHooked)
    ref = fit("auto", **kw)
    got = fit(ChunkOffloadStrategy(device_memory_limit=100_000, chunk_numel=4000), **kw)
    assert got.step_calls == ref.step_calls == {"pre": 6, "post": 6}


# ------------------------------------------------------------------ a deep copy between steps
class AveragesByTorch(L.Callback):
    """torch's EMA recipe: ``AveragedModel`` copies the module at the start, then averages after each step."""

    def on_fit_start(self, trainer, pl_module):
        self.ema = AveragedModel(pl_module, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=False)

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.ema.update_parameters(pl_module)


def _whole(trainer):
    """``full_parameters(writeback=False)`` under chunk_offload; nothing under a plain strategy."""
    full = getattr(trainer.strategy, "full_parameters", None)
    return full(writeback=False) if full else contextlib.nullcontext()


class AveragesInsideTheBlock(AveragesByTorch):
    """The same recipe as the error says it works: made and updated inside ``full_parameters``."""

    def on_fit_start(self, trainer, pl_module):
        with _whole(trainer):
            super().on_fit_start(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args):
        with _whole(trainer):
            super().on_train_batch_end(trainer, pl_module, *args)


class CopiesAfterAStep(L.Callback):
    """A frozen teacher copied once training has begun, inside ``full_parameters`` where the strategy has it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            with _whole(trainer):
                self.copy = copy.deepcopy(pl_module.blocks[1])


@pytest.mark.parametrize("kw", [dict(placement="host"), dict(device_memory_limit=100_000, chunk_numel=4000)])
def test_a_deep_copy_of_released_parameters_is_refused_by_name_and_one_inside_full_parameters_is_whole(kw):
    """[Note: a deep copy between steps]: ``AveragedModel`` copied placeholders, and every averaged weight was NaN
    after 6 steps on one rank, silently (with ``placement="device"`` the values are there: it trains as plain
    Lightning). Made and updated inside ``full_parameters``, as the error says, the average is plain Lightning's."""
    strategy = ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"}))
    with pytest.raises(ChunkError, match=r"copy\.deepcopy would copy parameter 'embed\.weight' as NaN.*ChunkEMA"):
        fit(strategy, steps=6, callbacks=[AveragesByTorch()])
    ref, got = [CopiesAfterAStep(), AveragesInsideTheBlock()], [CopiesAfterAStep(), AveragesInsideTheBlock()]
    fit("auto", steps=6, callbacks=ref)
    fit(ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"})), steps=6, callbacks=got)
    assert_same_params(ref[0].copy, got[0].copy, EXACT)
    assert_same_params(ref[1].ema.module, got[1].ema.module, EXACT)


# ------------------------------------------------------------------ a tensor the optimizer steps beside the module's
class LearnedTemperature(ParityNet):
    """A learned log-temperature scaling the logits (SAC's ``log_alpha`` is held the same way): a plain tensor with
    ``requires_grad`` in its own param group, or registered as a parameter (``variant="registered"``)."""

    def build(self) -> None:
        super().build()
        t = torch.zeros((), requires_grad=True)
        self.log_t = torch.nn.Parameter(t) if self.variant == "registered" else t

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x) * self.log_t.exp()
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self):
        rest = [p for p in self.parameters() if p is not self.log_t]
        return torch.optim.AdamW([{"params": rest}, {"params": [self.log_t], "lr": 0.1}], lr=1e-2)


def test_a_tensor_outside_the_module_in_the_optimizer_is_refused_naming_the_way_in():
    with pytest.raises(ValueError, match=r"AdamW holds a tensor of shape \(\) .* torch\.nn\.Parameter\(tensor\)"):
        fit(ChunkOffloadStrategy(placement="host"), steps=1, cls=LearnedTemperature)
    ref = fit("auto", steps=STEPS, cls=LearnedTemperature, variant="registered")
    strategy = ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop"))
    got = fit(strategy, steps=STEPS, cls=LearnedTemperature, variant="registered")
    assert_same_params(ref, got, EXACT)
    assert got.log_t.item() != 0
