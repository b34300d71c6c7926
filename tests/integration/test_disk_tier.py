"""The disk tier: shards beyond ``host_memory_limit`` in files, bit-exact with training in memory; its errors
and its clean-up. Its I/O: ``test_disk_io.py``. Two ranks: ``tests/distributed`` (cases ``disk``,
``disk_accumulate``)."""

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
    # AdamW's amsgrad in the matrices' group: 12 bytes of state an element there, 8 in the other group's files (the
    # probe of AdamW's state failed on its defaults, and its fallback of 8 left the first step's state no room)
    "amsgrad_one_group": dict(model=dict(optimizer="adamw_amsgrad_matrices")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_disk_tier_trains_bit_exact_with_memory(tmp_path, case):
    kw = dict(CASES[case])
    kw["model_kwargs"] = {**BIG, **kw.pop("model", {})}
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
