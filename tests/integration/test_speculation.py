"""Clipping by norm and fp16 loss scaling while stepping in backward: host chunks step on a guess that is undone
where wrong ([Note: speculating past the norm and the overflow] in ``engine/optim/speculation.py``). One rank, under
Lightning; the two-rank cases (``early_clip_norm``, ``early_host_fp16``) are in ``tests/distributed``."""

import lightning as L
import pytest
import torch

from lightning_chunk import CheckOptions, ChunkOffloadStrategy, ChunkPrecision, MemoryOptions, OffloadOptions
from tests.integration.test_lightning import EXACT, trainer
from tests.models import ParityNet, token_data

STEPS = 6


def fit(early, *, precision="bf16-mixed", init_scale=None, placement="host", thread=False, limit=None, **kw):
    L.seed_everything(5, verbose=False)
    model = ParityNet()
    if limit is not None:  # a fraction of the parameters' bytes
        limit = int(limit * sum(p.numel() * p.element_size() for p in model.parameters()))
    strategy = ChunkOffloadStrategy(
        placement=placement,
        step_in_backward=early,
        device_memory_limit=limit,
        memory=MemoryOptions(chunk_numel=20000 if placement == "host" else None),
        offload=OffloadOptions(step_thread=thread),
        checks=CheckOptions(log_memory_stats=False),
    )
    if init_scale is not None:  # fp16 payloads throughout: their overflows come after chunks stepped on the guess
        kw["plugins"] = [ChunkPrecision(precision, init_scale=init_scale, fp32_embeddings_and_norms=False)]
    else:
        kw["precision"] = precision
    trainer(strategy=strategy, max_steps=STEPS, **kw).fit(model, token_data())
    return {k: v.clone() for k, v in model.state_dict().items()}, strategy.memory_stats()


CLIPS = dict(gradient_clip_val=0.05)  # below every step's norm here: each guess is undone
HOLDS = dict(gradient_clip_val=100.0)  # above every norm: each guess holds


@pytest.mark.parametrize(
    "kw,undone",
    [
        (CLIPS, STEPS - 1),  # every step after the warm-up (which steps after backward) rolls back
        (HOLDS, 0),
        (dict(CLIPS, accumulate_grad_batches=2), STEPS - 1),
        (dict(CLIPS, precision="32-true"), STEPS - 1),
        (dict(CLIPS, thread=True), STEPS - 1),  # the guess and its copy on the worker thread
        (dict(precision="16-mixed", init_scale=1e7), None),  # overflows in some steps, in chunks not the first
        (dict(precision="16-mixed", init_scale=1e7, thread=True), None),
        (
            dict(CLIPS, precision="16-mixed", init_scale=1e7),
            None,
        ),  # the norm of gradients unscaled in and after backward
        (dict(CLIPS, placement="auto", limit=2.0), STEPS - 1),  # under a device limit: device chunks step after it
    ],
    ids=[
        "clips",
        "holds",
        "clips_accumulate",
        "clips_fp32",
        "clips_thread",
        "fp16",
        "fp16_thread",
        "fp16_clips",
        "clips_auto",
    ],
)
def test_stepping_in_backward_with_norm_clipping_or_fp16_trains_as_stepping_after_it(kw, undone):
    """The same parameters, bit for bit, as stepping after backward: where the clip's coefficient is 1.0 the guess
    is the step; where it clips, every speculated chunk is put back and steps again with the clipped gradients;
    where fp16 overflowed, the speculated chunks are put back and the step is skipped (the loss scale too)."""
    want, plain = fit(False, **kw)
    got, stats = fit(True, **kw)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **EXACT, msg=k)
    assert stats["chunks_stepped_in_backward"] > 0 and stats["speculation_peak_bytes"] > 0
    if undone is not None:
        assert stats["speculation_rollbacks"] == undone
    else:  # some steps overflowed after a chunk had stepped on the guess, others did not overflow at all
        assert 0 < stats["speculation_rollbacks"] and stats["loss_scale"] == plain["loss_scale"] < 1e7
    if kw.get("placement") == "auto":  # host and device chunks both
        assert stats["host_chunk_bytes"] > 0 and stats["device_chunk_bytes"] > 0, stats


def test_what_the_guess_undoes_is_the_whole_pre_step_state():
    """Put back, a chunk is its pre-step bits: master, compute copy and every optimizer state entry (``step``
    included), so a run whose every guess is undone equals one stepping after backward in its optimizer state too,
    not only in its parameters."""
    states = []
    for early in (False, True):
        L.seed_everything(5, verbose=False)
        model = ParityNet()
        strategy = ChunkOffloadStrategy(
            placement="host",
            step_in_backward=early,
            memory=MemoryOptions(chunk_numel=20000),
            checks=CheckOptions(log_memory_stats=False),
        )
        t = trainer(strategy=strategy, max_steps=STEPS, precision="bf16-mixed", **CLIPS)
        t.fit(model, token_data())
        states.append(strategy.optimizer_state(t.optimizers[0])["state"])
    want, got = states
    assert want.keys() == got.keys() and want
    for i in want:
        assert want[i].keys() == got[i].keys()
        for key in want[i]:
            assert torch.equal(got[i][key], want[i][key]), (i, key)


@pytest.mark.parametrize(
    "kw,match",
    [(CLIPS, "with gradient clipping by norm"), (dict(plugins=[ChunkPrecision("16-mixed")]), "with fp16 loss")],
)
def test_speculation_is_refused_under_a_host_limit_which_does_not_budget_its_copies(tmp_path, kw, match):
    strategy = ChunkOffloadStrategy(
        step_in_backward=True,
        host_memory_limit="100MB",
        offload=OffloadOptions(disk_dir=tmp_path / "scratch"),
        checks=CheckOptions(log_memory_stats=False),
    )
    with pytest.raises(ValueError, match=match + ".* is not allowed with host_memory_limit"):
        trainer(strategy=strategy, max_steps=2, **kw).fit(ParityNet(), token_data())


class WritesGradients(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with trainer.strategy.full_parameters(with_grads=True):
            for p in pl_module.parameters():
                p.grad.zero_()


def test_a_hook_that_would_change_gradients_a_guess_already_used_is_refused():
    """Speculating, the gradients are all kept, but only the norm clip may touch them: a change elsewhere would miss
    the chunks stepped on the guess, so reaching for them names the flag."""
    strategy = ChunkOffloadStrategy(
        placement="host", step_in_backward=True, checks=CheckOptions(log_memory_stats=False)
    )
    with pytest.raises(ValueError, match=r"full_parameters\(with_grads=True\) is not possible with step_in_backward"):
        trainer(strategy=strategy, max_steps=3, callbacks=[WritesGradients()], **CLIPS).fit(ParityNet(), token_data())


def test_a_run_stepping_on_guesses_saves_and_resumes_in_the_middle_as_one_stepping_after_backward(tmp_path):
    """Saved between steps, a run that steps on guesses holds no copy and no guess: saved at step 3 (the guesses of
    every step undone, fp16 overflows in the first ones) and resumed, it ends where the same save and resume of a run
    stepping after backward does, parameters and loss scale."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(early, steps, ckpt_path=None):
        L.seed_everything(5, verbose=False)
        model = ParityNet()
        strategy = ChunkOffloadStrategy(
            placement="host", step_in_backward=early, checks=CheckOptions(log_memory_stats=False)
        )
        save = ckpt_path is None
        t = trainer(
            strategy=strategy,
            max_steps=steps,
            plugins=[ChunkPrecision("16-mixed", init_scale=1e7)],
            enable_checkpointing=save,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / str(early), every_n_train_steps=3)] if save else [],
            **CLIPS,
        )
        t.fit(model, token_data(), ckpt_path=ckpt_path)
        return {k: v.clone() for k, v in model.state_dict().items()}, strategy.memory_stats()

    out = []
    for early in (False, True):
        run(early, 3)
        out.append(run(early, STEPS, ckpt_path=tmp_path / str(early) / "epoch=0-step=3.ckpt"))
    (want, plain), (got, stats) = out
    assert stats["speculation_rollbacks"] > 0 and stats["loss_scale"] == plain["loss_scale"]
    for k in want:
        torch.testing.assert_close(got[k], want[k], **EXACT, msg=k)
