"""What chunk_offload refuses from Lightning before anything is built: a device other than a CUDA GPU or the CPU,
callbacks that read or replace the module's parameters between steps, and ChunkEMA under a host limit without
``disk_dir``."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from .ema import ChunkEMA


def check_device(device: torch.device) -> None:
    """The engine's tiers are a CUDA device's memory, the host's and a disk; Apple's MPS (which Lightning picks on a
    Mac when ``accelerator`` is left to it), XLA and the others are refused before anything is moved."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"chunk_offload runs on CUDA GPUs and on the CPU, not on this Trainer's {device.type!r} device "
            f"({device}). Pass accelerator='cpu' (on Apple silicon the GPU shares the host's memory: there is nothing "
            "to offload to), or run on a CUDA GPU."
        )


def check_callbacks(trainer: pl.Trainer, host_memory_limit: int | None, disk_dir: str | None) -> None:
    """Callbacks that cannot work on a rebound optimizer or on packed parameters, refused before anything is
    built; ChunkEMA under a host limit without a directory for its files ([Note: the average under a host
    limit] in ``engine/optim/ema.py``)."""
    from lightning.pytorch import callbacks

    averaging = tuple(
        getattr(callbacks, n) for n in ("StochasticWeightAveraging", "WeightAveraging") if hasattr(callbacks, n)
    )
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, averaging):
            raise ValueError(
                f"{type(cb).__name__} does not work with chunk_offload: it keeps a whole copy of the model on "
                "every "
                "rank and reads and writes the module's parameters between steps, where chunk_offload's "
                "parameters are views of chunk payloads (released, or stale until the next gather) and the "
                "trained values live in the sharded master weights; the averaged weights it copies in would be "
                "lost (Lightning refuses it for FSDP and DeepSpeed for the same reason). For an exponential "
                "moving average use lightning_chunk.ChunkEMA (EMAWeightAveraging's behaviour, with the average "
                "sharded like the weights); for another average, a callback of your own inside "
                "`with trainer.strategy.full_parameters():` (docs/faq.md, 'Reading and writing parameters "
                "between steps')."
            )
        if isinstance(cb, callbacks.ModelPruning):
            raise ValueError(
                "ModelPruning does not work with chunk_offload: torch's pruning replaces each pruned parameter by "
                "`<name>_orig` and a whole-size mask while training, a new set of parameters the chunks were not "
                "packed for. Prune before or after training (torch.nn.utils.prune on the consolidated model)."
            )
        if isinstance(cb, ChunkEMA) and host_memory_limit is not None and disk_dir is None:
            raise ValueError(
                f"ChunkEMA with host_memory_limit={host_memory_limit!r} keeps the average in files under disk_dir, "
                "outside the host memory the limit bounds, and no disk_dir is set: pass "
                "offload=OffloadOptions(disk_dir=PATH) (a fast local disk), or leave host_memory_limit unset."
            )
