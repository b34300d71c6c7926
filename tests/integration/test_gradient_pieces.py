"""A gradient that arrives in pieces ([Note: gradients in pieces]): a block used three times, twice inside reentrant
activation checkpointing, trains as plain Lightning does in every placement; a piece no forward counted is refused
by name. Two ranks: ``tests/distributed`` (cases ``reused_reentrant``, ``reused_reentrant_limit``)."""

import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine.errors import ChunkError
from lightning_chunk.options import grouped
from tests.backward_models import ReusedCheckpointedNet
from tests.integration.test_parity import EXACT, assert_same_params
from tests.models import ParityNet, fit

WIDE = dict(dim=256, hidden=1024, depth=4)


@pytest.mark.parametrize(
    "kw,tkw",
    [
        # the block's weight alone in its chunk, stepped in backward (the default here): the chunk stepped on the
        # first piece and again on the others, 0.036 from plain Lightning after 4 steps, with no error
        (dict(chunk_numel=2048), {}),
        (dict(chunk_numel=2048, placement="host"), {}),
        (dict(chunk_numel_min=4096, device_memory_limit=0.45), {}),  # fraction of the parameter bytes
        (dict(chunk_numel_min=4096, device_memory_limit=0.45), dict(accumulate_grad_batches=2)),
    ],
    ids=["own_chunk", "host", "limit", "limit_accumulate"],
)
def test_a_reused_block_in_reentrant_checkpoints_trains_like_plain_lightning(kw, tkw):
    model_kwargs = {} if "chunk_numel" in kw else WIDE
    ref = fit("auto", steps=6, cls=ReusedCheckpointedNet, model_kwargs=model_kwargs, **tkw)
    if "device_memory_limit" in kw:
        kw = {
            **kw,
            "device_memory_limit": int(kw["device_memory_limit"] * sum(p.numel() * 4 for p in ref.parameters())),
        }
    strategy = ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"}))
    got = fit(strategy, steps=6, cls=ReusedCheckpointedNet, model_kwargs=model_kwargs, **tkw)
    assert_same_params(ref, got, EXACT)
    assert strategy.memory_stats()["chunks_stepped_in_backward"] > 0  # the default: where the pieces were lost


class OwnCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint of the user's own: its backward runs a backward of its own, as torch's does."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class ReusedInOwnCheckpoint(ParityNet):
    def forward(self, x, use_branch=True):
        h = self.embed(x)
        h = h + OwnCheckpoint.apply(self.blocks[0], h)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


def test_a_piece_no_forward_counted_is_refused_by_name():
    with pytest.raises(ChunkError, match=r"'blocks\.0\.\d\.\w+' got its gradient in more pieces .* than its forward"):
        fit(ChunkOffloadStrategy(), steps=2, cls=ReusedInOwnCheckpoint)
