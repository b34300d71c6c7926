"""[Note: a save inside a step]: a checkpoint asked for while the chunks step in backward, ahead of Lightning's
step, as ``SLURMEnvironment``'s auto-requeue asks for one from its signal handler wherever the signal lands (on a GPU,
as soon as ``backward()`` returns). One rank against plain Lightning."""

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.options import grouped
from tests.backward_models import AT, SavesInsideAStep
from tests.models import quiet_trainer, token_data

STEPS = 10


def _strategy(**kw):
    return ChunkOffloadStrategy(**grouped({"chunk_numel": 4000, "optimizer_kernel": "loop", **kw}))  # several chunks


def _fit(strategy, model, steps=STEPS, ckpt_path=None):
    L.seed_everything(7, verbose=False)
    t = quiet_trainer(
        accelerator="cpu", strategy=strategy, max_steps=steps, num_sanity_val_steps=0, limit_val_batches=0
    )
    t.fit(model, token_data(), ckpt_path=ckpt_path)
    return model


def _same(ref, got):
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def _model(*args, cls=SavesInsideAStep, **kw):
    L.seed_everything(7, verbose=False)
    return cls(*args, **kw)


@pytest.mark.parametrize("where", ["backward", "after_backward"])
@pytest.mark.parametrize("kw", [{}, dict(placement="host")], ids=["auto", "host"])
def test_a_save_inside_a_step_is_the_save_at_the_next_batch_and_resumes_like_plain_lightning(tmp_path, where, kw):
    """Before, the checkpoint held step 5's weights under step 4's counters: the resume took step 5 again (every
    parameter away from plain Lightning's). Now it is written at the next batch's start: the same global step and,
    resumed to step 10, the same parameters as plain Lightning saving there."""
    _fit("auto", _model("batch_start", tmp_path / "ref.ckpt", at=AT + 1), steps=AT + 2)
    _fit(_strategy(**kw), _model(where, tmp_path / "got.ckpt"), steps=AT + 2)
    assert torch.load(tmp_path / "ref.ckpt", weights_only=False)["global_step"] == AT + 1
    assert torch.load(tmp_path / "got.ckpt" / "meta.pt", weights_only=False)["global_step"] == AT + 1
    ref = _fit("auto", _model("none", None), ckpt_path=tmp_path / "ref.ckpt")
    got = _fit(_strategy(**kw), _model("none", None), ckpt_path=tmp_path / "got.ckpt")
    _same(ref, got)


def test_a_save_inside_the_last_step_is_written_at_the_end_of_training(tmp_path):
    got = _fit(_strategy(), _model("after_backward", tmp_path / "last.ckpt", at=STEPS - 1))
    resumed = _fit(_strategy(), _model("none", None), ckpt_path=tmp_path / "last.ckpt")  # nothing left to train
    assert resumed.trainer.global_step == STEPS
    _same(got, resumed)


def test_sigterm_after_a_save_inside_a_step_writes_it_at_the_end_of_the_batch(tmp_path):
    """SLURM's requeue then stops the job with SIGTERM: Lightning raises at the end of the batch."""

    def sigterm(trainer):
        trainer._signal_connector.received_sigterm = True

    with pytest.raises(SIGTERMException):
        _fit(_strategy(), _model("after_backward", tmp_path / "hpc.ckpt", then=sigterm))
    assert torch.load(tmp_path / "hpc.ckpt" / "meta.pt", weights_only=False)["global_step"] == AT + 1


def test_a_failure_inside_the_step_writes_no_half_taken_checkpoint_and_says_so(tmp_path):
    def fail(trainer):
        raise RuntimeError("lost a node")

    with (
        pytest.warns(UserWarning, match="not written: .*got.ckpt.*failed inside it"),
        pytest.warns(UserWarning, match="after 5 of 5 trainable chunks had stepped .* although Lightning did not"),
        pytest.raises(RuntimeError),
    ):
        _fit(_strategy(), _model("after_backward", tmp_path / "got.ckpt", then=fail))
    assert not (tmp_path / "got.ckpt").exists()


class Interrupted(SavesInsideAStep):
    """Ctrl-C at global step ``AT``: between two steps, half-way through a forward, or in backward after the head's
    chunks stepped."""

    def _save(self, where):
        if where == self.where and self.global_step == AT and not self.saved:
            self.saved = True
            raise KeyboardInterrupt

    def on_train_batch_end(self, *args):
        self._save("batch_end")

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for i, blk in enumerate(self.blocks):
            h = h + blk(h)
            if i == 0:
                self._save("forward")
                if torch.is_grad_enabled():
                    h.register_hook(lambda g: (self._save("backward"), g)[1])
        return self.head(self.norm(h))


def _interrupted(strategy, where):
    model = _model(where, cls=Interrupted)
    with pytest.raises(SystemExit):  # Lightning's answer to Ctrl-C
        _fit(strategy, model)
    return model


@pytest.mark.parametrize("where", ["batch_end", "forward"])
@pytest.mark.parametrize("kw", [{}, dict(device_memory_limit=400_000)], ids=["auto", "evicting_limit"])
def test_an_interrupted_fit_leaves_the_trained_parameters_as_plain_lightning_does(where, kw):
    """On one rank the teardown after a failure gives the parameters their values, as after a fit that ended:
    before, they were left empty (``model(x)`` raised "'weight' must be 2-D", the trained values gone)."""
    ref, got = _interrupted("auto", where), _interrupted(_strategy(**kw), where)
    _same(ref, got)
    x = token_data().dataset.tensors[0][:4]
    with torch.no_grad():
        torch.testing.assert_close(got(x), ref(x), rtol=0, atol=0)


def test_an_interrupt_inside_backward_says_which_chunks_took_the_step():
    with pytest.warns(UserWarning, match=r"after 2 of 5 trainable chunks had stepped .* for those chunks only"):
        got = _interrupted(_strategy(), "backward")
    assert all(p.isfinite().all() for p in got.parameters())
