"""``offload_states()`` / ``reload_states()`` between steps ([Note: offloading states between phases]), one rank
against plain Lightning; the two-rank case against DDP is ``offload_states`` in tests/distributed/."""

import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy, ChunkPrecision
from lightning_chunk.engine.errors import ChunkError
from lightning_chunk.options import grouped
from tests import callbacks
from tests.models import fit

STEPS = 12
LOOP = dict(optimizer_kernel="loop")


@pytest.mark.parametrize(
    ("kw", "bf16"),
    [
        (dict(placement="device"), False),  # every shard on the device: the payloads are the shards
        (dict(device_memory_limit=2_000_000, chunk_numel=20_000), True),  # auto placement: some shards on the device
    ],
    ids=["device_fp32", "auto_limit_bf16"],
)
def test_offloaded_states_leave_no_device_bytes_and_training_goes_on_bit_for_bit(kw, bf16):
    """Offloaded after steps 3 and 9, reloaded before step 6 and by the step after 9 itself: no chunk bytes on the
    device while offloaded, the device's bytes back after a reload, and the parameters of plain Lightning."""
    plugins = dict(plugins=[ChunkPrecision("bf16-mixed")]) if bf16 else {}
    ref = fit(ChunkOffloadStrategy(**grouped({**kw, **LOOP})), steps=STEPS, **plugins)
    cb = callbacks.OffloadAndReload()
    got = fit(ChunkOffloadStrategy(**grouped({**kw, **LOOP})), steps=STEPS, callbacks=[cb], **plugins)
    assert [what for what, _ in cb.seen] == ["offloaded", "reloaded", "offloaded"]
    assert [b for what, b in cb.seen if what == "offloaded"] == [0, 0]
    assert dict(cb.seen)["reloaded"] > 0
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    if not bf16:  # and the engine's run is plain Lightning's
        plain = fit("auto", steps=STEPS)
        for (n, a), (_, b) in zip(plain.named_parameters(), got.named_parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def test_offloading_inside_gradient_accumulation_is_refused_with_the_reason():
    class Early(callbacks.OffloadAndReload):  # after the first micro-batch of two: the step has not happened
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                trainer.strategy.offload_states()

    with pytest.raises(ChunkError, match="between optimizer steps"):
        fit(ChunkOffloadStrategy(placement="device"), steps=2, callbacks=[Early()], accumulate_grad_batches=2)


def test_offload_before_and_after_fit_does_nothing():
    strategy = ChunkOffloadStrategy(placement="device")
    strategy.offload_states()  # no engine yet
    model = fit(strategy, steps=2)
    strategy.offload_states()  # the engine is gone: the module is plain
    strategy.reload_states()
    assert all(not p.isnan().any() for p in model.parameters())
