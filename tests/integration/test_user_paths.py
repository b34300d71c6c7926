"""The paths a Lightning user takes first, written from the user's side (a LightningModule and a Trainer, no engine
internals), one rank against plain Lightning. The two-rank versions run in tests/distributed/."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.options import grouped
from tests import layer_models, models
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, fit, quiet_trainer, token_data

STEPS = 12


# ------------------------------------------------------------------ a tied head read in the root forward
@pytest.mark.parametrize("variant", ["plain", "matmul"], ids=["F.linear", "matmul"])
@pytest.mark.parametrize(
    "kw",
    [dict(placement="host"), dict(device_memory_limit=600_000, chunk_numel=20_000)],
    ids=["host", "evicting_limit"],
)
def test_a_tied_head_read_in_the_root_forward_trains_like_plain_lightning(kw, variant, monkeypatch):
    """[Note: parameters read outside their owner]: the root's read of the embedding's weight found its payload
    released and trained to NaN, silently. Now the root adopts it: the same parameters as plain Lightning. The
    limit is just above the smallest that holds the root's chunk through the step (587,268 bytes) and below the
    model's payloads beside the activations, so payloads are evicted. The root adopts it once: its read after the
    embedding's forward in every later step had been taken for a new adoption, and every step was traced and
    repacked again (never planned, never stepped in backward)."""
    from lightning_chunk.engine.runtime.warmup import WarmUpPlanner

    replans = []
    real = WarmUpPlanner.replan
    monkeypatch.setattr(
        WarmUpPlanner, "replan", lambda self, why, *a, **k: (replans.append(why), real(self, why, *a, **k))[1]
    )
    shape = dict(dim=64, hidden=256, depth=4)
    ref = fit("auto", steps=STEPS, cls=layer_models.RootTiedNet, variant=variant, model_kwargs=shape)
    got = fit(
        ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"})),
        steps=STEPS,
        cls=layer_models.RootTiedNet,
        variant=variant,
        model_kwargs=shape,
    )
    assert_same_params(ref, got, EXACT)
    assert [r.name for r in replans] == ["WARM_UP", "OWNERS_CHANGED", "WARM_UP"]  # traced again once, then planned
    if "device_memory_limit" in kw:
        assert got.trainer_ref.strategy.memory_stats()["evictions"] > 0  # the limit did release payloads


def test_a_tied_head_read_in_the_root_forward_validates_like_plain_lightning():
    """The first read comes in the sanity check's validation, before any training step traced the model."""
    dl = dict(val_dataloaders=token_data(16, seed=1), num_sanity_val_steps=2, limit_val_batches=2, val_check_interval=4)
    ref = fit("auto", steps=8, cls=layer_models.RootTiedNet, **dl)
    got = fit(
        ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop")),
        steps=8,
        cls=layer_models.RootTiedNet,
        **dl,
    )
    assert_same_params(ref, got, EXACT)
    assert got.trainer_ref.callback_metrics["val_loss"] == ref.trainer_ref.callback_metrics["val_loss"]


@pytest.mark.parametrize("leaf", [layer_models.RootTiedNet, "RootTiedNet"])
def test_the_root_module_is_accepted_in_leaf_modules(leaf):
    """The root as a leaf owns every parameter, gathered for the whole step (it was refused: "names no module")."""
    ref = fit("auto", steps=STEPS, cls=layer_models.RootTiedNet)
    got = fit(
        ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(leaf_modules=[leaf]), offload=OffloadOptions(optimizer_kernel="loop")
        ),
        steps=STEPS,
        cls=layer_models.RootTiedNet,
    )
    assert_same_params(ref, got, EXACT)


# ------------------------------------------------------------------ every save complete
def _fit_and_save(strategy, path, *, after_validate=False):
    L.seed_everything(7, verbose=False)
    model = ParityNet()
    trainer = quiet_trainer(strategy=strategy, max_steps=8, limit_val_batches=2)
    trainer.fit(model, token_data(), token_data(16, seed=1))
    if after_validate:
        trainer.validate(model, token_data(16, seed=1), verbose=False)
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=False)


def _resume(strategy, path):
    L.seed_everything(7, verbose=False)
    model = ParityNet()
    trainer = quiet_trainer(strategy=strategy, max_steps=14, limit_val_batches=0)
    trainer.fit(model, token_data(), ckpt_path=path)
    return model


@pytest.mark.parametrize("after_validate", [False, True], ids=["after_fit", "after_validate"])
def test_save_checkpoint_after_fit_keeps_the_optimizer_state_and_resumes_like_plain_lightning(tmp_path, after_validate):
    """[Note: optimizer state after fit]: the checkpoint held no optimizer state, so a resume restarted Adam's
    moments silently. It now holds what plain Lightning's holds, and the resume trains to the same parameters."""
    ref = _fit_and_save("auto", tmp_path / "ref.ckpt", after_validate=after_validate)
    got = _fit_and_save(
        ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop")),
        tmp_path / "got.ckpt",
        after_validate=after_validate,
    )
    for key in ("epoch", "global_step", "loops", "callbacks", "lr_schedulers"):
        assert got[key] == ref[key], key
    (ro,), (go,) = ref["optimizer_states"], got["optimizer_states"]
    assert len(go["state"]) == len(ro["state"]) == len(list(ParityNet().parameters()))
    for k, st in ro["state"].items():
        for name, v in st.items():
            torch.testing.assert_close(go["state"][k][name], v, **EXACT, msg=lambda m: f"{k}.{name}: {m}")
    # the user's groups as they built them: the engine's kernel flags are set for its steps alone
    assert go["param_groups"] == ro["param_groups"] and go["param_groups"][0]["fused"] is None
    for k, v in ref["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][k], v, **EXACT)
    resumed_ref = _resume("auto", tmp_path / "ref.ckpt")
    resumed = _resume(
        ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop")), tmp_path / "got.ckpt"
    )
    assert_same_params(resumed_ref, resumed, EXACT)


# ------------------------------------------------------------------ deferred init with what a module holds
class WithMetric(ParityNet):
    """A torchmetrics metric updated and logged in training and validation, a buffer with a ``reset_parameters``
    and a non-persistent buffer."""

    def build(self) -> None:
        super().build()
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=models.VOCAB)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def reset_parameters(self) -> None:  # the LightningModule owns its buffers directly
        self.calls.zero_()
        self.scratch.zero_()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x).float()
        self.acc(logits.reshape(-1, models.VOCAB), y.reshape(-1))
        self.log("train_acc", self.acc)
        self.scratch += 1
        return F.cross_entropy(logits.reshape(-1, models.VOCAB), y.reshape(-1))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.acc(self(x).reshape(-1, models.VOCAB), y.reshape(-1))
        self.log("val_acc", self.acc)


def _fit_deferred(strategy, *, empty_init):
    L.seed_everything(7, verbose=False)
    trainer = quiet_trainer(strategy=strategy, max_steps=8, limit_val_batches=2, val_check_interval=4)
    with trainer.init_module(empty_init=empty_init):
        model = WithMetric()
    trainer.fit(model, token_data(), token_data(16, seed=1))
    return model, trainer


def test_deferred_init_with_a_torchmetrics_metric_trains_and_logs_like_plain_lightning():
    """[Note: metrics under deferred init]: the metric's states were built on the meta device and the fit failed at
    its end with "Cannot copy out of meta tensor; no data!"."""
    ref, rt = _fit_deferred("auto", empty_init=False)  # plain Lightning's empty init leaves values unset
    got, gt = _fit_deferred(
        ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop")), empty_init=True
    )
    assert_same_params(ref, got, EXACT)
    for key in ("train_acc", "val_acc"):
        assert gt.callback_metrics[key] == rt.callback_metrics[key], key
    assert torch.equal(got.scratch, ref.scratch) and not got.acc.tp.is_meta


def test_a_meta_buffer_nothing_initialises_is_refused_at_setup_by_name():
    class Unresettable(WithMetric):
        def build(self) -> None:
            super().build()
            self.register_buffer("mask", torch.ones(3))

        def reset_parameters(self) -> None:
            pass

    L.seed_everything(7, verbose=False)
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=2)
    with trainer.init_module(empty_init=True):
        model = Unresettable()
    with pytest.raises(Exception, match=r"mask") as info:
        trainer.fit(model, token_data())
    assert trainer.global_step == 0
    assert "meta" in str(info.value) or "reset_parameters" in str(info.value)


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_a_tied_head_read_in_a_compiled_root_forward_trains_like_plain_lightning():
    """The root's ``forward`` compiled (dynamo reads every parameter while it traces: those reads adopt nothing)."""

    def run(strategy):
        torch._dynamo.reset()
        L.seed_everything(7, verbose=False)
        model = layer_models.RootTiedNet()
        trainer = quiet_trainer(strategy=strategy, max_steps=8, limit_val_batches=0)
        model.forward = torch.compile(model.forward, backend="aot_eager")
        trainer.fit(model, token_data())
        return model

    assert_same_params(
        run("auto"), run(ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop"))), EXACT
    )


# ------------------------------------------------------------------ silent no-ops say so, once
def test_disk_dir_without_a_host_limit_warns_that_it_does_nothing(tmp_path):
    with pytest.warns(UserWarning, match=r"disk_dir=.* does nothing without host_memory_limit"):
        ChunkOffloadStrategy(offload=OffloadOptions(disk_dir=str(tmp_path)))


class NoOptimizer(ParityNet):
    """``configure_optimizers`` returns None: Lightning fits "with no optimizer", running every forward, backward and
    ``on_before_optimizer_step``, and changes no weight."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.before_step = 0

    def configure_optimizers(self):
        return None

    def on_before_optimizer_step(self, optimizer):
        self.before_step += 1


@pytest.mark.parametrize("kw", [dict(), dict(placement="host")], ids=["defaults", "host"])
def test_a_fit_with_no_optimizer_runs_saves_and_resumes_as_plain_lightning_s(tmp_path, kw):
    """Before: UnsupportedOptimizerError on Lightning's placeholder for the missing optimizer."""
    L.seed_everything(7, verbose=False)
    initial = {k: v.clone() for k, v in NoOptimizer().state_dict().items() if k != "calls"}
    run = dict(steps=4, cls=NoOptimizer, gradient_clip_val=1.0, enable_checkpointing=True, default_root_dir=tmp_path)
    ref, got = fit("auto", **run), fit(ChunkOffloadStrategy(**grouped(kw)), **run)
    assert got.before_step == ref.before_step == 4
    assert_same_params(ref, got, EXACT)
    for k, v in initial.items():
        assert torch.equal(got.state_dict()[k], v), k
    ckpt = got.trainer_ref.checkpoint_callback.best_model_path
    resumed = fit(ChunkOffloadStrategy(**grouped(kw)), steps=6, cls=NoOptimizer, ckpt_path=ckpt)
    assert resumed.trainer_ref.global_step == 6
    assert_same_params(ref, resumed, EXACT)


# ------------------------------------------------------------------ the whole module pickled
class PicklesItself(ParityNet):
    def __init__(self, path: str = "", **kw) -> None:
        super().__init__(**kw)
        self.path = path

    def on_train_batch_end(self, outputs, batch, batch_idx):
        torch.save(self, self.path)


def test_torch_save_of_the_module_during_fit_says_why_and_what_to_save_and_after_fit_works(tmp_path):
    """Plain Lightning pickles the module mid-fit; here the engine's hooks are on it and its parameters are chunk
    views: the error was pickle's alone ("Can't pickle local object 'ChunkHooks...'"). Now a note says what to save."""
    path = str(tmp_path / "m.pt")
    with pytest.raises(AttributeError, match="local object") as e:
        fit(ChunkOffloadStrategy(), steps=2, cls=PicklesItself, model_kwargs=dict(path=path))
    notes = [str(e.value), *getattr(e.value, "__notes__", [])]  # before Python 3.11, the message carries the note
    assert any("torch.save(module.state_dict(), path)" in n and "after fit returns" in n for n in notes), notes
    model = fit(ChunkOffloadStrategy(placement="host"), steps=2)
    torch.save(model, path)
    again = torch.load(path, weights_only=False)
    assert_same_params(model, again, EXACT)


# ------------------------------------------------------------------ channels_last
class ChannelsLastCNN(models.BatchNormCNN):
    def build(self) -> None:
        super().build()
        self.to(memory_format=torch.channels_last)


def test_a_channels_last_model_is_said_to_train_contiguous_and_trains_as_plain_lightning_s_contiguous_model():
    """Chunks hold parameters contiguous: the layout was dropped without a word (the values train as without it)."""
    ref = fit("auto", steps=6, cls=models.BatchNormCNN)
    with pytest.warns(UserWarning, match=r"1 parameter is channels_last \(conv2.weight\).*on_after_batch_transfer"):
        got = fit(ChunkOffloadStrategy(offload=OffloadOptions(optimizer_kernel="loop")), steps=6, cls=ChannelsLastCNN)
    assert_same_params(ref, got, EXACT)


def test_the_default_kernel_is_not_written_into_the_user_s_optimizer_or_its_checkpoints(tmp_path):
    """[Note: the kernel and the user's param groups]: optimizer_kernel='auto' wrote fused=True into the groups, so
    a checkpoint resumed under another strategy stepped with a kernel the user never chose."""
    got = _fit_and_save(ChunkOffloadStrategy(), tmp_path / "got.ckpt")
    assert [g["fused"] for g in got["optimizer_states"][0]["param_groups"]] == [None, None]
    L.seed_everything(7, verbose=False)
    model = ParityNet()
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=2)
    trainer.fit(model, token_data())
    assert all(g["fused"] is None and g["foreach"] is None for g in trainer.optimizers[0].param_groups)


# ------------------------------------------------------------------ a module parameter's optimizer state
class ReadsAdamState(L.Callback):
    """What a user's callback does to log Adam's moments: ``optimizer.state[p]`` for each module parameter."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = pl_module.optimizers()  # Lightning's wrapper, as a user reaches it
        for p in pl_module.parameters():
            try:
                self.seen.append(",".join(sorted(opt.state[p])))
            except RuntimeError as e:
                self.seen.append(str(e))
        self.keys = len(opt.state)


def test_reading_a_module_parameter_s_optimizer_state_in_fit_says_where_it_is_and_changes_nothing(tmp_path):
    """[Note: optimizer state keyed by shards]: ``optimizer.state[p]`` gave an empty dict in every step, silently,
    and left an entry that no group holds. It now raises naming the parameter and where the state is, at the first
    step and after a resume, and training is plain Lightning's; after fit the optimizer holds plain Lightning's
    state keyed by the parameters."""

    def run(strategy, resume=False):
        seen = ReadsAdamState()
        L.seed_everything(7, verbose=False)
        model = ParityNet()
        kw = dict(limit_val_batches=0, accumulate_grad_batches=2)
        trainer = quiet_trainer(strategy=strategy(), max_steps=4, callbacks=[seen], **kw)
        trainer.fit(model, token_data())
        trainer.save_checkpoint(tmp_path / f"{resume}.ckpt")
        if resume:
            again = ReadsAdamState()
            trainer = quiet_trainer(strategy=strategy(), max_steps=6, callbacks=[again], **kw)
            trainer.fit(model, token_data(), ckpt_path=tmp_path / f"{resume}.ckpt")
            seen.seen += again.seen
            seen.keys = again.keys
        return model, trainer, seen

    ref, ref_trainer, plain = run(lambda: "auto")
    assert set(plain.seen) == {"", "exp_avg,exp_avg_sq,step"}  # empty before the first step

    def chunk():  # the defaults a user gets under a limit that evicts: the automatic chunk size, a repack
        return ChunkOffloadStrategy(device_memory_limit=80_000, offload=OffloadOptions(optimizer_kernel="loop"))

    for resume in (False, True):
        got, trainer, seen = run(chunk, resume)
        stats = trainer.strategy.memory_stats()
        assert stats["evictions"] > 0 and stats["repacked_chunks"] > 0, stats
        names = [n for n, _ in got.named_parameters()]
        assert len(seen.seen) == len(names) * (12 if resume else 8)  # every micro-batch
        for n, msg in zip(names * 12, seen.seen, strict=False):
            assert msg.startswith(f"optimizer.state[{n!r}]: under chunk_offload"), msg
            assert "materialize_optimizer_state=True" in msg and "strategy.full_optimizer_state(module)" in msg
        assert seen.keys == len(names)  # one entry for each of the optimizer's own pieces: the reads added none
        if not resume:
            assert_same_params(ref, got, EXACT)
            opt, ref_opt = trainer.optimizers[0], ref_trainer.optimizers[0]
            for p, q in zip(got.parameters(), ref.parameters(), strict=True):  # after fit: plain Lightning's
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], **EXACT)
