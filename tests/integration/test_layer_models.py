"""Layers that keep their own hold on their parameters, and a training step that calls the model twice, from the
user's side (``tests/layer_models.py``): one rank against plain Lightning under a device limit that evicts."""

import pytest

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from tests.compare import EXACT, assert_same_params
from tests.layer_models import ParametrizedNet, RecurrentNet, TwoPassNet
from tests.models import fit

LOOP = OffloadOptions(optimizer_kernel="loop")  # plain Adam's bits


@pytest.mark.parametrize(
    "cls, variant, chunk_numel, limit",
    [
        (RecurrentNet, "lstm_proj", 4096, 280_000),
        (RecurrentNet, "gru", 8192, 380_000),
        (ParametrizedNet, "plain", 4096, 125_000),
    ],
    ids=["lstm_proj", "gru", "parametrizations"],
)
def test_layers_that_hold_their_weights_train_like_plain_lightning(cls, variant, chunk_numel, limit):
    """``nn.LSTM`` and ``nn.GRU`` read their weights through a list made at construction, in one fused kernel;
    weight norm, spectral norm (its power iteration's buffers written in every training forward) and an orthogonal
    map compute ``weight`` from their own parameters when it is read. Bit for bit under a limit that evicts."""
    ref = fit("auto", steps=8, cls=cls, variant=variant)
    strategy = ChunkOffloadStrategy(
        device_memory_limit=limit, memory=MemoryOptions(chunk_numel=chunk_numel), offload=LOOP
    )
    got = fit(strategy, steps=8, cls=cls, variant=variant)
    assert_same_params(ref, got, EXACT)
    assert strategy.memory_stats()["evictions"] > 0


def test_a_model_called_twice_a_step_trains_under_a_limit_below_its_payloads():
    """[Note: a module called again before its backward]: R-Drop's two forwards, both in backward, kept every chunk
    in use from the second call's backward to the first's: the whole model's payloads at once, and at 0.6 of the
    parameter bytes the first step failed (naming as the smallest working limit one chunk more each time, ten
    times). The limit leaves the chunks 0.25 of the parameter bytes beside the two forwards' activations."""
    kw = dict(steps=6, cls=TwoPassNet, variant="rdrop", model_kwargs=dict(dim=256, hidden=1024, depth=4))
    ref = fit("auto", **kw)
    limit = int(0.6 * sum(p.numel() * p.element_size() for p in ref.parameters()))
    strategy = ChunkOffloadStrategy(device_memory_limit=limit, offload=LOOP)
    got = fit(strategy, **kw)
    assert_same_params(ref, got, EXACT)
    stats = strategy.memory_stats()
    assert stats["evictions"] > 0 and stats["device_chunk_bytes_peak"] <= limit
