"""Hugging Face models fine-tuned from save_pretrained directories on two gloo ranks, DDP (``from_pretrained`` on
every rank) against chunk_offload (built on the meta device, each rank reading its shards' pieces of the files):

- ``hf_gpt2``: GPT-2 under a device limit that evicts, fixed chunk size; chunk_offload saves a sharded checkpoint
  at the end.
- ``hf_generate``: ``generate()`` in ``validation_step``, each rank a different number of tokens, under an evicting
  limit: the tokens the plain model generates ([Note: generation on several ranks]). Last, with ``synced_gpus=False``
  passed as a user may: an error naming a chunk collective within the timeout, not a hang (the run ends there).
- ``hf_moe``: a Mixtral whose checkpoint holds a tensor per expert, merged into 3D experts as ``from_pretrained``
  merges them ([Note: converted checkpoints]), each rank taking its pieces, under an evicting limit, the defaults.
- ``hf_defaults``: what a user gets by default (automatic chunk size, placement auto) on a Llama, whose norms are
  registered after the layers they run before, under a device limit, with gradient accumulation, stopped at step 4
  and resumed from that checkpoint to step 8, against DDP stopped and resumed the same way.

    python tests/hf/two_ranks.py OUTDIR GPT2_DIR LLAMA_DIR MIXTRAL_DIR
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_chunk import (  # noqa: E402
    CheckOptions,
    ChunkOffloadStrategy,  # noqa: E402
    MemoryOptions,
    OffloadOptions,
)
from tests.hf.models import Batches, generating, load_example  # noqa: E402
from tests.models import quiet_trainer  # noqa: E402

STEPS, LIMIT = 6, 3_000_000
DEFAULTS_LIMIT = 1_600_000  # the tiny Llama's activations are 1.2 MB a rank: little room is left for chunks
MOE_LIMIT = 2_200_000  # the tiny Mixtral's: 1.5 MB


def fit(strategy, pretrained: str, steps: int = STEPS, ckpt_path=None, **kw) -> tuple[L.Trainer, L.LightningModule]:
    L.seed_everything(3, verbose=False)  # every rank: the same dropout masks under both strategies
    model = load_example().CausalLM(pretrained=pretrained, lr=1e-3, warmup_steps=1)
    t = quiet_trainer(
        devices=2,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **{"enable_checkpointing": True, **kw},
    )
    t.fit(model, Batches(n=64), ckpt_path=ckpt_path)
    return t, model


def defaults_case(out: Path, pretrained: str) -> None:
    final = {}
    for name, make in [
        ("ddp", DDPStrategy),
        (
            "chunk",
            lambda: ChunkOffloadStrategy(
                device_memory_limit=DEFAULTS_LIMIT, checks=CheckOptions(collective_timeout_s=60)
            ),
        ),
    ]:
        stop = ModelCheckpoint(dirpath=out / f"defaults_{name}", filename="{step}", every_n_train_steps=4)
        fit(make(), pretrained, steps=4, accumulate_grad_batches=2, callbacks=[stop])
        strategy = make()
        t, model = fit(
            strategy,
            pretrained,
            steps=8,
            accumulate_grad_batches=2,
            enable_checkpointing=False,
            ckpt_path=out / f"defaults_{name}" / "step=4.ckpt",
        )
        final[name] = model.state_dict()
    (out / f"defaults_stats{t.global_rank}.json").write_text(json.dumps(strategy.memory_stats()))
    if t.global_rank == 0:
        torch.save(final, out / "defaults.pt")
    print(f"CASE-DONE hf_defaults rank={t.global_rank}", flush=True)


def moe_case(out: Path, pretrained: str) -> None:
    _, ref = fit(DDPStrategy(), pretrained, enable_checkpointing=False)
    strategy = ChunkOffloadStrategy(device_memory_limit=MOE_LIMIT, checks=CheckOptions(collective_timeout_s=60))
    t, got = fit(strategy, pretrained, enable_checkpointing=False)
    (out / f"moe_stats{t.global_rank}.json").write_text(json.dumps(strategy.memory_stats()))
    if t.global_rank == 0:
        torch.save({"ddp": ref.state_dict(), "chunk": got.state_dict()}, out / "moe.pt")
    print(f"CASE-DONE hf_moe rank={t.global_rank}", flush=True)


def validate(model: L.LightningModule, timeout_s: float) -> L.Trainer:
    strategy = ChunkOffloadStrategy(
        device_memory_limit=DEFAULTS_LIMIT,
        memory=MemoryOptions(chunk_numel=16384),
        checks=CheckOptions(collective_timeout_s=timeout_s),
    )
    t = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, limit_val_batches=2)
    t.validate(model, Batches(n=64), verbose=False)
    return t


def generate_case(pretrained: str) -> None:
    from transformers import AutoModelForCausalLM

    model = generating(None)(pretrained=pretrained)
    t = validate(model, 60)
    plain = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    assert len(model.generated) == 2
    for prompt, n, got in model.generated:
        want = plain.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want), (got, want)
        assert got.shape[1] == 8 + n
    print(f"CASE-DONE hf_generate rank={t.global_rank}", flush=True)


def unsynced_generate_case(pretrained: str) -> None:
    start = time.monotonic()
    try:
        validate(generating(False)(pretrained=pretrained), 4)
        print("UNSYNCED-NO-ERROR", flush=True)
    except Exception as e:  # the ranks must fail, and say where
        print(f"UNSYNCED-ERROR after {time.monotonic() - start:.1f} s: {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    out, pretrained, llama, mixtral = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    _, ref = fit(DDPStrategy(), pretrained, enable_checkpointing=False)
    strategy = ChunkOffloadStrategy(
        device_memory_limit=LIMIT,
        memory=MemoryOptions(chunk_numel=16384),
        offload=OffloadOptions(optimizer_kernel="loop"),
        checks=CheckOptions(collective_timeout_s=60),
    )
    t, got = fit(strategy, pretrained, callbacks=[ModelCheckpoint(dirpath=out, filename="last")])
    rank = t.global_rank
    (out / f"stats{rank}.json").write_text(json.dumps(strategy.memory_stats()))
    if rank == 0:
        torch.save({"ref": ref.state_dict(), "got": got.state_dict()}, out / "params.pt")
    print(f"CASE-DONE hf_gpt2 rank={rank}", flush=True)
    defaults_case(out, llama)
    moe_case(out, mixtral)
    generate_case(llama)
    unsynced_generate_case(llama)  # last: a failed collective ends the process when it exits
