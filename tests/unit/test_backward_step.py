"""``step_in_backward=None``: on where nothing in the fit reads the gradients after backward ([Note: stepping in
backward by default] in ``lightning_chunk/backward_step.py``)."""

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkTelemetry
from lightning_chunk.backward_step import choose_step_in_backward, clip_value
from tests.backward_models import ZeroesInPlace
from tests.callbacks import GradNormsAndEdits, GradsAfterBackward
from tests.models import ManualNet, ParityNet, quiet_trainer


def trainer(**kw):
    return quiet_trainer(**kw)


class LogsGradients(ParityNet):
    def on_before_optimizer_step(self, optimizer):
        pass


class StepsItsOwnWay(ParityNet):
    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)


def test_a_fit_with_nothing_reading_gradients_steps_in_backward(tmp_path):
    # Lightning's own callbacks (checkpoint, progress bar, summary) and this package's read no gradient
    default = L.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, callbacks=[ChunkTelemetry()])
    assert choose_step_in_backward(default, ParityNet(), "bf16-mixed", 1) == (True, None)


@pytest.mark.parametrize("kw", [dict(gradient_clip_algorithm="value"), dict(gradient_clip_val=0)])
def test_clipping_by_value_or_at_zero_still_steps_in_backward(kw):
    """Clipping by value applies element by element, so each chunk clips as it steps ([Note: clipping by value in
    backward]); Lightning clips nothing at ``gradient_clip_val=0``."""
    t = trainer(**{"gradient_clip_val": 0.5, **kw})
    assert choose_step_in_backward(t, ParityNet(), "32-true", 1) == (True, None)
    assert clip_value(t) == (0.5 if kw.get("gradient_clip_algorithm") else None)


@pytest.mark.parametrize(
    "what, trainer_kw, module, precision, optimizers, named",
    [
        ("clipping", dict(gradient_clip_val=0.5), ParityNet, "32-true", 1, "gradient_clip_val=0.5"),
        ("fp16", {}, ParityNet, "16-mixed", 1, "precision='16-mixed'"),
        ("manual", {}, ManualNet, "32-true", 1, "automatic_optimization=False"),
        ("two optimizers", {}, ParityNet, "32-true", 2, "2 optimizers"),
        ("module hook", {}, LogsGradients, "32-true", 1, "LogsGradients.on_before_optimizer_step"),
        ("optimizer_step", {}, StepsItsOwnWay, "32-true", 1, "StepsItsOwnWay.optimizer_step"),
        ("optimizer_zero_grad", {}, ZeroesInPlace, "32-true", 1, "ZeroesInPlace.optimizer_zero_grad"),
        (
            "callback after backward",
            dict(callbacks=[GradsAfterBackward()]),
            ParityNet,
            "32-true",
            1,
            "GradsAfterBackward.on_after_backward",
        ),
        (
            "callback before the step",
            dict(callbacks=[GradNormsAndEdits()]),
            ParityNet,
            "32-true",
            1,
            "GradNormsAndEdits.on_before_optimizer_step",
        ),
    ],
)
def test_whatever_reads_gradients_after_backward_keeps_the_step_after_it_and_is_named(
    what, trainer_kw, module, precision, optimizers, named
):
    chosen, why = choose_step_in_backward(trainer(**trainer_kw), module(), precision, optimizers)
    assert not chosen and named in why, (what, why)


def test_the_engine_alone_steps_after_backward():
    from lightning_chunk.engine import ChunkConfig, ChunkEngine

    assert ChunkConfig().step_in_backward is None
    model = ParityNet()
    engine = ChunkEngine(model, [torch.optim.AdamW(model.parameters())], config=ChunkConfig(placement="device"))
    assert engine.early is None


def test_a_global_step_hook_of_the_user_is_named_and_torch_s_own_profiler_counter_is_not():
    """torch's profiler registers a global post-hook under ``KINETO_USE_DAEMON`` (a step counter): every fit on such a
    cluster would lose stepping in backward to it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from lightning_chunk.backward_step import step_hooks

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    def counter(*_):
        pass

    counter.__module__ = "torch.profiler"
    handle = register_optimizer_step_post_hook(counter)
    try:
        assert step_hooks([opt]) is None
        mine = register_optimizer_step_post_hook(lambda *_: None)
        try:
            assert "every optimizer" in (step_hooks([opt]) or "")
        finally:
            mine.remove()
    finally:
        handle.remove()
