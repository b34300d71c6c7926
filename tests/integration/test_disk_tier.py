"""The disk tier: shards beyond ``host_memory_limit`` in files, bit-exact with training in memory; its errors
and its clean-up. Two ranks: ``tests/distributed`` (cases ``disk``, ``disk_accumulate``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.engine.errors import DiskTierError, HostMemoryLimitError
from lightning_chunk.engine.tiers.disk import PREFIX, MappedFile, ScratchDir
from lightning_chunk.options import grouped
from tests.integration.test_checkpoints import train_and_save, trainer
from tests.integration.test_parity import BIG, EXACT, assert_same_params
from tests.models import ParityNet, ReorderedNet, fit, token_data

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
CHUNK = 66560  # BIG in 6 chunks


def disk(tmp_path, limit="3MB", **kw):
    """The disk tier stepping after backward (its gradients through their files), what these tests were written for;
    ``step_in_backward=None`` would step in backward wherever nothing reads the gradients after it."""
    return ChunkOffloadStrategy(
        **grouped(
            dict(
                placement="host",
                chunk_numel=CHUNK,
                optimizer_kernel="loop",
                host_memory_limit=limit,
                disk_dir=tmp_path / "scratch",
                step_in_backward=False,
            )
            | kw
        )
    )


CASES = {
    "adamw_groups_scheduler": dict(),
    "clip_norm": dict(gradient_clip_val=0.05),
    "accumulate_tied": dict(accumulate_grad_batches=2, variant="tied"),
    "frozen": dict(variant="frozen"),
    "bf16_mixed": dict(precision="bf16-mixed"),
    "fp16_mixed_clip": dict(precision="16-mixed", gradient_clip_val=0.05),  # unscaling and clipping page gradients
}


@pytest.mark.parametrize("case", list(CASES))
def test_disk_tier_trains_bit_exact_with_memory(tmp_path, case):
    kw = dict(CASES[case], model_kwargs=BIG)
    mixed = kw.get("precision") in ("bf16-mixed", "16-mixed")
    # fp32: against plain Lightning; mixed: against the same strategy with every shard in host memory
    ref = fit(
        ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(chunk_numel=CHUNK), offload=OffloadOptions(optimizer_kernel="loop")
        )
        if mixed
        else "auto",
        steps=STEPS,
        **kw,
    )
    strategy = disk(tmp_path)
    got = fit(strategy, steps=STEPS, **kw)
    assert_same_params(ref, got, EXACT)
    s = strategy.memory_stats()
    assert s["disk_shards"] >= 3 and s["disk_chunk_bytes"] > 0
    assert s["host_chunk_bytes"] <= 3_000_000
    assert s["disk_read_bytes"] > 0  # every disk shard's parameters are gathered from its file
    if s["disk_grad_bytes"]:  # trainable shards on disk: written every step; after the first, stepped staged
        assert s["disk_write_bytes"] > 0 and s["disk_staged_steps"] > 0
    else:  # only frozen shards on disk: never written after they were built
        assert s["disk_write_bytes"] == 0
    assert list((tmp_path / "scratch").iterdir()) == []  # the scratch directory went with the run


EARLY_CASES = {
    "fp32_direct": dict(disk_io="direct"),  # against plain Lightning; O_DIRECT pieces on the pool
    "bf16_mixed": dict(precision="bf16-mixed"),  # the compute copies written back from the stepped masters
    "accumulate_tied": dict(accumulate_grad_batches=2, variant="tied"),  # the first micro-batch's gradients in files
    # each chunk clips its gradients as it steps: in the staging buffer, or in the file at its first step
    "clip_value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    # the defaults (placement="auto", the automatic chunk size) on a model used in another order than registered
    "reordered_defaults": dict(
        cls=ReorderedNet, model_kwargs=dict(dim=64, hidden=512, depth=3), chunk_numel=None, placement="auto"
    ),
}


@pytest.mark.parametrize("case", list(EARLY_CASES))
def test_disk_chunks_stepped_in_backward_train_bit_exact_and_write_no_gradient_file(tmp_path, case, monkeypatch):
    """[Note: stepping disk chunks in backward]: each disk chunk steps as its gradients are final, from the buffer
    they gathered in, its master and optimizer state read ahead of need: the same bits as stepping after
    backward, with no gradient file written or read after the warm-up (only accumulation's first micro-batch
    writes one), every read ahead taken (the model's backward runs in one order every step), and the backward
    gathers served by those reads."""
    kw = dict(EARLY_CASES[case])
    strategy_kw = {k: kw.pop(k) for k in ("disk_io", "chunk_numel", "placement") if k in kw}
    kw.setdefault("model_kwargs", BIG)
    base = {**dict(placement="host", chunk_numel=CHUNK, optimizer_kernel="loop"), **strategy_kw}
    # fp32: against plain Lightning; mixed: against the same strategy in memory, stepping after backward
    ref = fit(
        ChunkOffloadStrategy(**grouped(base)) if kw.get("precision") == "bf16-mixed" else "auto", steps=STEPS, **kw
    )
    grad_writes = []
    real = MappedFile.write_from

    def write_from(self, buf, **io):
        if self.path.name.endswith("-grad.bin"):
            grad_writes.append(self.path.name)
        return real(self, buf, **io)

    monkeypatch.setattr(MappedFile, "write_from", write_from)
    limit = "2MB" if "cls" in kw else "3MB"
    strategy = ChunkOffloadStrategy(
        **grouped({**base, "host_memory_limit": limit, "step_in_backward": True, "disk_dir": tmp_path / "scratch"})
    )
    got = fit(strategy, steps=STEPS, **kw)
    assert_same_params(ref, got, EXACT)
    s = strategy.memory_stats()
    assert s["disk_shards"] >= 2 and s["disk_grad_bytes"] > 0
    assert s["chunks_stepped_in_backward"] >= s["disk_shards"] * (STEPS - 2)
    assert s["disk_staged_ahead_missed"] == 0
    if case in ("fp32_direct", "accumulate_tied"):  # fp32 masters released after forward: gathered again in backward
        # [Note: staging at the backward gather]: the backward gathers copy the master the step's staging read (all
        # but the two or three kept through the turn into backward or gathered before it starts: the prefetch window
        # keeps the chunk after the next, [Note: how far ahead to gather]), rather than read the file a third time
        assert s["disk_gathers_from_staging"] >= (s["disk_shards"] - 3) * (STEPS - 1), s
    # the warm-up's gradients, and those of the micro-batches that do not step (accumulation), and no more
    not_stepping = STEPS * (kw.get("accumulate_grad_batches", 1) - 1)
    if case in ("fp32_direct", "accumulate_tied"):
        # and no backward gather of a stepping micro-batch reads the file: each disk master is read by its forward
        # gathers, by the backward gathers of micro-batches that do not step, and twice more (the warm-up, the
        # first step); a disk chunk gathered ahead too early found the staging held and read it again (106 > 84)
        micro_batches = STEPS * kw.get("accumulate_grad_batches", 1)
        assert s["disk_gathers_from_file"] <= s["disk_shards"] * (micro_batches + not_stepping + 2), s
    assert 0 < len(grad_writes) <= s["disk_shards"] * (1 + not_stepping)
    assert list((tmp_path / "scratch").iterdir()) == []


def test_optimizer_state_lives_in_the_files(tmp_path):
    """Adam's moments of a disk shard are views of its file, not host tensors; the masters too."""
    strategy = disk(tmp_path, materialize_on_teardown=False)
    seen = {}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            eng = trainer.strategy.engine
            opt = eng.bindings[0].optimizer
            for c in eng.manager.chunks:
                if c.shard_tier.value == "disk":
                    files = eng.manager.tiers.disk.record(c).files
                    mm = files["optim"].mm
                    for t in c.tensors:
                        v = eng.bindings[0].views().get(t.slot.param_index)
                        if v is not None and v in opt.state:
                            seen[t.name] = all(_in(st, mm) for st in opt.state[v].values() if st.dim())

    fit(strategy, steps=3, model_kwargs=BIG, callbacks=[Probe()])
    assert seen and all(seen.values()), seen


def _in(t, mm):
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return base <= t.data_ptr() < base + len(mm)


@pytest.mark.parametrize("save_disk,resume_disk", [("auto", None), (None, "direct"), ("direct", "auto")])
def test_resume_across_the_disk_tier(tmp_path, save_disk, resume_disk):
    """A checkpoint written with shards on disk resumes in memory, and the reverse, and one written with the files
    past the page cache (``disk_io="direct"``) resumes through it, exactly as a run that never used the disk tier
    saves and resumes. (``auto`` is buffered here: the page cache can hold these files.)"""

    def make(on_disk):
        # the automatic chunk size (the host limit bounds it) and placement="auto", as a user gets them
        return (
            ChunkOffloadStrategy(
                host_memory_limit="100kB",
                offload=OffloadOptions(disk_dir=tmp_path / "scratch", optimizer_kernel="loop", disk_io=on_disk),
            )
            if on_disk
            else ChunkOffloadStrategy(offload=OffloadOptions(optimizer_kernel="loop"))
        )

    runs = []
    for name, save, resume in [("ref", False, False), ("got", save_disk, resume_disk)]:
        saver = make(save)
        train_and_save(tmp_path / name, saver, steps=6)
        L.seed_everything(11, verbose=False)
        model = ParityNet(variant="tied")
        strategy = make(resume)
        trainer(strategy, 10).fit(model, token_data(), ckpt_path=tmp_path / name / "step=6.ckpt")
        runs.append(model)
        for s, on_disk in ((saver, save), (strategy, resume)):
            assert (s.memory_stats()["disk_shards"] > 0) == bool(on_disk)
    assert_same_params(*runs, EXACT)


def test_errors_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(DiskTierError, match=r"disk_dir='.*a_file/sub' cannot be created"):
        fit(ChunkOffloadStrategy(**grouped(_args(tmp_path, disk_dir=blocker / "sub"))), steps=2, model_kwargs=BIG)
    with pytest.raises(DiskTierError, match=r"disk_dir='.*a_file' is not a directory"):
        fit(ChunkOffloadStrategy(**grouped(_args(tmp_path, disk_dir=blocker))), steps=2, model_kwargs=BIG)
    with pytest.raises(DiskTierError, match="no disk_dir is set"):
        fit(ChunkOffloadStrategy(**grouped(_args(tmp_path, disk_dir=None))), steps=2, model_kwargs=BIG)
    with pytest.raises(HostMemoryLimitError, match=r"host_memory_limit=1000 bytes is too small.*smallest limit"):
        fit(ChunkOffloadStrategy(**grouped(_args(tmp_path, host_memory_limit=1000))), steps=2, model_kwargs=BIG)


def _args(tmp_path, **kw):
    return dict(dict(placement="host", chunk_numel=CHUNK, host_memory_limit="3MB", disk_dir=tmp_path / "scratch"), **kw)


def test_a_full_disk_is_refused_with_the_bytes_needed(tmp_path, monkeypatch):
    """Injected: a filesystem with 1 MB free. The error names the bytes the disk tier needs and where."""
    import lightning_chunk.engine.tiers.disk as disk_mod

    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = 1, 1_000_000

    monkeypatch.setattr(disk_mod.os, "statvfs", lambda p: Small(real(p)))
    model = ParityNet(**BIG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = trainer(disk(tmp_path), STEPS)
    with pytest.raises(
        DiskTierError,
        match=r"the disk tier needs \d+ bytes .* in disk_dir='.*scratch'.* 1000000 "
        r"bytes \(976.56 KiB\) free",
    ):
        t.fit(model, token_data())
    assert t.global_step == 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, before[n], **EXACT)
    assert list((tmp_path / "scratch").iterdir()) == []


FSIZE = """
import resource, signal, sys
sys.path.insert(0, {root!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
from tests.integration.test_disk_tier import disk
from tests.models import fit
from tests.integration.test_parity import BIG
from pathlib import Path
from lightning_chunk.engine.errors import DiskTierError
try:
    fit(disk(Path({tmp!r})), steps=2, model_kwargs=BIG)
except DiskTierError as e:
    print("REFUSED", e)
"""


def test_the_room_check_counts_every_rank_that_shares_the_directory(tmp_path, monkeypatch):
    """Issue 49, defect 5: two ranks of a host that need 1 MB each of a filesystem with 1.5 MB free both passed a
    check of their own bytes; one then failed mid-pack while the other waited for it in a collective. Each rank
    now checks for all the ranks of its host, so both refuse before anything is written."""
    import lightning_chunk.engine.tiers.disk as disk_mod
    from lightning_chunk.engine.tiers.disk_storage import DiskStorage
    from lightning_chunk.engine.tiers.storage import HostStorage

    class Free:
        f_frsize, f_bavail = 1, 1_500_000

    monkeypatch.setattr(disk_mod.os, "statvfs", lambda p: Free())
    alone = DiskStorage(str(tmp_path), 0, HostStorage(pinned=False), ranks_here=1)
    alone.check_room(1_000_000, "the pack")  # one rank fits
    shared = DiskStorage(str(tmp_path), 1, HostStorage(pinned=False), ranks_here=2)
    with pytest.raises(
        DiskTierError,
        match=r"needs 2000000 bytes \(1.91 MiB\) .*for the 2 ranks of this host, "
        r"which share it.* 1500000 bytes \(1.43 MiB\) free",
    ):
        shared.check_room(1_000_000, "the pack")
    for d in (alone, shared):
        d.close()


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_a_filesystem_that_cannot_hold_a_shard_is_refused(tmp_path):
    """A real failure, not a check: files may not exceed 100 kB (RLIMIT_FSIZE), so preallocating a shard's
    file fails; the error says how many bytes it needed and where, and nothing is left behind."""
    r = subprocess.run(
        [sys.executable, "-c", FSIZE.format(root=str(ROOT), tmp=str(tmp_path))],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert "REFUSED the disk tier could not reserve" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "File too large" in r.stdout and str(tmp_path / "scratch") in r.stdout
    assert list((tmp_path / "scratch").iterdir()) == []


def test_a_dead_runs_scratch_is_removed_and_a_live_ones_kept(tmp_path):
    root = tmp_path / "scratch"
    root.mkdir()
    dead = root / f"{PREFIX}dead"
    dead.mkdir()
    (dead / "chunk0-1-master.bin").write_bytes(b"x" * 100)
    import socket

    from lightning_chunk.engine.system.host_id import host_identity

    here = host_identity()
    (dead / "owner.json").write_text(
        json.dumps({"host": socket.gethostname(), "machine": here, "pid": 2**22 + 7, "start": "1"})
    )
    alive = ScratchDir(root, rank=0)  # this process: alive
    other_host = root / f"{PREFIX}elsewhere"
    other_host.mkdir()
    (other_host / "owner.json").write_text(json.dumps({"host": "another-machine", "pid": 1, "start": "1"}))
    # a container with this machine's hostname and its own pid namespace ([Note: telling hosts apart]): its pid is
    # absent here, and its run alive
    container = root / f"{PREFIX}container"
    container.mkdir()
    hostname, boot, _ = here.split("/")
    (container / "owner.json").write_text(
        json.dumps({"host": hostname, "machine": f"{hostname}/{boot}/4026531999", "pid": 2**22 + 7, "start": "1"})
    )
    second = ScratchDir(root, rank=1)
    assert not dead.exists()
    assert alive.exists and second.exists and other_host.exists() and container.exists()
    alive.remove()
    second.remove()
    assert not alive.exists


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_a_killed_run_leaves_scratch_that_the_next_run_removes(tmp_path):
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import lightning as L
from tests.integration.test_disk_tier import disk
from tests.integration.test_parity import BIG
from tests.models import fit
from pathlib import Path

class Die(L.Callback):
    def on_train_batch_end(self, *a):
        os.kill(os.getpid(), signal.SIGKILL)

fit(disk(Path({str(tmp_path)!r})), steps=3, model_kwargs=BIG, callbacks=[Die()])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == -9, r.stderr[-2000:]
    left = list((tmp_path / "scratch").iterdir())
    assert len(left) == 1 and any(left[0].glob("*.bin"))
    strategy = disk(tmp_path)
    fit(strategy, steps=2, model_kwargs=BIG)
    assert list((tmp_path / "scratch").iterdir()) == []


def test_telemetry_draws_the_third_tier(tmp_path):
    """ChunkTelemetry's recorder sees which shards live on disk, and its picture is drawn with them."""
    from lightning_chunk import ChunkTelemetry

    events = []
    telemetry = ChunkTelemetry()
    record = telemetry.on_train_batch_start

    def spy(trainer, *a, **k):
        record(trainer, *a, **k)
        hooks = trainer.strategy.engine.hooks
        if hooks.moments.recorder is not None and not getattr(hooks.moments.recorder, "spied", False):
            inner = hooks.moments.recorder

            def both(e):
                events.append(e)
                inner(e)

            both.spied = True
            hooks.moments.recorder = both

    telemetry.on_train_batch_start = spy
    strategy = disk(tmp_path)
    fit(strategy, steps=4, model_kwargs=BIG, callbacks=[telemetry], default_root_dir=tmp_path)
    assert events and all(len(e.disk_shards) == strategy.memory_stats()["disk_shards"] for e in events)
    assert telemetry.picture_path is not None and telemetry.picture_path.exists()


def test_defaults_with_a_host_limit_spill_to_disk_bit_exact(tmp_path):
    """What a user gets by adding only host_memory_limit and disk_dir: placement="auto" (every shard on the device
    tier, which on a CPU machine is host memory), the automatic chunk size, a model used in another order than
    registered, with gradient accumulation: shards spill to disk, each chunk steps during backward (nothing here
    reads the gradients after it: [Note: stepping in backward by default]) and training equals
    plain Lightning."""
    from tests.models import ReorderedNet

    kw = dict(cls=ReorderedNet, model_kwargs=dict(dim=64, hidden=512, depth=3), accumulate_grad_batches=2)
    ref = fit("auto", steps=STEPS, **kw)
    strategy = ChunkOffloadStrategy(
        host_memory_limit="2MB", offload=OffloadOptions(disk_dir=tmp_path / "scratch", optimizer_kernel="loop")
    )
    got = fit(strategy, steps=STEPS, **kw)
    assert_same_params(ref, got, EXACT)
    s = strategy.memory_stats()
    assert s["disk_shards"] > 0 and s["disk_staged_steps"] > 0
    assert s["host_chunk_bytes"] + s["device_chunk_bytes"] <= 2_000_000
    assert s["chunks_stepped_in_backward"] >= s["disk_shards"] * (STEPS - 2)


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
    from tests.models import ReorderedNet

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
