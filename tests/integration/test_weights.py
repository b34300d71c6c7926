"""``ChunkOffloadStrategy(weights=...)``: a state dict file, a Lightning or consolidated checkpoint, or a
safetensors directory, read straight into the chunks; bad files are refused before anything is written."""

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.engine.files.weights import WeightsError
from tests.integration.test_deferred_init import init_values
from tests.integration.test_parity import EXACT, assert_same_params
from tests.models import DeferredNet, ParityNet, fit, quiet_trainer, token_data
from tests.weights_files import FORMATS, write_weights


def start_values(variant="plain", seed=3) -> dict:
    L.seed_everything(seed, verbose=False)
    return {k: v.clone() for k, v in ParityNet(variant=variant).state_dict().items()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("deferred", [True, False])
def test_weights_replace_the_init_in_every_format(tmp_path, fmt, deferred):
    want = start_values("tied")
    path = write_weights(want, tmp_path / "w", fmt, variant="tied")
    L.seed_everything(7, verbose=False)  # another seed: every value must come from the file
    model = (DeferredNet if deferred else ParityNet)(variant="tied")
    got = init_values(model, ChunkOffloadStrategy(weights=path, memory=MemoryOptions(chunk_numel=2048)))
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert model.head.weight is model.embed.weight


def test_training_from_loaded_weights_matches_training_from_those_values(tmp_path):
    want = start_values()
    path = write_weights(want, tmp_path / "w", "safetensors")

    class Loaded(ParityNet):  # plain Lightning, starting from the same values
        def __init__(self, **kw):
            super().__init__(**kw)
            self.load_state_dict(want)

    ref = fit("auto", cls=Loaded)
    got = fit(ChunkOffloadStrategy(weights=path, offload=OffloadOptions(optimizer_kernel="loop")), cls=DeferredNet)
    assert_same_params(ref, got, EXACT)


class Wrapper(L.LightningModule):
    """Wraps the saved model as ``self.net``: file names are the module's without ``net.``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ParityNet()

    def training_step(self, batch, batch_idx):
        return self.net.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_the_prefix_of_a_wrapping_module_is_found(tmp_path):
    want = start_values()
    path = write_weights(want, tmp_path / "w", "safetensors")
    L.seed_everything(7, verbose=False)
    got = init_values(Wrapper(), ChunkOffloadStrategy(weights=path))
    for k, v in want.items():
        assert torch.equal(got[f"net.{k}"], v), k


def _bad(tmp_path, edit):
    sd = start_values()
    edit(sd)
    torch.save(sd, tmp_path / "bad.pt")
    L.seed_everything(7, verbose=False)
    model = ParityNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(weights=tmp_path / "bad.pt"), max_steps=1)
    with pytest.raises(WeightsError) as e:
        trainer.fit(model, token_data())
    assert trainer.global_step == 0
    for k, v in before.items():  # nothing was overwritten
        assert torch.equal(model.state_dict()[k], v), k
    return str(e.value)


def test_missing_extra_and_misshaped_tensors_are_listed_before_anything_is_written(tmp_path):
    def edit(sd):
        del sd["blocks.0.1.bias"], sd["calls"]
        sd["blocks.9.weight"] = torch.zeros(3)
        sd["norm.weight"] = torch.zeros(7)

    msg = _bad(tmp_path, edit)
    assert "nothing was loaded" in msg
    assert "missing from the file (2): calls, blocks.0.1.bias" in msg
    assert "in the file but not in the model (1): blocks.9.weight" in msg
    assert "of another shape (1): norm.weight: (7,) in the file, (32,) in the model" in msg


def test_strict_loading_false_keeps_the_init_of_what_the_file_lacks(tmp_path):
    want = start_values()
    partial = {k: v for k, v in want.items() if not k.startswith("head.")}
    torch.save(partial, tmp_path / "w.pt")
    L.seed_everything(7, verbose=False)
    model = DeferredNet()
    model.strict_loading = False
    init = {k: v.clone() for k, v in init_values(model, ChunkOffloadStrategy(weights=tmp_path / "w.pt")).items()}
    for k in want:
        if k in partial:
            assert torch.equal(init[k], partial[k]), k
        else:  # initialised by its module's reset_parameters()
            assert not init[k].isnan().any() and not torch.equal(init[k], want[k]) and init[k].std() > 0.01, k


@pytest.mark.parametrize(
    "layout,match",
    [
        ("none", "no such file or directory"),
        ("empty_dir", "a directory with no weights"),
        ("two_files", "2 .safetensors files and no"),
        ("index_missing_shard", "names model-00002-of-00002.safetensors for"),
        ("not_a_dict", "not a state dict"),
    ],
)
def test_unreadable_weights_are_clear_errors(tmp_path, layout, match):
    w = tmp_path / "w"
    if layout == "empty_dir":
        w.mkdir()
    elif layout in ("two_files", "index_missing_shard"):
        write_weights(start_values(), w, "safetensors")
        if layout == "two_files":
            (w / "model.safetensors.index.json").unlink()
        else:
            (w / "model-00002-of-00002.safetensors").unlink()
    elif layout == "not_a_dict":
        torch.save([torch.zeros(2)], w)
    trainer = quiet_trainer(strategy=ChunkOffloadStrategy(weights=w), max_steps=1)
    with pytest.raises(WeightsError, match=match):
        trainer.fit(ParityNet(), token_data())


def test_weights_seed_the_first_fit_only_and_ckpt_path_still_wins(tmp_path):
    start = start_values()
    path = write_weights(start, tmp_path / "w", "torch")
    strategy = ChunkOffloadStrategy(weights=path)
    L.seed_everything(7, verbose=False)
    model = ParityNet()
    trainer = quiet_trainer(strategy=strategy, max_steps=4, default_root_dir=tmp_path, enable_checkpointing=True)
    trainer.fit(model, token_data())
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(trained["head.weight"], start["head.weight"])
    trainer.validate(model, token_data(8), verbose=False)  # a second setup: the trained values stay
    for k, v in trained.items():
        assert torch.equal(model.state_dict()[k], v), k
    ckpt = next(p for p in tmp_path.rglob("*.ckpt") if "w" not in p.parts)
    L.seed_everything(7, verbose=False)
    resumed = ParityNet()
    t2 = quiet_trainer(strategy=ChunkOffloadStrategy(weights=path), max_steps=4)
    t2.fit(resumed, token_data(), ckpt_path=ckpt)  # resumes at step 4: no step, the checkpoint's values
    for k, v in trained.items():
        assert torch.equal(resumed.state_dict()[k], v), k
