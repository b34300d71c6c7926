"""torch's Muon and Adafactor under chunk_offload, one rank against plain Lightning ([Note: optimizers that need
whole parameters]): Muon alone in automatic optimization and beside AdamW in manual optimization, Adafactor resumed
and consolidated, both stepped in backward. Two and four ranks against DDP: the ``muon_*`` and ``adafactor_*``
parity cases."""

import re

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy, ChunkPrecision
from lightning_chunk.consolidate import consolidate
from lightning_chunk.engine.config import ChunkConfig
from lightning_chunk.engine.errors import UnsupportedOptimizerError
from lightning_chunk.engine.optim.kernels import check_optimizer
from lightning_chunk.options import grouped
from tests import callbacks
from tests.compare import EXACT, assert_same_params, relative_update_error
from tests.features import needs_muon
from tests.models import fit
from tests.optimizer_models import AdafactorNet, MuonNet, MuonWithAdamW

STEPS = 10
ADAFACTOR = dict(model_kwargs=dict(optimizer="Adafactor"))  # ParityNet's two groups, weight decay on one
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
        pytest.param(MuonNet, {}, {}, marks=needs_muon),
        pytest.param(
            MuonNet, dict(placement="host"), dict(accumulate_grad_batches=2, gradient_clip_val=0.05), marks=needs_muon
        ),
        pytest.param(MuonNet, LIMIT, {}, marks=needs_muon),
        pytest.param(MuonWithAdamW, dict(placement="host"), {}, marks=needs_muon),
        pytest.param(MuonWithAdamW, LIMIT, {}, marks=needs_muon),
        (AdafactorNet, dict(placement="host"), {}),
        (AdafactorNet, LIMIT, {}),
        (AdafactorNet, {}, dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
        (ForeachAdafactor, dict(LIMIT, optimizer_kernel="auto"), {}),  # "loop" would step it with foreach=False
    ],
    ids=[
        "muon",
        "muon_host_accumulate_clip",
        "muon_limit",
        "muon_with_adamw_host",
        "muon_with_adamw_limit",
        "adafactor_host",
        "adafactor_limit",
        "adafactor_accumulate_clip",
        "adafactor_foreach_limit",
    ],
)
def test_trains_like_plain_lightning(cls, kw, trainer):
    """Both were refused ("needs parameter shapes"). Stepped on flat pieces Muon refuses a vector, and Adafactor
    would keep a full second moment for every matrix and take its norms over the piece. Bit-exact, Adafactor's
    ``foreach`` path too, and after fit the optimizer holds plain Lightning's state: Muon's momentum, Adafactor's
    ``row_var`` and ``col_var`` for matrices (a ``(1, 32)`` and a ``(32, 1)`` one among them), ``variance`` for
    vectors."""
    ref = fit("auto", cls=cls, steps=STEPS, **trainer)
    strategy = chunk(**kw)
    got = fit(strategy, cls=cls, steps=STEPS, **trainer)
    assert_same_params(ref, got, EXACT)
    if "device_memory_limit" in kw:
        assert strategy.memory_stats()["evictions"] > 0
    assert_plain_state(*(m.trainer_ref.optimizers[0].state_dict()["state"] for m in (ref, got)))


@pytest.mark.parametrize(
    "cls", [pytest.param(MuonNet, marks=needs_muon), pytest.param(MuonWithAdamW, marks=needs_muon)]
)
def test_muon_in_bf16_mixed_trains_like_plain_lightning_to_bf16_rounding(cls):
    """bf16 payloads under an evicting limit, fp32 masters and momentum: 0.022 and 0.036 of the update from plain
    Lightning's autocast (measured 2026-12-01), where plain bf16-mixed is itself 0.022 and 0.030 from fp32. Copies
    left stale by the step would be off by the whole update."""
    init = fit("auto", cls=cls, steps=0)
    ref = fit("auto", cls=cls, steps=STEPS, precision="bf16-mixed")
    got = fit(chunk(**LIMIT), cls=cls, steps=STEPS, precision="bf16-mixed")
    assert relative_update_error(ref, got, init) < 0.1
    assert all(p.dtype == torch.float32 for p in got.parameters())


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


def test_adafactor_s_whole_state_is_carried_through_the_repacks_freezing_and_unfreezing_make():
    """blocks[0] unfrozen at step 6, the embedding frozen from 6 to 14 ([Note: requires_grad changed]): each change
    repacks with the state there, ``row_var``, ``col_var`` and ``variance`` carried whole, not cut as per-element
    state; plain Lightning's parameters and state."""
    kw = dict(steps=20, variant="frozen", **ADAFACTOR)
    ref = fit("auto", callbacks=[callbacks.FlipRequiresGrad()], **kw)
    got = fit(chunk(device_memory_limit=90_000), callbacks=[callbacks.FlipRequiresGrad()], **kw)
    assert_same_params(ref, got, EXACT)
    assert_plain_state(*(m.trainer_ref.optimizers[0].state_dict()["state"] for m in (ref, got)))


@pytest.mark.parametrize("cls", [AdafactorNet, pytest.param(MuonNet, marks=needs_muon)])
@pytest.mark.parametrize(
    "kw, trainer",
    [
        (dict(placement="host", step_in_backward=True), dict(gradient_clip_val=0.05)),
        (dict(LIMIT, step_in_backward=True), dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")),
        ({}, {}),
    ],
    ids=["host_clip_norm", "limit_clip_value", "default"],
)
def test_on_one_rank_each_chunk_steps_in_backward_as_plain_lightning(cls, kw, trainer):
    """Nothing is gathered on one rank, so a chunk steps as its gradients are final and gives its gradient shard
    back, as with Adam; the default chooses it. Clipping by norm at 0.05 clips every step: each guess is undone and
    the chunk steps again after backward ([Note: speculating past the norm and the overflow])."""
    ref = fit("auto", cls=cls, steps=STEPS, **trainer)
    strategy = chunk(**kw)
    got = fit(strategy, cls=cls, steps=STEPS, **trainer)
    assert_same_params(ref, got, EXACT)
    stats = strategy.memory_stats()
    assert stats["chunks_stepped_in_backward"] > 0
    if "gradient_clip_val" in trainer and "gradient_clip_algorithm" not in trainer:
        assert stats["speculation_rollbacks"] == STEPS - 1  # the warm-up step steps after backward


def test_adafactor_in_fp16_steps_in_backward_on_a_thread_as_after_it():
    """fp16 loss scaling from 1e7 overflows in some steps after chunks stepped on the guess: those are put back, the
    step skipped, the loss scale halved, as stepping after backward does, bit for bit."""

    def run(early):
        strategy = chunk(placement="host", chunk_numel=20000, step_in_backward=early, step_thread=early)
        fp16 = ChunkPrecision("16-mixed", init_scale=1e7, fp32_embeddings_and_norms=False)  # every payload in fp16
        got = fit(strategy, steps=12, plugins=[fp16], **ADAFACTOR)
        return got, strategy.memory_stats()

    (want, plain), (got, stats) = run(False), run(True)
    assert_same_params(want, got, EXACT)
    assert stats["speculation_rollbacks"] > 0 and stats["loss_scale"] == plain["loss_scale"] < 1e7


@pytest.mark.parametrize(
    "cls, said",
    [
        (AdafactorNet, "torch.optim.Adafactor, which factors"),
        pytest.param(MuonNet, "torch.optim.Muon, which orthogonalizes", marks=needs_muon),
    ],
)
def test_several_ranks_step_them_after_backward_and_the_disk_tier_is_refused(tmp_path, cls, said):
    """With several ranks each chunk's step is a gather, which the autograd thread should not wait in."""
    opt = cls().configure_optimizers()
    with pytest.raises(UnsupportedOptimizerError, match=rf"{re.escape(said)}.*step_in_backward=True on several ranks"):
        check_optimizer(opt, ChunkConfig(step_in_backward=True), world_size=2)
    check_optimizer(opt, ChunkConfig(step_in_backward=True), world_size=1)
    with pytest.raises(UnsupportedOptimizerError, match=rf"{re.escape(said)}.*a host_memory_limit .the disk tier."):
        fit(chunk(host_memory_limit="1MB", disk_dir=str(tmp_path)), cls=cls, steps=1)
