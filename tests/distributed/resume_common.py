"""Resume with the defaults: the automatic chunk size, a model used in another order than registered (so
the resumed warm-up repacks and moves every rank's pieces), with and without a device limit. Shared by
the 2-rank child (``runner.py``) and the 1-rank halves in ``test_resume_defaults.py``; no side effects."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.options import grouped
from tests.models import ReorderedNet, quiet_trainer, token_data

RESUME_MODEL = dict(dim=64, hidden=256, depth=3)
RESUME_VARIANTS = ("auto_size", "auto_size_limit", "host_kept_limit", "disk_early_limit")
# the disk tier's scratch root for disk_early_limit: each process's own sub-directory is removed when fit ends
DISK_ROOT = Path(tempfile.gettempdir()) / "lightning_chunk-tests-resume"


# 106K parameters: the training state (16 bytes a parameter) is 1.7 MB on one rank and 0.85 MB a rank on two,
# both above this limit, so shards go to the host; the warm-up's working set and activations (~0.34 MB) fit
RESUME_LIMIT = 700_000


def resume_strategy(variant: str) -> ChunkOffloadStrategy:
    kw: dict[str, Any] = dict(optimizer_kernel="loop", collective_timeout_s=60, materialize_optimizer_state=True)
    if variant == "auto_size_limit":
        kw.update(chunk_numel_min=4096, device_memory_limit=RESUME_LIMIT)
    if variant == "host_kept_limit":  # payloads kept for backward within a limit (an accelerator's default)
        kw.update(placement="host", device_memory_limit=RESUME_LIMIT, reshard_after_forward=False)
    if variant == "disk_early_limit":  # most shards in files, each disk chunk stepped during backward: the default
        kw.update(
            chunk_numel_min=4096, device_memory_limit=RESUME_LIMIT, host_memory_limit=600_000, disk_dir=DISK_ROOT
        )  # with a host limit ([Note: stepping in backward by default])
    return ChunkOffloadStrategy(**grouped(kw))


def resume_fit(strategy: Any, out_dir: Path | None, steps: int, ckpt_path: Any = None, devices: int = 2):
    """One fit of ReorderedNet, saving a checkpoint at step 8 into ``out_dir`` when given; returns (trainer, model)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(11, verbose=False)
    model = ReorderedNet(**RESUME_MODEL)
    cbs = [ModelCheckpoint(dirpath=out_dir, every_n_train_steps=8, filename="{step}")] if out_dir else []
    t = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=cbs,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=bool(cbs),
    )
    t.fit(model, token_data(), ckpt_path=ckpt_path)
    if isinstance(strategy, ChunkOffloadStrategy) and strategy.config.host_memory_limit is not None:
        assert strategy.memory_stats().get("chunks_stepped_in_backward", 0) > 0, "the default steps in backward here"
    return t, model


def final_state(t: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state after fit (the state in parameter shapes)."""
    opt = {f"opt.{k}.{n}": v.clone() for k, st in t.optimizers[0].state_dict()["state"].items() for n, v in st.items()}
    return {**{k: v.clone() for k, v in model.state_dict().items()}, **opt}
