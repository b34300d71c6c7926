"""``MemoryOptions(activation_checkpointing=[...])`` ([Note: activation checkpointing by class]): a model
checkpointed from the strategy's configuration, as FSDP's ``activation_checkpointing_policy`` does, against plain
Lightning running the same model without recomputation."""

import pytest
import torch
import torch.nn as nn

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, fit


class DropoutBlocks(ParityNet):
    """ParityNet with dropout in each block (the recomputation must draw the forward's masks again), counting the
    calls of the first block's first Linear: twice a step when the block is recomputed in backward."""

    def build(self) -> None:
        super().build()
        for blk in self.blocks:
            blk.insert(3, nn.Dropout(0.1))  # no parameters: the initial values are unchanged
        self.calls_first = 0

        def count(*_):
            self.calls_first += 1

        self.blocks[0][1].register_forward_pre_hook(count)


def _chunked(**kw):
    return ChunkOffloadStrategy(**grouped({"optimizer_kernel": "loop", "chunk_numel": 3000, **kw}))


@pytest.mark.parametrize("named", [nn.Sequential, "Sequential", "torch.nn.Sequential"], ids=["class", "name", "path"])
def test_blocks_named_in_the_config_are_recomputed_and_train_like_plain_lightning(named):
    ref = fit("auto", steps=4, cls=DropoutBlocks)
    strategy = _chunked(placement="host", activation_checkpointing=[named])
    got = fit(strategy, steps=4, cls=DropoutBlocks)
    assert_same_params(ref, got, EXACT)
    assert list(got.state_dict()) == list(ref.state_dict())  # no wrapper: the names are the model's
    assert ref.calls_first == 4 and got.calls_first == 8  # each step's backward ran the block's forward again
    # the recomputation keeps the blocks' activations out of the traced peak
    plain = fit(_chunked(placement="host"), steps=1, cls=DropoutBlocks).trainer_ref.strategy.memory_stats()
    assert got.trainer_ref.strategy.memory_stats()["nonmodel_peak_bytes"] < plain["nonmodel_peak_bytes"]


def _built(checkpointed: bool) -> DropoutBlocks:
    """DropoutBlocks with the seed ``fit`` uses, its second block checkpointed by the model itself if asked."""
    from torch.distributed._composable import checkpoint

    model = DropoutBlocks(build=False)
    torch.manual_seed(7)
    model.build()
    if checkpointed:
        checkpoint(model.blocks[1])
    return model


def test_a_second_fit_and_a_model_that_checkpoints_itself_are_left_as_they_are_and_train_like_plain_lightning():
    from torch.distributed._composable import checkpoint

    ref, got = _built(False), _built(True)
    for steps in (2, 4):  # a second fit on the same model: its blocks are checkpointed already
        fit("auto", steps=steps, cls=lambda **_: ref)
        fit(_chunked(activation_checkpointing=["Sequential"]), steps=steps, cls=lambda **_: got)
    assert_same_params(ref, got, EXACT)
    assert got.calls_first == 2 * ref.calls_first == 2 * (2 + 4)
    assert checkpoint.state(got.blocks[0]) is not None and checkpoint.state(got.norm) is None


def test_the_automatic_chunk_size_a_device_limit_and_accumulation_train_like_plain_lightning():
    run = dict(steps=4, cls=DropoutBlocks, accumulate_grad_batches=2)
    ref = fit("auto", **run)
    kw = dict(optimizer_kernel="loop", device_memory_limit=80_000, activation_checkpointing=["Sequential"])
    got = fit(ChunkOffloadStrategy(**grouped(kw)), **run)
    assert_same_params(ref, got, EXACT)
    assert got.calls_first == 2 * ref.calls_first == 2 * 8
    assert got.trainer_ref.strategy.memory_stats()["evictions"] > 0  # the limit binds


@pytest.mark.parametrize(
    "named, said",
    [
        (["Sequentail"], r"activation_checkpointing=\['Sequentail'\]: \['Sequentail'\] names no module of this model"),
        (["DropoutBlocks"], r"names the model itself \(DropoutBlocks\)"),
        ("Sequential", r"activation_checkpointing='Sequential' is not allowed; it must be a list"),
    ],
    ids=["misspelt", "the_model", "not_a_list"],
)
def test_what_names_no_block_is_refused_naming_it(named, said):
    with pytest.raises(ValueError, match=said):
        fit(_chunked(activation_checkpointing=named), steps=1, cls=DropoutBlocks)
