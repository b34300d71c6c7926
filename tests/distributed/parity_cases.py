"""The parity cases: a model, its trainer and chunk_offload's settings, each trained by DDP and by chunk_offload with
the same global batch (``runner.run_parity``). A case's keys: ``cls`` (a model of ``tests.models``), ``variant``,
``model`` (its shape), ``trainer``, ``strategy`` (chunk_offload's options, flat), ``limit_fraction`` (the device
limit as a fraction of the parameter bytes; ``limit_fractions`` one a rank), ``host_memory_limit``,
``fp16``/``bf16`` (``fp32_layers``: chunk_offload's embeddings and norms in fp32; ``exact``: compared bit for bit),
``steps``, ``resume_at`` (both runs stop there and resume from their own checkpoints),
``ddp_unused``, ``callbacks`` (chunk_offload's run only; ``both_callbacks``: DDP's too; ``ddp_callbacks``: DDP's
only), ``telemetry``, ``weights``,
``chunk_cls`` (another model for chunk_offload's run), ``init_scale``, ``rank_seeds`` (each rank seeds ``7 + rank``
before building), ``async_save`` (chunk_offload's checkpoints written in the background), ``no_swaps``
(chunk_offload's run without storage swaps, as on torch before 2.12). The cases whose ranks
differ are ``rank_cases.py``'s."""

from __future__ import annotations

from tests.distributed.rank_cases import RANK_CASES
from tests.weights_files import FORMATS

BIG = dict(dim=64, hidden=1024)
UNDER_LIMITS = dict(dim=256, hidden=1024, depth=4)  # the cases under a device limit
MUON = dict(dim=64, hidden=256, depth=3)  # matrices of 16,384 elements, shards of 12,000
# enough chunks that the whole gradient is many times the few payloads in flight
ACCUMULATE = dict(
    trainer=dict(accumulate_grad_batches=2), model=dict(dim=64, hidden=256, depth=6), strategy=dict(chunk_numel=20000)
)
AFTER = dict(
    step_in_backward=False
)  # the twins of the early_* cases step after backward ([Note: stepping in backward])
SCHEDULE_FREE = dict(
    cls="ScheduleFreeNet",
    model=dict(dim=64, hidden=512, depth=3),
    trainer=dict(val_check_interval=4, limit_val_batches=2),
    strategy=dict(assume_elementwise_optimizer=True, chunk_numel=None, chunk_numel_min=4096),
)
# the settings a user meets: the automatic chunk size, limits that differ by rank (a model used in another order than
# registered gives each case its ``cls``)
USER = dict(
    model=dict(dim=64, hidden=512, depth=3),
    limit_fractions=(0.9, 1.3),
    strategy=dict(chunk_numel=None, chunk_numel_min=4096),
)
# [Note: param groups added while training]: the frozen head unfrozen and added with its own learning rate
ADDED = dict(callbacks=["AddHeadGroup"], ddp_callbacks=["AddHeadGroupAsDDP"])
CASES = {
    "plain": dict(strategy=AFTER),
    "clip_norm": dict(trainer=dict(gradient_clip_val=0.05)),
    "clip_value": dict(trainer=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"), strategy=AFTER),
    "accumulate": dict(ACCUMULATE, strategy=dict(chunk_numel=20000, **AFTER)),  # every micro-batch reduce-scattered
    "accumulate_unsharded": dict(ACCUMULATE, strategy=dict(chunk_numel=20000, sharded_accumulation=False)),
    "tied": dict(variant="tied"),
    "frozen": dict(variant="frozen"),
    "added_group": dict(cls="HeadAddedLater", **ADDED),
    # as a user meets it (USER), with accumulation and a resume before the group is added
    "added_group_limits": dict(
        USER, cls="HeadAddedLaterReordered", trainer=dict(accumulate_grad_batches=2), resume_at=2, **ADDED
    ),
    "unused": dict(variant="unused", strategy=AFTER),
    # the default on a CPU device: payloads released after use (FSDP2's reshard_after_forward=True),
    # each chunk gathered for forward and again for backward
    "host": dict(
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", chunk_numel=20000, **AFTER),
        telemetry=True,
        callbacks=["CudaStreamsOnCpu"],  # [Note: streams and prefetch] as it would run on CUDA
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
    # load_state_dict after set-up: each rank writes its piece of the values it loads, no collective
    "load_state_dict": dict(variant="tied", strategy=dict(placement="host"), both_callbacks=["LoadsWeights"]),
    # [Note: the whole optimizer state of a parameter]: every parameter's read after each step, the head's reset;
    # amsgrad in one group, so chunks hold parameters with different keys ([Note: state keys a parameter has])
    "whole_optimizer_state": dict(
        model=dict(optimizer="adamw_amsgrad_matrices"),
        strategy=dict(placement="host", **AFTER),
        both_callbacks=["WholeOptimizerState"],
    ),
    # the same as a user meets it: ranks of different limits, the automatic chunk size, a reordered model stepped in
    # backward, accumulation, a resume whose state the first read takes in before the warm-up, saved and read by key
    "whole_optimizer_state_user": dict(
        USER,
        model=dict(USER["model"], optimizer="adamw_amsgrad_matrices"),
        cls="ReorderedNet",
        trainer=dict(accumulate_grad_batches=2),
        resume_at=4,
        both_callbacks=["WholeOptimizerState"],
    ),
    "host_kept": dict(
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="host", reshard_after_forward=False, chunk_numel=20000),
    ),
    # kept under a limit below the model's payloads (an accelerator's default, explicit on CPU), with the automatic
    # chunk size: kept within the budget the limit leaves beside the traced activations, and what does not fit is
    # released and gathered again
    "host_kept_limit": dict(
        cls="ReorderedNet",
        model=UNDER_LIMITS,
        limit_fraction=0.45,
        strategy=dict(placement="host", chunk_numel=None, chunk_numel_min=4096, reshard_after_forward=False),
    ),
    # its twin with the CPU default, released after use (FSDP2's reshard_after_forward=True): keeping must gather less
    "host_released_limit": dict(
        cls="ReorderedNet",
        model=UNDER_LIMITS,
        limit_fraction=0.45,
        strategy=dict(placement="host", chunk_numel=None, chunk_numel_min=4096),
    ),
    # the same with chunks of 300,000 elements: the warm-up's backward (registration order) must let payloads go
    # while their gradients wait to reduce ([Note: a gradient waits without its payload])
    "host_kept_waiting": dict(
        steps=8,
        cls="ReorderedNet",
        model=UNDER_LIMITS,
        limit_fraction=0.45,
        strategy=dict(placement="host", chunk_numel=300000),
    ),
    # a device limit below this rank's share of the parameter bytes (2 ranks: half of them)
    "limit": dict(model=UNDER_LIMITS, strategy=dict(chunk_numel=270000), limit_fraction=0.45),
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
        cls="ReorderedNet", model=UNDER_LIMITS, limit_fraction=0.45, strategy=dict(chunk_numel=None)
    ),
    # bf16-mixed below a third of the parameter bytes: the warm-up's registration-order layout keeps a waiting
    # chunk's fp32 gradient payload beside the one filling (twice a bf16 payload each), so its size leaves room for two
    "reordered_bf16_tight": dict(
        cls="ReorderedNet", model=UNDER_LIMITS, limit_fraction=0.3, bf16=True, strategy=dict(chunk_numel=None)
    ),
    "reordered_bf16": dict(
        cls="ReorderedNet", model=UNDER_LIMITS, bf16=True, strategy=dict(chunk_numel=None)
    ),  # its twin without a limit
    # host shards with a bf16 compute copy, stepped by the one-pass kernel ([Note: one pass over a host shard]) after
    # backward and, chunk by chunk as each reduce-scatter lands, in backward (the same DDP run as reordered_bf16)
    "host_bf16_one_pass": dict(
        cls="ReorderedNet",
        model=UNDER_LIMITS,
        bf16=True,
        strategy=dict(chunk_numel=None, placement="host", optimizer_kernel="one_pass", **AFTER),
    ),
    "early_host_bf16_one_pass": dict(
        cls="ReorderedNet",
        model=UNDER_LIMITS,
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
        model=UNDER_LIMITS,
        limit_fraction=0.45,
        strategy=dict(chunk_numel=None, placement="host"),
    ),
    # torch's composable checkpoint(module) on blocks that drop out: the recomputation draws the forward's masks
    "composable_checkpointed_limit": dict(
        steps=8,
        cls="ComposableCheckpointedNet",
        model=UNDER_LIMITS,
        limit_fraction=0.45,
        strategy=dict(chunk_numel=None),
    ),
    # LoRA's shape under a limit: frozen weights must not stay pinned for the rest of backward
    "adapters_limit": dict(
        steps=8, cls="AdapterNet", model=UNDER_LIMITS, limit_fraction=0.3, strategy=dict(chunk_numel=None)
    ),
    # a block run twice a forward, frozen, and LoRA's shape under activation checkpointing: the defaults, a limit
    "reused_frozen_limit": dict(
        steps=8,
        cls="ReusedBlockNet",
        variant="frozen",
        model=UNDER_LIMITS,
        limit_fraction=0.45,
        strategy=dict(chunk_numel=None),
    ),
    # R-Drop: the model called twice a step, both calls in backward, registered in another order than it runs, under
    # limits below the model's payloads that differ by rank (its two forwards' activations take 0.35 of the parameter
    # bytes), with a resume ([Note: a module called again before its backward])
    "called_twice_limit": dict(
        steps=8,
        cls="ReorderedTwoPassNet",
        variant="rdrop",
        model=UNDER_LIMITS,
        limit_fractions=(0.7, 0.9),
        resume_at=3,
        strategy=dict(chunk_numel=None),
    ),
    "checkpointed_adapters_limit": dict(
        steps=8,
        cls="CheckpointedAdapterNet",
        model=UNDER_LIMITS,
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
    # torch's Muon, each matrix orthogonalized whole from pieces on both ranks ([Note: Muon over sharded matrices]):
    # matrices cut at the shard boundary, under a limit, resumed (its momentum); two micro-batches a step
    # (orthogonalized once, at the step); and beside AdamW in manual optimization, as Muon is used
    "muon_limit": dict(cls="MuonNet", model=MUON, strategy=dict(chunk_numel=24000), limit_fraction=1.2, resume_at=6),
    "muon_accumulate": dict(
        cls="MuonNet",
        model=MUON,
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=24000, sharded_accumulation=False),
    ),
    "muon_with_adamw": dict(cls="MuonWithAdamW", strategy=dict(chunk_numel=3000)),
    # torch's Adafactor, each parameter stepped whole from pieces on both ranks ([Note: Adafactor over sharded
    # matrices]): matrices cut at the shard boundary and a (1, dim) and a (dim, 1) one, whose factored state has
    # the parameter's shape, under a limit, resumed (row_var, col_var and variance carried whole)
    "adafactor_limit": dict(
        cls="AdafactorNet", model=MUON, strategy=dict(chunk_numel=24000), limit_fraction=1.2, resume_at=6
    ),
    "toggled_optimizers": dict(cls="ToggledOptimizers", ddp_unused=True, strategy=dict(chunk_numel=None)),
    "two_optimizers_fp16": dict(cls="TwoOptimizers", fp16=True),
    # built on the meta device in configure_model, initialised chunk by chunk: DDP's eager values, bit for bit
    "deferred": dict(chunk_cls="DeferredNet", variant="tied", strategy=dict(chunk_numel=None)),
    # the same under a device limit with the automatic chunk size (the settings of reordered_auto_limit)
    # the forward compiled (aot_eager) under a limit, with the automatic chunk size: the hooks' gathers and
    # reduce-scatters between dynamo's graphs, in the same order on both ranks
    "compiled_limit": dict(
        cls="CompiledNet", variant="tied", strategy=dict(chunk_numel=None, chunk_numel_min=2048), limit_fraction=2.2
    ),
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
        callbacks=["LateGradientCopies"],  # the copies to the host land late, as on CUDA
    ),
    # ... every shard on the device, one rank's worker slower ([Note: the same device bytes on every rank in backward])
    "early_device_thread": dict(
        model=dict(dim=64, hidden=256, depth=6),
        strategy=dict(placement="device", chunk_numel=20000, step_in_backward=True, step_thread=True),
        callbacks=["DeviceBytesAtHandOvers"],
    ),
    # ... as a user meets it (USER) with sharded accumulation, copies landing late as on CUDA, a resume in the middle
    "early_user_late": dict(
        USER,
        cls="ReorderedNet",
        trainer=dict(accumulate_grad_batches=2),
        resume_at=5,
        strategy=dict(USER["strategy"], step_in_backward=True, step_thread=True),
        callbacks=["LateGradientCopies"],
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
        trainer=dict(gradient_clip_val=0.05),
        strategy=dict(placement="host", step_in_backward=True, step_thread=True),
        callbacks=["LateGradientCopies"],  # the guesses step on the worker from copies that land late, as on CUDA
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
    # a block used three times, twice inside reentrant activation checkpointing: its gradient arrives in three pieces
    # ([Note: gradients in pieces]); DDP takes them with static_graph=True, and refuses them without
    "reused_reentrant": dict(cls="ReusedCheckpointedNet", ddp_static_graph=True, strategy=dict(chunk_numel=2048)),
    "reused_reentrant_limit": dict(
        cls="ReusedCheckpointedNet",
        ddp_static_graph=True,
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
        limit_fraction=0.9,
    ),
    # the same with ranks whose limits differ (0.9x and 1.4x), resumed at step 3 from its own checkpoint
    "reused_reentrant_resume": dict(
        cls="ReusedCheckpointedNet",
        ddp_static_graph=True,
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
        limit_fractions=(0.9, 1.4),
        resume_at=3,
        steps=8,
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
    # gradients summed across ranks in bf16 (ChunkPrecision(reduce_dtype=torch.bfloat16), FSDP's reduce_dtype), against
    # DDP with torch's bf16_compress_hook (runner.DDP_HOOKS): each rank's fp32 gradient rounded to bf16 and halved, the
    # sum rounded once: bit-exact
    "reduce_bf16": dict(reduce_dtype="bfloat16", ddp_comm_hook="bf16"),
    # the same as a user meets it: the automatic chunk size, limits that differ by rank, a model used in another order
    # than registered, a resume in the middle
    "reduce_bf16_limits": dict(USER, reduce_dtype="bfloat16", ddp_comm_hook="bf16", cls="ReorderedNet", resume_at=5),
    # BatchNorm 1d/2d/3d in mixed precision ([Note: normalisation in mixed precision]): bf16 against DDP with bf16
    # autocast, released after use, and fp16 with loss scaling against DDP with GradScaler
    "bn_cnn_bf16": dict(cls="BatchNormCNN", bf16=True, strategy=dict(chunk_numel=10_000)),
    "bn_cnn_bf16_host": dict(cls="BatchNormCNN", bf16=True, strategy=dict(chunk_numel=10_000, placement="host")),
    "bn_cnn_fp16": dict(cls="BatchNormCNN", fp16=True, strategy=dict(chunk_numel=10_000)),
    # parameters read with autocast off ([Note: parameters read outside autocast]): every rank's sanity check finds
    # them, the ranks agree, and the resume moves them before its first step as the checkpoint names them
    "autocast_off_bf16": dict(
        cls="AutocastOff", bf16=True, trainer=dict(limit_val_batches=1, num_sanity_val_steps=1), resume_at=8
    ),
    # an own zero_grad(set_to_none=False): an unused branch's zero gradient steps (so the default steps after backward)
    "zeroed_in_place": dict(
        cls="ReorderedZeroesInPlace",
        variant="unused",
        model=dict(dim=64, hidden=512, depth=3),
        resume_at=5,
        limit_fractions=(2.0, 3.0),
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=None),
    ),
    # schedule-free: eval() and train() around each validation write the masters through the optimizer's views
    # ([Note: the optimizer's views written outside its step]); its counters live in the param groups; resumed
    "schedule_free_limit": dict(SCHEDULE_FREE, limit_fraction=1.2, resume_at=6),
    # ranks whose limits differ, two micro-batches a step kept whole (no_sync) and validated in the middle of one
    # (eval() and train() write the masters while gradients wait in the payloads); at the epoch's end evaluated by
    # hand, a forward outside any step between eval() and train()
    "schedule_free_accumulate": dict(
        SCHEDULE_FREE,
        cls="ScheduleFreeEvaluatedByHand",
        limit_fractions=(2.2, 3.0),
        trainer=dict(val_check_interval=3, limit_val_batches=2, accumulate_grad_batches=2),
        strategy=dict(SCHEDULE_FREE["strategy"], sharded_accumulation=False),
    ),
    # DDP starts from the values in start.pt; chunk_offload reads them from a file (written by the test)
    **{f"weights_{fmt}": dict(chunk_cls="DeferredNet", weights=fmt, variant="tied") for fmt in FORMATS},
    **RANK_CASES,
}
