"""The disk tier's I/O: its thread and the cores it takes and gives back, gradients written back beside backward,
reads ahead, O_DIRECT in whole pages; each bit-exact with training in memory. The tier's training, resume, errors
and clean-up: ``test_disk_tier.py``."""

import os
from pathlib import Path

import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
from tests.integration.test_disk_tier import CASES, STEPS, disk
from tests.integration.test_parity import BIG, EXACT, assert_same_params
from tests.models import ReorderedNet, fit


def test_the_io_thread_gets_a_core_and_the_threads_come_back(tmp_path, monkeypatch):
    """While disk chunks step, torch's threads plus the I/O thread fit the cores; the count is restored after,
    also when the block raises, and left alone where the cores outnumber torch's threads."""
    from lightning_chunk.engine.tiers.disk_io import beside_io

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
        with beside_io():
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 4
        with pytest.raises(RuntimeError, match="boom"), beside_io():
            assert torch.get_num_threads() == 3
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 4
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        with beside_io():
            assert torch.get_num_threads() == 1
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
        with beside_io():
            assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_fused_adam_bits_do_not_depend_on_the_thread_count():
    """What lets ``beside_io`` lower the threads: torch's fused CPU Adam gives the same bits on one thread as on
    several, for a tensor large enough to be split (and not a multiple of the vector width)."""
    numel = (1 << 20) + 13

    def run(threads: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(numel, generator=g))
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=True)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for _ in range(3):
                p.grad = torch.randn(numel, generator=g)
                opt.step()
        finally:
            torch.set_num_threads(before)
        return p.detach().clone()

    one, several = run(1), run(max(2, os.cpu_count() or 2))
    assert torch.equal(one, several)


def test_threads_are_lowered_only_for_kernels_whose_bits_ignore_them():
    """Fused Adam(W) splits at cache lines; torch's other kernels split element-wise loops anywhere, where a scalar
    tail may round otherwise, so with them the disk chunks step on torch's usual threads."""
    from lightning_chunk.engine.optim.kernels import split_at_cache_lines

    p = [torch.nn.Parameter(torch.zeros(4))]
    assert split_at_cache_lines(torch.optim.AdamW(p, fused=True))
    assert split_at_cache_lines(torch.optim.Adam(p, fused=True))
    assert not split_at_cache_lines(torch.optim.AdamW(p, foreach=True))
    assert not split_at_cache_lines(torch.optim.AdamW(p, foreach=False))
    assert not split_at_cache_lines(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    mixed = torch.optim.AdamW(
        [{"params": p, "fused": True}, {"params": [torch.nn.Parameter(torch.zeros(2))], "foreach": True}]
    )
    assert not split_at_cache_lines(mixed)


def test_the_default_kernel_steps_disk_chunks_beside_the_io_thread_bit_exact(tmp_path, monkeypatch):
    """The user's defaults (``optimizer_kernel="auto"``: fused AdamW, the automatic chunk size, a model used in
    another order than registered, accumulation): the disk chunks step with torch's threads lowered beside the I/O
    thread, and training equals the same strategy with every shard in memory, bit for bit."""
    import contextlib

    from lightning_chunk.engine.optim import disk_stepper

    seen: list[int] = []
    inner = disk_stepper.beside_io

    @contextlib.contextmanager
    def spy():
        with inner():
            seen.append(torch.get_num_threads())
            yield

    monkeypatch.setattr(disk_stepper, "beside_io", spy)
    kw = dict(cls=ReorderedNet, model_kwargs=dict(dim=64, hidden=512, depth=3), accumulate_grad_batches=2)
    ref = fit(ChunkOffloadStrategy(), steps=STEPS, **kw)
    assert not seen  # no disk tier, no I/O thread
    strategy = ChunkOffloadStrategy(host_memory_limit="2MB", offload=OffloadOptions(disk_dir=tmp_path / "scratch"))
    got = fit(strategy, steps=STEPS, **kw)
    assert_same_params(ref, got, EXACT)
    assert seen, "fused AdamW over disk chunks must step beside the I/O thread"
    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    assert set(seen) == {max(1, min(threads, cores - 1))}
    s = strategy.memory_stats()
    assert s["disk_shards"] > 0 and s["disk_staged_steps"] > 0


def _grad_chunk(storage, numel):
    """A stand-in for a disk chunk with a gradient file of ``numel`` fp32 elements (what ``DiskStorage`` reads of
    it)."""
    from types import SimpleNamespace

    c = SimpleNamespace(chunk_id=0, shard_numel=numel, grad_written=False, world_size=1, tensors=[])
    c.grad = storage.alloc(c, "grad", numel, torch.float32)
    return c


def test_a_gradient_write_back_leaves_backward_running_and_every_reader_sees_it(tmp_path, monkeypatch):
    """[Note: gradient write-backs off the step]: ``grads_done`` returns while the I/O thread writes; a use of
    the file through the mapping waits for the write and sees its bytes; the end of backward waits for every
    write and raises the error of one that failed."""
    import threading

    from lightning_chunk.engine.tiers import disk as disk_mod
    from lightning_chunk.engine.tiers.disk_storage import DiskStorage
    from lightning_chunk.engine.tiers.storage import HostStorage

    storage = DiskStorage(str(tmp_path), 0, HostStorage(pinned=False))
    gate, written = threading.Event(), threading.Event()
    inner = disk_mod.MappedFile.write_from

    def slow_write(self, buf, **kw):
        assert gate.wait(10)
        inner(self, buf, **kw)
        written.set()

    monkeypatch.setattr(disk_mod.MappedFile, "write_from", slow_write)
    try:
        c = _grad_chunk(storage, 1000)
        storage.grads.target(c).copy_(torch.arange(1000, dtype=torch.float32))
        storage.grads.done(c)  # returns with the write held at the gate
        assert not written.is_set()
        threading.Timer(0.2, gate.set).start()
        with storage.reading(c, ("grad",)):
            assert written.is_set()
            assert torch.equal(c.grad, torch.arange(1000, dtype=torch.float32))

        def failing_write(self, buf, **kw):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(disk_mod.MappedFile, "write_from", failing_write)
        storage.grads.target(c).fill_(1.0)
        storage.grads.done(c)
        with pytest.raises(OSError, match="Input/output error"):
            storage.settle_grads()
    finally:
        gate.set()
        storage.close()


def test_reads_ahead_are_asked_once_a_use_and_only_for_files_on_disk(tmp_path, monkeypatch):
    """[Note: the gathers' reads ahead of use]: the kernel is asked (on the I/O thread) to read a master file
    ahead once until a gather reads it; a chunk with no master file on disk asks nothing."""
    from types import SimpleNamespace

    from lightning_chunk.engine.tiers import disk as disk_mod
    from lightning_chunk.engine.tiers.disk_storage import DiskStorage
    from lightning_chunk.engine.tiers.storage import HostStorage

    storage = DiskStorage(str(tmp_path), 0, HostStorage(pinned=False))
    asked = []
    monkeypatch.setattr(disk_mod.MappedFile, "will_need", lambda self: asked.append(self.path.name))
    try:
        c = SimpleNamespace(chunk_id=3, shard_numel=64)
        master = storage.alloc(c, "master", 64, torch.float32)
        master.copy_(torch.linspace(0, 1, 64))
        storage.read_ahead_master(c)
        storage.read_ahead_master(c)
        storage.flush()  # the asking runs on the I/O thread
        assert len(asked) == 1 and asked[0].endswith("master.bin")
        dst = torch.empty(64)
        assert storage.read_master_into(c, dst) and torch.equal(dst, torch.linspace(0, 1, 64))
        storage.read_ahead_master(c)  # the next use asks again
        storage.read_ahead_master(SimpleNamespace(chunk_id=4, shard_numel=64))
        storage.flush()
        assert len(asked) == 2
    finally:
        storage.close()


def o_direct_works(directory: Path) -> bool:
    probe = directory / "o_direct_probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def test_o_direct_transfers_move_whole_pages_in_pieces_and_the_mapping_sees_them(tmp_path, monkeypatch):
    """[Note: O_DIRECT where the page cache cannot hold the files]: a file of an odd size moves as whole pages, in
    pieces on a pool, to and from page-aligned buffers; its mapping sees what went past the page cache and the
    other way round; a buffer that is not page-aligned goes through the page cache and says so."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning_chunk.engine.tiers import disk as disk_mod

    if not o_direct_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(disk_mod, "DIRECT_PIECE", 2 * 4096)  # several pieces a file
    nbytes = 5 * 4096 + 123
    f = disk_mod.MappedFile(tmp_path / "f.bin", nbytes)
    assert os.path.getsize(f.path) == 6 * 4096
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    with ThreadPoolExecutor(3) as pool:
        buf = disk_mod.aligned_empty(nbytes)
        assert buf.data_ptr() % 4096 == 0 and buf.numel() == 6 * 4096
        buf[:nbytes] = data
        assert f.write_from(buf, direct=True, pool=pool)
        assert torch.equal(f.tensor(nbytes, torch.uint8), data)  # the mapping reads what went past the cache
        f.tensor(nbytes, torch.uint8)[:100] = 7  # written through the mapping: a dirty cached page
        back = disk_mod.aligned_empty(nbytes)
        assert f.read_into(back, direct=True, pool=pool)
        assert torch.equal(back[:100], torch.full((100,), 7, dtype=torch.uint8))
        assert torch.equal(back[100:nbytes], data[100:])
        raw = torch.empty(nbytes + 2 * 4096, dtype=torch.uint8)
        skip = -raw.data_ptr() % 4096 + 64
        odd = raw[skip : skip + nbytes]  # 64 bytes past a page boundary
        assert not f.read_into(odd, direct=True, pool=pool)  # not page-aligned: through the page cache
        assert torch.equal(odd, back[:nbytes])
    f.close()


@pytest.mark.parametrize("disk_io", ["direct", "auto"])
def test_o_direct_trains_bit_exact_with_memory_and_auto_takes_it_where_memory_is_short(tmp_path, monkeypatch, disk_io):
    """The disk tier past the page cache equals plain Lightning bit for bit (with accumulation and tied weights:
    gradient files read back, written, staged); ``auto`` takes it where the page cache has no room for the files
    (faked) and stays buffered where it has."""
    from lightning_chunk.engine.tiers import disk_storage

    if not o_direct_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    if disk_io == "auto":
        monkeypatch.setattr(disk_storage, "page_cache_room", lambda: 1 << 20)
    kw = dict(CASES["accumulate_tied"], model_kwargs=BIG)
    ref = fit("auto", steps=STEPS, **kw)
    strategy = disk(tmp_path, disk_io=disk_io)
    got = fit(strategy, steps=STEPS, **kw)
    assert_same_params(ref, got, EXACT)
    s = strategy.memory_stats()
    assert s["disk_direct_io"] == 1.0 and s["disk_staged_steps"] > 0
    monkeypatch.setattr(disk_storage, "page_cache_room", lambda: 1 << 40)
    cached = disk(tmp_path)
    fit(cached, steps=2, **kw)
    assert cached.memory_stats()["disk_direct_io"] == 0.0
