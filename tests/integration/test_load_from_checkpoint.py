"""``MyModule.load_from_checkpoint(ckpt.best_model_path)`` after training under chunk_offload, as Lightning's
tutorials end ([Note: load_from_checkpoint on a directory])."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine.errors import CheckpointError
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, fit, token_data


class WithHparams(ParityNet):
    def __init__(self, lr: float = 1e-2, depth: int = 2, **kw) -> None:
        super().__init__(lr=lr, depth=depth, **kw)
        self.save_hyperparameters()


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_the_best_checkpoint_loads_with_load_from_checkpoint_as_plain_lightning_s(tmp_path, state_dict_type):
    """Before, a sharded checkpoint (the default) failed with ``IsADirectoryError``."""
    best = ModelCheckpoint(tmp_path, monitor="val_loss", save_top_k=1)
    kw = dict(
        steps=6, cls=WithHparams, model_kwargs=dict(lr=3e-3, depth=3), val_dataloaders=token_data(16, seed=1),
        val_check_interval=6, limit_val_batches=2, enable_checkpointing=True, callbacks=[best],
    )  # fmt: skip
    strategy = ChunkOffloadStrategy(**grouped(dict(placement="host", state_dict_type=state_dict_type)))
    trained = fit(strategy, **kw)
    assert best.best_model_path.endswith("step=6.ckpt")
    loaded = WithHparams.load_from_checkpoint(best.best_model_path, map_location="cpu")
    assert loaded.hparams.lr == 3e-3 and len(loaded.blocks) == 3
    assert_same_params(trained, loaded, EXACT)
    assert torch.equal(loaded.calls, trained.calls)  # buffers too
    assert {p.device for p in loaded.parameters()} == {torch.device("cpu")}


def test_a_directory_that_is_no_complete_checkpoint_says_what_is_missing(tmp_path):
    (tmp_path / "run.ckpt").mkdir()
    with pytest.raises(CheckpointError, match=r"run\.ckpt' is not a complete lightning_chunk checkpoint: meta\.pt"):
        WithHparams.load_from_checkpoint(tmp_path / "run.ckpt")
