"""The largest Llama shape the plan says a GPU and its host can train, and its run: the campaign's ``largest`` part
sizes a child with it and runs ``train_largest`` there (``gpu_campaign.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

LLAMA = dict(hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000)  # Llama-2 7B's widths
MIN_LAYERS = 32  # 7B
# of the host's available memory: the CUDA context, pinned staging, Python and Lightning beside. 0.92 until a 9.0B
# try planned at 122.3 of 133.9 GB ended in its first step on an H200 (2026-12-04), taken then for memory; it was the
# part's time (set-up 148 of 257 s), at 121.7 GB resident as planned. 0.8 stays: a smaller model sets up sooner
HOST_SHARE = 0.8


CGROUP_MEMORY = (  # (limit, usage): cgroup v2, v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def host_bytes() -> int:
    """The host memory a run may take: what the kernel says is available now (the total less what the system
    and the page cache it cannot drop hold), and no more than a container's memory limit leaves (its usage counts
    its page cache too, so this errs low)."""
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    for limit, usage in CGROUP_MEMORY:
        try:
            avail = min(avail, int(open(limit).read()) - int(open(usage).read()))
        except (OSError, ValueError):  # no such file, or "max": no limit
            continue
    return avail


PIN_SHARE = 0.25  # of the largest part's budget: the most set-up may spend in torch's pinned blocks (cudaHostAlloc)


def first_touch_gbps(nbytes: int, huge: bool = False) -> float:
    """Host memory this process never touched, written once: the pace of a large model's set-up, which fills some
    hundred GB of fresh pages (0.35 to 3.5 GB/s on a 2-core VM, which rewrites touched memory at 23). ``huge``: in a
    mapping advised to take transparent huge pages (``MADV_HUGEPAGE``), as the shards pinned to the byte could be
    (``system/exact_pinned.py``): a fault a 2 MiB page where the kernel finds them (that VM: 0.63 GB/s, slower)."""
    import mmap

    import torch

    t = time.perf_counter()
    if huge:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        torch.frombuffer(mapping, dtype=torch.uint8).fill_(1)
    else:
        torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    return nbytes / (time.perf_counter() - t) / 1e9


def first_touch_paces(nbytes: int = 1 << 30) -> dict[str, Any]:
    """``first_touch_gbps`` of small pages and, where the kernel offers them, of huge pages, with the kernel's mode for
    them (``transparent_hugepage/enabled``: ``madvise`` gives them to advised mappings only)."""
    import mmap

    out: dict[str, Any] = {"host_first_touch_gbps": first_touch_gbps(nbytes)}
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return out
    out["transparent_hugepages"] = mode
    if mode != "never" and hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # measured before any part runs: a refused advice must not stop the lease
            out["host_first_touch_huge_gbps"] = first_touch_gbps(nbytes, huge=True)
        except OSError as e:
            out["transparent_hugepages"] = f"{mode} (advice refused: {e})"
    return out


def pinning_paces(nbytes: int = 1 << 30) -> dict[str, Any]:
    """GB/s of pinning fresh host memory, as a set-up pins its shards: torch's pinned blocks (``cudaHostAlloc``, whose
    pages are faulted in on one thread) and page-locking to the byte (``pin_memory="exact"``: a first touch on
    torch's threads, then ``cudaHostRegister``; [Note: exact pinned memory]). The 9.0B try of 2026-12-04 spent 148
    s in set-up in torch's blocks, with nothing measured to say how much of it was pinning."""
    import torch

    from lightning_chunk.engine.system.exact_pinned import ExactPinned
    from lightning_chunk.engine.system.host_heap import release_pinned_cache

    paces: dict[str, Any] = {}
    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)  # the CUDA context and the allocator, not timed
        for name, make in (
            ("torch", lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
            ("exact", lambda: ExactPinned().empty(nbytes, torch.uint8)),
        ):
            t = time.perf_counter()
            block = make()
            paces[name] = round(nbytes / (time.perf_counter() - t) / 1e9, 2)
            del block
        torch.cuda.synchronize()
        release_pinned_cache()  # torch's cached block goes back: the child pins its own
    except Exception as e:  # noqa: BLE001 - a probe that fails costs the row nothing but its reason
        paces["failed"] = str(e)[:200]
    return paces


def choose_pinning(
    exact_ok: bool, paces: dict[str, Any], plans: dict[bool | str, tuple[int, int]], seconds: float
) -> tuple[bool | str, str]:
    """How the largest try holds its host shards, and why: to the byte where ``tests/gpu``'s checks of it passed; else
    pageable where its plan fits more layers than torch's power-of-two pinned blocks allow (the goal is the size that
    trains; the copies run at the pageable pace, which a few steps can spare) or where, at ``paces["torch"]`` GB/s,
    pinning the planned shards would take more than ``PIN_SHARE`` of the ``seconds`` left; else torch's blocks.
    ``plans``: ``pin_memory`` -> (layers, the planned host peak). To the byte plans fewer layers where torch cannot
    swap storages (before 2.12: its gradient shards keep their bytes, [Note: torch versions]): the others then."""
    (pinned, peak), (paged, _) = plans.get(True, (0, 0)), plans.get(False, (0, 0))
    if exact_ok:
        exact = plans.get("exact", (0, 0))[0]
        if exact >= max(pinned, paged):
            return "exact", "tests/gpu's checks of pin_memory='exact' passed"
        exact_why = f"to the byte fits {exact} layers, fewer (its gradient shards kept); "
    else:
        exact_why = ""
    pin, why = choose_kept(paces, pinned, peak, paged, seconds)
    return pin, exact_why + why


def choose_kept(paces: dict[str, Any], pinned: int, peak: int, paged: int, seconds: float) -> tuple[bool, str]:
    """``choose_pinning`` between torch's pinned blocks (``pinned`` layers, ``peak`` bytes) and pageable shards."""
    if paged > pinned:
        return False, f"pageable fits {paged} layers, torch's pinned blocks {pinned}"
    pace = paces.get("torch")
    if pace and peak / (pace * 1e9) > PIN_SHARE * seconds:
        return False, f"torch's pinned blocks at {pace} GB/s: {peak / (pace * 1e9):.0f} s of set-up for the shards"
    return True, "torch's pinned blocks" + (f" at {pace} GB/s" if pace else "")


def activation_bytes(shape: dict, batch: int, context: int) -> int:
    """A step's activation peak for a Llama shape in bf16-mixed with SDPA's fused attention, nothing recomputed: per
    token and layer the residual stream, the norms' outputs, q, k, v and the attention's output (about 16 bytes a
    hidden unit), the MLP's gate, up and their product (8 an intermediate one); the logits in fp32 and their
    gradient. The warm-up traced 0.85-1.17x of it on CPU (2026-11-29, widths 256-512, 4-8 layers); 1.2x it errs
    safe."""
    per_token = shape["layers"] * (16 * shape["hidden"] + 8 * shape["intermediate"]) + 12 * shape["vocab"]
    return int(1.2 * batch * context * per_token)


def fitting_layers(
    args: argparse.Namespace, device_limit: int | None, pin_memory: bool | str = True
) -> tuple[int, Any]:
    """The most layers of Llama-2 7B's widths the plan says fit this device and host (at least ``MIN_LAYERS``), its
    host shards pinned as ``pin_memory`` says (``OffloadOptions``)."""
    from lightning_chunk.plan import make_shape_plan
    from lightning_chunk.shapes import Llama

    def plan(layers: int) -> Any:
        return make_shape_plan(
            Llama,
            {"size": {**LLAMA, "layers": layers}},
            {  # as the run is: stepped in backward, its gradient shards given back
                "placement": "auto",
                "device_memory_limit": device_limit,
                "pin_memory": pin_memory,
                "step_in_backward": True,
            },
            "bf16-mixed",
            1,
            (1, 1, int(HOST_SHARE * (args.host_memory or host_bytes()))),
            staging=args.accelerator == "cuda",
            activations=activation_bytes({**LLAMA, "layers": layers}, args.largest_batch, args.largest_context),
        )

    lo, hi = MIN_LAYERS, 2 * MIN_LAYERS
    while plan(hi).fits and hi < 1024:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # plan(lo) fits (or is the floor), plan(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(mid).fits else (lo, mid)
    return lo, plan(lo)


def model_params(shape: dict) -> int:
    h, i, v, n = shape["hidden"], shape["intermediate"], shape["vocab"], shape["layers"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    return 2 * v * h + h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


def llama_init(module: Any) -> None:
    """Llama's own initialisation (normal, std 0.02; norms at one) for deferred init, drawn on the GPU there ([Note:
    deferred initialisation]); on a CPU, one core draws some 300M numbers a second."""
    for name, t in module.named_parameters(recurse=False):
        if name == "weight" and t.dim() == 1:
            t.data.fill_(1.0)
        else:
            t.data.normal_(0.0, 0.02)


def train_largest(args: argparse.Namespace) -> None:
    """One ``Trainer.fit`` of a Llama shape built on the meta device (``configure_model``)."""
    import lightning as L
    import torch
    from _common import proc_bytes, quiet_trainer, step_timer, watch_calls
    from gpu import traffic

    from lightning_chunk import CheckOptions, ChunkOffloadStrategy, OffloadOptions
    from lightning_chunk.shapes import Llama

    marks = {"started": time.perf_counter()}
    shape = json.loads(args.shape)
    cuda = args.accelerator == "cuda"
    L.seed_everything(0, verbose=False)
    model = Llama(size=shape)
    data = torch.randint(0, shape["vocab"], (args.largest_steps * args.largest_batch, args.largest_context + 1))
    times: list[float] = []
    moved: dict[str, float] = {}
    strategy = ChunkOffloadStrategy(  # stepped in backward: no model's worth of gradient shards on the host
        device_memory_limit=int(args.largest_limit) if args.largest_limit else None,
        step_in_backward=True,
        param_init_fn=llama_init,
        checks=CheckOptions(log_memory_stats=False),
        offload=OffloadOptions(pin_memory={"exact": "exact", "true": True, "false": False}[args.largest_pin]),
    )

    resident: list[tuple[float, float]] = []  # (seconds since the start, GB resident), every 5 s
    lock, finished = threading.Lock(), list[bool]()

    watched = watch_calls(moved)  # the engine's calls: where set-up's and the first step's seconds went

    def report(done: bool) -> None:  # at each step: a child stopped at the budget keeps its set-up and steps
        watched.now()
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        res = {"times": times, "params": model_params(shape), "peak_device": peak, "peak_host": proc_bytes("VmHWM")}
        out = Path(args.child_out)
        with lock:  # the sampler below writes too, never after the last step's report
            if finished:
                return
            finished.extend([True] * done)
            res.update(moved, marks=marks, done=done, rss=resident)
            out.with_suffix(".tmp").write_text(json.dumps(res))
            out.with_suffix(".tmp").replace(out)

    def sample() -> None:  # a child killed for memory still says how high it got, and when (set-up, first step)
        while True:
            resident.append((round(time.perf_counter() - marks["started"], 1), round(proc_bytes("VmRSS") / 1e9, 2)))
            report(False)
            time.sleep(5)

    threading.Thread(target=sample, daemon=True).start()

    class Progress(L.Callback):
        def on_train_start(self, *_: Any) -> None:
            marks["set_up"] = time.perf_counter()
            report(False)

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step < args.largest_steps:
                return report(False)
            report(True)  # and no teardown: keeping the optimizer state for after fit copies the device's part of
            sys.stdout.flush()  # it to the host, a minute at 10B parameters that a lease cannot spare
            sys.stderr.flush()
            os._exit(0)

    callbacks = [step_timer(times), traffic(strategy, 1, moved), watched, Progress()]
    precision = "bf16-mixed"
    trainer = quiet_trainer(1, strategy, args.largest_steps, args.accelerator, precision=precision, callbacks=callbacks)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.largest_batch))
