"""CUDA checks: parity, deferred init on the GPU's generator, the device limit on real device memory, the default
limit, gradient offload on a side stream, the one-pass host Adam step (also on a thread beside backward), Adafactor and
Muon, the tracer's peaks, host shards pinned to the byte (saved state: test_cuda_state.py). Skipped cleanly without
CUDA.

One GPU runs one rank: the NCCL paths of several ranks (collectives on device tensors, in-place all-gather and
reduce-scatter, DCP with host-resident DTensors) are covered on CPU with gloo and by the device checks in
tests/unit/test_collectives.py."""

import lightning as L
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_chunk import ChunkOffloadStrategy, ChunkPrecision, MemoryOptions, OffloadOptions
from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.config import device_margin_bytes
from tests.compare import EXACT, assert_same_params, relative_update_error
from tests.features import needs_swap
from tests.models import TwoOptimizers, fit, quiet_trainer, token_data

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = dict(rtol=1e-4, atol=1e-5)
BIG = dict(dim=256, hidden=4096, depth=4)  # ~8.4M parameters: 134 MB of params + grads + Adam state


@pytest.mark.parametrize("placement", ["device", "host", "auto"])
def test_parity_on_cuda(placement):
    ref = fit("auto", steps=20, accelerator="gpu", gradient_clip_val=0.05)
    got = fit(
        ChunkOffloadStrategy(placement=placement, memory=MemoryOptions(chunk_numel=4096)),
        steps=20,
        accelerator="gpu",
        gradient_clip_val=0.05,
    )
    assert_same_params(ref, got, TOL)


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("variant", ["plain", "tied"])
def test_configure_model_on_meta_initialises_as_plain_lightning_builds_it_on_the_gpu(variant, placement):
    """Plain Lightning builds ``configure_model`` on the GPU (its ``tensor_init_context``): deferred initialisation
    runs each module's init there too, on the GPU's generator, so the values are bit for bit plain Lightning's
    ([Note: deferred initialisation]); on the CPU's generator they were another draw, and 10B of them took half a
    minute of one core."""
    from tests.models import DeferredNet

    def init_values(strategy) -> dict:
        L.seed_everything(7, verbose=False)
        model = DeferredNet(variant=variant)
        quiet_trainer(strategy=strategy, accelerator="gpu", max_steps=0).fit(model, token_data())
        return {k: v.cpu() for k, v in model.state_dict().items()}

    want = init_values("auto")
    got = init_values(ChunkOffloadStrategy(placement=placement, memory=MemoryOptions(chunk_numel=2048)))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_host_shard_s_compute_copy_made_on_the_gpu_is_its_master_s_in_bf16():
    """[Note: the compute copy from the values]: deferred init makes the values on the GPU, and a host shard's bf16
    copy is converted there, not from the master on the host: the same bits as converting the master."""
    from tests.models import DeferredNet

    strategy = ChunkOffloadStrategy(placement="host", memory=MemoryOptions(chunk_numel=2048))
    same: list[bool] = []

    class Look(L.Callback):
        def on_train_start(self, *_) -> None:
            for c in strategy.engine.manager.chunks:
                if c.low is not None:
                    same.append(torch.equal(c.low, c.master.to(c.low.dtype)))

    L.seed_everything(7, verbose=False)
    trainer = quiet_trainer(
        strategy=strategy, accelerator="gpu", precision="bf16-mixed", max_steps=1, callbacks=[Look()]
    )
    trainer.fit(DeferredNet(), token_data())
    assert same and all(same), same


def test_default_device_limit_is_free_memory_less_the_margin():
    """Before: None meant no limit at all, so chunk_offload never offloaded on a GPU by default."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    strategy = ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096))
    fit(strategy, steps=2, accelerator="gpu")
    limit = strategy.memory_stats()["device_memory_limit"]
    assert limit == pytest.approx(free - device_margin_bytes(total), rel=0.02)


@pytest.mark.parametrize("pin", [True, "exact"])
@pytest.mark.parametrize("extra", [{}, {"accumulate_grad_batches": 2}])
def test_host_shards_take_gradients_on_a_side_stream_in_parity(extra, pin):
    """Accumulating, gradients are staged and added on the host, in a ring: one block of torch's pinned memory, or
    one pinned to the byte ([Note: staging in a ring])."""
    ref = fit("auto", steps=12, accelerator="gpu", **extra)
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(pin_memory=pin)
    )
    got = fit(strategy, steps=12, accelerator="gpu", **extra)
    assert_same_params(ref, got, TOL)
    stats = strategy.memory_stats()
    assert stats["d2h_async_bytes"] == stats["d2h_bytes"] > 0  # every gradient copy left the compute stream


@pytest.mark.parametrize("pin", [True, "exact"])
def test_bf16_mixed_host_gradients_convert_on_the_host(pin):
    init = fit("auto", steps=0, accelerator="gpu")
    ref = fit("auto", steps=20, accelerator="gpu", precision="bf16-mixed")
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=4096), offload=OffloadOptions(pin_memory=pin)
    )
    got = fit(strategy, steps=20, accelerator="gpu", precision="bf16-mixed")
    assert relative_update_error(ref, got, init) < 0.10  # bf16 payloads; same bound as on CPU
    assert strategy.memory_stats()["d2h_async_bytes"] > 0


@pytest.mark.parametrize("native", [True, False], ids=["native", "compiled"])
def test_the_one_pass_host_step_equals_torchs_fused_kernel_on_cuda(native, monkeypatch):
    """Host shards of a bf16 run on a GPU: the pinned bf16 copy written inside the host Adam step (the native loop
    of adam_native.py, streamed past the caches, or the torch.compile kernel of host_adam.py) trains bit for bit
    like torch's fused kernel and the two-pass write-back."""
    from lightning_chunk.engine.optim import host_adam

    monkeypatch.setattr(host_adam, "NATIVE", native)
    runs = {}
    for kernel in ("fused", "one_pass"):
        strategy = ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(chunk_numel=40000), offload=OffloadOptions(optimizer_kernel=kernel)
        )
        runs[kernel] = fit(
            strategy, steps=12, accelerator="gpu", precision="bf16-mixed", model_kwargs=dict(dim=64, hidden=512)
        )
    for (n, a), b in zip(runs["fused"].named_parameters(), runs["one_pass"].parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), n


def test_fp16_mixed_with_loss_scaling_on_cuda():
    init = fit("auto", steps=0, accelerator="gpu")
    ref = fit(
        "auto",
        steps=20,
        accelerator="gpu",
        plugins=[MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda"))],
    )
    got = fit(
        ChunkOffloadStrategy(placement="auto", device_memory_limit="256MiB", memory=MemoryOptions(chunk_numel=4096)),
        steps=20,
        accelerator="gpu",
        plugins=[ChunkPrecision("16-mixed")],
    )
    assert relative_update_error(ref, got, init) < 0.05


def test_two_optimizers_on_cuda():
    def run(strategy):
        L.seed_everything(7, verbose=False)
        m = TwoOptimizers()
        quiet_trainer(accelerator="gpu", strategy=strategy, max_steps=12, limit_val_batches=0).fit(m, token_data())
        return m

    assert_same_params(
        run("auto"), run(ChunkOffloadStrategy(placement="host", memory=MemoryOptions(chunk_numel=4096))), TOL
    )


def test_model_state_larger_than_the_limit_trains_within_it():
    ref = fit("auto", steps=4, accelerator="gpu", model_kwargs=BIG)
    n = sum(p.numel() for p in ref.parameters())
    probe = ChunkOffloadStrategy(device_memory_limit="1GiB", memory=MemoryOptions(chunk_numel=1 << 20))
    fit(probe, steps=1, accelerator="gpu", model_kwargs=BIG)
    nonmodel = probe.memory_stats()["nonmodel_peak_bytes"]  # activations, cuBLAS workspaces, the batch
    room = 6 * (4 << 20)  # six 4 MiB payloads of room for chunks
    limit = nonmodel + room
    assert 16 * n > 4 * room  # parameters, gradients and Adam state are four times the room for chunks
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    strategy = ChunkOffloadStrategy(device_memory_limit=limit, memory=MemoryOptions(chunk_numel=1 << 20))
    got = fit(strategy, steps=4, accelerator="gpu", model_kwargs=BIG)
    stats = strategy.memory_stats()
    peak = torch.cuda.max_memory_allocated() - base
    assert stats["device_chunk_bytes_peak"] <= limit and stats["evictions"] > 0
    # chunk memory stays under the limit less the traced activations, so everything together stays near it
    assert peak <= limit * 1.1 + 16 * 2**20, (peak, limit, stats)
    assert_same_params(ref, got, TOL)


class Spiky(nn.Module):
    """A module that holds a large temporary only while it runs (like attention scores)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        scratch = torch.ones(64 << 18, device=x.device)  # 64 MiB, freed before the module returns
        return self.lin(x) + scratch[:1].sum() * 0


def test_tracer_sees_a_peak_inside_a_module():
    """Before: memory was read at the hooks only, and a module's transient 64 MiB was invisible to placement."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), Spiky(), nn.Linear(64, 64)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ChunkEngine(
        m,
        [opt],
        config=ChunkConfig(placement="auto", chunk_numel=8192, device_memory_limit=512 << 20),
        device=torch.device("cuda"),
    )
    with eng.micro_batch(training=True):
        loss = m(torch.randn(8, 64, device="cuda")).sum()
    loss.backward()
    eng.prepare_step()
    assert eng.hooks.moments.trace is not None and eng.hooks.moments.trace.nonmodel_peak_bytes >= 64 << 20
    eng.teardown()


def test_host_chunks_step_on_a_thread_beside_backward_by_default_as_on_the_autograd_thread():
    """[Note: the host Adam beside backward]: on a GPU, ``step_in_backward=True`` hands each host chunk's step to the
    worker (``step_thread=None``); the parameters are those of stepping on the autograd thread, bit for bit."""
    kw = dict(steps=8, accelerator="gpu", precision="bf16-mixed", model_kwargs=dict(dim=64, hidden=1024))

    def run(thread):
        strategy = ChunkOffloadStrategy(
            placement="host",
            step_in_backward=True,
            memory=MemoryOptions(chunk_numel=66560),
            offload=OffloadOptions(step_thread=thread),
        )
        return fit(strategy, **kw), strategy.memory_stats()

    (want, _), (got, stats) = run(False), run(None)
    assert stats["chunks_stepped_on_thread"] == stats["chunks_stepped_in_backward"] > 0
    assert stats["grad_copies_handed_over"] > 0  # the worker lands them ([Note: gradients landed beside backward])
    assert_same_params(want, got, EXACT)


@pytest.mark.parametrize("pin", [True, "exact"])
def test_host_chunks_step_from_bf16_gradients_copied_straight_into_pinned_memory(pin):
    """[Note: gradients in bf16 until the step] on a GPU: each host chunk's bf16 gradients go on the side stream
    straight into a pinned bf16 buffer (no staging, no widening), and the worker steps the chunk from them with the
    native loop; the parameters are those of stepping after backward from fp32 shards, bit for bit."""
    kw = dict(steps=8, accelerator="gpu", precision="bf16-mixed", model_kwargs=dict(dim=64, hidden=1024))

    def run(early):
        offload = OffloadOptions(optimizer_kernel="one_pass", pin_memory=pin)
        memory = MemoryOptions(chunk_numel=66560)
        strategy = ChunkOffloadStrategy(placement="host", step_in_backward=early, memory=memory, offload=offload)
        return fit(strategy, **kw), strategy.memory_stats()

    (want, _), (got, stats) = run(False), run(True)
    assert stats["chunks_stepped_from_bf16_grads"] == stats["chunks_stepped_on_thread"] > 0
    assert stats["d2h_async_bytes"] > 0 and "chunks_widened_to_fp32" in stats
    assert_same_params(want, got, EXACT)


def test_pageable_host_shards_stepped_in_backward_train_as_stepping_after_it():
    """The campaign's largest try holds its host shards pageable where pinning to the byte was not checked and its
    plan fits more layers than torch's pinned blocks (``choose_pinning``): copies from and to pageable memory run on
    the compute stream, chunks still step in backward, bit for bit as stepping after backward does."""
    kw = dict(steps=8, accelerator="gpu", precision="bf16-mixed", model_kwargs=dict(dim=64, hidden=1024))

    def run(early):
        offload = OffloadOptions(pin_memory=False)
        memory = MemoryOptions(chunk_numel=66560)
        strategy = ChunkOffloadStrategy(placement="host", step_in_backward=early, memory=memory, offload=offload)
        return fit(strategy, **kw), strategy.memory_stats()

    (want, _), (got, stats) = run(False), run(True)
    assert stats["chunks_stepped_in_backward"] > 0 and stats["d2h_async_bytes"] == 0 < stats["d2h_bytes"]
    assert_same_params(want, got, EXACT)


@pytest.mark.parametrize("fp16", [False, True], ids=["clip_norm", "fp16"])
def test_a_guess_stepped_on_the_thread_beside_backward_trains_as_stepping_after_it(fp16):
    """[Note: speculating past the norm and the overflow] on a GPU: host chunks step on the worker on a guess,
    undone where the norm clips or fp16 overflowed; the parameters are those of stepping after backward, bit for bit.
    Every guess clips here. Each fit takes a plugin of its own: a plugin's loss scaler keeps its scale from one fit to
    the next, as Lightning's does, so one shared (until 2026-12-06) started the second fit lower and made it skip
    other steps (failed on an H200 on 2026-12-04, and on CPU with the worker on)."""

    def run(early):
        strategy = ChunkOffloadStrategy(
            placement="host", step_in_backward=early, memory=MemoryOptions(chunk_numel=66560)
        )
        kw = (
            dict(plugins=[ChunkPrecision("16-mixed", init_scale=1e7, fp32_embeddings_and_norms=False)])
            if fp16  # every payload in fp16: overflows after chunks stepped on the guess
            else dict(precision="bf16-mixed", gradient_clip_val=0.05)
        )
        model = fit(strategy, steps=8, accelerator="gpu", model_kwargs=dict(dim=64, hidden=1024), **kw)
        return model, strategy.memory_stats()

    (want, plain), (got, stats) = run(False), run(True)
    assert stats["chunks_stepped_on_thread"] > 0
    assert stats["speculation_rollbacks"] > 0 or fp16
    assert not fp16 or stats["loss_scale"] == plain["loss_scale"]
    assert_same_params(want, got, EXACT)


@pytest.mark.parametrize("name", ["AdafactorNet", "MuonNet"])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_whole_parameter_optimizers_on_cuda_step_in_backward_as_after_it(name, placement):
    """[Note: optimizers that need whole parameters] on a GPU: torch's Adafactor and Muon on one rank step each
    chunk in backward (host chunks on the worker thread, Muon's Newton-Schulz on the device) to the bits of stepping
    after backward, and after backward to plain Lightning's within fp32 rounding."""
    from tests import optimizer_models

    cls = getattr(optimizer_models, name)
    kw = dict(steps=8, accelerator="gpu", cls=cls, model_kwargs=dict(dim=64, hidden=1024))

    def run(early):
        strategy = ChunkOffloadStrategy(
            placement=placement, step_in_backward=early, memory=MemoryOptions(chunk_numel=66560)
        )
        return fit(strategy, **kw), strategy.memory_stats()

    (after, _), (early, stats) = run(False), run(True)
    assert stats["chunks_stepped_in_backward"] > 0
    assert_same_params(after, early, EXACT)
    assert_same_params(fit("auto", **kw), after, TOL)


def test_exact_pinned_tensors_are_page_locked_copy_asynchronously_and_unregister():
    """[Note: exact pinned memory]: a tensor registered with cudaHostRegister is pinned as torch sees it, copies both
    ways, and its registration goes with it (the next mapping, often at the same address, registers again)."""
    from lightning_chunk.engine.system.exact_pinned import ExactPinned

    pinned = ExactPinned()
    for _ in range(3):
        t = pinned.empty((64 << 20) // 2 + 1, torch.bfloat16)  # torch's allocator would take 128 MiB
        assert t.is_pinned() and pinned.live_bytes == t.numel() * 2
        t.copy_(torch.arange(t.numel()) % 251)
        d = t.to("cuda", non_blocking=True)
        back = pinned.empty(t.numel(), torch.bfloat16)
        back.copy_(d, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, t)
        del t, d, back
        assert pinned.live_bytes == 0


def test_host_shards_pinned_to_the_byte_train_as_torch_s_pinned_blocks():
    """``pin_memory="exact"``: every host buffer is page-locked, exactly its bytes are registered, gradients leave on
    the side stream, training matches torch's pinned blocks to the bit, and nothing stays registered after."""
    import gc

    from lightning_chunk.engine.chunks.chunk import Tier
    from tests.engine_steps import step

    xs = [torch.randn(8, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(4)]

    def run(pin):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        config = ChunkConfig(placement="host", chunk_numel=70_000, pin_memory=pin)
        eng = ChunkEngine(model, [opt], config=config, device=torch.device("cuda"))
        for x in xs:
            step(eng, model, opt, x)
        return eng

    ref = run(True)
    want = ref.full_state_dict()
    ref.teardown()
    eng = run("exact")
    exact = eng.manager.tiers.host.exact
    buffers = [t for c in eng.manager.chunks for t in (c.master, c.low, c.grad) if t is not None]
    assert all(c.shard_tier is Tier.HOST for c in eng.manager.chunks) and all(t.is_pinned() for t in buffers)
    stats = eng.memory_stats()
    assert exact is not None and stats["exact_pinned_bytes"] == sum(t.untyped_storage().nbytes() for t in buffers)
    assert stats["d2h_async_bytes"] > 0
    got = eng.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    eng.teardown()
    del eng, buffers
    gc.collect()
    assert exact.live_bytes == 0


@needs_swap
def test_host_gradient_shards_pinned_to_the_byte_are_given_back_stepping_in_backward():
    """[Note: gradient shards pinned to the byte] on a GPU: stepping in backward, each host gradient shard's registered
    block goes to the host pool (at most four of a size) and back, gradients still land in it on the side stream, and
    training matches stepping after backward in torch's pinned blocks to the bit. The set-up registers the masters and
    compute copies alone ([Note: gradient shards made for their views])."""
    from lightning_chunk.engine.chunks.chunk import Tier
    from tests.engine_steps import step

    xs = [torch.randn(8, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(4)]
    at_set_up = []

    def run(pin, early):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        config = ChunkConfig(placement="host", chunk_numel=70_000, pin_memory=pin, step_in_backward=early)
        eng = ChunkEngine(model, [opt], config=config, device=torch.device("cuda"))
        at_set_up.append(eng.memory_stats()["exact_pinned_bytes"])
        for x in xs:
            step(eng, model, opt, x, through_engine=True)  # as Lightning's precision steps it
        return eng

    ref = run(True, False)
    want = ref.full_state_dict()
    ref.teardown()
    eng = run("exact", True)
    chunks, stats = eng.manager.chunks, eng.memory_stats()
    assert len(chunks) == 8 and all(c.shard_tier is Tier.HOST for c in chunks)
    assert stats["chunks_stepped_in_backward"] > 0 and stats["d2h_async_bytes"] > 0
    assert all(c.grad_released and c.grad.untyped_storage().nbytes() == 0 for c in chunks)
    held = sum(t.untyped_storage().nbytes() for c in chunks for t in (c.master, c.low) if t is not None)
    pooled = eng.manager.grads.host_pool.pooled_bytes
    assert stats["exact_pinned_bytes"] == held + pooled and 0 < pooled <= 4 * chunks[0].grad.numel() * 4
    assert at_set_up[-1] == held
    got = eng.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    eng.teardown()


def test_auto_leaves_the_chunks_backward_finishes_first_on_the_host_when_they_step_beside_it():
    """[Note: which chunks the host gets] on a GPU: stepping in backward the worker is on by default, and auto gives
    the device's room to the first chunks in use order; the host chunks, the last ones, step on the worker. Within
    fp32 rounding of stepping after backward, whose host chunks are the first ones (the host and the GPU round their
    Adam steps apart)."""
    kw = dict(steps=6, accelerator="gpu", model_kwargs=BIG)
    probe = ChunkOffloadStrategy(device_memory_limit="1GiB", memory=MemoryOptions(chunk_numel=1 << 20))
    fit(probe, steps=1, **{k: v for k, v in kw.items() if k != "steps"})
    limit = probe.memory_stats()["nonmodel_peak_bytes"] + 24 * (4 << 20)  # room for about half the shards (16 MiB each)

    def run(early):
        tiers: list[str] = []

        class Tiers(L.Callback):
            def on_train_end(self, *_: object) -> None:
                tiers.append("".join(c.shard_tier.name[0] for c in strategy.engine.manager.chunks))

        strategy = ChunkOffloadStrategy(
            device_memory_limit=limit, step_in_backward=early, memory=MemoryOptions(chunk_numel=1 << 20)
        )
        return fit(strategy, callbacks=[Tiers()], **kw), strategy.memory_stats(), tiers[0]

    (want, _, after), (got, stats, beside) = run(False), run(True)
    assert stats["chunks_stepped_on_thread"] > 0 and "H" in beside and "D" in beside
    # in use order; a small chunk may take room the greedy fill left, wherever it is
    assert beside.startswith("DD") and after.startswith("H") and after.endswith("DD"), (beside, after)
    assert_same_params(want, got, TOL)
