"""[Note: the heap between steps]: on a CPU device the engine has glibc keep the pages a step frees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.runtime import engine as runtime
from lightning_chunk.engine.system.host_heap import user_set_thresholds

ROOT = Path(__file__).resolve().parents[2]

# A step's pattern in one process: 72 MiB of blocks under 32 MiB (activations) allocated, freed, allocated again.
CHILD = r"""
import ctypes, json, os, resource, sys
sys.path.insert(0, ROOT)
import torch
from lightning_chunk.engine.system.host_heap import keep_freed_heap

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
kept = keep_freed_heap() if KEEP else None
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
MiB = 1 << 20
blocks = [torch.ones(6 * MiB) for _ in range(3)]  # 24 MiB each
grown, mapped = libc.mallinfo2().arena, libc.mallinfo2().hblkhd
del blocks
after_free = libc.mallinfo2().arena
f0 = faults()
blocks = [torch.ones(6 * MiB) for _ in range(3)]
print(json.dumps({"kept": kept, "arena_grown": grown, "mapped": mapped, "arena_after_free": after_free,
                  "faults_again": faults() - f0}))
"""


def run_child(keep: bool, env: dict) -> dict:
    code = CHILD.replace("ROOT", repr(str(ROOT))).replace("KEEP", repr(keep))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_freed_blocks_stay_in_the_heap_for_the_next_step():
    kept = run_child(True, _clean_env())
    assert kept["kept"] is True
    # the 24 MiB blocks came from the heap, not from mappings of their own
    assert kept["arena_grown"] >= 72 << 20 and kept["mapped"] < 24 << 20
    # freeing them gave nothing back, so allocating them again faults in few pages (none in most runs, one block's
    # in some), where glibc's adaptive settings, in the same pattern, give the pages back or map them afresh: every
    # page of the three blocks faults again (18,400 of 4 KiB)
    assert kept["arena_after_free"] == kept["arena_grown"]
    default = run_child(False, _clean_env())
    assert default["faults_again"] > 12_000, default
    assert kept["faults_again"] < default["faults_again"] / 2, (kept, default)


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_the_environment_s_own_thresholds_stand():
    env = dict(_clean_env(), GLIBC_TUNABLES="glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304")
    assert run_child(True, env)["kept"] is False


def test_user_set_thresholds_reads_glibc_tunables_and_malloc_variables():
    assert not user_set_thresholds({})
    assert not user_set_thresholds({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert user_set_thresholds({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304"})
    assert user_set_thresholds({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert user_set_thresholds({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_set_thresholds({"MALLOC_MMAP_THRESHOLD_": "65536"})


@pytest.mark.parametrize(
    "config, asked",
    [
        (ChunkConfig(placement="device"), True),
        (ChunkConfig(placement="device", keep_freed_heap=False), False),
        (ChunkConfig(placement="host", host_memory_limit=1 << 30), False),  # map_large_blocks bounds memory there
    ],
)
def test_the_engine_asks_only_on_a_cpu_device_without_a_host_limit(monkeypatch, config, asked):
    calls = []
    monkeypatch.setattr(runtime, "keep_freed_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(runtime, "map_large_blocks", lambda: True)
    m = nn.Linear(4, 4)
    ChunkEngine(m, [torch.optim.SGD(m.parameters(), lr=0.1)], config=config)
    assert bool(calls) == asked


def test_keep_freed_heap_must_be_a_bool():
    with pytest.raises(ValueError, match=r"keep_freed_heap='yes' is not allowed; it must be True or False"):
        ChunkConfig(keep_freed_heap="yes")


def test_a_later_host_limit_takes_the_kept_trim_threshold_back(monkeypatch):
    from lightning_chunk.engine.system import host_heap

    calls = []
    monkeypatch.setattr(host_heap, "_mallopt", lambda param, value: calls.append((param, value)) or True)
    monkeypatch.setattr(host_heap, "_kept", False)
    monkeypatch.setattr(host_heap, "user_set_thresholds", lambda: False)
    assert host_heap.keep_freed_heap() and host_heap.keep_freed_heap()  # once a process
    assert calls == [(-3, 32 << 20), (-1, 1 << 30)]
    host_heap.map_large_blocks()
    assert calls[2:] == [(-1, 128 * 1024), (-3, 4 << 20)] and not host_heap._kept


@pytest.mark.parametrize("limited", [True, False])
def test_under_a_host_limit_the_heap_s_free_pages_go_back_once_a_step(monkeypatch, tmp_path, limited):
    """[Note: a fixed mmap threshold]: activations stay under the threshold and come from the heap, whose holes the
    process would keep; under ``host_memory_limit`` the engine trims them once a step, after backward (not at
    every ``prepare_step`` a step may ask for: clipping, a second optimizer)."""
    from tests.engine_steps import step

    trims = []
    monkeypatch.setattr(runtime, "release_freed_memory", lambda: trims.append(1))
    monkeypatch.setattr(runtime, "map_large_blocks", lambda: True)  # process-wide: not this test's to change
    monkeypatch.setattr(runtime, "keep_freed_heap", lambda: True)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    kw = dict(host_memory_limit="1GiB", disk_dir=str(tmp_path)) if limited else {}
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=1200, **kw))
    for i in range(4):
        step(eng, m, opt, torch.randn(4, 16, generator=torch.Generator().manual_seed(i)))
        if i == 0:
            trims.clear()  # the warm-up trims after its repack as well
    eng.prepare_step()  # asked again before the next backward: no second trim
    assert len(trims) == (3 if limited else 0), trims


def test_while_backward_runs_glibc_maps_no_block_for_autograd(monkeypatch):
    """[Note: the heap between steps]: from a backward's first gradient to its end autograd's blocks come from the
    heap (``M_MMAP_MAX`` 0); the engine's own code in it (its hooks) and everything after it map large blocks as
    before, so the chunks' buffers and optimizer state stay off the heap."""
    from lightning_chunk.engine.system import host_heap

    calls = []
    monkeypatch.setattr(host_heap, "_mallopt", lambda param, value: calls.append((param, value)) or True)
    monkeypatch.setattr(host_heap, "_kept", True)
    monkeypatch.setattr(host_heap, "_backward", False)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="device", chunk_numel=300))
    assert eng._heap_in_backward is host_heap.no_switch  # its gradients are far under 32 MiB: nothing to switch
    eng._heap_in_backward = host_heap.heap_in_backward  # as an engine of a wide model
    seen = []
    m[0].weight.register_hook(lambda g: seen.append(calls[-1]))  # autograd's work, between the engine's hooks
    for i in range(3):
        calls.clear()
        opt.zero_grad()
        with eng.micro_batch(training=True) as outputs:
            loss = m(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).mean()
            outputs(loss)
        loss.backward()
        assert seen[-1] == (-4, 0) and calls[-1] == (-4, 65536), (i, calls)  # mapped again as backward ended
        # the first hook gives autograd the heap as it ends, each later one maps as it starts and gives the heap back
        # as it ends, the backward's end maps: one call each way, never the same twice
        assert calls[::2] == [(-4, 0)] * len(calls[::2]) and calls[1::2] == [(-4, 65536)] * len(calls[1::2]), calls
        assert len(calls) >= 5, calls  # three gradients' hooks at least
        eng.after_backward()
        eng.prepare_step()
        opt.step()
        eng.finish_step(stepped=True)
    assert host_heap.ENGINE_BLOCKS.depth == 0 and not host_heap._backward
    monkeypatch.setattr(host_heap, "_kept", False)  # a later host limit gave the heap back: nothing asked
    calls.clear()
    host_heap.heap_in_backward(True)
    with host_heap.ENGINE_BLOCKS:
        pass
    assert calls == []


@pytest.mark.parametrize(
    "config, kept, switches",
    [
        (ChunkConfig(placement="device"), True, True),
        (ChunkConfig(placement="device"), False, False),  # the environment set glibc's thresholds: nothing kept
        # an earlier engine of the process kept the heap; this one was told not to, or bounds host memory
        (ChunkConfig(placement="device", keep_freed_heap=False), True, False),
        (ChunkConfig(placement="host", host_memory_limit=1 << 30), True, False),
    ],
)
def test_only_an_engine_that_keeps_the_heap_and_has_a_wide_gradient_switches(monkeypatch, config, kept, switches):
    from lightning_chunk.engine.system import host_heap

    monkeypatch.setattr(runtime, "keep_freed_heap", lambda: kept)
    monkeypatch.setattr(runtime, "map_large_blocks", lambda: True)
    monkeypatch.setattr(host_heap, "_kept", kept)
    wide = nn.Linear(4096, 2049, bias=False)  # 32 MiB and 16 KiB of gradient: past the threshold
    eng = ChunkEngine(wide, [torch.optim.SGD(wide.parameters(), lr=0.1)], config=config)
    assert (eng._heap_in_backward is host_heap.heap_in_backward) is switches
    assert host_heap.switch_in_backward([torch.empty(4096, 2048, device="meta")]) is host_heap.no_switch  # 32 MiB


# A linear layer whose weight's gradient (64 MiB) is past the highest mmap threshold glibc allows (32 MiB), trained
# on an engine: minor faults in a steady step, with the engine keeping the heap and with glibc's own settings.
FAULTS = r"""
import json, resource, sys
sys.path.insert(0, ROOT)
import torch
from lightning_chunk.engine import ChunkConfig, ChunkEngine
from tests.engine_steps import step

torch.manual_seed(0)
m = torch.nn.Linear(4096, 4096, bias=False)
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="device", keep_freed_heap=KEEP))
faults = []
for i in range(4):
    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(eng, m, opt, torch.randn(8, 4096))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
print(json.dumps(faults))
"""


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_gradient_past_the_mmap_threshold_is_not_faulted_in_every_step():
    def steady_faults(keep: bool) -> int:
        code = FAULTS.replace("ROOT", repr(str(ROOT))).replace("KEEP", repr(keep))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_clean_env())
        assert r.returncode == 0, r.stderr[-3000:]
        return min(json.loads(r.stdout.strip().splitlines()[-1])[2:])

    pages = (64 << 20) // 4096  # the gradient's 4 KiB pages: 16,384
    assert steady_faults(False) >= pages  # glibc maps it afresh in every backward, and unmaps it when it is dropped
    assert steady_faults(True) < pages // 8  # from the heap: the last backward's pages
