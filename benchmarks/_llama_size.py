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
        offload=OffloadOptions(pin_memory="exact" if args.largest_pin == "exact" else True),
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
