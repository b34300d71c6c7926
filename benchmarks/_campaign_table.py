"""The GPU campaign's report (``gpu_campaign.py``): its JSON as the markdown that docs/benchmarks.md takes."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def time_spent(rows: list[dict]) -> list[str]:
    """Each row's wall time by phase ([Note: where a row's time goes]) and, for chunk_offload's rows, the host's
    seconds a timed step by cause ([Note: where a step's time goes]; ``traffic``)."""
    spent = [r for r in rows if r.get("phases")]
    waits = [r for r in rows if r.get("host_s_per_step")]
    out = []
    if spent:
        wall = "; ".join(
            f"{r['contender']} {r['wall_s']:.0f} ("
            + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items() if v >= 0.05)
            + ")"
            for r in spent
        )
        out += [f"Seconds a row, by phase: {wall}", ""]
    if waits:
        host = "; ".join(
            f"{r['contender']} ("
            + ", ".join(f"{k} {v:.3f}" for k, v in r["host_s_per_step"].items() if v >= 0.0005)
            + f" of {r['median_s']:.3f})"
            for r in waits
        )
        out += [f"Host seconds a step, by cause: {host}", ""]
    for r in rows:  # the staging ring full: the autograd thread lands copies the worker had not come to
        if r.get("grad_copies", {}).get("grad_copies_handed_over"):
            c = r["grad_copies"]
            out += [
                f"{r['contender']}: {c['grad_copies_landed_by_drain']} of {c['grad_copies_handed_over']} gradient "
                "copies handed to the worker were landed by a drain first (in all steps)"
                + (f"; {n} chunk steps from bf16 gradients" if (n := c.get("chunks_stepped_from_bf16_grads")) else ""),
                "",
            ]
    out += call_lines(rows)
    for r in rows:  # ``--profile``: what the host's own time in one step went to
        prof = r.get("profile", {})
        if prof.get("host_self_ms"):
            ops = ", ".join(f"{k} {ms:.1f} ({n})" for k, ms, n in prof["host_self_ms"][:8])
            out += [f"{r['contender']}, a profiled step, the host's own ms (calls): {ops}", ""]
        if prof.get("busy_ms"):
            out += [
                f"{r['contender']}, a profiled step: {prof['step_ms']:.1f} ms, the device busy {prof['busy_ms']:.1f} "
                f"(kernels {prof['compute_ms']:.1f})",
                "",
            ]
    return out


def call_lines(rows: list[dict]) -> list[str]:
    """The engine's calls that took longest in each row's set-up and first two steps (``watch_calls``)."""
    out = []
    for r in rows:
        for phase, calls in r.get("calls", {}).items():
            top = sorted(((v[0], v[1], k) for k, v in calls.items() if v[0] >= 0.05), reverse=True)[:5]
            if top:
                said = ", ".join(f"{k} {sec:.1f} ({n})" for sec, n, k in top)
                out += [f"{r['contender']}, {phase}, seconds (calls): {said}", ""]
    return out


def _table(rows: list[dict]) -> list[str]:
    out = [
        "| contender | params | s/step | tokens/s | model TFLOP/s | peak device GiB | peak host GiB | x DDP | "
        "T_gpu / T_cpu / T_pcie s | x bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "median_s" not in r:
            why = r.get("skipped") and "skipped: " + r["skipped"] or "failed: " + r.get("failed", "?")
            out.append(f"| {r['contender']} | {r.get('params', 0):,} | {why} |  |  |  |  |  |  |  |")
            continue
        parts = " / ".join(_num(r.get(k), ".3f") for k in ("t_gpu", "t_cpu", "t_pcie")) if "bound_s" in r else "-"
        out.append(
            f"| {r['contender']} | {r['params']:,} | {r['median_s']:.3f} | {_num(r.get('tokens_per_s'), '.0f')} | "
            f"{r['tflops']:.1f} | {r['peak_device'] / GIB:.2f} | {r['peak_host'] / GIB:.2f} | "
            f"{_num(r.get('vs_ddp'), '.2f')} | {parts} | {_num(r.get('vs_bound'), '.2f')} |"
        )
    return out


def render(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"GPU campaign on {m['device']} (driver {m['driver'] or '-'}), torch {m['torch']}, host "
        f"{m['host_memory'] / GIB:.0f} GiB, commit {m['commit'] or '-'}",
        "",
    ]
    parts = {k: v for k, v in res["parts"].items() if "failed" not in v or k == "tests"}
    lines += [f"{k}: failed: {v['failed']}" for k, v in res["parts"].items() if k not in parts]
    if "tests" in parts:
        t = parts["tests"]
        lines += [f"tests/gpu: {t.get('summary') or t.get('failed')}", *(f"  {f}" for f in t.get("failures", []))]
        for test, why in t.get("reasons", {}).items():  # where each failure was raised and its first error lines
            lines += [f"  {test}:", *(f"    {w}" for w in why[:4])]
        lines.append("")
    if "probes" in parts:
        p = parts["probes"]
        ways = ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable")
        copies = (
            "copies "
            + ", ".join(f"{k} {p[k]:.1f}" for k in ways)
            + f" GB/s; bf16 matmul {p['matmul_tflops']:.0f} TFLOP/s"
            if "h2d_pinned" in p
            else "copies " + p.get("copies", "-")
        )
        host = (
            f"host memory {p['host_bandwidth_gbps']:.1f} GB/s (the Adam pattern, {p['host_floor']}); "
            f"host Adam {p['host_adam_gbps']:.1f} GB/s on {p['threads']} threads"
            if "host_adam_gbps" in p
            else f"host probes {p.get('host')}"
        )
        if "host_first_touch_gbps" in p:
            host += f"; fresh host pages written at {p['host_first_touch_gbps']:.2f} GB/s"
            if "host_first_touch_huge_gbps" in p:  # transparent huge pages, asked for
                host += f", {p['host_first_touch_huge_gbps']:.2f} in huge pages ({p['transparent_hugepages']})"
        earlier = p.get("from")  # --probes-from
        whence = f" (from {earlier['commit']} on {earlier['device']})" if earlier else ""
        lines += [f"probes{whence}: {copies}; {host}", ""]
    if "contenders" in parts:
        c = parts["contenders"]
        if "rows" in c:
            lines += [
                f"GPT width {c['width']}, depth {c['depth']}, context {c['context']}, batch {c['batch']}; "
                f"chunk_offload device limit {c['device_limit']}",
                "",
                *_table(c["rows"]),
                "",
                *time_spent(c["rows"]),
            ]
    if "largest" in parts and "rows" in parts["largest"]:
        rows = parts["largest"]["rows"]
        lines += ["Largest Llama-shaped model (bf16-mixed, built on the meta device):", "", *_table(rows)]
        if "ddp_from" in parts["largest"]:  # no DDP row in this run
            src = parts["largest"]["ddp_from"]
            lines.append(f"\nT_gpu from DDP's TFLOP/s of {src.get('commit')} on {src.get('device')}")
        for r in rows:  # where a lease's minutes went, and how its host shards were held
            if "set_up_s" in r:
                first = _num(r["first_step_s"], ".1f")
                lines.append(f"\n{r['contender']}: set-up {r['set_up_s']:.1f} s, warm-up step {first} s")
            if "pin_why" in r:
                paces = ", ".join(f"{k} {v}" for k, v in r.get("pin_gbps", {}).items())
                lines.append(f"\n{r['contender']}: pin_memory={r['pin_memory']} ({r['pin_why']}; GB/s: {paces})")
        calls = call_lines(rows)
        lines += ["", *calls] if calls else []
        done = [r for r in rows if "of_host_capacity" in r]
        if done:
            share = done[-1]["of_host_capacity"]
            lines.append(
                f"\n{done[-1]['params'] / 1e9:.1f}B parameters: {share:.0%} of the host at 12 bytes a parameter"
            )
    return "\n".join(lines)
