"""A GPT whose training state is several times the host memory it may use, trained with the disk tier.

    python benchmarks/disk.py                                  # ~85M GPT, 16 B/param = 4.1x a 320 MiB host limit
    python benchmarks/disk.py --width 128 --depth 2 --host-limit 4MiB --device-limit 8MiB --out /tmp/d.json

Rows, each in its own process, one rank, measured in one run:

- ``in memory``: ``chunk_offload`` with ``placement="host"`` and no host limit: every shard in host memory
  (what the disk tier's step is compared with, and its peak resident set).
- ``disk tier, stepped after backward``: the same with ``host_memory_limit=--host-limit``, ``disk_dir=--dir`` and
  ``step_in_backward=False``: the masters, gradient shards and Adam's moments that do not fit go to files there,
  moved through the page cache or past it (``O_DIRECT``) as ``--disk-io`` (default ``auto``, the strategy's
  default) chooses; the notes say which. Every disk chunk steps after backward, its gradients through their file
  (what a fit with gradient clipping or fp16 loss scaling gets).
- ``disk tier, stepped in backward (the default)``: the same with ``step_in_backward`` left at its default, which
  with nothing reading the gradients after backward steps each disk chunk during backward from
  its gradients in memory, its master and optimizer state read ahead ([Note: stepping disk chunks in backward],
  [Note: stepping in backward by default]); compared with its own floor, the bytes its step
  must move (no gradient file; a master read twice, forward and staged, the staging serving the backward
  gather). The child refuses to report a row that did not step in backward.
- ``disk floor``: the bytes a step must move through the disk tier (every disk shard's master, gradient
  and optimizer state read once and written once, and, in fp32, its master read again by the forward and
  the backward gathers), moved by a plain loop of 64 MiB ``os.pwrite``/``os.preadv`` calls through one
  file in the same directory, in the same page-cache conditions (no ``fsync``, as the tier does not);
  the median of 5, each after ``os.sync()`` as every row starts after one. ``disk floor, O_DIRECT``: the same
  loop with ``O_DIRECT``, so that the bytes go to and come from the disk itself: the floor of a machine whose
  page cache cannot hold the files.
- ``DeepSpeed ZeRO-Infinity``: ``offload_param`` and ``offload_optimizer`` to ``nvme`` at ``--dir``, the model
  built under ``deepspeed.zero.Init`` and the swap buffers sized to it, when deepspeed can run here (its
  ``async_io`` op needs ``libaio``: Debian's ``libaio-dev``); otherwise the reason it gave. With
  ``--memory-cap``, again inside the cgroup (``DeepSpeed ZeRO-Infinity (nvme), memory capped``).
- with ``--memory-cap SIZE``, ``disk tier, memory capped`` and ``disk floor, memory capped``: the disk-tier row
  and the floor again, each in a memory cgroup of SIZE, which charges the page cache too. Without it a machine
  with more memory than the state keeps the files in its page cache, and "disk" I/O runs at memory speed; capped,
  the files do not fit and the bytes go to the disk, as on a machine whose memory is smaller than the state
  (what the disk tier is for). The capped floor's process first makes its resident set as large as the capped
  disk tier's peak, so that its loop gets the page cache the tier got, not the whole cgroup. Needs a cgroup
  this process may create (root, or a delegated subtree); where it cannot, the rows say why.
- with ``--memory-cap`` and ``--rounds N``: N more rounds of the capped disk-tier rows, each followed at once by
  the ``O_DIRECT`` floor of its own bytes (the median of 3), the order shuffled each round; a ratio pairs a step
  with the disk's speed of the same minute (this virtual disk's own speed moves by half between minutes), and the
  table gives the median of the per-round ratios with its 95% interval.

Both chunk_offload rows build the GPT in ``configure_model`` (``deferred_init=True``), so the model never
exists whole in memory, with ``device_memory_limit=--device-limit`` bounding the payloads gathered at once
(the device tier is host memory on a CPU machine). ``limit``: ``--host-limit`` plus ``--device-limit``.
``baseline``: the process's resident set just before ``fit`` (Python, torch, Lightning, the data).
The disk-tier row must end with peak RSS under baseline + limit. ``s a step``: the median after the
first step (the warm-up, which also repacks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    ROOT,
    clean_env,
    gpt_parser,
    make_gpt,
    proc_bytes,
    quiet_trainer,
    run_or_child,
    step_timer,
)
from _disk_floor import BLOCK, MemoryCgroup, disk_floor, floors  # noqa: E402
from _disk_table import median_after_first, render  # noqa: E402

sys.path.insert(0, str(ROOT))
from lightning_chunk.engine.config import parse_bytes  # noqa: E402
from lightning_chunk.options import grouped  # noqa: E402


def _data(args: argparse.Namespace) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.steps * args.batch, args.context + 1), generator=g)
    return torch.utils.data.DataLoader(data, batch_size=args.batch)


def child_chunk(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from lightning_chunk import ChunkOffloadStrategy, OffloadOptions

    on_disk = args.child in ("disk", "disk_early")
    kw: dict = dict(host_memory_limit=args.host_limit) if on_disk else {}
    if args.child == "disk":  # the default steps in backward here ([Note: stepping disk chunks in backward])
        kw["step_in_backward"] = False
    strategy = ChunkOffloadStrategy(
        **grouped(
            {
                "placement": "host",
                "device_memory_limit": args.device_limit,
                **kw,
                "materialize_on_teardown": False,
                "offload": OffloadOptions(disk_dir=args.dir, disk_io=args.disk_io) if on_disk else None,
                "log_memory_stats": False,
            }
        )
    )
    L.seed_everything(0, verbose=False)
    model = make_gpt(args, deferred_init=True)
    data = _data(args)
    times: list[float] = []
    stats: dict = {}

    class Stats(L.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            stats.setdefault("per_step", []).append(dict(trainer.strategy.memory_stats()))

        def on_train_end(self, trainer: Any, *a: Any) -> None:
            stats["peak_rss"] = proc_bytes("VmHWM")

    trainer = quiet_trainer(1, strategy, args.steps, callbacks=[step_timer(times), Stats()])
    baseline = proc_bytes("VmRSS")
    trainer.fit(model, data)
    last = stats["per_step"][-1]
    prev = stats["per_step"][-2] if len(stats["per_step"]) > 1 else {k: 0 for k in last}
    if args.child == "disk_early" and not last.get("chunks_stepped_in_backward"):
        raise SystemExit("the default did not step in backward on this model: the row would measure another path")
    report = {
        "steps": trainer.global_step,
        "params": int(last["param_numel"]),
        "step_times": times,
        "baseline_rss": baseline,
        "peak_rss": stats["peak_rss"],
        "stats": {
            k: last[k]
            for k in (
                "host_chunk_bytes",
                "disk_chunk_bytes",
                "disk_shards",
                "chunks",
                "device_chunk_bytes_peak",
                "nonmodel_peak_bytes",
                "chunk_numel",
            )
        },
        "disk_direct_io": bool(last.get("disk_direct_io", 0)),
        "last_step": {
            k: last[k] - prev.get(k, 0)
            for k in last
            if k in ("disk_read_bytes", "disk_write_bytes", "disk_wait_s") or k.startswith("time_")
        },
        "disk_roles": {r: last.get(f"disk_{r}_bytes", 0) for r in ("master", "grad", "optim")},
    }
    Path(f"{args.out}.{args.child}").write_text(json.dumps(report))
    del torch


def child_deepspeed(args: argparse.Namespace) -> None:
    """ZeRO-Infinity: parameters and optimizer state offloaded to NVMe at ``--dir``; reports why it cannot run."""
    out: dict = {}
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        import deepspeed
        import torch

        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        nvme = str(Path(args.dir) / "deepspeed")
        Path(nvme).mkdir(parents=True, exist_ok=True)
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            # the swap buffers sized to this model, as a ZeRO-Infinity user bounding host memory sets them: by default
            # five 1e8-element parameter buffers and one optimizer sub-group of 1e9 elements (several GiB of buffers)
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 10**7,
                "offload_param": {
                    "device": "nvme",
                    "nvme_path": nvme,
                    "pin_memory": False,
                    "buffer_count": 5,
                    "buffer_size": 10**7,
                },
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False},
            },
            "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True},
            "steps_per_print": 10**9,
        }
        # built partitioned, its parameters sent to NVMe as each module is made (zero.Init), as ZeRO-Infinity's
        # users build a model larger than memory; chunk_offload's rows build on the meta device likewise
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme", pin_memory=False):
            model = make_gpt(args)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        times = []
        baseline = proc_bytes("VmRSS")
        for batch in _data(args):
            t0 = time.perf_counter()
            logits = engine(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
        out = {"step_times": times, "peak_rss": proc_bytes("VmHWM"), "baseline_rss": baseline}
    except Exception as e:  # the reason it gave, never a faked row
        out = {
            "skipped": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            "trace": traceback.format_exc()[-2000:],
        }
    finally:
        shutil.rmtree(Path(args.dir) / "deepspeed", ignore_errors=True)
    Path(f"{args.out}.deepspeed").write_text(json.dumps(out))


def child_floor(args: argparse.Namespace) -> None:
    """The buffered floor in a process of its own, inside the memory cgroup (``O_DIRECT`` bypasses the page cache:
    the parent's measure of it stands for both). ``--floor-hold``: first make this process's resident set that
    large (the disk tier's capped peak), so that the loop has the page cache the tier had in the same cgroup and
    not the whole cgroup: without it the loop's reads found most of what it had just written still cached."""
    import mmap

    hold = max(0, args.floor_hold - proc_bytes("VmRSS") - BLOCK)  # the loop's own buffer is BLOCK more
    held = mmap.mmap(-1, max(hold, 1))
    ones = b"\x01" * min(BLOCK, max(hold, 1))
    for off in range(0, hold, BLOCK):  # touched, so that every page is resident
        held[off : off + min(BLOCK, hold - off)] = ones[: min(BLOCK, hold - off)]
    out = floors(Path(args.dir), args.floor_read, args.floor_write, with_direct=False)
    out["held_rss"] = proc_bytes("VmRSS")
    held.close()
    Path(f"{args.out}.{args.child}").write_text(json.dumps(out))


def _run(
    name: str, args: argparse.Namespace, scratch: Path, cap: MemoryCgroup | None = None, extra: list[str] | None = None
) -> dict:
    os.sync()  # every row starts with no writeback left over from the one before
    if cap is not None and cap.why_not:
        return {"skipped": cap.why_not}
    out = scratch / "res"
    # a row run before under the same name (deepspeed, then deepspeed_capped) left its file: a child killed before
    # writing its own must not be read as having run
    Path(f"{out}.{name}").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--out",
        str(out),
        "--dir",
        args.dir,
        "--host-limit",
        str(args.host_limit),
        "--device-limit",
        str(args.device_limit),
        "--disk-io",
        args.disk_io,
        *(extra or []),
    ]
    for k in ("width", "depth", "context", "batch", "steps"):
        cmd += [f"--{k}", str(getattr(args, k))]
    try:
        r = subprocess.run(
            cmd,
            env=clean_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            preexec_fn=None if cap is None else cap.enter,
        )
    except subprocess.SubprocessError as e:  # the child could not join the cgroup
        return {"skipped": f"no memory cgroup could be made here (joining it failed: {e})"}
    path = Path(f"{out}.{name}")
    if not path.exists():
        if r.returncode == -9 and cap is not None:  # the cgroup's OOM killer leaves no message of its own
            return {"failed": f"killed (SIGKILL) inside the {cap.limit >> 20} MiB memory cgroup", "returncode": -9}
        return {"failed": (r.stdout + r.stderr)[-3000:], "returncode": r.returncode}
    res = json.loads(path.read_text())
    if cap is not None:
        res["cgroup_peak"] = cap.peak()
    return res


def measure(args: argparse.Namespace) -> dict:
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp())
    rows = {name: _run(name, args, scratch) for name in ("memory", "disk", "disk_early")}
    disk = rows["disk"]
    res: dict[str, Any] = {
        "args": {
            k: getattr(args, k)
            for k in ("width", "depth", "context", "batch", "steps", "host_limit", "device_limit", "dir")
        },
        "rows": rows,
    }
    if args.deepspeed:  # before its capped run, which then finds its ops built (the build is no part of the row)
        rows["deepspeed"] = (
            _run("deepspeed", args, scratch) if _importable("deepspeed") else {"skipped": "deepspeed is not installed"}
        )
    if "failed" not in disk:
        roles = disk["disk_roles"]
        must_read = roles.get("master", 0) * 3 + roles.get("grad", 0) + roles.get("optim", 0)
        must_write = roles.get("master", 0) + roles.get("grad", 0) + roles.get("optim", 0)
        sizes = ["--floor-read", str(must_read), "--floor-write", str(must_write)]
        floor = floors(Path(args.dir), must_read, must_write)
        if "seconds" in floor:
            res["floor"] = {"read_bytes": must_read, "write_bytes": must_write, **floor}
        if "step_times" in rows["disk_early"]:
            # stepped in backward no gradient file is written or read, and the step's staging read of a master can
            # serve that chunk's backward gather: a master read twice (forward, and staged for the step), the
            # optimizer state once, both written once
            early_read = roles.get("master", 0) * 2 + roles.get("optim", 0)
            early_write = roles.get("master", 0) + roles.get("optim", 0)
            early = floors(Path(args.dir), early_read, early_write)
            if "seconds" in early:
                res["floor_early"] = {"read_bytes": early_read, "write_bytes": early_write, **early}
        if args.memory_cap:
            cap_bytes = parse_bytes(args.memory_cap, field="--memory-cap")
            res["memory_cap"] = cap_bytes
            ran = "step_times" in rows.get("deepspeed", {})  # where it cannot run at all, capped adds nothing
            for name in ("disk", "floor", "disk_early", "deepspeed") if ran else ("disk", "floor", "disk_early"):
                cap = MemoryCgroup(cap_bytes, name)
                try:
                    # the floor beside the resident set the disk tier had in the same cgroup (run just before)
                    hold = ["--floor-hold", str(rows.get("disk_capped", {}).get("peak_rss", 0))]
                    rows[f"{name}_capped"] = _run(
                        name, args, scratch, cap, extra=sizes + hold if name == "floor" else None
                    )
                finally:
                    cap.remove()
            if args.rounds and "direct_seconds" in res.get("floor", {}):
                bytes_of = {"disk": (must_read, must_write)}
                if "floor_early" in res:
                    bytes_of["disk_early"] = (early_read, early_write)
                res["rounds"] = capped_rounds(args, scratch, cap_bytes, bytes_of)
    shutil.rmtree(scratch, ignore_errors=True)
    return res


def capped_rounds(args: argparse.Namespace, scratch: Path, cap_bytes: int, sizes: dict) -> list[dict]:
    """``--rounds``: each row of ``sizes`` (name -> the bytes its step reads and writes) run again in a memory
    cgroup of ``cap_bytes``, then the ``O_DIRECT`` floor of its bytes at once (the median of 3); the order shuffled
    each round."""
    out = []
    for _ in range(args.rounds):
        rnd: dict = {}
        names = list(sizes)
        random.shuffle(names)
        for name in names:
            cap = MemoryCgroup(cap_bytes, f"{name}-round")
            try:
                r = _run(name, args, scratch, cap)
            finally:
                cap.remove()
            if "step_times" not in r:
                rnd[name] = {k: v for k, v in r.items() if k in ("failed", "skipped")}
                continue
            floors_s = []
            for _ in range(3):
                os.sync()
                floors_s.append(disk_floor(Path(args.dir), *sizes[name], direct=True))
            rnd[name] = {"step_s": median_after_first(r["step_times"]), "direct_floor_s": sorted(floors_s)[1]}
        out.append(rnd)
    return out


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(
        __doc__, str(ROOT / "benchmarks/results/disk.json"), width=768, depth=12, context=64, batch=1, steps=6
    )
    p.add_argument("--host-limit", default="320MiB")
    p.add_argument("--device-limit", default="160MiB")
    p.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "lightning_chunk_disk_bench"))
    p.add_argument(
        "--disk-io",
        default="auto",
        choices=("auto", "direct", "buffered"),
        help="the disk tier's disk_io (auto: past the page cache where it cannot hold the files)",
    )
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
    p.add_argument(
        "--memory-cap",
        default=None,
        help="also run the disk tier and the floor in a memory cgroup of "
        "this size (resident set and page cache), e.g. 1100MiB",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="with --memory-cap: this many more rounds of the capped "
        "disk-tier rows, each paired with an O_DIRECT floor measured right after it",
    )
    p.add_argument("--floor-read", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--floor-write", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--floor-hold", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return run_or_child(
        args,
        {
            "memory": child_chunk,
            "disk": child_chunk,
            "disk_early": child_chunk,
            "deepspeed": child_deepspeed,
            "floor": child_floor,
        },
        measure,
        render,
    )


if __name__ == "__main__":
    main()
