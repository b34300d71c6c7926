"""chunk_offload as a Lightning strategy: registration, CLI, logging, checkpoints, life after fit."""

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry

import lightning_chunk
from lightning_chunk import CheckOptions, ChunkOffloadStrategy, ChunkPrecision, MemoryOptions, OffloadOptions
from tests.children import DIST_VARS
from tests.models import ManualNet, ParityNet, TokenData, quiet_trainer, token_data

EXACT = dict(rtol=0, atol=0)


def trainer(tmp_path=None, **kw):
    if tmp_path is not None:
        kw = {"default_root_dir": tmp_path, **kw}
    return quiet_trainer(**{"limit_val_batches": 0, "num_sanity_val_steps": 0, **kw})


def test_presets_are_registered_with_their_placements():
    for name, placement in [("chunk_offload", "auto"), ("chunk", "device"), ("chunk_offload_cpu", "host")]:
        assert name in StrategyRegistry
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, ChunkOffloadStrategy) and strategy.config.placement == placement
    lightning_chunk.ChunkOffloadStrategy.register_strategies(StrategyRegistry)  # importing twice is harmless


@pytest.mark.parametrize("started_by", ["the launcher", "rank 0's launcher", "torchrun"])
def test_every_rank_gets_the_launcher_s_thread_count_as_ddp_s_ranks_do(monkeypatch, started_by):
    """[Note: every rank's thread count]: a rank that rank 0's launcher started (its environment has ``LOCAL_RANK`` and
    no ``OMP_NUM_THREADS``) gets ``cores // ranks`` threads, as DDP's ranks do, not torch's default of every core; where
    the starter set ``OMP_NUM_THREADS`` (torchrun: 1, read by torch as the process starts) the count is left alone."""
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    for var in DIST_VARS:  # what an earlier launch in this process left behind
        monkeypatch.delenv(var, raising=False)
    if started_by != "the launcher":
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setenv("NODE_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
    spawned = []
    monkeypatch.setattr(
        "lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher._call_children_scripts",
        lambda self: spawned.append(True),
    )
    threads, default = torch.get_num_threads(), max(2, torch.get_num_threads())
    try:
        for strategy in (ChunkOffloadStrategy(), "ddp"):
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # each rank starts with what its starter set
            if started_by == "torchrun":
                monkeypatch.setenv("OMP_NUM_THREADS", "1")
            torch.set_num_threads(default)  # torch's count where nothing set it: every core
            got = trainer(strategy=strategy, devices=2).strategy.launcher.launch(torch.get_num_threads)
            assert got == (default if started_by == "torchrun" else _suggested_max_num_threads(2)), strategy
    finally:
        torch.set_num_threads(threads)
    assert len(spawned) == (2 if started_by == "the launcher" else 0)  # only rank 0's launcher starts the others


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precisions_are_refused_with_a_reason(precision):
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported by chunk_offload"):
        trainer(strategy="chunk_offload", precision=precision)


def test_a_mac_s_mps_device_is_refused_naming_it_and_the_cpu(monkeypatch):
    """Lightning picks MPS on a Mac when ``accelerator`` is left to it; the fit failed inside the first buffer's move
    ("Could not run 'aten::empty_strided' with arguments from the 'MPS' backend" where MPS is faked here). Refused
    before anything moves, naming the device and what to pass."""
    from lightning.fabric.accelerators.mps import MPSAccelerator

    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: True))
    t = trainer(accelerator="mps", strategy="chunk_offload", max_steps=1)
    with pytest.raises(
        ValueError,
        match=r"runs on CUDA GPUs and on the CPU, not on this Trainer's 'mps' device.*"
        r"accelerator='cpu'",
    ):
        t.fit(ParityNet(), token_data())


def test_bad_strategy_knobs_name_the_value():
    with pytest.raises(ValueError, match="placement='everywhere'"):
        ChunkOffloadStrategy(placement="everywhere")
    with pytest.raises(ValueError, match="device_memory_limit=-5"):
        ChunkOffloadStrategy(device_memory_limit=-5)


@pytest.mark.parametrize("which", [True, "all"])
def test_memory_stats_are_logged_every_step(tmp_path, which):
    """By default a few (where the bytes are, what moved, where the time went); every entry when asked."""
    t = trainer(
        tmp_path,
        strategy=ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(log_memory_stats=which)
        ),
        max_steps=5,
        logger=CSVLogger(tmp_path, name="csv"),
        log_every_n_steps=1,
    )
    t.fit(ParityNet(), token_data())
    rows = list(csv.DictReader(open(next(Path(tmp_path).rglob("metrics.csv")))))
    for col in (
        "device_chunk_bytes",
        "device_chunk_bytes_peak",
        "host_chunk_bytes",
        "evictions",
        "gathers",
        "time_gather_wait_s",
        "time_optimizer_s",
    ):
        assert f"chunk/{col}" in rows[0]
    assert float(rows[-1]["chunk/gathers"]) > 0 and float(rows[-1]["chunk/host_chunk_bytes"]) > 0
    logged = [c for c in rows[0] if c.startswith("chunk/")]
    if which == "all":
        assert "chunk/h2d_bytes" in rows[0] and len(logged) == len(t.strategy.memory_stats()) > 30
    else:
        assert "chunk/h2d_bytes" not in rows[0] and len(logged) <= 20


def test_chunk_telemetry_logs_where_each_step_s_time_went_and_prints_the_totals(tmp_path, caplog):
    from lightning_chunk import ChunkTelemetry

    tel = ChunkTelemetry(picture=False)
    t = trainer(
        tmp_path,
        strategy=ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(log_memory_stats=False)
        ),
        max_steps=5,
        logger=CSVLogger(tmp_path, name="csv"),
        log_every_n_steps=1,
        callbacks=[tel],
    )
    with caplog.at_level("INFO"):
        t.fit(ParityNet(), token_data())
    rows = list(csv.DictReader(open(next(Path(tmp_path).rglob("metrics.csv")))))
    from lightning_chunk.engine.system.timing import CAUSES

    causes = CAUSES + ("rest",)
    for row in rows:
        parts = [float(row[f"chunk/time_{c}_ms"]) for c in causes]
        assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(float(row["chunk/step_time_ms"]), rel=1e-6)
        assert float(row["chunk/time_optimizer_ms"]) > 0 and float(row["chunk/time_hooks_ms"]) > 0
    (totals,) = tel.breakdown
    assert totals["step"] > totals["optimizer"] + totals["hooks"] > 0
    assert "where the training steps' time went" in caplog.text
    assert totals["step"] == pytest.approx(sum(float(r["chunk/step_time_ms"]) for r in rows[1:]) / 1000, rel=1e-6)
    stats = t.strategy.memory_stats()
    assert stats["time_optimizer_s"] >= totals["optimizer"]  # cumulative since set-up


def test_parameters_hold_trained_values_after_fit_and_the_model_keeps_working():
    ref = ParityNet()
    L.seed_everything(3)
    model = ParityNet()
    ref.load_state_dict(model.state_dict())
    t = trainer(
        strategy=ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")
        ),
        max_steps=6,
        limit_val_batches=2,
    )
    t.fit(model, datamodule=TokenData())
    trainer(strategy="auto", max_steps=6, limit_val_batches=2).fit(ref, datamodule=TokenData())
    for (_n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    x = torch.randint(0, 48, (2, 8))
    torch.testing.assert_close(model(x), ref(x), **EXACT)  # inference after training just works
    out = t.validate(model, datamodule=TokenData(), verbose=False)  # a second run sets the engine up again
    assert out and "val_loss" in out[0]
    preds = t.predict(model, dataloaders=token_data(8))
    assert len(preds) == 2


def test_manual_optimization_matches_auto():
    L.seed_everything(5)
    ref = ManualNet()
    L.seed_everything(5)
    got = ManualNet()
    trainer(strategy="auto", max_steps=10).fit(ref, token_data())
    trainer(
        strategy=ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")
        ),
        max_steps=10,
    ).fit(got, token_data())
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def run_with_resume(strategy_factory, tmp_path: Path):
    """12 steps with a checkpoint at step 8 written during fit, then a new run resumed from it to 12."""
    L.seed_everything(11)
    model = ParityNet()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1, filename="{step}")
    trainer(tmp_path, strategy=strategy_factory(), max_steps=8, callbacks=[ckpt], enable_checkpointing=True).fit(
        model, token_data()
    )
    path = tmp_path / "step=8.ckpt"
    assert path.exists()
    resumed = ParityNet()
    resumed.load_state_dict(init)  # resume overwrites everything
    trainer(tmp_path, strategy=strategy_factory(), max_steps=12).fit(resumed, token_data(), ckpt_path=path)
    return (torch.load(path, weights_only=False) if path.is_file() else None), resumed


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_checkpoint_resume_matches_auto_resumed_the_same_way(tmp_path, state_dict_type):
    ref_ckpt, ref = run_with_resume(lambda: "auto", tmp_path / "auto")
    got_ckpt, got = run_with_resume(
        lambda: ChunkOffloadStrategy(
            placement="host",
            state_dict_type=state_dict_type,
            memory=MemoryOptions(chunk_numel=4096),
            offload=OffloadOptions(optimizer_kernel="loop"),
        ),
        tmp_path / "chunk",
    )
    for a, b in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)
    if state_dict_type == "sharded":
        assert (tmp_path / "chunk" / "step=8.ckpt" / "meta.pt").is_file()
        return
    # the checkpoint written during fit is a plain Lightning checkpoint
    assert got_ckpt["state_dict"].keys() == ref_ckpt["state_dict"].keys()
    for k in ref_ckpt["state_dict"]:
        torch.testing.assert_close(got_ckpt["state_dict"][k], ref_ckpt["state_dict"][k], **EXACT)
    ref_opt, got_opt = ref_ckpt["optimizer_states"][0], got_ckpt["optimizer_states"][0]
    for k, st in ref_opt["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got_opt["state"][k][name], st[name], **EXACT)
    plain = ParityNet()
    plain.load_state_dict(got_ckpt["state_dict"], strict=True)


def test_fp16_loss_scale_is_saved_and_restored(tmp_path):
    strategy = ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096))
    plugin = ChunkPrecision("16-mixed", init_scale=1024.0)
    t = trainer(tmp_path, strategy=strategy, plugins=[plugin], max_steps=3)
    t.fit(ParityNet(), token_data())
    plugin.scaler.scale = 123.0
    t.save_checkpoint(tmp_path / "s.ckpt")
    plugin2 = ChunkPrecision("16-mixed")
    t2 = trainer(
        tmp_path, strategy=ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096)), plugins=[plugin2], max_steps=4
    )
    t2.fit(ParityNet(), token_data(), ckpt_path=tmp_path / "s.ckpt")
    assert plugin2.scaler.scale == 123.0


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "strategy_yaml",
    [
        "  strategy: chunk_offload\n",
        "  strategy:\n    class_path: lightning_chunk.ChunkOffloadStrategy\n    init_args:\n      placement: host\n"
        "      device_memory_limit: 4MiB\n      memory:\n        chunk_numel: 4096\n      checks:\n"
        "        log_memory_stats: all\n",
    ],
)
def test_lightning_cli_selects_the_strategy_from_yaml(tmp_path, strategy_yaml):
    cfg = write(
        tmp_path / "cfg.yaml",
        "trainer:\n  accelerator: cpu\n  devices: 1\n  max_steps: 3\n"
        "  logger: false\n  enable_checkpointing: false\n  enable_progress_bar: false\n"
        f"  limit_val_batches: 0\n  default_root_dir: {tmp_path}\n" + strategy_yaml,
    )  # the saved config goes there
    cli = LightningCLI(ParityNet, TokenData, args=["fit", "--config", str(cfg)], save_config_kwargs={"overwrite": True})
    assert isinstance(cli.trainer.strategy, ChunkOffloadStrategy)
    assert cli.trainer.global_step == 3
    if "host" in strategy_yaml:
        assert cli.trainer.strategy.config.placement == "host"
        assert cli.trainer.strategy.config.device_memory_limit == 4 * 2**20
        assert cli.trainer.strategy.config.chunk_numel == 4096 and cli.trainer.strategy.log_memory_stats == "all"


def test_lightning_cli_rejects_an_unknown_knob(tmp_path, capsys):
    cfg = write(
        tmp_path / "bad.yaml",
        "trainer:\n  strategy:\n    class_path: lightning_chunk.ChunkOffloadStrategy\n"
        "    init_args:\n      offload_everything: true\n",
    )
    with pytest.raises(SystemExit) as e:
        LightningCLI(ParityNet, TokenData, args=["fit", "--config", str(cfg)])
    assert e.value.code != 0
    assert "offload_everything" in capsys.readouterr().err


CLIP_VALUE = dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")


@pytest.mark.parametrize(
    "kw",
    [dict(), CLIP_VALUE, dict(CLIP_VALUE, accumulate_grad_batches=2)],
    ids=["defaults", "clip_value", "clip_value_accumulate"],
)
def test_stepping_in_backward_trains_like_stepping_after_it_under_lightning(kw):
    """One rank, bf16-mixed, placement="auto" with the defaults: the same parameters, bit for bit; clipping by value
    too, each chunk clipping its own gradients as it steps ([Note: clipping by value in backward]), also the sum
    of accumulated micro-batches."""

    def fit(early, **more):
        L.seed_everything(5, verbose=False)
        model = ParityNet()
        strategy = ChunkOffloadStrategy(step_in_backward=early, checks=CheckOptions(log_memory_stats=False))
        trainer(strategy=strategy, precision="bf16-mixed", max_steps=6, **more).fit(model, token_data())
        return {k: v.clone() for k, v in model.state_dict().items()}, strategy.memory_stats()

    want, _ = fit(False, **kw)
    got, stats = fit(True, **kw)
    assert stats["chunks_stepped_in_backward"] > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], **EXACT, msg=k)
    if kw:  # the clipping changed the run: a step that clipped nothing would pass without it
        unclipped, _ = fit(True, **{k: v for k, v in kw.items() if not k.startswith("gradient_clip")})
        assert any(not torch.equal(unclipped[k], got[k]) for k in got)


@pytest.mark.parametrize(
    "kw,offload,placement",
    [
        (dict(CLIP_VALUE, accumulate_grad_batches=2), dict(optimizer_kernel="loop"), "host"),
        (dict(precision="bf16-mixed"), dict(optimizer_kernel="one_pass"), "host"),  # the native pass writes the copy
        (dict(precision="bf16-mixed"), {}, "auto"),  # the defaults: device-tier chunks go to the worker too
    ],
    ids=["clip_value_accumulate", "bf16_one_pass", "bf16_defaults"],
)
def test_host_chunks_stepped_on_a_thread_beside_backward_train_as_on_the_autograd_thread(kw, offload, placement):
    """[Note: the host Adam beside backward]: with ``step_thread=True`` the host shards step on the worker while
    backward goes on; the parameters are those of the steps on the autograd thread, bit for bit, and every chunk
    stepped in backward gave its gradient shard back."""

    def fit(thread):
        L.seed_everything(5, verbose=False)
        model = ParityNet()
        strategy = ChunkOffloadStrategy(
            placement=placement,
            step_in_backward=True,
            memory=MemoryOptions(chunk_numel=20000 if placement == "host" else None),
            offload=OffloadOptions(step_thread=thread, **offload),
            checks=CheckOptions(log_memory_stats=False),
        )
        trainer(strategy=strategy, max_steps=6, **kw).fit(model, token_data())
        return {k: v.clone() for k, v in model.state_dict().items()}, strategy.memory_stats()

    want, plain = fit(False)
    got, stats = fit(True)
    assert "chunks_stepped_on_thread" not in plain  # off on a CPU device unless asked for
    assert stats["chunks_stepped_on_thread"] == stats["chunks_stepped_in_backward"] > 0
    assert stats["host_chunk_bytes"] == plain["host_chunk_bytes"]  # no gradient shard kept past its step
    for k in want:
        torch.testing.assert_close(got[k], want[k], **EXACT, msg=k)


def test_what_stepping_in_backward_cannot_do_is_refused_before_the_first_step():
    """Manual optimization steps when the user says; norm clipping and fp16: tests/integration/test_speculation.py."""
    model = ManualNet()
    with pytest.raises(ValueError, match="not allowed with manual optimization"):
        trainer(
            strategy=ChunkOffloadStrategy(step_in_backward=True, checks=CheckOptions(log_memory_stats=False)),
            max_steps=3,
        ).fit(model, token_data())
    assert all(torch.isfinite(p).all() for p in model.parameters())  # refused before anything was built


class SeesBatchNormType(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.during = type(pl_module.bn)


def test_sync_batchnorm_is_applied_for_fit_and_reverted_after_and_batchnorm_trains_like_auto():
    """``Trainer(sync_batchnorm=True)`` was ignored: the strategy never applied Lightning's layer sync, as DDP and
    FSDP do before wrapping. On one rank SyncBatchNorm computes plain batch statistics, so parameters and running
    statistics equal plain Lightning's."""
    from tests.models import BatchNormNet, fit

    ref = fit("auto", steps=8, cls=BatchNormNet)
    seen = SeesBatchNormType()
    got = fit(
        ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")),
        steps=8,
        cls=BatchNormNet,
        sync_batchnorm=True,
        callbacks=[seen],
    )
    assert seen.during is torch.nn.SyncBatchNorm
    assert isinstance(got.bn, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(got.bn, torch.nn.SyncBatchNorm)
    for (n, a), (_, b) in [
        *zip(ref.named_parameters(), got.named_parameters(), strict=True),
        *zip(ref.named_buffers(), got.named_buffers(), strict=True),
    ]:
        assert torch.equal(a, b), n


class LazyHead(ParityNet):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.head = torch.nn.LazyLinear(48, bias=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_lazy_module_is_refused_with_its_name_and_the_way_out():
    """Plain Lightning trains a LazyLinear (its first forward sizes it); chunks are packed by shape before any forward,
    and torch's own error named neither the parameter nor what to do."""
    with pytest.raises(ValueError, match=r"1 parameter is not initialised yet \(head\.weight\).*sample batch"):
        trainer(
            strategy=ChunkOffloadStrategy(
                memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(log_memory_stats=False)
            ),
            max_steps=1,
        ).fit(LazyHead(), token_data())
    model = LazyHead()
    model(torch.zeros(2, 8, dtype=torch.long))  # the way out: one forward on a sample batch
    trainer(
        strategy=ChunkOffloadStrategy(
            memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(log_memory_stats=False)
        ),
        max_steps=1,
    ).fit(model, token_data())


class IntegerParameter(ParityNet):
    def build(self) -> None:
        super().build()
        self.seen = torch.nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)


def test_an_integer_parameter_is_refused_naming_it_and_the_way_out():
    with pytest.raises(TypeError, match=r"'seen' has dtype torch\.int64.*register_buffer\('seen'"):
        trainer(strategy=ChunkOffloadStrategy(), max_steps=1).fit(IntegerParameter(), token_data())
