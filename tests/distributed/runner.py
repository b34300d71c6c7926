"""Two-rank cases on CPU with gloo, run as a script (Lightning's launcher re-runs it for rank 1).

    python tests/distributed/runner.py OUTDIR CASE [CASE ...]

For each parity case: a DDP run and a chunk_offload run with the same global batch; rank 0
saves both parameter sets, every rank saves its memory stats; each rank prints
``CASE-DONE <case> rank=<r>`` when the case finished. Cases "skip_module", "swap_module" and
"fp16_overflow_one_rank" exercise failure detection and the overflow vote.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_chunk import (  # noqa: E402  # noqa: E402
    CheckOptions,
    ChunkOffloadStrategy,
    ChunkPrecision,
    ChunkTelemetry,
    MemoryOptions,
    OffloadOptions,
)
from lightning_chunk.engine.chunks.chunk import Tier  # noqa: E402
from lightning_chunk.engine.runtime.moments import MomentClock  # noqa: E402
from lightning_chunk.options import grouped  # noqa: E402
from tests import models  # noqa: E402
from tests.distributed.resume_common import RESUME_VARIANTS, final_state, resume_fit, resume_strategy  # noqa: E402
from tests.models import ParityNet, token_data  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", 2))  # read once: Lightning's teardown deletes the variable
# the device bytes at every moment of a case's fit, which ranks plan evictions from: the same on every rank
# ([Note: the same bytes on every rank after a step])
DEVICE_BYTES: list[int] = []
_tick = MomentClock.tick


def _ticked(self: MomentClock, kind: Any, key: str) -> tuple[int, ...]:
    out = _tick(self, kind, key)
    DEVICE_BYTES.append(self.manager.ledger[Tier.DEVICE])
    return out


MomentClock.tick = _ticked  # type: ignore[method-assign]
OWN_CHUNK = dict(cls="RankGatedNet", variant="own_chunk", ddp_unused=True, model=dict(dim=64, hidden=512, depth=3))
STEPS = 16  # a case's own "steps" shortens it: the wide models' cases run 8 (warm-up, repack, six steady steps)
BIG = dict(dim=64, hidden=1024)
# enough chunks that the whole gradient is many times the few payloads in flight
ACCUMULATE = dict(
    trainer=dict(accumulate_grad_batches=2), model=dict(dim=64, hidden=256, depth=6), strategy=dict(chunk_numel=20000)
)
AFTER = dict(
    step_in_backward=False
)  # the twins of the early_* cases step after backward ([Note: stepping in backward])
CASES = {
    "plain": dict(strategy=AFTER),
    "clip_norm": dict(trainer=dict(gradient_clip_val=0.05)),
    "clip_value": dict(trainer=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"), strategy=AFTER),
    "accumulate": dict(ACCUMULATE, strategy=dict(chunk_numel=20000, **AFTER)),  # every micro-batch reduce-scattered
    "accumulate_unsharded": dict(ACCUMULATE, strategy=dict(chunk_numel=20000, sharded_accumulation=False)),
    "tied": dict(variant="tied"),
    "frozen": dict(variant="frozen"),
    "unused": dict(variant="unused", strategy=AFTER),
    # the default on a CPU device: payloads released after use (FSDP2's reshard_after_forward=True),
    # each chunk gathered for forward and again for backward
    "host": dict(
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", chunk_numel=20000, **AFTER),
        telemetry=True,
    ),
    # the agreement tag before each collective ([Note: agreeing without a barrier]), where the default checks once
    # a micro-batch ([Note: checking once a micro-batch]); accumulation and host placement give it many of each kind
    "host_checked_each": dict(
        ACCUMULATE,
        strategy=dict(placement="host", chunk_numel=20000, sharded_accumulation=False, verify_collectives=True),
    ),
    # payloads kept from forward to backward ([Note: keeping payloads for backward]), each gathered once a step
    # [Note: offloading states between phases]: every shard off the device after steps 3 and 9, back before 6 and 10
    "offload_states": dict(strategy=dict(placement="device"), callbacks=["OffloadAndReload"]),
    "host_kept": dict(
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", reshard_after_forward=False, chunk_numel=20000),
    ),
    # kept under a limit below the model's payloads (an accelerator's default, explicit on CPU), with the automatic
    # chunk size: kept within the budget the limit leaves beside the traced activations, and what does not fit is
    # released and gathered again
    "host_kept_limit": dict(
        cls="ReorderedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.45,
        strategy=dict(placement="host", chunk_numel=None, chunk_numel_min=4096, reshard_after_forward=False),
    ),
    # its twin with the CPU default, released after use (FSDP2's reshard_after_forward=True): keeping must gather less
    "host_released_limit": dict(
        cls="ReorderedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.45,
        strategy=dict(placement="host", chunk_numel=None, chunk_numel_min=4096),
    ),
    # the same with chunks of 300,000 elements: the warm-up's backward (registration order) must let payloads go
    # while their gradients wait to reduce ([Note: a gradient waits without its payload])
    "host_kept_waiting": dict(
        steps=8,
        cls="ReorderedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.45,
        strategy=dict(placement="host", chunk_numel=300000),
    ),
    # a device limit below this rank's share of the parameter bytes (2 ranks: half of them)
    "limit": dict(model=dict(dim=256, hidden=1024, depth=4), strategy=dict(chunk_numel=270000), limit_fraction=0.45),
    # the defaults a user gets: automatic chunk size, on a model used in another order than registered
    "reordered_auto": dict(cls="ReorderedNet", strategy=dict(chunk_numel=None)),
    # below a rank's share of the training state (16 bytes a parameter over 2 ranks: 2x the parameter bytes);
    # the automatic layout's backward working set (two half-reduced chunks and their gradient payloads) needs
    # about 0.8x here, so a limit below the parameter share alone would be refused with its numbers
    "reordered_auto_limit": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, **AFTER),
        limit_fraction=0.9,
    ),
    # the same defaults under a limit below half the parameter bytes, on a model whose activations are small beside
    # its parameters: the warm-up's registration-order layout pins more in backward than the trained one needs
    # ([Note: a gradient waits without its payload])
    "reordered_auto_tight": dict(
        cls="ReorderedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.45,
        strategy=dict(chunk_numel=None),
    ),
    # bf16-mixed below a third of the parameter bytes: the warm-up's registration-order layout keeps a waiting
    # chunk's fp32 gradient payload beside the one filling (twice a bf16 payload each), so its size leaves room for two
    "reordered_bf16_tight": dict(
        cls="ReorderedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.3,
        bf16=True,
        strategy=dict(chunk_numel=None),
    ),
    "reordered_bf16": dict(
        cls="ReorderedNet", model=dict(dim=256, hidden=1024, depth=4), bf16=True, strategy=dict(chunk_numel=None)
    ),  # its twin without a limit
    # host shards with a bf16 compute copy, stepped by the one-pass kernel ([Note: one pass over a host shard]) after
    # backward and, chunk by chunk as each reduce-scatter lands, in backward (the same DDP run as reordered_bf16)
    "host_bf16_one_pass": dict(
        cls="ReorderedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        bf16=True,
        strategy=dict(chunk_numel=None, placement="host", optimizer_kernel="one_pass", **AFTER),
    ),
    "early_host_bf16_one_pass": dict(
        cls="ReorderedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        bf16=True,
        strategy=dict(chunk_numel=None, placement="host", optimizer_kernel="one_pass", step_in_backward=True),
    ),
    # activation checkpointing: each block's chunk is needed again when backward recomputes it
    "checkpointed": dict(
        cls="CheckpointedNet", model=dict(dim=64, hidden=256, depth=6), strategy=dict(chunk_numel=None)
    ),
    "checkpointed_host": dict(
        cls="ReentrantCheckpointedNet",
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", chunk_numel=20000),
    ),
    "checkpointed_limit": dict(
        steps=8,
        cls="CheckpointedNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.45,
        strategy=dict(chunk_numel=None, placement="host"),
    ),
    # LoRA's shape under a limit: frozen weights must not stay pinned for the rest of backward
    "adapters_limit": dict(
        steps=8,
        cls="AdapterNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.3,
        strategy=dict(chunk_numel=None),
    ),
    # a block run twice a forward, frozen, and LoRA's shape under activation checkpointing: the defaults, a limit
    "reused_frozen_limit": dict(
        steps=8,
        cls="ReusedBlockNet",
        variant="frozen",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.45,
        strategy=dict(chunk_numel=None),
    ),
    "checkpointed_adapters_limit": dict(
        steps=8,
        cls="CheckpointedAdapterNet",
        model=dict(dim=256, hidden=1024, depth=4),
        limit_fraction=0.3,
        strategy=dict(chunk_numel=None, placement="host"),
    ),
    # torch's TransformerEncoderLayer and MultiheadAttention ([Note: leaf modules]), released after use
    "torch_transformer_host": dict(
        cls="TorchTransformerNet", strategy=dict(placement="host", chunk_numel=None, chunk_numel_min=4096)
    ),
    # a gradient penalty: the step's backward reads what a create_graph=True backward saved ([Note: double backward])
    "grad_penalty_host": dict(
        steps=8, cls="GradPenalty", strategy=dict(placement="host", chunk_numel=None, chunk_numel_min=4096)
    ),
    # its first backward (autograd.grad of the inputs) delivers no parameter gradient, so it must not end the
    # micro-batch's gradients ([Note: a backward that delivers no gradient]): unsharded, DDP's sum bit for bit;
    # stepping in backward, the last micro-batch's chunks step after its own gradients (not at that first end)
    "grad_penalty_accumulate_unsharded": dict(
        steps=8,
        cls="GradPenalty",
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, sharded_accumulation=False),
    ),
    "grad_penalty_early_accumulate": dict(
        steps=8,
        cls="GradPenalty",
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, step_in_backward=True),
    ),
    "two_optimizers": dict(cls="TwoOptimizers"),
    "toggled_optimizers": dict(cls="ToggledOptimizers", ddp_unused=True, strategy=dict(chunk_numel=None)),
    "two_optimizers_fp16": dict(cls="TwoOptimizers", fp16=True),
    "rank_buffer": dict(cls="RankBuffer"),
    # built on the meta device in configure_model, initialised chunk by chunk: DDP's eager values, bit for bit
    "deferred": dict(chunk_cls="DeferredNet", variant="tied", strategy=dict(chunk_numel=None)),
    # the same under a device limit with the automatic chunk size (the settings of reordered_auto_limit)
    "deferred_limit": dict(
        chunk_cls="DeferredNet",
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
        limit_fraction=0.9,
    ),
    # most of each rank's masters, gradient shards and optimizer state on the disk tier, in files (stepped in
    # backward: step_in_backward=None with a host limit and nothing reading the gradients after backward)
    "disk": dict(model=BIG, strategy=dict(placement="host", chunk_numel=66560), host_memory_limit="1.2MB"),
    # ... past the page cache (disk_io="direct": O_DIRECT, pieces in flight), gradients accumulated in the files
    "disk_accumulate": dict(
        ACCUMULATE,
        strategy=dict(chunk_numel=20000, placement="host", disk_io="direct"),
        host_memory_limit="400kB",
        trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
    ),
    # the defaults with a host limit: automatic chunk size, placement="auto" under a device limit, a model used in
    # another order than registered, gradient accumulation; and step_in_backward=None, which steps each disk chunk
    # during backward here (nothing reads the gradients after it), its files read ahead: the first micro-batch's
    # gradients go to the files, the second's landing adds to them and steps from memory ([Note: stepping disk
    # chunks in backward], [Note: stepping in backward by default])
    "disk_defaults": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fraction=0.9,
        strategy=dict(chunk_numel=None),
        host_memory_limit="1MB",
        trainer=dict(accumulate_grad_batches=2),
    ),
    # ... its twin stepping after backward, its gradients through their files, past the page cache
    "disk_defaults_after": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fraction=0.9,
        strategy=dict(chunk_numel=None, step_in_backward=False, disk_io="direct"),
        host_memory_limit="1MB",
        trainer=dict(accumulate_grad_batches=2),
    ),
    # each chunk stepped as its reduce-scatter lands, its gradient shard given back ([Note: stepping in backward])
    "early": dict(strategy=dict(step_in_backward=True)),
    # a parameter no rank uses: its chunk waits for the vote and steps after backward
    "early_unused": dict(variant="unused", strategy=dict(step_in_backward=True)),
    "early_accumulate": dict(ACCUMULATE, strategy=dict(chunk_numel=20000, step_in_backward=True)),
    # host shards stepped on a worker thread beside backward ([Note: the host Adam beside backward])
    "early_host_thread": dict(
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", chunk_numel=20000, step_in_backward=True, step_thread=True),
    ),
    # the same under a device limit that evicts payloads, with the automatic chunk size, on a model used in another
    # order than registered
    "early_limit_thread": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fraction=0.9,
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, step_in_backward=True, step_thread=True),
    ),
    # host chunks step in backward on a guess, undone where the norm clips ([Note: speculating past the norm and the
    # overflow]); and under fp16 loss scaling from a scale that overflows in the first steps, in some chunk shards
    # of one rank and not the other's: the vote undoes the other's
    "early_clip_norm": dict(
        trainer=dict(gradient_clip_val=0.05), strategy=dict(placement="host", step_in_backward=True, step_thread=True)
    ),
    # ... with gradient accumulation (the guess on the micro-batch that steps, the norm of the sum)
    "clip_norm_accumulate": dict(ACCUMULATE, trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
    "early_clip_norm_accumulate": dict(
        ACCUMULATE,
        trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
        strategy=dict(chunk_numel=20000, placement="host", step_in_backward=True),
    ),
    # ... the defaults a user gets under a device limit (automatic chunk size, placement="auto", every shard on the
    # host here) on a model used in another order than registered, with accumulation
    "clip_norm_limit": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fraction=0.9,
        trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
    ),
    "early_clip_norm_limit": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fraction=0.9,
        trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, step_in_backward=True),
    ),
    "host_fp16": dict(
        fp16=True,
        init_scale=1e7,
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", chunk_numel=20000),
    ),
    "early_host_fp16": dict(
        fp16=True,
        init_scale=1e7,
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", chunk_numel=20000, step_in_backward=True),
    ),
    # each chunk clips its own gradient shard by value as it steps ([Note: clipping by value in backward])
    "early_clip_value": dict(
        trainer=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"), strategy=dict(step_in_backward=True)
    ),
    "early_limit": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fraction=0.9,
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, step_in_backward=True),
    ),
    # a tied head read in the root forward ([Note: parameters read outside their owner]), released after use and
    # under a limit below this rank's share
    "root_tied_host": dict(cls="RootTiedNet", strategy=dict(placement="host")),
    "root_tied_limit": dict(
        cls="RootTiedNet",
        variant="matmul",
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=33_000),
        limit_fraction=1.15,
    ),
    # ranks whose limits differ (each GPU's free memory, on CUDA): they must plan under one limit, the smallest
    # ([Note: one limit for every rank]); with their own they evicted different chunks and paired different gathers
    "limits_differ": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fractions=(0.9, 1.3),
        strategy=dict(
            chunk_numel=None,
            chunk_numel_min=4096,
            placement="host",
            reshard_after_forward=False,
            verify_collectives=False,
        ),
    ),
    # a gate's own parameter used on some ranks and not others, differently each step, in the warm-up too (DDP's
    # find_unused_parameters=True): released after use, so backward gathers too ([Note: when a chunk reduces])
    "rank_gated": dict(cls="RankGatedNet", ddp_unused=True, strategy=dict(placement="host")),
    "rank_gated_limit": dict(
        cls="RankGatedNet",
        ddp_unused=True,
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
        limit_fraction=0.9,
    ),
    # the gate's row in a chunk of weights: a chunk that got gradients on one rank only, under a limit (the ranks once
    # held its gradient payload and its tensors' states apart, so planned different evictions)
    "rank_gated_own_chunk": dict(OWN_CHUNK, strategy=dict(chunk_numel=32768), limit_fraction=0.9),
    # and with every shard on the device, stepped in backward: a rank that lacks the gradients steps the chunk as it
    # lands all the same (its vote), so both give the gradient shard back there (a limit: only then do plans read
    # the device bytes)
    "rank_gated_device": dict(
        OWN_CHUNK, strategy=dict(chunk_numel=32768, placement="device", step_in_backward=True), limit_fraction=3.0
    ),
    # with the automatic chunk size and two micro-batches a step, kept whole (no_sync): the second micro-batch of the
    # warm-up step planned from each rank's own trace of the first (one rank had the gate's activations), so the ranks
    # evicted different chunks and hung ([Note: the warm-up's phases])
    "rank_gated_accumulate_unsharded": dict(
        OWN_CHUNK,
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, sharded_accumulation=False),
        limit_fraction=2.7,
    ),
    # resumed at step 3 of 8 from its own checkpoint, as DDP from its: the resumed warm-up traces, agrees and
    # repacks with the optimizer state restored, a chunk's gradients on one rank only
    "rank_gated_resume": dict(
        OWN_CHUNK, strategy=dict(chunk_numel=None, chunk_numel_min=4096), limit_fraction=0.9, resume_at=3, steps=8
    ),
    # a parameter of the root, read in its forward on some ranks: in the warm-up its payload is made where its
    # gradient arrives first, and on the other ranks at the next moment
    "root_gated_limit": dict(
        cls="RootGatedNet",
        ddp_unused=True,
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=32768),
        limit_fraction=1.3,
    ),
    # a layer no rank ever uses, under a limit with the automatic chunk size: its chunk, last in the reduce order,
    # once held every gradient payload back (a limit error in the warm-up), then the repack carried a zero gradient
    # for it and weight decay moved it where torch.optim skips it
    "spare_limit": dict(
        cls="SpareNet",
        ddp_unused=True,
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
        limit_fraction=0.9,
    ),
    # BatchNorm 1d/2d/3d in mixed precision ([Note: normalisation in mixed precision]): bf16 against DDP with bf16
    # autocast, released after use, and fp16 with loss scaling against DDP with GradScaler
    "bn_cnn_bf16": dict(cls="BatchNormCNN", bf16=True, strategy=dict(chunk_numel=10_000)),
    "bn_cnn_bf16_host": dict(cls="BatchNormCNN", bf16=True, strategy=dict(chunk_numel=10_000, placement="host")),
    "bn_cnn_fp16": dict(cls="BatchNormCNN", fp16=True, strategy=dict(chunk_numel=10_000)),
    # DDP starts from the values in start.pt; chunk_offload reads them from a file (written by the test)
    **{
        f"weights_{fmt}": dict(chunk_cls="DeferredNet", weights=fmt, variant="tied")
        for fmt in ("torch", "lightning", "consolidated", "safetensors")
    },
}


def trainer(strategy, steps=STEPS, **kw):
    defaults = dict(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kw})


class CommMode(L.Callback):
    """How the engine's collectives ran: one communicator or a group per kind, the agreement check on or off."""

    seen: dict = {}

    def on_train_start(self, trainer, pl_module):
        comm = trainer.strategy.engine.comm
        self.seen = dict(
            as_nccl=comm.as_nccl, groups_per_kind=bool(comm._op_groups), checked=comm.agreement is not None
        )


def fit_or_resume(make: Any, steps: int, resume_at: int | None, ckdir: Path, callbacks=(), **kw: Any):
    """``make()`` gives a fresh (model, strategy, plugins). One fit to ``steps``; with ``resume_at``, a fit to that
    step that saves a checkpoint, then a fresh model resumed from it to ``steps`` (the one returned, with its
    trainer and strategy; the device bytes recorded are the resumed fit's)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model, strategy, plugins = make()
    if resume_at:
        save = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=resume_at, filename="{step}", save_top_k=-1)
        trainer(strategy, resume_at, plugins=plugins, callbacks=[save], enable_checkpointing=True, **kw).fit(
            model, token_data()
        )
        DEVICE_BYTES.clear()
        model, strategy, plugins = make()
    t = trainer(strategy, steps, plugins=plugins, callbacks=list(callbacks), **kw)
    t.fit(model, token_data(), ckpt_path=ckdir / f"step={resume_at}.ckpt" if resume_at else None)
    return t, model, strategy


_DDP_RUNS: dict[str, tuple[dict[str, torch.Tensor], int]] = {}  # DDP's trained state and parameter bytes, by setup


def run_parity(case: str, out: Path) -> None:
    spec = CASES[case]
    variant, model_kw, tkw = spec.get("variant", "plain"), spec.get("model", {}), spec.get("trainer", {})
    cls = getattr(models, spec.get("cls", "ParityNet"))
    fp16, bf16 = spec.get("fp16", False), spec.get("bf16", False)
    init_scale = spec.get("init_scale", 2.0**16)
    steps, resume_at = spec.get("steps", STEPS), spec.get("resume_at")
    unused = variant == "unused" or spec.get("ddp_unused", False)
    # cases that differ only in chunk_offload's settings share one DDP run (the same bits: DDP is deterministic here)
    key = json.dumps(
        [cls.__name__, variant, model_kw, tkw, fp16, init_scale, bf16, steps, unused, "weights" in spec, resume_at],
        sort_keys=True,
        default=str,
    )
    if key not in _DDP_RUNS:

        def make_ref():
            L.seed_everything(7, verbose=False)
            ref = cls(variant=variant, **model_kw)
            if "weights" in spec:
                ref.load_state_dict(torch.load(out / "start.pt"))
            plugins = (
                [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]
                if fp16
                else [MixedPrecision("bf16-mixed", "cpu")]
                if bf16
                else None
            )
            return ref, DDPStrategy(find_unused_parameters=unused), plugins

        _, ref, _ = fit_or_resume(make_ref, steps, resume_at, out / f"{case}.ddp_ckpt", **tkw)
        _DDP_RUNS[key] = (
            {k: v.clone() for k, v in ref.state_dict().items()},
            sum(p.numel() * p.element_size() for p in ref.parameters()),
        )
    ref_state, param_bytes = _DDP_RUNS[key]
    skw = dict(chunk_numel=4096, optimizer_kernel="loop", collective_timeout_s=60)
    skw.update(spec.get("strategy", {}))
    if "limit_fraction" in spec:
        skw["device_memory_limit"] = int(param_bytes * spec["limit_fraction"])  # below this rank's share
    if "limit_fractions" in spec:  # each rank its own limit, as each GPU's free memory gives ([Note: one limit ...])
        fractions = spec["limit_fractions"]
        skw["device_memory_limit"] = int(param_bytes * fractions[int(os.environ.get("LOCAL_RANK", 0)) % len(fractions)])
    if "host_memory_limit" in spec:
        skw.update(host_memory_limit=spec["host_memory_limit"], disk_dir=str(out / f"{case}.disk"))
    if "weights" in spec:
        skw["weights"] = json.loads((out / "weights.json").read_text())[spec["weights"]]

    def make_chunk():
        L.seed_everything(7, verbose=False)  # the distributed sampler's order follows the seed: keep DDP's
        got = getattr(models, spec.get("chunk_cls", spec.get("cls", "ParityNet")))(variant=variant, **model_kw)
        plugins = (
            [ChunkPrecision("16-mixed", init_scale=init_scale)]
            if fp16
            else [ChunkPrecision("bf16-mixed")]
            if bf16
            else None
        )
        return got, ChunkOffloadStrategy(**grouped(skw)), plugins

    telemetry = ChunkTelemetry(picture=False) if spec.get("telemetry") else None
    comm_mode = CommMode()
    extra = [getattr(models, name)() for name in spec.get("callbacks", ())]
    DEVICE_BYTES.clear()
    callbacks = [comm_mode, *extra, *([telemetry] if telemetry else [])]
    t, got, strategy = fit_or_resume(make_chunk, steps, resume_at, out / f"{case}.ckpt", callbacks, **tkw)
    if telemetry is not None and t.global_rank == 0:
        (out / f"{case}.breakdown.json").write_text(json.dumps(telemetry.breakdown))
    rank = t.global_rank
    stats = dict(
        strategy.memory_stats(),
        limit=skw.get("device_memory_limit"),
        comm=comm_mode.seen,
        disk_left=sorted(p.name for p in Path(skw["disk_dir"]).iterdir() if f"-rank{strategy.global_rank}-" in p.name)
        if "disk_dir" in skw
        else [],
        host_memory_limit=strategy.config.host_memory_limit,
        param_bytes=sum(p.numel() * p.element_size() for p in got.parameters()),
        buffers={n: b.float().sum().item() for n, b in got.named_buffers()},
        seen=[getattr(cb, "seen", None) for cb in extra],
        device_bytes=DEVICE_BYTES,
    )
    (out / f"{case}.stats{rank}.json").write_text(json.dumps(stats))
    if rank == 0:
        L.seed_everything(7, verbose=False)
        init = cls(variant=variant, **model_kw).state_dict()
        torch.save({"ref": ref_state, "got": got.state_dict(), "init": init}, out / f"{case}.pt")
    print(f"CASE-DONE {case} rank={rank}", flush=True)


class LogsRank(ParityNet):
    def validation_step(self, batch, batch_idx):
        self.log("rank_mean", float(self.global_rank), sync_dist=True)


def run_resume(out: Path) -> None:
    """8 steps with checkpoints written during fit at steps 4 and 8 (collectives on every rank, rank 0 writes),
    resumed from step 4 to 12. chunk_offload writes them in the background (Lightning's ``AsyncCheckpointIO``),
    so step 4's is written while steps 5 to 8 train. Each rank counts the elements of saved chunks it asked to
    read, against those the checkpoint holds."""
    import shutil

    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_chunk.engine.state import saved_chunks

    read = {"asked": 0, "saved": 0}
    whole = saved_chunks.load_chunk

    def counting(path, key, numel, dtype, span=None):
        read["asked"] += numel if span is None else span[1] - span[0]
        read["saved"] += numel
        return whole(path, key, numel, dtype, span)

    saved_chunks.load_chunk = counting

    from lightning.pytorch.callbacks import ModelCheckpoint

    results = {}
    for name, make in [
        ("ddp", lambda: "ddp"),
        (
            "chunk",
            lambda: ChunkOffloadStrategy(
                placement="host",
                memory=MemoryOptions(chunk_numel=4096, materialize_optimizer_state=True),
                offload=OffloadOptions(optimizer_kernel="loop"),
                checks=CheckOptions(collective_timeout_s=60),
            ),
        ),
    ]:
        ckdir = out / f"ckpt_{name}"
        L.seed_everything(11, verbose=False)
        model = LogsRank()
        cb = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=4, save_top_k=-1, filename="{step}")
        plugins = [AsyncCheckpointIO()] if name == "chunk" else []
        t = trainer(make(), steps=8, callbacks=[cb], enable_checkpointing=True, limit_val_batches=1.0, plugins=plugins)
        t.fit(model, token_data())
        metrics = t.validate(model, dataloaders=token_data(8), verbose=False)
        L.seed_everything(11, verbose=False)
        resumed = LogsRank()
        t2 = trainer(make(), steps=12)
        t2.fit(resumed, token_data(), ckpt_path=ckdir / "step=4.ckpt")
        opt = {f"opt.{k}.{n}": v for k, st in t2.optimizers[0].state_dict()["state"].items() for n, v in st.items()}
        results[name] = ({**{k: v.clone() for k, v in resumed.state_dict().items()}, **opt}, metrics[0]["rank_mean"])
        if t2.global_rank == 0:
            shutil.rmtree(ckdir, ignore_errors=True)
    rank = t2.global_rank
    if rank == 0:
        torch.save({"ref": results["ddp"][0], "got": results["chunk"][0]}, out / "resume.pt")
    (out / f"resume.rank{rank}.json").write_text(json.dumps({k: v[1] for k, v in results.items()}))
    (out / f"resume.read{rank}.json").write_text(json.dumps(read))
    print(f"CASE-DONE resume rank={rank}", flush=True)


def reshard_strategy(**kw):
    return ChunkOffloadStrategy(
        **grouped({**kw, "chunk_numel": 4096, "optimizer_kernel": "loop", "collective_timeout_s": 60})
    )


def run_reshard_save(out: Path) -> None:
    """2 ranks, 8 steps: a DDP checkpoint (plain file) and a chunk_offload one (sharded directory)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name, make in [("ddp", lambda: "ddp"), ("chunk", lambda: reshard_strategy(placement="host"))]:
        L.seed_everything(11, verbose=False)
        cb = ModelCheckpoint(dirpath=out / f"from2_{name}", every_n_train_steps=8, filename="{step}")
        t = trainer(make(), steps=8, callbacks=[cb], enable_checkpointing=True)
        t.fit(ParityNet(variant="tied"), token_data())
    print(f"CASE-DONE reshard_save rank={t.global_rank}", flush=True)


def run_reshard_resume(out: Path) -> None:
    """2 ranks resume 1-rank checkpoints (written by the test) to step 12: DDP from the plain file,
    chunk_offload from the sharded directory, with another placement and a device limit."""
    results = {}
    for name, make, path in [
        ("ddp", lambda: "ddp", out / "from1_auto" / "step=8.ckpt"),
        (
            "chunk",
            lambda: reshard_strategy(placement="auto", device_memory_limit=120_000),
            out / "from1_chunk" / "step=8.ckpt",
        ),
    ]:
        L.seed_everything(11, verbose=False)
        model = ParityNet(variant="tied")
        t = trainer(make(), steps=12)
        t.fit(model, token_data(), ckpt_path=path)
        results[name] = model.state_dict()
    if t.global_rank == 0:
        torch.save({"ref": results["ddp"], "got": results["chunk"]}, out / "reshard_resume.pt")
    print(f"CASE-DONE reshard_resume rank={t.global_rank}", flush=True)


def run_resume_defaults(out: Path) -> None:
    results, held = {}, {}
    t, _ = resume_fit("ddp", out / "from2_ddp", 8)
    for v in RESUME_VARIANTS:
        resume_fit(resume_strategy(v), out / f"from2_{v}", 8)
    for src in ("from2", "from1"):
        ref_ckpt = out / ("from2_ddp" if src == "from2" else "from1_auto") / "step=8.ckpt"
        t, m = resume_fit("ddp", None, 12, ckpt_path=ref_ckpt)
        results[f"{src}.ddp"] = final_state(t, m)
        for v in RESUME_VARIANTS:
            DEVICE_BYTES.clear()
            t, m = resume_fit(resume_strategy(v), None, 12, ckpt_path=out / f"{src}_{v}" / "step=8.ckpt")
            results[f"{src}.{v}"] = final_state(t, m)
            held[f"{src}.{v}"] = list(DEVICE_BYTES)
    (out / f"resume_defaults.bytes{t.global_rank}.json").write_text(json.dumps(held))
    if t.global_rank == 0:
        torch.save(results, out / "resume_defaults.pt")
    print(f"CASE-DONE resume_defaults rank={t.global_rank}", flush=True)


def run_unfreeze(out: Path) -> None:
    """[Note: requires_grad changed]: blocks[0] unfrozen at step 6 and the embedding frozen from 6 to 14, with the
    defaults; DDP trains everything and drops the gradients the schedule freezes (``DropFrozenGrads``)."""
    L.seed_everything(7, verbose=False)
    ref = ParityNet()
    trainer(DDPStrategy(), steps=20, callbacks=[models.DropFrozenGrads()]).fit(ref, token_data())
    L.seed_everything(7, verbose=False)
    model = ParityNet(variant="frozen")
    strategy = ChunkOffloadStrategy(
        offload=OffloadOptions(optimizer_kernel="loop"), checks=CheckOptions(collective_timeout_s=60)
    )
    t = trainer(strategy, steps=20, callbacks=[models.FlipRequiresGrad()])
    t.fit(model, token_data())
    state = {"ref": ref.state_dict(), "got": model.state_dict(), "stats": strategy.memory_stats()}
    if t.global_rank == 0:
        torch.save(state, out / "unfreeze.pt")
    print(f"CASE-DONE unfreeze rank={t.global_rank}", flush=True)


def run_full_parameters(out: Path) -> None:
    """[Note: parameters outside a step]: weights clamped after every step and a norm read between steps, with the
    defaults and with host placement, against DDP doing the same on its parameters."""
    L.seed_everything(7, verbose=False)
    ref, ref_cb, ref_grads = ParityNet(), models.ClampFirstBlock(), models.GradNormsAndEdits()
    trainer(DDPStrategy(), steps=12, callbacks=[ref_cb, ref_grads]).fit(ref, token_data())
    state: dict = {"ref": ref.state_dict(), "ref_norms": ref_cb.norms, "ref_grad_norms": ref_grads.norms}
    for placement in ("auto", "host"):
        L.seed_everything(7, verbose=False)
        model, cb, grads = ParityNet(), models.ClampFirstBlock(), models.GradNormsAndEdits()
        t = trainer(
            ChunkOffloadStrategy(
                placement=placement,
                offload=OffloadOptions(optimizer_kernel="loop"),
                checks=CheckOptions(collective_timeout_s=60),
            ),
            steps=12,
            callbacks=[cb, grads],
        )
        t.fit(model, token_data())
        state[placement] = {
            "got": model.state_dict(),
            "norms": cb.norms,
            "seen_outside": cb.seen_outside,
            "saved_inside": cb.saved,
            "grad_norms": grads.norms,
        }
    # the defaults under a limit below this rank's share, on a model used in another order than registered, with
    # gradient accumulation (the block runs between micro-batches, while gradients wait in the shards), against the
    # same run without the limit: what the block writes must not depend on what was evicted. (Against DDP, sharded
    # accumulation differs by its rounding: ROUNDING["accumulate"].)
    hard: dict = {}
    for limited in (False, True):
        L.seed_everything(7, verbose=False)
        model = models.ReorderedNet(dim=256, hidden=1024, depth=4)
        limit = int(sum(p.numel() * p.element_size() for p in model.parameters()) * 0.45) if limited else None
        strategy = ChunkOffloadStrategy(
            device_memory_limit=limit,
            offload=OffloadOptions(optimizer_kernel="loop"),
            checks=CheckOptions(collective_timeout_s=60),
        )
        trainer(
            strategy,
            steps=8,
            callbacks=[models.ClampFirstBlock(), models.GradNormsAndEdits()],
            accumulate_grad_batches=2,
        ).fit(model, token_data())
        hard[limited] = {"state": model.state_dict(), "evictions": strategy.memory_stats()["evictions"]}
    state["hard"] = hard
    try:  # outside the block, a state_dict needs every rank's shards: refused with the way to get it
        t2 = trainer(
            ChunkOffloadStrategy(checks=CheckOptions(collective_timeout_s=60)),
            steps=2,
            callbacks=[models.StateDictOutside()],
        )
        t2.fit(ParityNet(), token_data())
    except Exception as e:  # noqa: BLE001 -- the message is what the test reads
        state["outside_error"] = f"{type(e).__name__}: {e}"
    try:  # unsharded accumulation: between micro-batches the gradients wait in the payloads, not in the shards
        trainer(
            ChunkOffloadStrategy(
                memory=MemoryOptions(sharded_accumulation=False), checks=CheckOptions(collective_timeout_s=60)
            ),
            steps=2,
            callbacks=[models.GradsAfterBackward()],
            accumulate_grad_batches=2,
        ).fit(ParityNet(), token_data())
    except Exception as e:  # noqa: BLE001 -- the message is what the test reads
        state["waiting_error"] = f"{type(e).__name__}: {e}"
    if t.global_rank == 0:
        torch.save(state, out / "full_parameters.pt")
    print(f"CASE-DONE full_parameters rank={t.global_rank}", flush=True)


def run_edited_checkpoint(out: Path) -> None:
    """[Note: the state_dict of a sharded save] on two ranks: the frozen weights dropped in on_save_checkpoint, an
    entry added, the head's value replaced; 6 steps saved, resumed to 10, against DDP doing the same. The defaults
    (automatic chunk size, auto placement) under a device limit below half the parameter bytes, on LoRA's shape
    (adapters registered after the blocks, used between them)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    cls = models.edited(replace_head=True)
    kw = dict(dim=64, hidden=512, depth=3)
    limit = int(sum(p.numel() * p.element_size() for p in cls(**kw).parameters()) * 0.5)
    results = {}
    for name, make in [
        ("ddp", lambda: DDPStrategy()),
        (
            "chunk",
            lambda: ChunkOffloadStrategy(
                device_memory_limit=limit,
                memory=MemoryOptions(chunk_numel_min=4096),
                offload=OffloadOptions(optimizer_kernel="loop"),
                checks=CheckOptions(collective_timeout_s=60),
            ),
        ),
    ]:
        L.seed_everything(11, verbose=False)
        first = cls(**kw)
        cb = ModelCheckpoint(dirpath=out / f"edited_{name}", every_n_train_steps=6, filename="{step}")
        trainer(make(), steps=6, callbacks=[cb], enable_checkpointing=True).fit(first, token_data())
        L.seed_everything(11, verbose=False)
        model, strategy = cls(**kw), make()
        t = trainer(strategy, steps=10)
        t.fit(model, token_data(), ckpt_path=out / f"edited_{name}" / "step=6.ckpt")
        results[name] = {
            "state": model.state_dict(),
            "entry": model.loaded_entry,
            "evictions": 0 if name == "ddp" else strategy.memory_stats()["evictions"],
        }
    if t.global_rank == 0:
        torch.save(results, out / "edited_checkpoint.pt")
    print(f"CASE-DONE edited_checkpoint rank={t.global_rank}", flush=True)


def run_grad_penalty_limit(out: Path) -> None:
    """[Note: a backward that delivers no gradient] with the defaults under a device limit (the automatic chunk size,
    payloads evicted and gathered again), on a model used in another order than registered, with accumulation,
    stepping in backward and after it: each as the same run without the limit, bit for bit."""
    kw = dict(dim=64, hidden=512, depth=3)
    limit = int(sum(p.numel() * p.element_size() for p in models.ReorderedGradPenalty(**kw).parameters()) * 1.8)
    results = {}
    for name, extra in [
        ("free", {}),
        ("limited", dict(device_memory_limit=limit)),
        ("limited_early", dict(device_memory_limit=limit, step_in_backward=True)),
    ]:
        L.seed_everything(7, verbose=False)
        model = models.ReorderedGradPenalty(**kw)
        strategy = ChunkOffloadStrategy(
            **grouped({**extra, "chunk_numel_min": 4096, "optimizer_kernel": "loop", "collective_timeout_s": 60})
        )
        t = trainer(strategy, steps=6, accumulate_grad_batches=2)
        t.fit(model, token_data())
        results[name] = {
            "state": model.state_dict(),
            **{k: v for k, v in strategy.memory_stats().items() if k in ("evictions", "chunks_stepped_in_backward")},
        }
    if t.global_rank == 0:
        torch.save(results, out / "grad_penalty_limit.pt")
    print(f"CASE-DONE grad_penalty_limit rank={t.global_rank}", flush=True)


def run_ema(out: Path) -> None:
    """[Note: a sharded EMA] on two ranks: ChunkEMA against DDP with Lightning's EMAWeightAveraging, validating with
    the average every 3 steps; saved at step 4 and resumed to 8 on two ranks (the test resumes the same checkpoints
    on one)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

    from lightning_chunk import ChunkEMA

    results = {}
    for name, make, ema in [
        ("ddp", lambda: DDPStrategy(), lambda: EMAWeightAveraging(decay=0.8)),
        (
            "chunk",
            lambda: ChunkOffloadStrategy(
                placement="host",
                offload=OffloadOptions(optimizer_kernel="loop"),
                checks=CheckOptions(collective_timeout_s=60),
            ),
            lambda: ChunkEMA(decay=0.8),
        ),
    ]:
        val = dict(limit_val_batches=2, val_check_interval=3)
        L.seed_everything(7, verbose=False)
        model = models.LogsValLoss()
        trainer(make(), steps=8, callbacks=[ema()], **val).fit(model, token_data(), token_data(16, seed=1))
        L.seed_everything(7, verbose=False)
        cb = ModelCheckpoint(dirpath=out / f"ema_{name}", every_n_train_steps=4, filename="{step}")
        trainer(make(), steps=4, callbacks=[ema(), cb], enable_checkpointing=True, **val).fit(
            models.LogsValLoss(), token_data(), token_data(16, seed=1)
        )
        L.seed_everything(7, verbose=False)
        resumed = models.LogsValLoss()
        t = trainer(make(), steps=8, callbacks=[ema()], **val)
        t.fit(resumed, token_data(), token_data(16, seed=1), ckpt_path=out / f"ema_{name}" / "step=4.ckpt")
        results[name] = {"state": model.state_dict(), "val": model.val_losses, "resumed": resumed.state_dict()}
    # the defaults a user gets, on a model used in another order than registered: the automatic chunk size, a
    # device limit (payloads evicted and gathered again), accumulation, validation with the average every 2 steps,
    # saved at step 3 and resumed to 6; under the limit and without it alike, and as DDP to sharded accumulation's
    # rounding (ROUNDING["accumulate"])
    kw = dict(dim=64, hidden=512, depth=3)
    limit = int(sum(p.numel() * p.element_size() for p in models.ReorderedNet(**kw).parameters()) * 0.9)
    for name, make, ema in [
        ("ddp", lambda: DDPStrategy(), lambda: EMAWeightAveraging(decay=0.8)),
        (
            "limited",
            lambda: ChunkOffloadStrategy(
                device_memory_limit=limit,
                memory=MemoryOptions(chunk_numel_min=4096),
                offload=OffloadOptions(optimizer_kernel="loop"),
                checks=CheckOptions(collective_timeout_s=60),
            ),
            lambda: ChunkEMA(decay=0.8),
        ),
        (
            "free",
            lambda: ChunkOffloadStrategy(
                memory=MemoryOptions(chunk_numel_min=4096),
                offload=OffloadOptions(optimizer_kernel="loop"),
                checks=CheckOptions(collective_timeout_s=60),
            ),
            lambda: ChunkEMA(decay=0.8),
        ),
    ]:
        val = dict(limit_val_batches=2, val_check_interval=2, accumulate_grad_batches=2)
        L.seed_everything(7, verbose=False)
        first = models.ReorderedNet(**kw)
        cb = ModelCheckpoint(dirpath=out / f"ema_hard_{name}", every_n_train_steps=3, filename="{step}")
        trainer(make(), steps=3, callbacks=[ema(), cb], enable_checkpointing=True, **val).fit(
            first, token_data(), token_data(16, seed=1)
        )
        L.seed_everything(7, verbose=False)
        resumed, strategy = models.ReorderedNet(**kw), make()
        t = trainer(strategy, steps=6, callbacks=[ema()], **val)
        t.fit(resumed, token_data(), token_data(16, seed=1), ckpt_path=out / f"ema_hard_{name}" / "step=3.ckpt")
        results[f"hard_{name}"] = {
            "state": resumed.state_dict(),
            "evictions": 0 if name == "ddp" else strategy.memory_stats()["evictions"],
        }
    if t.global_rank == 0:
        torch.save(results, out / "ema.pt")
    print(f"CASE-DONE ema rank={t.global_rank}", flush=True)


class SkipOnRankOne(ParityNet):
    """From step 3 on, rank 1 skips the branch that rank 0 runs."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        use = not (self.global_step >= 3 and self.global_rank == 1)
        logits = self(x, use_branch=use)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def run_skip(out: Path) -> None:
    L.seed_everything(7, verbose=False)
    model = SkipOnRankOne(variant="unused")
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(collective_timeout_s=10)
    )
    trainer(strategy).fit(model, token_data())
    print("UNEXPECTED-SUCCESS", flush=True)


class SwapOnRankOne(ParityNet):
    """From step 3 on, rank 1 runs the two blocks (chunks of one size) in the other order."""

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.embed(x)
        swapped = self.global_step >= 3 and self.global_rank == 1
        for blk in reversed(self.blocks) if swapped else self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


def run_swap(out: Path) -> None:
    """[Note: checking once a micro-batch]: the defaults name the disagreement before step 3 is taken."""
    from lightning_chunk.engine.comm.collectives import CollectiveMismatchError, CollectiveTimeoutError

    L.seed_everything(7, verbose=False)
    model = SwapOnRankOne()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=block), checks=CheckOptions(collective_timeout_s=10)
    )
    t = trainer(strategy)
    try:
        t.fit(model, token_data())
    except (CollectiveMismatchError, CollectiveTimeoutError) as e:
        print(f"SWAP-CAUGHT rank={t.global_rank} global_step={t.global_step}: {e}", flush=True)
        raise
    print("UNEXPECTED-SUCCESS", flush=True)


def run_save_after_fit(out: Path) -> None:
    """``trainer.save_checkpoint()`` after ``fit`` (and after a ``validate`` that followed it), then a resume from that
    file to step 12 ([Note: optimizer state after fit]): DDP's and chunk_offload's with the defaults."""
    results = {}
    for name, make in [
        ("ddp", lambda: "ddp"),
        (
            "chunk",
            lambda: ChunkOffloadStrategy(
                offload=OffloadOptions(optimizer_kernel="loop"), checks=CheckOptions(collective_timeout_s=60)
            ),
        ),
    ]:
        path = out / f"save_after_fit_{name}.ckpt"
        L.seed_everything(11, verbose=False)
        model = ParityNet()
        t = trainer(make(), steps=8, limit_val_batches=2)
        t.fit(model, token_data(), token_data(n=16, seed=1))
        t.validate(model, token_data(n=16, seed=1), verbose=False)
        t.save_checkpoint(path)
        L.seed_everything(11, verbose=False)
        resumed = ParityNet()
        trainer(make(), steps=12).fit(resumed, token_data(), ckpt_path=path)
        results[name] = {"resumed": resumed.state_dict(), "saved": torch.load(path, weights_only=False)}
    if t.global_rank == 0:
        torch.save({"ref": results["ddp"], "got": results["chunk"]}, out / "save_after_fit.pt")
    print(f"CASE-DONE save_after_fit rank={t.global_rank}", flush=True)


def run_batchnorm(out: Path) -> None:
    """Buffers follow DDP's ``broadcast_buffers`` on every rank: rank 0's running statistics before each forward
    in ``fit`` that DDP syncs (after a training forward outside ``no_sync``), none after evaluation or a
    non-stepping micro-batch. Each rank saves its own buffers, parameters and validation losses: for a run DDP
    matches bit for bit, and for the defaults (automatic chunk size, sharded accumulation) under a device limit
    below the parameter bytes, resumed from a step-4 checkpoint as DDP is."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    params = sum(p.numel() * 4 for p in models.BatchNormNet(depth=4, dim=256, hidden=1024).parameters())
    seen = {}
    for name in ("ddp", "chunk", "ddp_resumed", "defaults_resumed"):
        if name == "ddp" or name == "ddp_resumed":
            make = DDPStrategy
        elif name == "chunk":

            def make():
                return ChunkOffloadStrategy(
                    memory=MemoryOptions(chunk_numel=4096, sharded_accumulation=False),
                    offload=OffloadOptions(optimizer_kernel="loop"),
                    checks=CheckOptions(collective_timeout_s=60),
                )
        else:

            def make():
                return ChunkOffloadStrategy(
                    device_memory_limit=int(0.45 * params),
                    memory=MemoryOptions(chunk_numel_min=4096),
                    offload=OffloadOptions(optimizer_kernel="loop"),
                    checks=CheckOptions(collective_timeout_s=60),
                )

        resumed = name.endswith("resumed")
        model_kw = dict(depth=4, dim=256, hidden=1024) if resumed else {}
        ckpt_path = None
        if resumed:  # the first half, with a checkpoint at step 4
            L.seed_everything(7, verbose=False)
            cb = ModelCheckpoint(dirpath=out / f"bn_{name}", every_n_train_steps=4, filename="{step}")
            t = trainer(
                make(),
                steps=4,
                accumulate_grad_batches=2,
                limit_val_batches=2,
                val_check_interval=6,
                num_sanity_val_steps=1,
                callbacks=[cb],
                enable_checkpointing=True,
            )
            t.fit(models.BatchNormNet(**model_kw), token_data(), token_data(n=16, seed=1))
            ckpt_path = out / f"bn_{name}" / "step=4.ckpt"
        L.seed_everything(7, verbose=False)
        model = models.BatchNormNet(**model_kw)
        strategy = make()
        t = trainer(
            strategy,
            steps=8,
            accumulate_grad_batches=2,
            limit_val_batches=2,
            val_check_interval=6,
            num_sanity_val_steps=1,
        )
        t.fit(model, token_data(), token_data(n=16, seed=1), ckpt_path=ckpt_path)
        if isinstance(strategy, ChunkOffloadStrategy):
            with strategy.full_parameters():
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            evictions = strategy.memory_stats()["evictions"]
        else:
            state, evictions = {k: v.detach().clone() for k, v in model.state_dict().items()}, 0
        seen[name] = {"state": state, "val": model.val_seen, "evictions": evictions}
    torch.save(seen, out / f"batchnorm.rank{t.global_rank}.pt")
    print(f"CASE-DONE batchnorm rank={t.global_rank}", flush=True)


class OverflowOnRankOne(ParityNet):
    """At step 3, rank 1's loss overflows fp16; rank 0's does not."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 3 and self.global_rank == 1:
            loss = loss * torch.tensor(float("inf"))
        if self.global_step in (3, 4):
            self.seen.append([p.detach().float().clone() for p in self.parameters()])
        return loss


def run_overflow(out: Path) -> None:
    L.seed_everything(7, verbose=False)
    model = OverflowOnRankOne()
    model.seen = []
    strategy = ChunkOffloadStrategy(
        memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(collective_timeout_s=60)
    )
    t = trainer(strategy, steps=6, plugins=[ChunkPrecision("16-mixed")])
    t.fit(model, token_data())
    before, after = model.seen
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    (out / f"overflow.rank{t.global_rank}.json").write_text(
        json.dumps({"unchanged": unchanged, "loss_scale": strategy.memory_stats()["loss_scale"]})
    )
    print(f"CASE-DONE fp16_overflow_one_rank rank={t.global_rank}", flush=True)


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        started = time.monotonic()
        if name == "skip_module":
            run_skip(out_dir)
        elif name == "swap_module":
            run_swap(out_dir)
        elif name == "batchnorm":
            run_batchnorm(out_dir)
        elif name == "save_after_fit":
            run_save_after_fit(out_dir)
        elif name == "fp16_overflow_one_rank":
            run_overflow(out_dir)
        elif name == "resume":
            run_resume(out_dir)
        elif name == "reshard_save":
            run_reshard_save(out_dir)
        elif name == "reshard_resume":
            run_reshard_resume(out_dir)
        elif name == "resume_defaults":
            run_resume_defaults(out_dir)
        elif name == "unfreeze":
            run_unfreeze(out_dir)
        elif name == "full_parameters":
            run_full_parameters(out_dir)
        elif name == "edited_checkpoint":
            run_edited_checkpoint(out_dir)
        elif name == "ema":
            run_ema(out_dir)
        elif name == "grad_penalty_limit":
            run_grad_penalty_limit(out_dir)
        else:
            run_parity(name, out_dir)
        print(f"CASE-TIME {name} {time.monotonic() - started:.1f} s", flush=True)  # which cases the launch spends on
    if torch.distributed.is_initialized():  # a clean exit: gloo aborts at interpreter exit otherwise
        torch.distributed.destroy_process_group()
