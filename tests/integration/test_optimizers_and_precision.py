"""One rank, against plain Lightning: several optimizers (manual optimization, GAN style), clipping inside
and before ``step()``, ``zero_grad`` semantics, ``16-mixed``, ``bf16-true`` buffers, and what the optimizer
holds after ``fit``. The two-rank versions run in tests/distributed/."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_chunk import CheckOptions, ChunkOffloadStrategy, ChunkPrecision
from lightning_chunk.engine.errors import ChunkError, UnsupportedOptimizerError
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params, relative_update_error
from tests.models import VOCAB, FloatBuffer, ParityNet, TwoOptimizers, fit, quiet_trainer, token_data
from tests.optimizer_models import (
    ClosureNet,
    GroupCounted,
    GroupNormalizedSGD,
    ScheduleFreeAveragedAtTheEnd,
    ScheduleFreeEvaluatedByHand,
    ScheduleFreeNet,
    SharpnessAwareManual,
)


def fit_model(model_cls, strategy, *, steps=12, plugins=None, precision="32-true", **kw):
    L.seed_everything(7, verbose=False)
    model = model_cls(**kw)
    trainer = quiet_trainer(
        strategy=strategy,
        max_steps=steps,
        precision=None if plugins else precision,
        plugins=plugins,
        limit_val_batches=0,
    )
    trainer.fit(model, token_data())
    model.trainer_ref = trainer
    return model


def chunk(**kw):
    return ChunkOffloadStrategy(**grouped({**kw, "chunk_numel": 4096, "optimizer_kernel": "loop"}))


@pytest.mark.parametrize("placement", ["device", "host"])
def test_two_optimizers_each_step_their_own_parameters_like_plain_lightning(placement):
    """Before: only the first optimizer stepped (the second's gradients had been cleared with the first's)."""
    ref = fit_model(TwoOptimizers, "auto")
    got = fit_model(TwoOptimizers, chunk(placement=placement))
    init = fit_model(TwoOptimizers, "auto", steps=0)
    for (n, a), b, i in zip(ref.named_parameters(), got.parameters(), init.parameters(), strict=True):
        torch.testing.assert_close(b, a, msg=lambda m: f"{n}: {m}", **EXACT)
        assert not torch.equal(b, i), f"{n} never stepped"


def test_two_optimizers_with_fp16_loss_scaling():
    init = fit_model(TwoOptimizers, "auto", steps=0)
    ref = fit_model(
        TwoOptimizers, "auto", plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    )
    got = fit_model(TwoOptimizers, chunk(), plugins=[ChunkPrecision("16-mixed")])
    assert relative_update_error(ref, got, init) < 0.05
    for (n, b), i in zip(got.named_parameters(), init.parameters(), strict=True):
        assert not torch.equal(b, i), f"{n} never stepped"
    # one scaler, updated after each optimizer's step as Lightning's AMP plugin does: no overflow, no change yet
    assert got.trainer_ref.strategy.memory_stats()["loss_scale"] == 2.0**16


class ClipBeforeStep(ParityNet):
    """Manual optimization that clips in training_step, before ``opt.step()`` (the pattern Lightning documents)."""

    def __init__(self, **kw):
        super().__init__(scheduler=False, **kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        return loss


def test_manual_clipping_before_step_sees_the_gradients():
    """Before: the views got their gradients only inside step(), so clipping before it clipped nothing."""
    ref = fit_model(ClipBeforeStep, "auto")
    strategy = chunk(placement="host")
    got = fit_model(ClipBeforeStep, strategy)
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    assert strategy.memory_stats()["grad_norm"] > 0.05  # it did clip


class NoZeroGrad(ParityNet):
    """Manual optimization that steps every other batch and never calls zero_grad: gradients accumulate
    across steps, as they do in plain PyTorch."""

    def __init__(self, **kw):
        super().__init__(scheduler=False, optimizer="sgd", **kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1)))
        if batch_idx % 2 == 1:
            opt.step()


def test_gradients_stay_until_zero_grad_as_in_torch():
    ref = fit_model(NoZeroGrad, "auto", steps=6)
    got = fit_model(NoZeroGrad, chunk(placement="host"), steps=6)
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def test_bf16_true_converts_float_buffers_like_lightning():
    """Before: the fp32 buffer met bf16 activations ('mat1 and mat2 must have the same dtype')."""
    init = fit_model(FloatBuffer, "auto", steps=0, precision="bf16-true")
    ref = fit_model(FloatBuffer, "auto", precision="bf16-true")
    got = fit_model(FloatBuffer, "chunk_offload", precision="bf16-true")
    assert got.shift.dtype == ref.shift.dtype == torch.bfloat16
    assert {p.dtype for p in got.parameters()} == {torch.bfloat16}  # as Lightning's bf16-true leaves them
    assert relative_update_error(ref, got, init) < 0.15


class HeldState(ParityNet):
    """Notes where the optimizer's per-element state lives when training ends, before the teardown."""

    def on_train_end(self) -> None:
        state = self.trainer.optimizers[0].state
        self.held = {v.data_ptr() for st in state.values() for k, v in st.items() if k != "step"}


@pytest.mark.parametrize("kw", [dict(placement="host"), dict(), dict(materialize_optimizer_state=True)])
def test_the_optimizer_after_fit_on_one_rank_holds_plain_lightning_s_state(kw):
    """[Note: optimizer state after fit]: it held none, and ``state_dict()`` after fit was silently empty. On one
    rank each piece is a parameter's whole state: given back in place (host placement: the tensors training used)."""
    want = fit_model(ParityNet, "auto").trainer_ref.optimizers[0].state_dict()
    got = fit_model(HeldState, chunk(**kw))
    opt = got.trainer_ref.optimizers[0]  # pointed back at the module's own parameters, in their groups
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(p) for p in got.parameters() if (p.dim() >= 2) == decay] for decay in (True, False)
    ]
    have = opt.state_dict()
    assert want["state"].keys() == have["state"].keys() and want["param_groups"] == have["param_groups"]
    for k in want["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(have["state"][k][name], want["state"][k][name], **EXACT)
    if kw.get("placement") == "host":
        assert {v.data_ptr() for st in opt.state.values() for k, v in st.items() if k != "step"} == got.held


def test_an_optimizer_left_without_its_state_after_fit_says_so_where_it_is_read():
    dropped = fit_model(ParityNet, chunk(materialize_optimizer_state=False)).trainer_ref.optimizers[0]
    for read in (dropped.state_dict, lambda: dropped.state[dropped.param_groups[0]["params"][0]]):
        with pytest.raises(
            ChunkError, match=r"AdamW's state after fit is kept apart.*materialize_optimizer_state=True"
        ):
            read()


def test_schedule_free_moved_to_its_average_after_fit_is_plain_lightning_s():
    """``optimizer.eval()`` in ``on_fit_end``: the optimizer had no state there (its ``z``), so the weights stayed
    where training left them, silently."""
    kw = dict(cls=ScheduleFreeAveragedAtTheEnd, steps=12, val_check_interval=4, limit_val_batches=2)
    ref = fit("auto", **kw)
    got = fit(chunk(assume_elementwise_optimizer=True, device_memory_limit=200_000), **kw)
    assert_same_params(ref, got, EXACT)
    assert not ref.trainer_ref.optimizers[0].param_groups[0]["train_mode"]


def test_bf16_mixed_gives_fp32_parameters_back_after_a_repack(tmp_path):
    """The warm-up repacks (automatic chunk size, a model used in another order than registered, a limit); the
    repack read each parameter's dtype off the parameter, which was by then a bf16 view of the old payload. So the
    trained model came back in bf16 at the end of fit, and sharded checkpoints recorded bf16 for consolidation:
    the fp32 masters' last bits were lost on the way out."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_chunk.consolidate import consolidate
    from tests.models import ReorderedNet

    L.seed_everything(7, verbose=False)
    model = ReorderedNet()
    trainer = quiet_trainer(
        max_steps=4,
        precision="bf16-mixed",
        strategy=ChunkOffloadStrategy(device_memory_limit=200_000, checks=CheckOptions(log_memory_stats=False)),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, filename="{step}")],
        limit_val_batches=0,
        enable_checkpointing=True,
    )
    trainer.fit(model, token_data())
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    # the fp32 masters came back, not their bf16 copies: some values are not representable in bf16
    assert any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in params.values())
    full = torch.load(
        consolidate(tmp_path / "step=4.ckpt", tmp_path / "full.ckpt", progress=False), weights_only=False
    )["state_dict"]
    for name, p in params.items():
        assert full[name].dtype == torch.float32
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_bf16_true_steps_with_the_default_kernel_exactly_as_plain_lightning(optimizer):
    """[Note: the kernel and the user's param groups]: the default kernel chose torch's fused one for every optimizer
    that has it, and on bf16 masters fused SGD with momentum and weight decay strays 7x as far from fp32 as its
    loop: 2.4% from DDP after 9 steps on two ranks. Such a group now steps with torch's own default."""
    kw = dict(precision="bf16-true", optimizer=optimizer if optimizer == "sgd" else "Adagrad")
    ref = fit_model(ParityNet, "auto", **kw)
    got = fit_model(ParityNet, ChunkOffloadStrategy(), **kw)  # the defaults a user gets
    torch.testing.assert_close(dict(got.named_parameters()), dict(ref.named_parameters()), **EXACT)


@pytest.mark.parametrize("case", ["in_backward", "clip_norm_in_backward", "disk"])
def test_an_optimizer_keeping_state_in_its_param_groups_counts_one_step_a_step(case, tmp_path):
    """Stepping in backward (the default) calls ``step()`` once a chunk, a speculated chunk undone by the clip again
    after backward, the disk tier once a disk chunk: each call advanced the groups' counters, so the learning rate
    warmed up once a chunk, silently ([Note: group state in partial steps])."""
    kw = {"gradient_clip_val": 0.05} if case == "clip_norm_in_backward" else {}
    opts = dict(assume_elementwise_optimizer=True)
    if case == "disk":  # this SGD keeps no state an element: the host budget holds masters and gradients alone
        opts |= dict(placement="host", host_memory_limit="80KB", disk_dir=tmp_path, step_in_backward=False)
    else:  # on host shards a chunk steps on the guess that the clip leaves it alone, undone where it does not
        opts |= dict(step_in_backward=True, placement="host" if kw else "device")
    ref = fit("auto", cls=GroupCounted, steps=12, **kw)
    strategy = chunk(**opts)
    got = fit(strategy, cls=GroupCounted, steps=12, **kw)
    assert_same_params(ref, got, EXACT)
    got_groups = got.trainer_ref.optimizers[0].param_groups
    for a, b in zip(ref.trainer_ref.optimizers[0].param_groups, got_groups, strict=True):
        assert (b["k"], b["scheduled_lr"], float(b["weight_sum"])) == (
            a["k"],
            a["scheduled_lr"],
            float(a["weight_sum"]),
        )
    stats = strategy.memory_stats()
    seen = {"in_backward": "chunks_stepped_in_backward", "clip_norm_in_backward": "speculation_rollbacks"}
    assert stats[seen.get(case, "disk_shards")] >= 2
    assert stats["masters_written"] == 0  # nothing wrote a master outside a step


def test_an_optimizer_writing_its_parameters_outside_step_is_what_the_next_forward_computes_with():
    """Schedule-free's ``optimizer.eval()`` before validation and ``.train()`` after write the masters through the
    optimizer's views; under a device limit the compute copies kept the old values where resident and took the new
    ones where gathered: validation and training left plain Lightning's ([Note: the optimizer's views written
    outside its step])."""
    kw = dict(cls=ScheduleFreeNet, steps=12, val_check_interval=4, limit_val_batches=2)
    ref = fit("auto", **kw)
    strategy = chunk(assume_elementwise_optimizer=True, device_memory_limit=200_000)
    got = fit(strategy, **kw)
    assert got.val_losses == ref.val_losses and len(ref.val_losses) == 6
    assert_same_params(ref, got, EXACT)
    assert strategy.memory_stats()["masters_written"] == 5  # after each eval() and train() but the last


@pytest.mark.parametrize("modes, twice", [(True, False), (False, False), (True, True)], ids=["eval", "train", "twice"])
@pytest.mark.parametrize("kw", [dict(device_memory_limit=200_000), dict(placement="host", precision="bf16-mixed")])
def test_a_forward_outside_a_step_after_the_optimizer_wrote_its_parameters_computes_with_what_it_wrote(
    kw, modes, twice
):
    """``eval()``, a forward and ``train()`` in ``on_train_epoch_end`` (the module in eval mode for it or not): the
    copies were made again only before batches, so the forward was refused as if SAM wrote the weights inside a
    training step. Now it computes at the average as plain Lightning does, on one rank after a forward at the
    training weights too (``twice``: two ranks refuse that, test_two_rank_paths.py)."""
    kw = dict(kw)
    precision = kw.pop("precision", "32-true")
    cls = type("Evaluated", (ScheduleFreeEvaluatedByHand,), {"modes": modes, "twice": twice})
    run = dict(cls=cls, steps=30, limit_train_batches=10, precision=precision)
    ref = fit("auto", **run)
    strategy = chunk(assume_elementwise_optimizer=True, **kw)
    got = fit(strategy, **run)
    if precision == "32-true":
        assert got.val_losses == ref.val_losses and len(ref.val_losses) == 3 * (1 + twice)
        assert_same_params(ref, got, EXACT)
    else:  # bf16 payloads against autocast's casts: the losses agree to bf16's rounding, not to the bit
        torch.testing.assert_close(got.val_losses, ref.val_losses, rtol=0.01, atol=0)
    assert strategy.memory_stats()["masters_written"] == 5  # after each eval() and train() but the last


def test_a_forward_at_the_training_weights_after_a_validation_computes_with_them():
    """Validated at each epoch's end (``eval()`` and ``train()`` around it), then in ``on_train_epoch_end`` a forward
    at the training weights: it computed with the validation's copies where they were resident, at the average,
    silently (after the first epoch 4.009439 for plain Lightning's 4.009432 here, 4.0110 where every chunk stays)."""
    cls = type("Twice", (ScheduleFreeEvaluatedByHand,), {"twice": True})
    run = dict(cls=cls, steps=20, limit_train_batches=10, val_check_interval=10, limit_val_batches=2)
    ref = fit("auto", **run)
    got = fit(chunk(assume_elementwise_optimizer=True, device_memory_limit=200_000), **run)
    assert got.val_losses == ref.val_losses and len(ref.val_losses) == 8
    assert_same_params(ref, got, EXACT)


class GroupNormalized(ParityNet):
    def configure_optimizers(self):
        return GroupNormalizedSGD(self.parameters(), lr=0.05)


def test_an_optimizer_wrongly_taken_as_element_wise_is_refused_where_it_would_train_otherwise():
    """A group-wide gradient norm (Prodigy's kind) stepped a chunk at a time under the default step_in_backward
    computed each chunk's own norm, silently; it is refused there, and steps as plain Lightning's in one call."""
    with pytest.raises(UnsupportedOptimizerError, match=r"GroupNormalizedSGD.*across the parameters of a group"):
        fit(chunk(assume_elementwise_optimizer=True), cls=GroupNormalized, steps=2)
    ref = fit("auto", cls=GroupNormalized, steps=6)
    got = fit(chunk(assume_elementwise_optimizer=True, step_in_backward=False), cls=GroupNormalized, steps=6)
    assert_same_params(ref, got, EXACT)


@pytest.mark.parametrize("kw", [{}, dict(step_in_backward=False)], ids=["in_backward", "after_backward"])
def test_an_optimizer_calling_its_closure_trains_and_one_wanting_gradients_elsewhere_is_refused_naming_why(kw):
    """[Note: the closure of a step the engine runs]: the engine runs Lightning's closure before ``step()`` and gave
    none: an optimizer that calls it whatever it is given failed with ``'NoneType' object is not callable``. Now
    its first call in a step returns at once and it trains as plain Lightning's, once a chunk or after backward. One
    that moved the weights before the call (schedule-free's closure variants), or calls it again (SAM), wants the
    gradients elsewhere: it raises, naming the optimizer and why, where taking the old gradients trained otherwise."""
    ref = fit("auto", cls=ClosureNet, steps=6)
    got = fit(chunk(assume_elementwise_optimizer=True, **kw), cls=ClosureNet, steps=6)
    assert_same_params(ref, got, EXACT)
    for when, why in [("again", "called its closure a second time"), ("moved", "wrote its parameters and then called")]:
        with pytest.raises(UnsupportedOptimizerError, match=rf"ClosureSGD\.step\(\) {why}"):
            fit(chunk(assume_elementwise_optimizer=True, **kw), cls=ClosureNet, steps=2, model_kwargs=dict(when=when))


def test_sam_in_manual_optimization_is_refused_where_it_would_train_otherwise():
    """[Note: an optimizer's parameter given another tensor] in ``optim/binding.py`` and the end of [Note: the
    optimizer's views written outside its step]: SAM's manual recipe, one rank. Its ``p.data = old`` left the
    optimizer stepping tensors of its own (0.035 off plain Lightning after four steps, silently): refused at the
    next batch. Under a limit its second forward computed with copies made before ``first_step`` moved the weights:
    refused at that forward. Where the weights are the compute copy (fp32, on the device) and put back in place,
    it trains as plain Lightning."""
    steps = dict(steps=-1, max_epochs=1, limit_train_batches=4)
    kw = dict(assume_elementwise_optimizer=True)
    with pytest.raises(ChunkError, match=r"SAM's parameter 'embed.weight' \(and 15 more\) was given another tensor"):
        fit(chunk(**kw), cls=SharpnessAwareManual, **steps)
    with pytest.raises(ChunkError, match=r"were written during this training step, before a forward"):
        fit(chunk(**kw, chunk_numel=3000, device_memory_limit=120_000), cls=SharpnessAwareManual, **steps)
    ref = fit("auto", cls=SharpnessAwareManual, model_kwargs=dict(in_place=True), **steps)
    got = fit(chunk(**kw), cls=SharpnessAwareManual, model_kwargs=dict(in_place=True), **steps)
    assert_same_params(ref, got, EXACT)
