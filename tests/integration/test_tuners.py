"""Lightning's tuners from the user's side, one rank against plain Lightning. ``BatchSizeFinder`` doubles the batch
until a trial runs out of memory, halves it, then restores the weights from a checkpoint it saved before the trials
and removes at once; ``LearningRateFinder`` restores and removes the same way after its sweep. Also an out-of-memory
raised in backward, which the finder or the user's own ``backward`` hook catches ([Note: a backward that raised])."""

import sys

import lightning as L
import lightning.pytorch.tuner.batch_size_scaling as batch_size_scaling
import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.utilities.memory import is_oom_error

from lightning_chunk import ChunkOffloadStrategy, DeviceMemoryLimitError
from lightning_chunk.options import grouped
from tests.backward_models import BackwardSizedNet
from tests.models import SizedNet, quiet_trainer

EXACT = dict(rtol=0, atol=0)
LIMITED = dict(chunk_numel=4000, optimizer_kernel="loop")  # a limit evicts; the loop kernel is plain Adam's bits


def _fit(strategy, callback, fits=None):
    L.seed_everything(7, verbose=False)
    model = SizedNet(fits)
    trainer = quiet_trainer(
        accelerator="cpu", strategy=strategy, max_steps=6, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[callback],
    )  # fmt: skip
    trainer.fit(model)
    return model


def _same(ref, got):
    assert got.batch_size == ref.batch_size and got.lr == ref.lr
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, msg=lambda m: f"{n}: {m}", **EXACT)


@pytest.mark.parametrize("early", [False, True], ids=["after_backward", "in_backward"])
def test_the_batch_size_finder_halves_after_an_out_of_memory_in_backward(early):
    """A trial's backward runs out of memory after some chunks took their gradients. The engine still took it to be
    running: the next trial's backward failed with an illegal tensor-state transition blamed on a hook-order bug.
    Now it ends where it stopped and the run trains as plain Lightning; stepped in backward, the chunks that had
    stepped keep that step (said in a warning) until the finder restores its checkpoint."""

    def fit(strategy):
        L.seed_everything(7, verbose=False)
        model = BackwardSizedNet(16)
        trainer = quiet_trainer(
            accelerator="cpu", strategy=strategy, max_steps=6, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[_finder()],
        )  # fmt: skip
        trainer.fit(model)
        return model

    ref = fit("auto")
    strategy = ChunkOffloadStrategy(step_in_backward=early, **grouped(LIMITED))
    if early:
        with pytest.warns(UserWarning, match=r"chunk\(s\) had stepped in it"):
            got = fit(strategy)
    else:
        got = fit(strategy)
    assert ref.batch_size == 16
    _same(ref, got)


@pytest.mark.parametrize("early", [False, True], ids=["after_backward", "guessed_in_backward"])
def test_a_backward_hook_that_catches_an_out_of_memory_steps_with_the_gradients_that_arrived(early):
    """The user's ``backward`` catches the out-of-memory and the step goes on, as in plain Lightning, with the
    gradients that arrived before it, clipped by norm. Stepped in backward, the chunks that stepped on a guess
    before the failure are put back first, so the step is plain Lightning's too."""

    def fit(strategy):
        L.seed_everything(7, verbose=False)
        model = BackwardSizedNet(2, swallow=True)
        model.batch_size = 3  # every batch's backward runs out of memory
        trainer = quiet_trainer(
            accelerator="cpu", strategy=strategy, max_steps=3, limit_val_batches=0, gradient_clip_val=0.05
        )
        trainer.fit(model)
        return model, strategy

    ref, _ = fit("auto")
    got, strategy = fit(ChunkOffloadStrategy(placement="host", step_in_backward=early, **grouped(LIMITED)))
    assert (strategy.memory_stats().get("speculation_rollbacks", 0) > 0) == early  # guesses were made, and undone
    _same(ref, got)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10: the clean-up error is a warning")
def test_an_out_of_memory_in_backward_is_raised_as_itself_when_ending_that_backward_fails_too(monkeypatch):
    """Ending the backward that raised can raise in turn: a gradient payload that did not fit is asked for again. The
    error shown, last in the log, is where the backward stopped; the clean-up's error rides on it as a note."""
    from lightning_chunk.engine.runtime.engine import ChunkEngine

    def fail_too(self):  # noqa: ANN001, ANN202
        raise torch.OutOfMemoryError("a gradient payload does not fit")

    monkeypatch.setattr(ChunkEngine, "after_backward", fail_too)
    L.seed_everything(7, verbose=False)
    model = BackwardSizedNet(2)
    model.batch_size = 3  # the first backward runs out of memory
    trainer = quiet_trainer(accelerator="cpu", strategy=ChunkOffloadStrategy(**grouped(LIMITED)), max_steps=1)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.fit(model)
    assert "a gradient payload" not in str(raised.value)
    assert raised.traceback[-1].name == "backward"  # OutOfMemoryInBackward's, where the backward stopped
    notes = raised.value.__notes__
    assert any("ending this backward" in note and "a gradient payload does not fit" in note for note in notes)


def _finder():
    return BatchSizeFinder(steps_per_trial=2, max_trials=5)


def test_the_batch_size_finder_halves_after_an_out_of_memory_and_trains_like_plain_lightning():
    """The trial at 32 runs out of memory in its forward. Its grown inputs had sent the engine back to a warm-up,
    so the restore left the optimizer state to the first step, and the finder removed the checkpoint before it:
    the run failed there, on every GPU, where a limit is always set. Now the removal reads it first."""
    ref = _fit("auto", _finder(), fits=16)
    got = _fit(ChunkOffloadStrategy(**grouped({**LIMITED, "device_memory_limit": 600_000})), _finder(), fits=16)
    assert ref.batch_size == 16
    _same(ref, got)


def test_the_device_limit_is_an_out_of_memory_the_batch_size_finder_halves_after(monkeypatch):
    """The limit, not the allocator, stops the trial at 32: the warm-up traced more than it. Lightning recognises
    an out-of-memory by the CUDA allocator's words, which the error has on a CUDA device; on this CPU run the
    finder is told to recognise the type instead."""
    cuda = DeviceMemoryLimitError("a warm-up needs more", torch.device("cuda", 0))
    assert is_oom_error(cuda) and str(cuda).startswith("CUDA out of memory")
    cpu = DeviceMemoryLimitError("a warm-up needs more", torch.device("cpu"))
    assert isinstance(cpu, torch.OutOfMemoryError) and "CUDA" not in str(cpu)
    monkeypatch.setattr(batch_size_scaling, "is_oom_error", lambda e: isinstance(e, torch.OutOfMemoryError))
    ref = _fit("auto", _finder(), fits=16)
    got = _fit(ChunkOffloadStrategy(**grouped({**LIMITED, "device_memory_limit": 400_000})), _finder())
    _same(ref, got)


@pytest.mark.parametrize("limit", [None, 400_000], ids=["no_limit", "evicting_limit"])
def test_the_learning_rate_finder_suggests_and_trains_like_plain_lightning(limit):
    def finder():
        return LearningRateFinder(num_training_steps=20, early_stop_threshold=None, update_attr=True, attr_name="lr")

    ref = _fit("auto", finder())
    got = _fit(ChunkOffloadStrategy(**grouped({**LIMITED, "device_memory_limit": limit})), finder())
    assert got.lr != 1e-2  # the suggestion was taken
    _same(ref, got)
