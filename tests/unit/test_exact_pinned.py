"""``pin_memory="exact"``: host tensors page-locked to the byte, registered once and unregistered when their last
view goes ([Note: exact pinned memory]). CUDA's registration is faked here to follow the lifetime on a CPU; the real
one runs in tests/gpu/test_cuda.py."""

import collections
import gc

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig
from lightning_chunk.engine.chunks.chunk import Tier
from lightning_chunk.engine.system import torch_features
from lightning_chunk.engine.system.exact_pinned import ExactPinned
from lightning_chunk.engine.tiers.storage import HostStorage
from tests.engine_steps import train_beside_torch
from tests.features import needs_swap


class Registry:
    """What a fake ``cudaHostRegister`` saw: ranges registered now, and every call."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, ptr: int, nbytes: int) -> None:
        assert all(ptr + nbytes <= p or p + n <= ptr for p, n in self.live.items()), "overlaps a registered range"
        self.live[ptr] = nbytes
        self.calls.append(("register", ptr))

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, "unregistered twice, or never registered"
        del self.live[ptr]
        self.calls.append(("unregister", ptr))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_tensor_is_registered_to_the_byte_and_unregistered_with_its_last_view(dtype):
    reg = Registry()
    pinned = ExactPinned(reg.register, reg.unregister)
    t = pinned.empty(1001, dtype)
    assert t.shape == (1001,) and t.dtype == dtype and t.device.type == "cpu"
    assert list(reg.live.values()) == [1001 * dtype.itemsize] == [pinned.live_bytes]
    assert reg.live.keys() == {t.data_ptr()}
    t.fill_(3)
    view = t[10:20]
    del t
    gc.collect()
    assert reg.live and torch.equal(view, torch.full((10,), 3, dtype=dtype))  # a view keeps it registered
    del view
    assert not reg.live and pinned.live_bytes == 0
    assert [c for c, _ in reg.calls] == ["register", "unregister"]


def resident_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(pages resident, pages) of the page-aligned range: ``mincore``."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), pages


def test_its_pages_are_touched_before_they_are_registered():
    """[Note: exact pinned memory]: the first touch runs on torch's threads, not inside cudaHostRegister, which
    faults the pages in on one thread. Every page is there when the registration comes."""
    seen: list[tuple[int, int]] = []
    pinned = ExactPinned(lambda ptr, n: seen.append(resident_pages(ptr, n)), lambda ptr: None)
    t = pinned.empty((8 << 20) // 4 + 5, torch.float32)
    assert seen[0][0] == seen[0][1] > 2048 and bool((t == 0).all())


def test_its_storage_keeps_its_bytes_when_asked_to_resize_as_a_pinned_block_does():
    reg = Registry()
    t = ExactPinned(reg.register, reg.unregister).empty(64, torch.float32)
    with pytest.raises(RuntimeError, match="not resizable"):
        t.untyped_storage().resize_(0)  # ``free_storage`` and ``Chunk.release_grad`` leave it to the last view
    assert t.untyped_storage().nbytes() == 256 and reg.live


def test_a_failed_registration_raises_and_leaves_nothing_registered():
    reg = Registry()

    def refuse(ptr: int, nbytes: int) -> None:
        raise RuntimeError(f"pin_memory='exact': cudaHostRegister of {nbytes} bytes failed")

    pinned = ExactPinned(refuse, reg.unregister)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 400 bytes failed"):
        pinned.empty(100, torch.float32)
    gc.collect()
    assert not reg.calls and pinned.live_bytes == 0


def test_an_empty_tensor_registers_nothing():
    reg = Registry()
    assert ExactPinned(reg.register, reg.unregister).empty(0, torch.float32).numel() == 0 and not reg.calls


@pytest.mark.parametrize("bad", ["yes", 1, "Exact", None])
def test_pin_memory_names_what_is_allowed(bad):
    with pytest.raises(ValueError, match=rf"pin_memory={bad!r} is not allowed; it must be True .* 'exact'"):
        ChunkConfig(pin_memory=bad)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def same_as_torch_then_torn_down(eng, ref: nn.Module) -> None:  # noqa: ANN001
    sd = eng.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)
    eng.teardown()


@pytest.fixture
def exact_host(monkeypatch) -> tuple[Registry, ExactPinned]:
    """Every engine's host tier allocates from one exact allocator whose registration is faked (a CPU device never
    pins)."""
    reg = Registry()
    exact = ExactPinned(reg.register, reg.unregister)
    init = HostStorage.__init__

    def host(self, *, pinned, exact_=None, device=None):  # noqa: ANN001
        init(self, pinned="exact", exact=exact)

    monkeypatch.setattr(HostStorage, "__init__", host)
    return reg, exact


def test_host_shards_in_exact_pinned_memory_train_as_torch_and_are_all_unregistered(exact_host):
    """The host tier's buffers (master and gradient here) come from the exact allocator: training is unchanged, the
    registered bytes are the host shards' to the byte while training (the warm-up's repack freed the first layout's
    as it went), and nothing stays registered once the engine and the model are gone."""
    reg, exact = exact_host
    torch.manual_seed(0)
    m, ref = Net(), Net()
    eng, opt = train_beside_torch(m, ref, ChunkConfig(placement="host", chunk_numel=300, check_invariants=True))
    chunks = eng.manager.chunks
    assert all(c.shard_tier is Tier.HOST for c in chunks)
    held = sum(t.untyped_storage().nbytes() for c in chunks for t in (c.master, c.low, c.grad) if t is not None)
    assert exact.live_bytes == sum(reg.live.values()) == held == eng.memory_stats()["exact_pinned_bytes"] > 0
    same_as_torch_then_torn_down(eng, ref)
    del eng, opt, chunks, m
    gc.collect()
    assert not reg.live and exact.live_bytes == 0
    assert sum(c == "register" for c, _ in reg.calls) == sum(c == "unregister" for c, _ in reg.calls) > 2


def test_a_fit_with_host_shards_pinned_to_the_byte_saves_and_resumes_as_plain_lightning(exact_host, tmp_path):
    """What a user runs: the automatic chunk size, a tied head, accumulation, ``save_checkpoint`` after 4 steps and a
    resume to 8, every shard in exact pinned memory: the parameters plain Lightning's save and resume reach, and
    nothing registered once both fits are over."""
    import lightning as L

    from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
    from tests.compare import EXACT, assert_same_params
    from tests.models import ParityNet, quiet_trainer, token_data

    def run(strategy, path):
        L.seed_everything(7, verbose=False)
        model = ParityNet(variant="tied")
        trainer = quiet_trainer(strategy=strategy(), max_steps=4, accumulate_grad_batches=2, limit_val_batches=0)
        trainer.fit(model, token_data())
        trainer.save_checkpoint(path)
        L.seed_everything(7, verbose=False)
        model = ParityNet(variant="tied")
        trainer = quiet_trainer(strategy=strategy(), max_steps=8, accumulate_grad_batches=2, limit_val_batches=0)
        trainer.fit(model, token_data(), ckpt_path=path)
        return model

    ref = run(lambda: "auto", tmp_path / "ref.ckpt")
    got = run(
        lambda: ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop")),
        tmp_path / "got.ckpt",
    )
    assert_same_params(ref, got, EXACT)
    reg, exact = exact_host
    gc.collect()
    assert not reg.live and exact.live_bytes == 0 and sum(c == "register" for c, _ in reg.calls) > 2


def test_a_background_save_copies_device_shards_into_host_memory_pinned_as_the_host_shards_are():
    """Before, they were pinned by torch's allocator whatever ``pin_memory`` said, ``False`` included."""
    import types

    from lightning_chunk.engine.state.background_save import BackgroundSave

    def host_like(host: HostStorage) -> torch.Tensor:
        save = BackgroundSave.__new__(BackgroundSave)
        save.job = types.SimpleNamespace(mgr=types.SimpleNamespace(tiers=types.SimpleNamespace(host=host)))
        return save._host_like(torch.empty(3, 5, dtype=torch.bfloat16))

    reg = Registry()
    t = host_like(HostStorage(pinned="exact", exact=ExactPinned(reg.register, reg.unregister)))
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and list(reg.live.values()) == [30]
    t = host_like(HostStorage(pinned=False))
    assert t.shape == (3, 5) and not t.is_pinned()


def test_cuda_registration_is_portable_and_unregistration_waits_for_the_rank_s_gpu(monkeypatch):
    """``__del__`` runs on whichever thread drops the last view, whose current device may be GPU 0: the wait before
    unregistering names the rank's GPU, and the registration holds for every device's context. CUDA faked."""
    calls: list[tuple] = []

    class CudaRT:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister",))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", CudaRT)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    gpu = torch.device("cuda", 5)
    t = ExactPinned(device=gpu).empty(10, torch.float32)
    del t
    gc.collect()
    assert calls == [("register", 40, 1), ("synchronize", gpu), ("unregister",)]  # 1: cudaHostRegisterPortable


def test_without_swapping_storages_host_gradient_shards_pinned_to_the_byte_keep_their_bytes(exact_host, monkeypatch):
    """[Note: torch versions]: a torch before 2.12 cannot move a block pinned to the byte out of its storage, nor
    resize it. Stepping in backward, each host gradient shard is then the tier's from set-up on and keeps its bytes
    (what ``plan`` counts there): the set-up's pageable stand-in would have been refilled pageable, so the gradients'
    copies from a GPU would have gone to pageable memory. Training is torch's."""
    reg, exact = exact_host
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", False)
    torch.manual_seed(0)
    m, ref = Net(), Net()
    config = ChunkConfig(
        placement="host", chunk_numel=300, step_in_backward=True, check_invariants=True, optimizer_kernel="loop"
    )
    eng, _ = train_beside_torch(m, ref, config, steps=4, through_engine=True)
    chunks = eng.manager.chunks
    assert eng.memory_stats()["chunks_stepped_in_backward"] > 0
    held = sum(t.untyped_storage().nbytes() for c in chunks for t in (c.master, c.low, c.grad) if t is not None)
    grads = sum(c.grad.untyped_storage().nbytes() for c in chunks)
    assert grads == sum(c.grad.numel() * 4 for c in chunks) > 0  # every gradient shard kept, pinned to the byte
    assert exact.live_bytes == held and eng.manager.grads.host_pool.pooled_bytes == 0
    same_as_torch_then_torn_down(eng, ref)


@needs_swap
def test_host_gradient_shards_pinned_to_the_byte_are_given_back_when_stepping_in_backward(exact_host):
    """[Note: gradient shards pinned to the byte]: stepping in backward, a host gradient shard's registered block moves
    to the host pool and back, so between steps the registered bytes are the masters and the pool's few blocks, not
    every gradient shard (before, all of them); the warm-up, which steps after backward, gives each back as its chunk
    steps; the steps after the second register nothing; training is torch's."""
    reg, exact = exact_host
    torch.manual_seed(0)

    def deep() -> nn.Module:  # a chunk a layer (300 elements at most): eight of one size
        return nn.Sequential(nn.Linear(8, 16), *(nn.Linear(16, 16) for _ in range(8)), nn.Linear(16, 8))

    m, ref = deep(), deep()
    config = ChunkConfig(
        placement="host", chunk_numel=300, step_in_backward=True, check_invariants=True, optimizer_kernel="loop"
    )
    registered: list[int] = []
    live: list[int] = []

    def after_step() -> None:
        registered.append(len(reg.calls))
        live.append(exact.live_bytes)

    eng, opt = train_beside_torch(m, ref, config, steps=4, after_step=after_step, through_engine=True)
    chunks = eng.manager.chunks
    assert len(chunks) == 10 and all(c.shard_tier is Tier.HOST and c.grad_released for c in chunks)
    assert eng.memory_stats()["chunks_stepped_in_backward"] > 0
    masters = sum(c.master.untyped_storage().nbytes() for c in chunks)
    grads = sum(c.grad.numel() * 4 for c in chunks)
    pooled = eng.manager.grads.host_pool.pooled_bytes
    assert all(c.grad.untyped_storage().nbytes() == 0 for c in chunks)
    sizes = collections.Counter(c.grad.numel() * 4 for c in chunks)
    assert max(sizes.values()) > 4  # the pool keeps at most four blocks of a size; here those in flight at once
    assert exact.live_bytes == masters + pooled and 0 < pooled <= sum(n * min(k, 4) for n, k in sizes.items())
    assert pooled < grads / 4
    assert registered[1] == registered[2] == registered[3]  # the pool served every gradient shard
    # the warm-up steps after backward: each gradient shard went as its chunk stepped, none beside Adam's new state
    assert live[0] == masters
    same_as_torch_then_torn_down(eng, ref)
    del eng, opt, chunks, m
    gc.collect()
    assert not reg.live and exact.live_bytes == 0


@needs_swap
def test_stepping_in_backward_a_set_up_pins_no_gradient_shard(exact_host):
    """[Note: gradient shards made for their views]: a set-up stepping in backward gives each gradient shard back once
    packed, so it registers the masters alone (before, every gradient shard too, unregistered at once); the shards
    stay views of one storage each, and the first gradients bring registered memory (the test above trains it)."""
    from lightning_chunk.engine import ChunkEngine

    reg, exact = exact_host
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters())
    config = ChunkConfig(placement="host", chunk_numel=300, step_in_backward=True)
    eng = ChunkEngine(model, [opt], config=config)
    chunks = eng.manager.chunks
    masters = [c.master.untyped_storage().nbytes() for c in chunks]
    assert len(chunks) == 4 and all(c.grad_released and c.grad.untyped_storage().nbytes() == 0 for c in chunks)
    assert [c for c, _ in reg.calls] == ["register"] * 4 and sorted(reg.live.values()) == sorted(masters)
    eng.teardown()


def test_a_speculated_step_keeps_the_gradient_shards_pinned_to_the_byte_and_trains_as_plain_lightning(exact_host):
    """Clipping by norm while stepping in backward speculates ([Note: speculating past the norm and the overflow]):
    every gradient shard is held until ``optimizer.step()``, after which one pinned to the byte keeps its bytes
    (registering it again at the next backward would cost more): nothing is registered after the warm-up's repack,
    and the parameters are plain Lightning's."""
    import lightning as L

    from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
    from tests.compare import EXACT, assert_same_params
    from tests.models import fit

    reg, _ = exact_host
    calls: list[int] = []

    class Count(L.Callback):
        def on_train_batch_end(self, *_: object) -> None:
            calls.append(sum(c == "register" for c, _ in reg.calls))

    kw = dict(steps=6, gradient_clip_val=0.05)
    ref = fit("auto", **kw)
    strategy = ChunkOffloadStrategy(
        placement="host", step_in_backward=True, offload=OffloadOptions(optimizer_kernel="loop")
    )
    got = fit(strategy, callbacks=[Count()], **kw)
    assert strategy.memory_stats()["speculation_rollbacks"] > 0
    assert calls[1] == calls[-1]
    assert_same_params(ref, got, EXACT)


def test_torch_s_pinned_cache_is_emptied_after_the_first_step_in_a_fit_stepping_in_backward(monkeypatch):
    """The first step (the warm-up's, after backward) gives each gradient shard back as it makes the optimizer state;
    torch's pinned blocks go to its cache, which kept them beside that state until emptied. Once after that step (the
    repack's own emptying comes before it), never in a steady step. Counted, not run (no CUDA here)."""
    from lightning_chunk.engine.runtime import engine as engine_module
    from tests.engine_steps import step

    calls: list[int] = []
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    eng = engine_module.ChunkEngine(model, [opt], config=ChunkConfig(placement="host", step_in_backward=True))
    monkeypatch.setattr(engine_module, "release_pinned_cache", lambda: calls.append(len(calls)))
    counts = []
    for i in range(3):
        step(eng, model, opt, torch.randn(3, 8, generator=torch.Generator().manual_seed(i)), through_engine=True)
        counts.append(len(calls))
    assert counts == [1, 1, 1]  # after the first step only (the layout stayed: no repack emptied it)
