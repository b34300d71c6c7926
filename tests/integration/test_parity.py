"""Trainer.fit with chunk_offload against strategy="auto": the same parameters after 24 steps."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.engine.runtime.moments import MomentClock
from lightning_chunk.engine.schedule.tracer import BACKWARD
from lightning_chunk.options import grouped
from tests import layer_models, models
from tests.backward_models import GradPenalty, model_class
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, SparseEmbedding, fit, quiet_trainer, token_data

STEPS = 24
# The default kernel is torch's fused Adam; plain Lightning on CPU runs the single-tensor loop. The two
# round differently in the last bit, and Adam carries that along: 24 steps leave ~1e-6 differences.
# With optimizer_kernel="loop" the same runs are bit-exact (EXACT), which pins the difference on the kernel.
FUSED = dict(rtol=1e-4, atol=1e-5)


CASES = {
    "adamw_groups_scheduler": dict(),
    "clip_norm": dict(gradient_clip_val=0.05),
    "clip_value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    "accumulate": dict(accumulate_grad_batches=2),
    "tied": dict(variant="tied"),
    "frozen": dict(variant="frozen"),
    "unused_branch": dict(variant="unused"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_auto_is_bit_exact(case):
    kw = CASES[case]
    ref = fit("auto", steps=STEPS, **kw)
    got = fit(
        ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")),
        steps=STEPS,
        **kw,
    )  # several chunks
    assert_same_params(ref, got, EXACT)
    assert int(got.calls) == int(ref.calls) > 0  # buffers updated in training_step survive


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_auto_fused_kernel(case):
    kw = CASES[case]
    ref = fit("auto", steps=STEPS, **kw)
    got = fit(ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096)), steps=STEPS, **kw)
    assert_same_params(ref, got, FUSED)


@pytest.mark.parametrize("case", ["adamw_groups_scheduler", "accumulate", "tied", "unused_branch", "clip_norm"])
def test_parity_all_on_host(case):
    kw = CASES[case]
    ref = fit("auto", steps=STEPS, **kw)
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=STEPS, **kw)
    assert_same_params(ref, got, EXACT)
    stats = strategy.memory_stats()
    assert stats["device_shards"] == 0 and stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0


@pytest.mark.parametrize("case", ["accumulate", "tied"])
def test_host_payloads_kept_for_backward_are_bit_exact_and_fetched_once_a_step(case):
    """``reshard_after_forward=False`` on one rank: a payload is a host-to-device copy, made once a step instead of
    twice, and the training is the same, bit for bit."""
    kw = CASES[case]
    ref = fit("auto", steps=STEPS, **kw)
    runs = {}
    for reshard in (True, False):
        # six or seven chunks: with four, the prefetch window ([Note: how far ahead to gather]) keeps every payload
        # released after use through the turn into backward, and releasing gathers no more than keeping
        strategy = ChunkOffloadStrategy(
            placement="host",
            memory=MemoryOptions(chunk_numel=2048, reshard_after_forward=reshard),
            offload=OffloadOptions(optimizer_kernel="loop"),
        )
        got = fit(strategy, steps=STEPS, **kw)
        assert_same_params(ref, got, EXACT)
        runs[reshard] = strategy.memory_stats()
    kept, released = runs[False], runs[True]
    micro_batches = STEPS * kw.get("accumulate_grad_batches", 1)
    # one copy a chunk a micro-batch, and the warm-up's (it releases after use: there is no trace yet)
    assert kept["gathers"] <= kept["chunks"] * (micro_batches + 4) < released["gathers"], runs
    assert kept["h2d_bytes"] < 0.8 * released["h2d_bytes"]


class RecordMoments(L.Callback):
    """Every moment of the training steps after the warm-up: what each released, gathered and left resident."""

    def __init__(self):
        self.events = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        trainer.strategy.engine.hooks.moments.recorder = self.events.append if trainer.global_step >= 2 else None


SKIPPED_MODELS = {  # a setting -> its model ("limit": under a device limit)
    **dict.fromkeys(["released", "released_limit", "kept_limit"]),
    **{"reordered_accumulate": "ReorderedNet", "checkpointed_limit": "CheckpointedNet", "adapters_limit": "AdapterNet"},
    **{"reused_limit": "ReusedBlockNet", "root_tied_limit": "RootTiedNet"},
}


@pytest.mark.parametrize("setting", list(SKIPPED_MODELS))
def test_moments_known_to_have_nothing_to_release_skip_their_plan_and_change_nothing(setting, monkeypatch):
    """[Note: moments with nothing to release] and [Note: backward moments with nothing to release]: the plans
    skipped at a module's end whose chunks stay kept, at a module's start in forward whose chunks are all resident,
    and at a backward moment after another with no chunk changed outside the window, would have released and
    gathered nothing. Every moment of the run, its releases, gathers, resident payloads and device bytes, is the
    same as with a plan at every moment, and so is the training; with the automatic chunk size, without a limit,
    under a limit, keeping payloads for backward under one, on a model that runs its blocks in another order than it
    registers them with accumulation, under activation checkpointing (forward moments inside backward), with frozen
    blocks beside adapters (their backward ends by a hook on its inputs), a block called twice, and a tied head read
    in the root's forward."""
    cls = SKIPPED_MODELS.get(setting)
    cls = cls and model_class(cls)
    limit = (
        dict(device_memory_limit=int(4 * sum(p.numel() for p in ParityNet(**WIDE).parameters()) * 0.45))
        if "limit" in setting
        else {}
    )
    reshard = dict(reshard_after_forward=setting != "kept_limit")
    extra = dict(accumulate_grad_batches=2) if "accumulate" in setting else {}
    runs, skipped, in_backward = {}, [], []
    real = MomentClock._plan_is_empty

    def counting(self, *args):
        out = real(self, *args)
        skipped.append(out)
        in_backward.append(out and self._this_moment[0] == BACKWARD)
        return out

    for skip in (False, True):
        monkeypatch.setattr(MomentClock, "_plan_is_empty", counting if skip else lambda self, *args: False)
        moments = RecordMoments()
        strategy = ChunkOffloadStrategy(
            **grouped({"placement": "host", **limit, **reshard, "optimizer_kernel": "loop"})
        )
        model = fit(strategy, steps=8, model_kwargs=WIDE, callbacks=[moments], cls=cls, **extra)
        runs[skip] = (model, moments.events, strategy.memory_stats())
    (ref, ref_events, ref_stats), (got, events, stats) = runs[False], runs[True]
    assert_same_params(ref, got, EXACT)
    assert events == ref_events and len(events) > 100
    assert any(e.evicted for e in events) and stats["gathers"] == ref_stats["gathers"]
    # skipped (of them at backward moments): 280 (84) of 368 plans without a limit (the warm-up's included), 133 (21)
    # and 49 (14) under the limit (the device past the room the activations leave, the plan before released for
    # room, or the chunk leaving the window), 598 (180) of 736 reordered with accumulation, 168 (28) of 560
    # checkpointed, 182 (35) of 560 with adapters, 105 (21) of 440 with a block called twice, 30 (6) of 367 tied
    assert sum(skipped) > (len(skipped) // 2 if setting == "released" else 20), (sum(skipped), len(skipped))
    assert sum(in_backward) > 4, (sum(in_backward), sum(skipped), len(skipped))


BIG = dict(dim=64, hidden=1024)  # parameters outweigh activations (the regime offload is for)


@pytest.mark.parametrize("placement,extra", [("auto", {}), ("static", {"offload_fraction": 0.85})])
@pytest.mark.parametrize("case", ["adamw_groups_scheduler", "clip_norm", "tied"])
def test_parity_under_a_device_limit_below_the_parameter_bytes(placement, extra, case):
    kw = dict(CASES[case])
    variant = kw.pop("variant", "plain")
    ref = fit("auto", steps=STEPS, variant=variant, model_kwargs=BIG, **kw)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    limit = int(param_bytes * 0.9)
    strategy = ChunkOffloadStrategy(
        **grouped(
            {
                "placement": placement,
                "device_memory_limit": limit,
                **extra,
                "chunk_numel": 66560,
                "optimizer_kernel": "loop",
            }
        )
    )
    got = fit(strategy, steps=STEPS, variant=variant, model_kwargs=BIG, **kw)
    assert_same_params(ref, got, EXACT)
    stats = strategy.memory_stats()
    assert stats["evictions"] > 0
    assert 0 < stats["device_chunk_bytes_peak"] <= limit < param_bytes


WIDE = dict(dim=256, hidden=1024, depth=4)  # each weight matrix 1 MB: a chunk of its own under the limits below


@pytest.mark.parametrize("cls", ["CheckpointedNet", "ReentrantCheckpointedNet", "ComposableCheckpointedNet"])
@pytest.mark.parametrize("placement", ["auto", "host"])
def test_activation_checkpointing_with_the_defaults_under_a_limit_is_bit_exact(cls, placement):
    """[Note: recomputation]: backward runs each block's forward again. With the automatic chunk size under a limit
    below the parameter bytes, the recomputed blocks gather their chunks beside the chunk of the module whose
    backward asked for them, and nothing a running backward reads is released (with ``use_reentrant=False`` host
    placement released the last layer's payload under its backward: "setStorage ... storage of size 0")."""
    model_cls = model_class(cls)
    ref = fit("auto", steps=8, cls=model_cls, model_kwargs=WIDE)
    limit = int(sum(p.numel() * p.element_size() for p in ref.parameters()) * 0.45)
    strategy = ChunkOffloadStrategy(
        placement=placement, device_memory_limit=limit, offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=8, cls=model_cls, model_kwargs=WIDE)
    assert_same_params(ref, got, EXACT)
    stats = strategy.memory_stats()
    assert stats["chunks"] > 4 and stats["evictions"] > 0
    assert 0 < stats["device_chunk_bytes_peak"] <= limit


@pytest.mark.parametrize("cls", ["CheckpointedNet", "ReentrantCheckpointedNet"])
def test_activation_checkpointing_on_the_host_with_a_chunk_a_module_is_bit_exact(cls):
    """Host placement releases each payload after use; the recomputation's forward must not release the chunk of
    the module whose backward runs it."""
    ref = fit("auto", steps=STEPS, cls=model_class(cls), model_kwargs=dict(depth=3))
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=2048), offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=STEPS, cls=model_class(cls), model_kwargs=dict(depth=3))
    assert_same_params(ref, got, EXACT)


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_frozen_weights_under_a_limit_are_released_after_their_backward(placement):
    """[Note: frozen parameters in backward]: LoRA's shape (frozen blocks, trainable adapters) under a limit below
    the parameter bytes. The frozen weights never get a gradient; they used to stay pinned from their module's
    backward to the end of backward, and the first backward failed."""
    ref = fit("auto", steps=8, cls=model_class("AdapterNet"), model_kwargs=WIDE)
    limit = int(sum(p.numel() * p.element_size() for p in ref.parameters()) * 0.3)
    strategy = ChunkOffloadStrategy(
        placement=placement, device_memory_limit=limit, offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=8, cls=model_class("AdapterNet"), model_kwargs=WIDE)
    assert_same_params(ref, got, EXACT)
    assert 0 < strategy.memory_stats()["device_chunk_bytes_peak"] <= limit


@pytest.mark.parametrize(
    "cls,variant,placement,fraction",
    [
        ("ReusedBlockNet", "plain", "auto", 0.45),
        ("ReusedBlockNet", "frozen", "auto", 0.45),
        ("ReusedBlockNet", "frozen", "host", 0.3),
        ("CheckpointedAdapterNet", "plain", "auto", 0.45),
        ("CheckpointedAdapterNet", "plain", "host", 0.3),
    ],
)
def test_reused_modules_and_checkpointed_adapters_with_the_defaults_under_a_limit(cls, variant, placement, fraction):
    """A block called twice a forward (with the defaults under a limit its warm-up once needed both its chunks
    beside the next module's and failed); the same with that block frozen (the repack after the warm-up built the new
    chunks beside the payloads the warm-up left resident, over the limit); LoRA's shape under activation
    checkpointing (both fixes of the frozen and recomputed paths at once)."""
    model_cls = model_class(cls)
    ref = fit("auto", steps=8, cls=model_cls, variant=variant, model_kwargs=WIDE)
    limit = int(sum(p.numel() * p.element_size() for p in ref.parameters()) * fraction)
    strategy = ChunkOffloadStrategy(
        placement=placement, device_memory_limit=limit, offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=8, cls=model_cls, variant=variant, model_kwargs=WIDE)
    assert_same_params(ref, got, EXACT)
    assert 0 < strategy.memory_stats()["device_chunk_bytes_peak"] <= limit


def fit_with_validation(strategy, cls, steps=STEPS, **kw):
    """``fit`` with a validation pass every 4 batches; returns (model, the validation losses)."""
    losses = []

    class Recording(cls):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x).float().reshape(-1, models.VOCAB), y.reshape(-1))
            losses.append(loss.item())

    model = fit(
        strategy,
        steps=steps,
        cls=Recording,
        limit_val_batches=2,
        val_check_interval=4,
        val_dataloaders=models.token_data(16, seed=1),
        **kw,
    )
    return model, losses


@pytest.mark.parametrize(
    "kw",
    [
        dict(placement="host"),
        dict(placement="host", chunk_numel=16384),
        dict(device_memory_limit=300_000, chunk_numel=16384),
    ],
    ids=["host", "host-small", "limit"],
)
def test_torch_transformer_layers_train_and_validate_bit_exact(kw):
    """[Note: leaf modules]: nn.MultiheadAttention reads out_proj's weights without calling it (training failed with
    IllegalTransitionError), and the encoder layer's fast path in validation reads every child's ("setStorage ...
    storage of size 0"). Both are leaves by default: the same parameters and validation losses as plain Lightning."""
    ref, ref_losses = fit_with_validation("auto", models.TorchTransformerNet)
    got, losses = fit_with_validation(
        ChunkOffloadStrategy(**grouped({**kw, "optimizer_kernel": "loop"})), models.TorchTransformerNet
    )
    assert_same_params(ref, got, EXACT)
    assert losses == ref_losses and len(losses) == 2 * (STEPS // 4)


def test_torch_fast_paths_run_in_the_checked_steps(monkeypatch, tmp_path):
    """[Note: torch's fast paths in checked steps]: the warm-up's steps and the first validation step ran torch's
    attention and encoder on their slow paths, under the mode that checks for released parameters: the first
    validation loss 1.86 apart where outputs at padded positions are zeros in plain Lightning, and a frozen encoder
    in eval mode moved the training off plain Lightning's bits. With the defaults under a limit that evicts, with
    accumulation and a resume half-way (whose first steps are checked again): the same parameters and losses, and the
    fused attention runs in every step, the checked ones included."""
    calls = []
    fused = torch._native_multi_head_attention
    monkeypatch.setattr(torch, "_native_multi_head_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))

    def chunked() -> ChunkOffloadStrategy:  # under the chunks and the activations the warm-up traces
        return ChunkOffloadStrategy(device_memory_limit=150_000, offload=OffloadOptions(optimizer_kernel="loop"))

    runs = {}
    for name, strategy in (("auto", lambda: "auto"), ("chunk", chunked)):
        save = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=STEPS // 2, filename="half")
        kw = dict(accumulate_grad_batches=2)
        first = fit_with_validation(
            strategy(), models.PaddedTransformerNet, STEPS // 2, callbacks=[save], enable_checkpointing=True, **kw
        )[1]
        calls.clear()
        got, losses = fit_with_validation(
            strategy(), models.PaddedTransformerNet, ckpt_path=str(tmp_path / name / "half.ckpt"), **kw
        )
        runs[name] = got, first + losses, len(calls)
    (ref, ref_losses, _), (got, losses, fused_calls) = runs["auto"], runs["chunk"]
    assert_same_params(ref, got, EXACT)
    assert losses == ref_losses and len(losses) == 2 * (2 * STEPS // 4)  # 2 batches every 4 of 2 x STEPS
    assert got.trainer_ref.strategy.memory_stats()["evictions"] > 0
    layers = models.ParityNet().shape["depth"] + 1  # the encoder's and the frozen one's, a validation batch
    # the resumed fit: STEPS micro-batches, each through the frozen layer, and STEPS // 4 validations of 2 batches
    assert fused_calls == STEPS + STEPS // 4 * 2 * layers


@pytest.mark.parametrize("leaf", [layer_models.Peek, "Peek", "tests.layer_models.Peek"])
def test_a_module_reading_its_child_s_weights_is_a_leaf_when_named(leaf):
    ref = fit("auto", steps=STEPS, cls=layer_models.PeekNet)
    got = fit(
        ChunkOffloadStrategy(
            placement="host",
            memory=MemoryOptions(chunk_numel=4096, leaf_modules=[leaf]),
            offload=OffloadOptions(optimizer_kernel="loop"),
        ),
        steps=STEPS,
        cls=layer_models.PeekNet,
    )
    assert_same_params(ref, got, EXACT)


@pytest.mark.parametrize("kw", [dict(placement="host"), dict(device_memory_limit=300_000)], ids=["host", "limit"])
def test_a_module_reading_its_child_s_weights_needs_no_leaf_modules(kw):
    """[Note: parameters read outside their owner]: the block that reads its child's weight adopts it (not the root,
    which would keep it gathered for the whole step). It used to fail with an IllegalTransitionError naming
    leaf_modules."""
    ref = fit("auto", steps=STEPS, cls=layer_models.PeekNet)
    strategy = ChunkOffloadStrategy(
        **grouped({**kw, "chunk_numel": 4096, "materialize_on_teardown": True, "optimizer_kernel": "loop"})
    )
    got = fit(strategy, steps=STEPS, cls=layer_models.PeekNet)
    assert_same_params(ref, got, EXACT)


def fit_compiled(strategy, steps: int = 8, **kw):
    """The LightningModule's forward compiled in place (Lightning refuses ``trainer.fit(torch.compile(model))`` for
    strategies outside its own list; compiling the module's forward or a submodule is the way with chunk_offload).
    AOTAutograd with the eager backend: dynamo's graph breaks and autograd functions, no C compiler needed."""
    import lightning as L

    torch._dynamo.reset()  # a fresh cache: each run compiles its own model
    L.seed_everything(7, verbose=False)
    model = ParityNet(**kw)
    trainer = quiet_trainer(strategy=strategy, max_steps=steps, limit_val_batches=0)
    model.forward = torch.compile(model.forward, backend="aot_eager")
    trainer.fit(model, token_data())
    return model


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_compiled_model_trains_in_parity_under_a_device_limit(monkeypatch):
    """The engine's hooks run eagerly (dynamo breaks the graph around them), and the warm-up's saved-tensor hooks
    count real storages; the first compiled runs printed "'_Saved' object has no attribute 'key'" every step,
    from an instance dynamo builds with ``object.__new__`` to probe the class."""
    import sys

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: raised.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    ref = fit_compiled("auto", variant="tied", dim=64, hidden=1024)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    strategy = ChunkOffloadStrategy(
        device_memory_limit=int(param_bytes * 0.9),
        memory=MemoryOptions(chunk_numel=66560),
        offload=OffloadOptions(optimizer_kernel="loop"),
    )
    got = fit_compiled(strategy, variant="tied", dim=64, hidden=1024)
    assert_same_params(ref, got, EXACT)
    assert strategy.memory_stats()["evictions"] > 0
    assert raised == []


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_a_gradient_penalty_double_backward_trains_like_auto(placement):
    """[Note: double backward]: with host placement the payloads that the create_graph=True backward's graph saved
    were released at its end, and the step's backward read freed memory (a segmentation fault)."""
    ref = fit("auto", steps=6, cls=GradPenalty)
    strategy = ChunkOffloadStrategy(
        placement=placement, memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, steps=6, cls=GradPenalty)
    assert_same_params(ref, got, EXACT)
    if placement == "host":
        assert strategy.memory_stats()["evictions"] > 0


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_a_sparse_embedding_trains_like_its_dense_twin(placement):
    """A sparse gradient (``nn.Embedding(sparse=True)``) failed in the engine's copy ("reshape is not implemented for
    sparse tensors"). It is made dense on arrival, so the run equals plain Lightning with a dense embedding bit for
    bit (plain PyTorch's sparse path itself rounds the repeated rows' sum differently)."""
    ref = fit("auto", steps=4, cls=SparseEmbedding, model_kwargs=dict(dense=True))
    got = fit(
        ChunkOffloadStrategy(
            placement=placement, memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(optimizer_kernel="loop")
        ),
        steps=4,
        cls=SparseEmbedding,
    )
    assert got.embed.sparse
    assert_same_params(ref, got, EXACT)
