"""The parity cases whose ranks differ, as they do at scale: each rank its own device limit (each GPU's free memory),
a parameter or an expert used on some ranks only, a buffer or the weights built differently on each rank. Each is
trained by DDP and by chunk_offload (``runner.run_parity``; a case's keys: ``parity_cases.py``)."""

FOUR_ONLY = ("hybrid_limits_differ", "hybrid_rank_gated", "hybrid_disk")  # shard groups of two: four ranks at least
OWN_CHUNK = dict(cls="RankGatedNet", variant="own_chunk", ddp_unused=True, model=dict(dim=64, hidden=512, depth=3))

# [Note: backward moments with nothing to release] as a user meets it: host placement, the automatic chunk size,
# limits that differ by rank, a model used in another order than registered, accumulation, a resume; every moment on
# each rank as with a plan at every backward moment (its twin). Under 0.9 and 1.3 of the parameter bytes no backward
# plan is skipped: the device is past the room the activations leave
SKIPS = dict(
    cls="ReorderedNet",
    model=dict(dim=64, hidden=512, depth=3),
    limit_fractions=(1.5, 2.0),
    resume_at=3,
    steps=8,
    trainer=dict(accumulate_grad_batches=2),
    strategy=dict(placement="host", chunk_numel=None, chunk_numel_min=4096),
)

RANK_CASES = {
    # torch's Muon as a user meets it ([Note: Muon over sharded matrices]): the automatic chunk size, limits that
    # differ by rank (4 chunks, 65 evictions a rank), a resume in the middle. With sharded accumulation too it is
    # 0.0074 of the update off DDP (the accumulation's last-bit rounding, ROUNDING["accumulate"], through bf16
    # Newton-Schulz); muon_accumulate, accumulating whole, is exact
    "muon_limits_differ": dict(
        cls="MuonNet",
        model=dict(dim=64, hidden=256, depth=3),
        limit_fractions=(1.2, 2.0),
        resume_at=6,
        strategy=dict(chunk_numel=None),
    ),
    # torch's Adafactor with the defaults a user gets: the automatic chunk size, limits that differ by rank, two
    # micro-batches a step accumulated in shards (ROUNDING; accumulated whole under limits of 2.2 and 3.0 it was
    # bit-exact), a resume in the middle
    "adafactor_limits_differ": dict(
        cls="AdafactorNet",
        model=dict(dim=64, hidden=256, depth=3),
        limit_fractions=(1.2, 2.0),
        resume_at=5,
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=None),
    ),
    # ranks whose limits differ (each GPU's free memory, on CUDA): they must plan under one limit, the smallest
    # ([Note: one limit for every rank]); with their own they evicted different chunks and paired different gathers
    # [Note: the shards a placement keeps on the device] as a user meets it: static placement under limits that
    # differ by rank (the ranks agree on the smaller), the automatic chunk size, a model used in another order than
    # registered, accumulation (sharded: ROUNDING), a resume in the middle
    "static_limit": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fractions=(2.0, 2.5),
        resume_at=5,
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=None, placement="static"),
    ),
    # [Note: replicas of the shard group] on four ranks: two shard groups of two. Limits that would give the groups
    # different layouts if agreed within each (0.9 against 1.3 of the parameters), a model used in another order than
    # registered, norm clipping (a sum over the shard group alone), sharded accumulation, a resume in the middle from
    # a checkpoint the first group wrote in the background
    "hybrid_limits_differ": dict(
        cls="ReorderedNet",
        # SGD: a norm off by sqrt(2) moves the update 16x the bound off DDP; Adam's normalisation leaves 1.3x
        model=dict(dim=64, hidden=512, depth=3, optimizer="sgd"),
        limit_fractions=(0.9, 1.3, 1.3, 1.3),
        resume_at=5,
        async_save=True,
        trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096, placement="host", shard_size=2),
    ),
    # a gate's parameter used by one shard group and not the other, differently each step: the vote on which
    # parameters got gradients goes over every rank (within the groups, one group skipped the step the other took).
    # Shard groups of a node's ranks (``"node"``): two, the four-rank launch being two nodes of two
    "hybrid_rank_gated": dict(
        cls="RankGatedNet", variant="pairs", ddp_unused=True, strategy=dict(placement="host", shard_size="node")
    ),
    # the disk tier's defaults (disk_defaults) in shard groups: two ranks of a host with the same shards keep scratch
    # files of their own and step their copies of each file alike; a resume from the first group's checkpoint
    "hybrid_disk": dict(
        cls="ReorderedNet",
        model=dict(dim=64, hidden=512, depth=3),
        limit_fraction=0.9,
        strategy=dict(chunk_numel=None, shard_size=2),
        host_memory_limit="1MB",
        resume_at=5,
        trainer=dict(accumulate_grad_batches=2),
    ),
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
    # [Note: a weight used twice under mixed precision]: bf16-mixed with every weight read by one op a step is DDP's
    # bit for bit, as a user meets it (the automatic chunk size, limits that differ by rank, layers registered in
    # another order than used, accumulation, a resume)
    "bf16_one_read": dict(
        cls="LinearsOnly",
        bf16=True,
        exact=True,
        model={},
        limit_fractions=(0.9, 1.3),
        resume_at=5,
        trainer=dict(accumulate_grad_batches=2),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
    ),
    # the same Note: 16-mixed with the embeddings and norms in fp32, as autocast computes them
    # (ChunkPrecision(fp32_embeddings_and_norms=True)), is DDP's bit for bit with its loss scales, as a user meets it:
    # a tied head, layers registered in another order than used, the automatic chunk size, limits that differ by
    # rank and a resume; with fp16 payloads there the first step overflowed where DDP's did not. (Accumulation sums
    # in sharded_accumulation's order, as the "accumulate" case does: 1e-6 of the update from DDP, checked by hand)
    "fp16_fp32_layers": dict(
        cls="ReorderedNet",
        variant="tied",
        fp16=True,
        exact=True,
        fp32_layers=True,
        limit_fractions=(1.7, 2.2),
        resume_at=5,
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
    ),
    "backward_skips": dict(SKIPS, callbacks=["RecordsMoments"]),
    "backward_planned": dict(SKIPS, callbacks=["PlansEveryBackwardMoment"]),
    # [Note: gradient buffers the kernel may take]: without storage swaps (torch before 2.12) the host gradient shards
    # stepped in backward keep their bytes, advised free, and the ledger counts them given back: backward_skips' run
    "no_swaps": dict(SKIPS, no_swaps=True),
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
    # the device bytes; one that holds the shards, the payloads and the activations at once)
    "rank_gated_device": dict(
        OWN_CHUNK, strategy=dict(chunk_numel=32768, placement="device", step_in_backward=True), limit_fraction=4.0
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
    # a mixture of experts running only the experts its tokens chose (which differ across ranks), as a leaf: DDP
    # needs find_unused_parameters=True; with the experts as modules of their own the ranks' gathers differed
    "mixture_of_experts": dict(
        cls="MixtureNet", ddp_unused=True, strategy=dict(leaf_modules=["Experts"], placement="host")
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
    "rank_buffer": dict(cls="RankBuffer"),
    # no common seed: each rank builds other weights, and both runs train from rank 0's (DDP syncs them as it wraps)
    "rank_seeds": dict(variant="tied", rank_seeds=True),
    "rank_seeds_deferred_limit": dict(
        chunk_cls="DeferredNet",
        rank_seeds=True,
        model=dict(dim=64, hidden=512, depth=3),
        strategy=dict(chunk_numel=None, chunk_numel_min=4096),
        limit_fraction=0.9,
    ),
}
