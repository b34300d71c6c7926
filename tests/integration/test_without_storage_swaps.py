"""[Note: torch versions]: a torch before 2.12 cannot swap storages' memory, and the engine then refills a given-back
gradient shard from its own allocator. One rank against plain Lightning with the defaults a user gets (the automatic
chunk size, stepping in backward), under a device limit, on a model used in another order than it registers its
parameters, with accumulation and a resume half-way; the feature switched off on a torch that has it. Every rank
count and limit of the multi-rank suite also passed on torch 2.7.1 and 2.11, which lack it (2026-12-06)."""

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
from lightning_chunk.engine.system import torch_features
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, ReorderedNet, fit

STEPS = 10
WIDE = dict(dim=128, hidden=512, depth=3)  # the activations a small limit leaves beside the chunks


def test_the_defaults_under_a_limit_train_and_resume_as_plain_lightning_without_storage_swaps(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", False)
    limit = int(4 * sum(p.numel() for p in ParityNet(**WIDE).parameters()) * 0.6)  # under the fp32 parameters

    def chunked() -> ChunkOffloadStrategy:  # torch's loop, as plain Lightning's CPU AdamW: the same bits
        return ChunkOffloadStrategy(device_memory_limit=limit, offload=OffloadOptions(optimizer_kernel="loop"))

    kw = dict(cls=ReorderedNet, model_kwargs=WIDE, accumulate_grad_batches=2)
    for strategy, where in (("auto", tmp_path / "auto"), (chunked(), tmp_path / "chunk")):
        save = ModelCheckpoint(dirpath=where, every_n_train_steps=STEPS // 2, filename="half")
        fit(strategy, steps=STEPS // 2, callbacks=[save], enable_checkpointing=True, **kw)
    plain = fit("auto", steps=STEPS, ckpt_path=str(tmp_path / "auto" / "half.ckpt"), **kw)
    got = fit(chunked(), steps=STEPS, ckpt_path=str(tmp_path / "chunk" / "half.ckpt"), **kw)
    stats = got.trainer_ref.strategy.memory_stats()
    assert stats["chunks_stepped_in_backward"] > 0 and stats["host_chunk_bytes"] > 0 and stats["evictions"] > 0
    assert stats["pool_reused"] == 0  # nothing swapped: the host pool kept nothing
    assert stats["host_grads_kept_lazily"] > 0  # [Note: gradient buffers the kernel may take]
    assert_same_params(plain, got, EXACT)
    assert not torch.equal(plain.head.weight, fit("auto", steps=0, **kw).head.weight)  # it trained
