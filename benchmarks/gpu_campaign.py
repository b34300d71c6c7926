"""Everything a lent GPU should measure, by parts that fit a lease: one JSON and one markdown table.

    python benchmarks/gpu_campaign.py --out $OUT/gpu_campaign.json     # on the GPU machine (../shared/GPU.md)
    python benchmarks/gpu_campaign.py --smoke --out /tmp/c.json        # all of it on CPU at a tiny size (the tests)

Parts, in this order, each given what is left of ``--budget`` seconds (at most ``--cap PART=SECONDS``); the JSON
and the table are rewritten after each, so a run stopped part-way keeps what it measured (``--parts`` runs some
again, ``--contenders`` picks rows, ``--probes-from`` reuses an earlier run's probes on the same kind of machine).
Every part at once does not fit one 10-minute command (on an H200 on 2026-11-30: ``tests`` 90 s, ``probes`` 76 s,
a contender's row about 100 s, the 9.0B model's set-up 148 s), so a lease measures first what the committed results
lack, for example (the largest model bounded by the DDP row of the run it takes the probes from):

    python benchmarks/gpu_campaign.py --parts largest contenders tests --contenders "chunk_offload step_in_backward" \
      --cap largest=400 contenders=110 --probes-from benchmarks/results/gpu_campaign.json --budget 560 \
      --out $OUT/gpu_campaign.json

- ``tests``: ``pytest tests/gpu``: passed, failed, skipped, and why the first failures failed (where, the error).
- ``probes``: the roofline's inputs. Host to device and back, pinned and pageable (GB/s, 512 MiB copies); host
  memory bandwidth with the host Adam's access pattern (``optimizer_step.py``'s floor: read parameter, gradient
  and both moments, write them and a bf16 copy, 30 bytes a parameter); the host Adam itself (``ours+bf16``) at
  this process's thread count, which is one rank's share of the cores on a one-GPU machine; a bf16 matmul's
  TFLOP/s.
- ``contenders``: ``gpu.py``'s rows for the 1.0B GPT (DDP, ``chunk_offload`` under a limit with and without
  ``step_in_backward``, its default, DeepSpeed ZeRO-3 offload, Lightning's FSDP with CPU offload), each with
  its bound; a chunk_offload row profiles a step more (host ops, the device busy), counts copies a drain landed.
- ``largest``: the largest Llama-shaped model (Llama-2 7B's widths, layers added) that ``lightning-chunk plan``
  says fits this GPU and 80% of the host's available memory (within a container's limit) with the device limit at
  85% of the GPU and the activations ``activation_bytes`` estimates, built on the meta device and streamed, trained
  ``--largest-steps`` steps in bf16-mixed, stepped in backward (as the plan counts it: the gradient shards given
  back); the row keeps each step's seconds, the resident set every 5 s, so a run killed for memory says how far it
  got, and the seconds of the engine's calls in set-up and the first two steps (``watch_calls``; the chunk_offload rows'
  too); a failure steps down a fifth of the layers (not below 7B) while time is left. Its T_gpu takes the FLOP/s DDP
  achieved on the 1.0B GPT (in this run, or in the one ``--probes-from`` names). Its host shards are pinned to the
  byte (``pin_memory="exact"``: 48 layers, 10.0B, on 80 GB and 128 GiB, where torch's power-of-two blocks allow 38)
  where ``tests/gpu``'s checks of that pinning passed in this run (they run first when ``tests`` is not among the
  parts); else, and after a failed try pinned to the byte, pageable where that plans more layers than torch's
  blocks or where their measured pace would spend over a quarter of the time left pinning, else in torch's blocks
  (``choose_pinning``; the row says why, and the paces).

[Note: a step's bound]
With the optimizer state of some shards on the host, a step cannot take less than the longest of three streams
that can all run at once: T_gpu = the model's FLOPs a step / the FLOP/s DDP achieves on the same GPU (its
model TFLOP/s, the same kernels without offload), T_cpu = 30 bytes x the parameters the host Adam steps / the
host bandwidth of that access pattern, and T_pcie = the bytes copied each way a step (the engine's own counts,
averaged over the steps after ``--skip``) / the pinned bandwidth that way. The bound is their maximum; the
first chunk's tail (its step cannot overlap the backward that ends with it) is left out, so the bound flatters
the hardware a little. ZeRO-Offload's schedule pays their sum. Rows without the engine's counts (DeepSpeed,
FSDP: every optimizer state on the host) are held to the same bound with every parameter stepped on the host
and 2 bytes a parameter each way; DDP's own row has none.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _campaign_table import render  # noqa: E402
from _common import ROOT, clean_env, run_ranks, save_results  # noqa: E402
from _llama_size import (  # noqa: E402
    LLAMA,
    MIN_LAYERS,
    choose_pinning,
    first_touch_paces,
    fitting_layers,
    host_bytes,
    model_params,
    pinning_paces,
    train_largest,
)
from _pytest_report import failure_reasons, outcomes  # noqa: E402

PARTS = ("tests", "probes", "contenders", "largest")
ADAM_BYTES = 30  # a parameter the host Adam reads and writes, the bf16 copy included
TINY_LLAMA = dict(hidden=64, intermediate=128, heads=4, kv_heads=4, vocab=256)


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def part_tests(args: argparse.Namespace, budget: float, select: list[str] | None = None) -> dict:
    """``pytest tests/gpu``: its summary, failures and why, and the tests that passed; stopped at ``budget``, what
    it had reported by then (each test's outcome as it ends: ``-v``)."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=short", "tests/gpu", *(select or [])]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, cwd=ROOT, env=clean_env())
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        ended = outcomes(out.splitlines())
        stopped = {k: sum(v == k for v in ended.values()) for k in ("PASSED", "FAILED", "ERROR")}
        return {
            "failed": f"tests/gpu ran past {budget:.0f} s",
            "summary": f"stopped at {budget:.0f} s: " + ", ".join(f"{n} {k.lower()}" for k, n in stopped.items()),
            "failures": [f"{v} {k}" for k, v in ended.items() if v in ("FAILED", "ERROR")][:10],
            "passed": [k for k, v in ended.items() if v == "PASSED"],
        }
    lines = r.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if " in " in ln and ("passed" in ln or "skipped" in ln)), "")
    return {
        "rc": r.returncode,
        "summary": summary.strip("= ") or (lines[-1:] or ["no output"])[0],
        "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:10],
        "reasons": failure_reasons(lines),
        "passed": [k for k, v in outcomes(lines).items() if v == "PASSED"],
        "seconds": time.perf_counter() - t,
    }


def _copy_gbps(nbytes: int) -> dict[str, float]:
    """Host to device and back, pinned and pageable: GB/s, the best of five."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for kind in ("pinned", "pageable"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        host.fill_(1)
        for way, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            best = float("inf")
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                dst.copy_(src, non_blocking=kind == "pinned")
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            out[f"{way}_{kind}"] = nbytes / best / 1e9
    return out


def _matmul_tflops(n: int) -> float:
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - t) / 1e12


def part_probes(args: argparse.Namespace, budget: float) -> dict:
    import torch

    out: dict[str, Any] = {"threads": torch.get_num_threads(), **first_touch_paces()}
    if args.accelerator == "cuda":  # first: they need no compiler, the host Adam's kernels may
        out.update(_copy_gbps(args.copy_bytes))
        out["matmul_tflops"] = _matmul_tflops(8192)
    else:
        out["copies"] = "skipped: needs CUDA"
    try:
        res = _load("optimizer_step").measure(args.probe_numel, args.probe_repeats, only=["ours+bf16"])
    except Exception as e:  # noqa: BLE001 - the copy probes stand without it
        out["host"] = f"failed: {type(e).__name__}: {e}"[:300]
        return out
    rows = {r["contender"]: r for r in res["rows"]}
    out.update(
        host_floor=res["floor"],
        host_bandwidth_gbps=rows["floor+bf16"]["GB_per_s"],
        host_adam_gbps=rows["ours+bf16"]["GB_per_s"],
        host_adam_params_per_s=args.probe_numel / rows["ours+bf16"]["median_s"],
    )
    return out


def bound(row: dict, probes: dict, ddp_tflops: float | None) -> dict:
    """[Note: a step's bound] for one contender's row: its three times and their maximum, in seconds."""
    if "median_s" not in row or row["contender"] == "ddp" or not ddp_tflops or "host_bandwidth_gbps" not in probes:
        return {}  # no bound without DDP's FLOP/s and the host probe
    inf = float("inf")  # no copy probe (a CPU run): no copies to wait for
    flops_per_step = row["tflops"] * row["median_s"] * 1e12
    measured = "host_stepped" in row
    host_params = row["host_stepped"] if measured else row["params"]
    h2d = row["h2d_per_step"] if measured else 2 * row["params"]
    d2h = row["d2h_per_step"] if measured else 2 * row["params"]
    times = {
        "t_gpu": flops_per_step / (ddp_tflops * 1e12),
        "t_cpu": ADAM_BYTES * host_params / (probes["host_bandwidth_gbps"] * 1e9),
        "t_pcie": max(h2d / (probes.get("h2d_pinned", inf) * 1e9), d2h / (probes.get("d2h_pinned", inf) * 1e9)),
    }
    step_bound = max(times.values())
    return {**times, "bound_s": step_bound, "vs_bound": row["median_s"] / step_bound if step_bound else None}


def part_contenders(args: argparse.Namespace, budget: float, probes: dict) -> dict:
    gpu = _load("gpu")
    ns = argparse.Namespace(**{k: getattr(args, k) for k in ("width", "depth", "context", "batch", "steps", "skip")})
    ns.accelerator, ns.device_limit, ns.largest, ns.profile = args.accelerator, args.device_limit, False, True
    ns.contenders = args.contenders
    ns.deadline = time.monotonic() + budget
    res = gpu.measure(ns)
    ddp = next((r for r in res["rows"] if r["contender"] == "ddp" and "tflops" in r), None)
    for r in res["rows"]:
        r.update(bound(r, probes, ddp and ddp["tflops"]))
    return res


EXACT_TESTS = ("exact", "pinned_to_the_byte")  # what tests/gpu's checks of pin_memory="exact" are named by


def exact_pinning_passed(args: argparse.Namespace, tests: dict | None, budget: float) -> bool:
    """Whether ``tests/gpu``'s checks of ``pin_memory="exact"`` passed: in this run's ``tests`` part, or run now."""
    if args.accelerator != "cuda":
        return False

    def ran(t: dict) -> bool:  # some check of it ended (a part stopped at its cap may not have come to them)
        ended = t.get("passed", []) + t.get("failures", [])
        return "summary" in t and ("passed" not in t or any(n in f for f in ended for n in EXACT_TESTS))

    if tests is None or not ran(tests):
        tests = part_tests(args, min(budget, 120), ["-k", " or ".join(EXACT_TESTS)])
    if "passed" in tests:
        passed = any(name in p for p in tests["passed"] for name in EXACT_TESTS)
    else:
        passed = "passed" in tests.get("summary", "")
    return passed and not any(name in f for f in tests.get("failures", []) for name in EXACT_TESTS)


def part_largest(
    args: argparse.Namespace, budget: float, probes: dict, ddp_tflops: float | None, tests: dict | None = None
) -> dict:
    deadline = time.monotonic() + budget
    pin: bool | str = True  # pin_memory
    paces: dict[str, Any] = {}  # GB/s of pinning fresh memory: what set-up's pinned shards cost

    def sized(exact_ok: bool) -> tuple[bool | str, str, int, int]:  # pin_memory, why, layers, the planned host peak
        peaks = {}
        for mode in ("exact", True, False) if exact_ok else (True, False):
            layers, report = fitting_layers(args, limit, mode)
            peaks[mode] = (layers, max(p.host for p in report.phases))
        pin, why = choose_pinning(exact_ok, paces, peaks, deadline - time.monotonic())
        return pin, why, *peaks[pin]

    why = ""
    if args.smoke:
        layers, limit, planned = 2, None, None
        base = TINY_LLAMA
    else:
        import torch

        limit = int(0.85 * torch.cuda.get_device_properties(0).total_memory) if args.accelerator == "cuda" else None
        paces = pinning_paces() if args.accelerator == "cuda" else {}
        pin, why, layers, planned = sized(exact_pinning_passed(args, tests, budget / 4))
        base = LLAMA
    capacity = (args.host_memory or host_bytes()) / 12  # the yardstick: 12 host bytes a parameter
    tries = []
    while True:
        shape = {**base, "layers": layers}
        out = Path(args.scratch) / f"largest_{layers}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "largest", "--child-out", str(out)]
        cmd += ["--shape", json.dumps(shape), "--accelerator", args.accelerator, "--largest-limit", str(limit or "")]
        cmd += ["--largest-pin", str(pin).lower()]
        for k in ("largest_steps", "largest_batch", "largest_context"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        left = deadline - time.monotonic()
        rc, log = run_ranks(cmd, 1, clean_env(), timeout=max(left, 1))
        row: dict[str, Any] = {
            "contender": f"Llama {layers} layers",
            "layers": layers,
            "params": model_params(shape),
            "planned_peak_host": planned,
            "pin_memory": pin,
            **({"pin_why": why, "pin_gbps": paces} if why else {}),
        }
        res = json.loads(out.read_text()) if out.exists() else {}
        marks, times = res.pop("marks", {}), res.pop("times", [])
        rss = res.pop("rss", [])
        if res.get("calls"):  # where set-up's and the first step's seconds went, a stopped try's too
            row["calls"] = res.pop("calls")
        if rss:  # the resident set every 5 s: where a child killed for memory got to
            row.update(peak_resident_gb=max(r for _, r in rss), resident_gb=rss)
        if "set_up" in marks:  # seconds from the child's start to the first step, and that (warm-up) step's
            row.update(set_up_s=marks["set_up"] - marks["started"], first_step_s=(times or [None])[0])
        steady = times[1:]  # the first step is the warm-up's
        if steady:  # all of them, or those done when the budget stopped it
            row["steps_done"] = len(times)
            row["step_s"] = [round(t, 3) for t in times]  # each step's: one-time costs show as a step apart
            step = statistics.median(steady)
            tokens = args.largest_batch * args.largest_context
            flops = 6 * res["params"] * tokens + 12 * layers * shape["hidden"] * args.largest_context * tokens
            row.update(res, median_s=step, tokens_per_s=tokens / step, tflops=flops / step / 1e12)
            row["of_host_capacity"] = res["params"] / capacity
            row.update(bound(row, probes, ddp_tflops))
            tries.append(row)
            return {"rows": tries}
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or [f"exit {rc}, no output"]
        if rc < 0:  # its last line says nothing of a kill: the kernel's out-of-memory killer sends SIGKILL
            tail = [f"killed by signal {-rc}" + (f" at {row['peak_resident_gb']} GB resident" if rss else "")]
        if time.monotonic() >= deadline - 1:  # its last line was a warning the try printed long before (2026-12-04)
            tail = [f"stopped at the part's {budget:.0f} s"]
        row["failed"] = f"after {len(times)} steps: " * bool(marks) + tail[0][:300]
        tries.append(row)
        smaller, was = max(layers * 4 // 5, MIN_LAYERS), pin
        if pin == "exact":  # the next try in torch's pinned blocks (or pageable), at the size their plan allows
            pin, why, smaller, planned = sized(False)
        if args.smoke or (smaller, pin) == (layers, was) or deadline - time.monotonic() < 60:
            return {"rows": tries}
        layers = smaller


def _machine(args: argparse.Namespace) -> dict:
    import torch

    info: dict[str, Any] = {"device": "cpu", "driver": None, "torch": torch.__version__}
    if args.accelerator == "cuda":
        info["device"] = torch.cuda.get_device_name(0)
        try:
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            info["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        info["commit"] = sha.stdout.strip() or None
    except OSError:
        info["commit"] = None
    info["host_memory"] = args.host_memory or host_bytes()
    return info


def _cap(text: str) -> tuple[str, float]:
    part, _, seconds = text.partition("=")
    try:
        if part in PARTS and float(seconds) > 0:
            return part, float(seconds)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not PART=SECONDS with PART one of {', '.join(PARTS)}")


def _ddp_row(parts: dict) -> dict:
    """The DDP row of a run's ``contenders`` part that measured one (its model TFLOP/s are T_gpu's yardstick)."""
    return next(
        (r for r in parts.get("contenders", {}).get("rows", []) if r["contender"] == "ddp" and "tflops" in r), {}
    )


def measure(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.budget
    res: dict[str, Any] = {"machine": _machine(args), "smoke": args.smoke, "parts": {}}
    parts = res["parts"]
    Path(args.scratch).mkdir(parents=True, exist_ok=True)

    def keep() -> None:  # after each part: a run stopped later keeps what it measured
        save_results(res, args.out)
        Path(args.out).with_suffix(".md").write_text(render(res) + "\n")

    earlier: dict = {}
    if args.probes_from:  # an earlier run's probes on the same kind of machine, named as such
        earlier = json.loads(Path(args.probes_from).read_text())
        probes = earlier["parts"]["probes"]  # a file that reused probes itself names where they were measured
        parts["probes"] = {**probes, "from": probes.get("from") or {"file": args.probes_from, **earlier["machine"]}}
        parts["probes"].update(first_touch_paces())  # this machine's: seconds, not a bound
    caps = dict(args.cap)
    for name in args.parts:
        left = min(deadline - time.monotonic(), caps.get(name, args.budget))
        if left < 5:
            parts[name] = {"failed": "no time left in --budget"}
            continue
        t = time.perf_counter()
        try:
            if name == "tests":
                parts[name] = part_tests(args, left)
            elif name == "probes":
                parts[name] = part_probes(args, left)
            elif name == "contenders":
                parts[name] = part_contenders(args, left, parts.get("probes", {}))
            else:
                ddp, ddp_from = _ddp_row(parts), None
                if "tflops" not in ddp and _ddp_row(earlier.get("parts", {})):  # T_gpu from DDP's run on that machine
                    ddp, ddp_from = _ddp_row(earlier["parts"]), parts["probes"]["from"]
                tests = parts.get("tests")
                parts[name] = part_largest(args, left, parts.get("probes", {}), ddp.get("tflops"), tests)
                if ddp_from is not None:
                    parts[name]["ddp_from"] = ddp_from
        except Exception as e:  # noqa: BLE001 - one part failing must not lose the others' numbers
            parts[name] = {"failed": f"{type(e).__name__}: {e}"[:300]}
        parts[name]["seconds"] = time.perf_counter() - t
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        keep()
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="every part on CPU at a tiny size")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--budget", type=float, default=480, help="seconds for all parts together")
    p.add_argument("--cap", nargs="*", type=_cap, default=[], metavar="PART=SECONDS", help="a part's most seconds")
    p.add_argument("--contenders", nargs="+", choices=_load("gpu").CONTENDERS, help="gpu.py's rows (default: all)")
    p.add_argument("--probes-from", help="take the probes from this earlier campaign JSON instead of running them")
    p.add_argument("--out", default="benchmarks/results/gpu_campaign.json")
    p.add_argument("--host-memory", type=int, default=0, help="bytes (default: what this machine has available)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--largest-limit", default="", help=argparse.SUPPRESS)
    p.add_argument("--largest-pin", choices=("true", "false", "exact"), default="true", help=argparse.SUPPRESS)
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cuda")
    # four steps: the median of the three after the warm-up's, so one second step's one-time costs (first touches of
    # the bf16 gradient buffers; 6.9 s against 3.4 after on CPU for a 0.67B Llama) do not make the row's s/step
    for name, default in (("largest-steps", 4), ("largest-batch", 1), ("largest-context", 2048)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args(argv)
    if args.child:
        train_largest(args)
        return {}
    gpt = dict(width=2048, depth=20, context=1024, batch=8, steps=8, skip=3)
    args.device_limit, args.probe_numel, args.probe_repeats, args.copy_bytes = "12GiB", 200_000_000, 5, 512 * 2**20
    if args.smoke:  # a tiny run of everything on CPU; the limit leaves shards on the host tier
        gpt = dict(width=64, depth=2, context=16, batch=2, steps=3, skip=1)
        args.accelerator, args.device_limit, args.probe_numel, args.probe_repeats = "cpu", "300KB", 100_000, 2
        args.largest_context = 16
    vars(args).update(gpt)
    args.scratch = str(Path(args.out).with_suffix("")) + ".scratch"
    res = measure(args)
    print(render(res), flush=True)
    return res


if __name__ == "__main__":
    main()
