"""Models built on the meta device (``configure_model``, ``Trainer.init_module(empty_init=True)``) and
initialised chunk by chunk at setup: the same values as an eager build, the same training, clear errors."""

import lightning as L
import pytest
import torch
import torch.nn as nn

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.engine.chunks.materialize import DeferredInitError
from tests.integration.test_parity import EXACT, STEPS, assert_same_params
from tests.models import DeferredNet, ParityNet, fit, quiet_trainer, token_data


def init_values(model: L.LightningModule, strategy, **trainer_kw) -> dict:
    """``fit`` with no step: setup (deferred init, packing), then teardown gives the values back."""
    t = quiet_trainer(strategy=strategy, max_steps=0, **trainer_kw)
    t.fit(model, token_data())
    return model.state_dict()


def eager_values(variant: str = "plain", seed: int = 7, **kw) -> dict:
    L.seed_everything(seed, verbose=False)
    return {k: v.clone() for k, v in ParityNet(variant=variant, **kw).state_dict().items()}


@pytest.mark.parametrize("variant", ["plain", "tied", "frozen", "unused"])
@pytest.mark.parametrize("chunk_numel", [None, 2048])
def test_configure_model_on_meta_equals_eager_init(variant, chunk_numel):
    want = eager_values(variant)
    L.seed_everything(7, verbose=False)
    model = DeferredNet(variant=variant)
    got = init_values(model, ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=chunk_numel)))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    if variant == "tied":
        assert model.head.weight is model.embed.weight


class WithReset(ParityNet):
    def reset_parameters(self) -> None:
        self.calls.zero_()


def test_init_module_empty_init_builds_on_meta_and_initialises_at_setup():
    want = eager_values()
    L.seed_everything(7, verbose=False)
    strategy = ChunkOffloadStrategy()
    trainer = quiet_trainer(strategy=strategy, max_steps=0)
    with trainer.init_module(empty_init=True):
        model = WithReset()
    assert all(p.is_meta for p in model.parameters()) and model.calls.is_meta
    trainer.fit(model, token_data())
    for k, v in want.items():
        assert torch.equal(model.state_dict()[k], v), k
    with trainer.init_module():  # without empty_init: an ordinary model on the host
        plain = ParityNet()
    assert all(p.device.type == "cpu" for p in plain.parameters())


@pytest.mark.parametrize("placement,limit", [("auto", None), ("host", None), ("auto", 80_000)])
def test_deferred_model_trains_like_an_eager_one(placement, limit):
    ref = fit("auto", steps=STEPS)
    strategy = ChunkOffloadStrategy(
        placement=placement, device_memory_limit=limit, offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=STEPS, cls=DeferredNet)
    assert_same_params(ref, got, EXACT)
    assert int(got.calls) == int(ref.calls) > 0
    if limit is not None:  # under the limit chunks do move
        assert strategy.memory_stats()["evictions"] > 0


def test_a_tensor_with_no_init_is_named_before_training():
    L.seed_everything(7, verbose=False)
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=1)
    with trainer.init_module(empty_init=True):
        model = ParityNet()  # owns the buffer `calls` itself and has no reset_parameters()
    with pytest.raises(DeferredInitError, match=r"<root> \(ParityNet\): calls.*param_init_fn"):
        trainer.fit(model, token_data())
    assert trainer.global_step == 0


class Scaled(nn.Module):
    """A layer whose init lives outside ``reset_parameters`` for ``scale`` (left NaN if nothing sets it), with a
    non-persistent cache computed from its shape, like a rotary table."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.register_buffer("table", torch.arange(dim, dtype=torch.float32), persistent=False)

    def reset_parameters(self) -> None:
        self.table.copy_(torch.arange(self.table.numel(), dtype=torch.float32))  # forgets `scale`

    def forward(self, x):
        return self.lin(x) * self.scale + self.table


class ScaledNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = None

    def configure_model(self) -> None:
        self.embed = nn.Embedding(48, 16)
        self.layer = Scaled(16)
        self.head = nn.Linear(16, 48)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.layer(self.embed(x))).reshape(-1, 48), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)  # fused checks the parameters' device


def test_an_init_that_forgets_a_tensor_is_an_error_naming_it():
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=1)
    with pytest.raises(DeferredInitError, match=r"Scaled.reset_parameters\(\) left layer.scale uninitialised"):
        trainer.fit(ScaledNet(), token_data())


def test_an_init_that_writes_part_of_a_tensor_is_an_error_naming_it(monkeypatch):
    """One element left NaN among 16, in the middle of a vector lane, is found as a whole tensor left is."""

    forgets = Scaled.reset_parameters

    def partly(self):
        forgets(self)
        self.scale.data[:9].fill_(1.0)
        self.scale.data[10:].fill_(1.0)

    monkeypatch.setattr(Scaled, "reset_parameters", partly)
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=1)
    with pytest.raises(DeferredInitError, match=r"left layer.scale uninitialised"):
        trainer.fit(ScaledNet(), token_data())


def test_param_init_fn_initialises_what_reset_parameters_does_not():
    seen = []

    def init(m: nn.Module) -> None:
        seen.append(type(m).__name__)
        if isinstance(m, Scaled):
            m.reset_parameters()
            nn.init.constant_(m.scale, 0.5)
        else:
            m.reset_parameters()

    model = ScaledNet()
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(param_init_fn=init), max_steps=3)
    trainer.fit(model, token_data())
    assert trainer.global_step == 3
    assert seen == ["Embedding", "Scaled", "Linear", "Linear"]  # modules() order, each once
    assert torch.equal(model.layer.table, torch.arange(16, dtype=torch.float32))  # the non-persistent buffer
    assert not model.layer.scale.isnan().any() and not torch.equal(model.layer.scale, torch.full((16,), 0.5))


class CustomInit(DeferredNet):
    """GPT-2 style: layers built, then re-initialised by ``self.apply``: on the meta device that does nothing."""

    def build(self) -> None:
        super().build()
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)


def test_an_init_that_would_be_lost_on_the_meta_device_is_refused_unless_param_init_fn_says_how():
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=1)
    with pytest.raises(DeferredInitError, match=r"outside reset_parameters\(\).*normal_ at .*test_deferred_init.py"):
        trainer.fit(CustomInit(), token_data())

    def init(m: nn.Module) -> None:  # the same init, per module: reset, then the custom draw
        m.reset_parameters()
        CustomInit._init(m)

    L.seed_everything(0, verbose=False)  # unseeded, a small layer's std fell outside the bounds once (2026-12-06)
    model = CustomInit()
    init_values(model, ChunkOffloadStrategy(param_init_fn=init))
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            assert 0.015 < float(m.weight.std()) < 0.025


def test_a_deferred_model_resumes_from_a_checkpoint_like_an_eager_one(tmp_path):
    """ckpt_path still wins over the deferred init: the resumed run equals the eager model's resume."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(7, verbose=False)
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, filename="{step}")
    quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=4, callbacks=[cb], enable_checkpointing=True).fit(
        ParityNet(), token_data()
    )
    ckpt = tmp_path / "step=4.ckpt"
    out = {}
    for cls in (ParityNet, DeferredNet):
        L.seed_everything(11, verbose=False)
        model = cls()
        quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=8).fit(model, token_data(), ckpt_path=ckpt)
        out[cls.__name__] = model.state_dict()
    for k, v in out["ParityNet"].items():
        assert torch.equal(out["DeferredNet"][k], v), k


class MidTied(nn.Module):
    """A tied layer without a bias in the middle: its init draws (and drops) a weight in an eager build, so it must
    draw in a deferred one too, or every layer after it gets other values."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight
        self.c = nn.Linear(8, 8)


def test_a_tied_module_in_the_middle_keeps_the_random_stream_of_an_eager_build():
    from lightning_chunk.engine import ChunkConfig, ChunkEngine
    from lightning_chunk.engine.chunks.materialize import DeferredInit

    torch.manual_seed(3)
    eager = MidTied()
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = MidTied()
    engine = ChunkEngine(meta, [], config=ChunkConfig(chunk_numel=64), deferred=DeferredInit.capture(meta))
    engine.teardown(materialize=True, device=torch.device("cpu"))
    assert meta.b.weight is meta.a.weight
    for k, v in eager.state_dict().items():
        assert torch.equal(meta.state_dict()[k], v), k
