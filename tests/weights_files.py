"""Weights files in every format ``ChunkOffloadStrategy(weights=...)`` reads, written from one state dict."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch

from tests.models import ParityNet, quiet_trainer, token_data

FORMATS = ("torch", "lightning", "consolidated", "safetensors", "fsdp")


class _SaveAtStart(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def write_weights(sd: dict[str, torch.Tensor], out: Path, fmt: str, *, variant: str = "plain") -> Path:
    """``sd`` (a ParityNet's state dict) saved as ``fmt``; returns what to pass as ``weights=``."""
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        torch.save(sd, out / "weights.pt")
        return out / "weights.pt"
    if fmt in ("lightning", "consolidated"):  # a checkpoint written by a Trainer (the second one consolidated)
        from lightning_chunk import ChunkOffloadStrategy, MemoryOptions
        from lightning_chunk.consolidate import consolidate

        model = ParityNet(variant=variant)
        model.load_state_dict(sd)
        strategy = "auto" if fmt == "lightning" else ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096))
        ck = out / ("plain.ckpt" if fmt == "lightning" else "sharded.ckpt")
        quiet_trainer(strategy=strategy, max_steps=1, callbacks=[_SaveAtStart(ck)]).fit(model, token_data())
        if fmt == "lightning":
            return ck
        return consolidate(ck, out / "consolidated.ckpt", progress=False)
    if fmt == "safetensors":  # what save_pretrained writes: shards, an index, no duplicate of a tied tensor
        from safetensors.torch import save_file

        seen, keys = set(), []
        for k, v in sd.items():
            if v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                keys.append(k)
        halves = {
            "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
            "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
        }
        for name, ks in halves.items():
            save_file({k: sd[k].contiguous() for k in ks}, str(out / name))
        index = {"metadata": {}, "weight_map": {k: name for name, ks in halves.items() for k in ks}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
        return out
    if fmt == "fsdp":  # the sharded directory of Lightning's ModelParallelStrategy (FSDP2), written by one process
        import torch.distributed.checkpoint as dcp

        dcp.save({"state_dict": sd}, checkpoint_id=out / "fsdp.ckpt", no_dist=True)
        torch.save({"global_step": 0}, out / "fsdp.ckpt" / "meta.pt")
        return out / "fsdp.ckpt"
    raise ValueError(fmt)
