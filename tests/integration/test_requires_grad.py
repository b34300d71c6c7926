"""Parameters frozen, unfrozen and toggled mid-training on one rank, bit-exact with plain Lightning; what cannot
change that way (inside gradient accumulation) is refused with what to do instead. Two ranks: ``tests/distributed``
(case ``unfreeze``). Lightning's finetuning callbacks: ``test_added_param_groups.py``."""

import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.options import grouped
from tests import callbacks, models
from tests.integration.test_parity import EXACT, STEPS, assert_same_params
from tests.models import fit


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_toggle_optimizer_freezes_the_module_s_parameters(placement):
    """[Note: toggled optimizers]: Lightning's GAN pattern. toggle_optimizer acted on the optimizers' tensors (views
    of the shards) only, so each phase's backward left gradients on the other optimizer's parameters, which it then
    stepped with (0.07 from plain Lightning after 12 steps)."""
    ref = fit("auto", steps=12, cls=models.ToggledOptimizers)
    strategy = ChunkOffloadStrategy(
        placement=placement, memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=12, cls=models.ToggledOptimizers)
    assert_same_params(ref, got, EXACT)
    assert all(p.requires_grad for p in got.parameters())  # untoggled, and the class's own methods again
    assert "toggle_optimizer" not in got.__dict__


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(placement="host"), dict(device_memory_limit=90_000), dict(trainer=dict(accumulate_grad_batches=2))],
    ids=["auto", "host", "limit", "accumulate"],
)
def test_freezing_and_unfreezing_mid_training_is_bit_exact(kw):
    """[Note: requires_grad changed]: blocks[0] unfrozen at step 6, the embedding frozen from step 6 to 14, with the
    defaults. The unfrozen block used to stay as it was, silently."""
    kw = dict(kw)
    tkw = kw.pop("trainer", {})
    ref = fit("auto", steps=STEPS, variant="frozen", callbacks=[callbacks.FlipRequiresGrad()], **tkw)
    strategy = ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"}))
    got = fit(strategy, steps=STEPS, variant="frozen", callbacks=[callbacks.FlipRequiresGrad()], **tkw)
    assert_same_params(ref, got, EXACT)
    init = fit("auto", steps=0, variant="frozen")
    assert not torch.equal(got.blocks[0][1].weight, init.blocks[0][1].weight)


class FlipInsideAccumulation(callbacks.FlipRequiresGrad):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 5:  # the second micro-batch of a step
            for p in pl_module.blocks[0].parameters():
                p.requires_grad_(True)


def test_changing_requires_grad_inside_gradient_accumulation_is_refused():
    with pytest.raises(Exception, match=r"requires_grad of 'blocks.0.0.weight'.* changed inside a step"):
        fit(
            ChunkOffloadStrategy(),
            steps=8,
            variant="frozen",
            callbacks=[FlipInsideAccumulation()],
            accumulate_grad_batches=2,
        )
