"""torch's Adafactor under chunk_offload, one rank against plain Lightning ([Note: Adafactor over sharded matrices]):
trained, resumed, consolidated. Two and four ranks against DDP: the ``adafactor_*`` parity cases."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.consolidate import consolidate
from lightning_chunk.engine.errors import UnsupportedOptimizerError
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import fit
from tests.optimizer_models import AdafactorNet

STEPS = 10
LIMIT = dict(device_memory_limit=150_000, chunk_numel=4096)


def chunk(**kw) -> ChunkOffloadStrategy:
    return ChunkOffloadStrategy(**grouped({"optimizer_kernel": "loop", **kw}))


class ForeachAdafactor(AdafactorNet):
    foreach = True


def assert_plain_state(want: dict, have: dict) -> None:
    """The same parameters with state, each with the same keys (a matrix has no ``variance``) and values."""
    assert want.keys() == have.keys() and want
    for k in want:
        assert want[k].keys() == have[k].keys(), k
        for key, v in want[k].items():
            torch.testing.assert_close(have[k][key], v, **EXACT)


@pytest.mark.parametrize(
    "cls, kw, trainer",
    [
        (AdafactorNet, dict(placement="host"), {}),
        (AdafactorNet, LIMIT, {}),
        (AdafactorNet, {}, dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
        (ForeachAdafactor, dict(LIMIT, optimizer_kernel="auto"), {}),  # "loop" would step it with foreach=False
    ],
    ids=["host", "limit", "accumulate_clip", "foreach_limit"],
)
def test_adafactor_trains_like_plain_lightning(cls, kw, trainer):
    """It was refused ("needs parameter shapes"); stepped on flat pieces it would have kept a full second moment for
    every matrix and taken its norms over the piece. Bit-exact, with its ``foreach`` path too, and after fit the
    optimizer holds plain Lightning's state: ``row_var`` and ``col_var`` for matrices (a ``(1, 32)`` and a
    ``(32, 1)`` one among them), ``variance`` for vectors."""
    ref = fit("auto", cls=cls, steps=STEPS, **trainer)
    strategy = chunk(**kw)
    got = fit(strategy, cls=cls, steps=STEPS, **trainer)
    assert_same_params(ref, got, EXACT)
    if "device_memory_limit" in kw:
        assert strategy.memory_stats()["evictions"] > 0
    assert_plain_state(*(m.trainer_ref.optimizers[0].state_dict()["state"] for m in (ref, got)))


def test_adafactor_resumes_and_consolidates_as_plain_lightning(tmp_path):
    """A sharded checkpoint at step 5 and plain Lightning's own both resume under a limit to the parameters plain
    Lightning resumes to; the sharded one consolidated with the optimizer is plain Lightning's checkpoint state."""

    def every_5(name):
        return dict(
            callbacks=[ModelCheckpoint(tmp_path / name, every_n_train_steps=5, save_top_k=-1, filename="{step}")],
            enable_checkpointing=True,
        )

    fit("auto", cls=AdafactorNet, steps=STEPS, **every_5("auto"))
    fit(chunk(**LIMIT), cls=AdafactorNet, steps=STEPS, **every_5("chunk"))
    ref = fit("auto", cls=AdafactorNet, steps=STEPS, ckpt_path=str(tmp_path / "auto" / "step=5.ckpt"))
    for path in (tmp_path / "chunk" / "step=5.ckpt", tmp_path / "auto" / "step=5.ckpt"):
        resumed = fit(chunk(**LIMIT), cls=AdafactorNet, steps=STEPS, ckpt_path=str(path))
        assert_same_params(ref, resumed, EXACT)
    out = consolidate(tmp_path / "chunk" / "step=5.ckpt", tmp_path / "plain.ckpt", with_optimizer=True, progress=False)
    want, have = (
        torch.load(p, weights_only=False)["optimizer_states"][0]["state"]
        for p in (tmp_path / "auto" / "step=5.ckpt", out)
    )
    assert_plain_state(want, have)


def test_adafactor_steps_after_backward_by_default_and_refuses_what_steps_a_chunk_at_a_time(tmp_path, caplog):
    with caplog.at_level("INFO"):
        fit(chunk(), cls=AdafactorNet, steps=1)
    assert "because of torch.optim.Adafactor, which factors each matrix's second moment" in caplog.text
    for kw, said in [
        (dict(step_in_backward=True), "step_in_backward=True steps chunks one at a time"),
        (dict(host_memory_limit="1MB", disk_dir=str(tmp_path)), "a host_memory_limit .the disk tier."),
    ]:
        with pytest.raises(UnsupportedOptimizerError, match=rf"torch\.optim\.Adafactor, which factors .*{said}"):
            fit(chunk(**kw), cls=AdafactorNet, steps=1)
