"""benchmarks/disk.py's markdown table: a row a contender with its step, peaks and notes, and the capped rounds'
ratios with their interval."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, median_interval  # noqa: E402

sys.path.insert(0, str(ROOT))
from lightning_chunk.engine.config import parse_bytes  # noqa: E402


def median_after_first(times: list[float]) -> float:
    rest = sorted(times[1:] or times)
    return rest[len(rest) // 2]


def _io_mode(row: dict) -> str:
    """What ``disk_io="auto"`` chose for a disk-tier row."""
    if "disk_direct_io" not in row:
        return "disk_io not recorded"
    return "past the page cache (O_DIRECT)" if row["disk_direct_io"] else "through the page cache"


def render(res: dict) -> str:
    a = res["args"]
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    limit = parse_bytes(a["host_limit"], field="--host-limit") + parse_bytes(a["device_limit"], field="--device-limit")
    lines = [
        f"GPT width {a['width']} depth {a['depth']}, context {a['context']}, batch {a['batch']}, {a['steps']} "
        f"steps, 1 rank; host_memory_limit {a['host_limit']}, device_memory_limit {a['device_limit']} "
        f"(limit {mib(limit)}), disk_dir {a['dir']}",
        "",
    ]
    lines.append("| row | s a step | peak RSS | − baseline | under baseline + limit | state / host limit | notes |")
    lines.append("|---|---|---|---|---|---|---|")
    floor = res.get("floor")
    for name, label in (
        ("memory", "in memory (placement=host)"),
        ("disk", "disk tier, stepped after backward"),
        ("disk_early", "disk tier, stepped in backward (the default)"),
        ("deepspeed", "DeepSpeed ZeRO-Infinity (nvme)"),
    ):
        r = res["rows"].get(name)
        if r is None:
            continue
        if "failed" in r or "skipped" in r:
            reason = r.get("skipped") or r["failed"].strip().splitlines()[-1]
            lines.append(f"| {label} | — | — | — | — | — | cannot run here: {reason} |")
            continue
        step = median_after_first(r["step_times"])
        over = r["peak_rss"] - r["baseline_rss"]
        state = (r.get("params") or res["rows"].get("memory", {}).get("params", 0)) * 16  # the same GPT
        host = parse_bytes(a["host_limit"], field="--host-limit")
        note = ""
        if name in ("disk", "disk_early"):
            s, last = r["stats"], r["last_step"]
            note = (
                f"{s['disk_shards']}/{s['chunks']} shards on disk ({gib(s['disk_chunk_bytes'])}); last step read "
                f"{gib(last['disk_read_bytes'])}, wrote {gib(last['disk_write_bytes'])}, waited "
                f"{last['disk_wait_s']:.2f} s, {_io_mode(r)}"
            )
            mem = res["rows"].get("memory", {})
            own = res.get("floor_early") if name == "disk_early" else floor
            if own:
                note += f"; {step / own['seconds']:.2f}× {'its' if name == 'disk_early' else 'the'} disk floor"
                if "step_times" in mem:
                    extra = step - median_after_first(mem["step_times"])
                    note += f", its {extra:.2f} s over the in-memory step = {extra / own['seconds']:.2f}× the floor"
        if name == "memory":
            note = f"{r['params'] / 1e6:.1f}M parameters"
        if name == "deepspeed":
            note = "built under zero.Init, swap buffers sized to the model"
            disk_row = res["rows"].get("disk", {})
            if "step_times" in disk_row:
                note += f"; the disk tier's step is {median_after_first(disk_row['step_times']) / step:.2f}× this one"
        fits = "yes" if over <= limit else "no"
        lines.append(
            f"| {label} | {step:.2f} | {gib(r['peak_rss'])} | {mib(over)} | "
            f"{fits if name.startswith('disk') else '—'} | {state / host:.1f}× | {note} |"
        )
    for f, label in ((floor, "disk floor"), (res.get("floor_early"), "disk floor, stepped in backward")):
        if not f:
            continue
        lines.append(
            f"| {label} | {f['seconds']:.2f} | | | | | reads {gib(f['read_bytes'])}, writes "
            f"{gib(f['write_bytes'])} with a plain loop in disk_dir (median of 5: "
            f"{min(f['all']):.2f}..{max(f['all']):.2f} s) |"
        )
        if "direct_seconds" in f:
            lines.append(
                f"| {label}, O_DIRECT | {f['direct_seconds']:.2f} | | | | | the same bytes to and from "
                f"the disk itself (median of 5: {min(f['direct_all']):.2f}..{max(f['direct_all']):.2f}"
                " s): the floor where the page cache cannot hold the files |"
            )
        elif "direct_skipped" in f:
            lines.append(f"| {label}, O_DIRECT | — | | | | | cannot run here: {f['direct_skipped']} |")
    if "memory_cap" in res:
        lines += [
            "",
            f"In a memory cgroup of {mib(res['memory_cap'])} (resident set and page cache together):",
            "",
            "| row | s a step | peak RSS | − baseline | cgroup peak | notes |",
            "|---|---|---|---|---|---|",
        ]
        capped_floor = res["rows"].get("floor_capped", {})
        for name, label in (
            ("disk_capped", "disk tier stepped after backward, memory capped"),
            ("floor_capped", "disk floor, memory capped"),
            ("disk_early_capped", "disk tier stepped in backward (the default), memory capped"),
            ("deepspeed_capped", "DeepSpeed ZeRO-Infinity (nvme), memory capped"),
        ):
            if name not in res["rows"]:
                continue
            r = res["rows"][name]
            if "failed" in r or "skipped" in r:
                reason = r.get("skipped") or r["failed"].strip().splitlines()[-1]
                lines.append(f"| {label} | — | — | — | — | cannot run here: {reason} |")
            elif name == "deepspeed_capped":
                step = median_after_first(r["step_times"])
                over = mib(r["peak_rss"] - r["baseline_rss"])
                lines.append(f"| {label} | {step:.2f} | {gib(r['peak_rss'])} | {over} | {mib(r['cgroup_peak'])} | |")
            elif name in ("disk_capped", "disk_early_capped"):
                step, last = median_after_first(r["step_times"]), r["last_step"]
                note = f"waited {last['disk_wait_s']:.2f} s on the disk in the last step, {_io_mode(r)}"
                if name == "disk_capped" and "seconds" in capped_floor:
                    note += f"; {step / capped_floor['seconds']:.2f}× the capped floor"
                own = floor if name == "disk_capped" else res.get("floor_early")
                if own and "direct_seconds" in own:
                    note += f", {step / own['direct_seconds']:.2f}× {'the' if own is floor else 'its'} O_DIRECT floor"
                if name == "disk_early_capped" and "step_times" in res["rows"].get("disk_capped", {}):
                    note += (
                        f"; {step / median_after_first(res['rows']['disk_capped']['step_times']):.2f}× the "
                        "capped disk tier's step"
                    )
                over = mib(r["peak_rss"] - r["baseline_rss"])
                lines.append(
                    f"| {label} | {step:.2f} | {gib(r['peak_rss'])} | {over} | {mib(r['cgroup_peak'])} | {note} |"
                )
            elif "seconds" in r:
                held = f"; beside a resident set of {mib(r['held_rss'])}, the disk tier's" if r.get("held_rss") else ""
                lines.append(
                    f"| {label} | {r['seconds']:.2f} | | | {mib(r['cgroup_peak'])} | median of 5: "
                    f"{min(r['all']):.2f}..{max(r['all']):.2f} s{held} |"
                )
    if res.get("rounds"):
        lines += [
            "",
            f"{len(res['rounds'])} more rounds, each capped row followed at once by the O_DIRECT floor of "
            "its own bytes (median of 3), the order shuffled each round:",
            "",
            "| row | s a step (min..max) | × its O_DIRECT floor, each round | median | 95% interval |",
            "|---|---|---|---|---|",
        ]
        for name, label in (
            ("disk", "disk tier stepped after backward, memory capped"),
            ("disk_early", "disk tier stepped in backward (the default), memory capped"),
        ):
            got = [r[name] for r in res["rounds"] if "step_s" in r.get(name, {})]
            if not got:
                continue
            steps = [g["step_s"] for g in got]
            ratios = [g["step_s"] / g["direct_floor_s"] for g in got]
            low, high = median_interval(ratios)
            lines.append(
                f"| {label} | {statistics.median(steps):.2f} ({min(steps):.2f}..{max(steps):.2f}) | "
                f"{', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}** | "
                f"{low:.2f}..{high:.2f} |"
            )
    return "\n".join(lines)
