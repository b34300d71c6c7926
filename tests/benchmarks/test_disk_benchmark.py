"""benchmarks/disk.py at a tiny size and its parts: every row, a failed child, the capped rounds' pairing, the table."""

import pytest

from tests.benchmarks.scripts import load

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's


def test_disk_benchmark_runs_every_row(tmp_path, capsys):
    res = load("disk").main(
        [
            "--width",
            "128",
            "--depth",
            "4",
            "--context",
            "16",
            "--steps",
            "3",
            "--host-limit",
            "3MiB",
            "--device-limit",
            "4MiB",
            "--dir",
            str(tmp_path / "scratch"),
            "--out",
            str(tmp_path / "disk.json"),
            "--memory-cap",
            "1GiB",
        ]
    )
    rows = res["rows"]
    assert rows["memory"]["stats"]["disk_shards"] == 0 and len(rows["memory"]["step_times"]) == 3
    disk = rows["disk"]
    assert disk["stats"]["disk_shards"] > 0 and disk["last_step"]["disk_read_bytes"] > 0
    assert disk["params"] * 16 >= 4 * 3 * 2**20  # the state is at least 4x the host limit
    assert res["floor"]["seconds"] > 0 and res["floor"]["write_bytes"] > 0
    early = rows["disk_early"]  # no gradient file: fewer bytes than the plain disk row, and a floor of its own
    assert early["stats"]["disk_shards"] == disk["stats"]["disk_shards"]
    assert early["last_step"]["disk_write_bytes"] < disk["last_step"]["disk_write_bytes"]
    assert 0 < res["floor_early"]["write_bytes"] < res["floor"]["write_bytes"]
    ds = rows["deepspeed"]
    assert "skipped" in ds or ds["step_times"]  # never faked
    # in a memory cgroup where one can be made (root, or a delegated subtree); elsewhere the reason, never faked
    capped, capped_floor = rows["disk_capped"], rows["floor_capped"]
    if "skipped" in capped:
        assert capped["skipped"].startswith("no memory cgroup could be made here") and "skipped" in capped_floor
    else:
        # (the peak reads 0 where the kernel has no memory.peak: cgroup v2 before Linux 5.19)
        assert capped["cgroup_peak"] <= 2**30 and len(capped["step_times"]) == 3 and capped_floor["seconds"] > 0
        assert len(rows["disk_early_capped"]["step_times"]) == 3
    out = capsys.readouterr().out
    assert "disk floor" in out and "memory capped" in out and "stepped in backward" in out
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == []  # scratch and floor file removed


def test_a_disk_row_whose_child_wrote_nothing_is_failed_not_the_row_before_it(tmp_path):
    """The capped rows reuse the uncapped rows' result file names: a capped child killed before writing its own
    (DeepSpeed in a 1 GiB cgroup) once read the uncapped row's numbers as its own."""
    disk = load("disk")
    args = disk.argparse.Namespace(
        dir=str(tmp_path / "scratch"),
        host_limit="1MiB",
        device_limit="1MiB",
        disk_io="auto",
        width=8,
        depth=1,
        context=4,
        batch=1,
        steps=1,
    )
    (tmp_path / "res.nosuchrow").write_text('{"step_times": [1.0]}')  # what an earlier run of the same name left
    row = disk._run("nosuchrow", args, tmp_path)
    assert "failed" in row and "step_times" not in row


def test_disk_rounds_pair_each_capped_step_with_the_floor_measured_right_after_it(monkeypatch, tmp_path):
    """``--rounds``: the disk's speed moves between minutes, so each capped row is followed at once by the O_DIRECT
    floor of its own bytes, and the ratio is the median of the per-round ratios (a round where the disk was slow
    for both sides does not count against the row)."""
    disk = load("disk")
    events = []
    speed = iter([1.0, 1.0, 2.0, 2.0, 1.0, 1.0])  # the disk twice as slow in the second round, for both rows

    class NoCgroup:
        def __init__(self, limit, name):
            pass

        def remove(self):
            pass

    def fake_run(name, args, scratch, cap=None, extra=None):
        events.append(("row", name))
        fake_run.factor = next(speed)
        return {"step_times": [9.0, 1.2 * fake_run.factor, 1.2 * fake_run.factor]}

    def fake_floor(directory, read_bytes, write_bytes, *, direct=False):
        assert direct
        events.append(("floor", read_bytes))
        return 1.0 * fake_run.factor

    monkeypatch.setattr(disk, "_run", fake_run)
    monkeypatch.setattr(disk, "disk_floor", fake_floor)
    monkeypatch.setattr(disk, "MemoryCgroup", NoCgroup)
    args = disk.argparse.Namespace(rounds=3, dir=str(tmp_path))
    rounds = disk.capped_rounds(args, tmp_path, 2**30, {"disk": (30, 20), "disk_early": (10, 5)})
    assert len(rounds) == 3
    for k in range(3):  # in every round each row once, each followed by three floors of its own bytes
        part = events[8 * k : 8 * k + 8]
        rows = [e[1] for e in part if e[0] == "row"]
        assert sorted(rows) == ["disk", "disk_early"]
        for i in (0, 4):
            assert part[i + 1 : i + 4] == [("floor", {"disk": 30, "disk_early": 10}[part[i][1]])] * 3
    assert [r["disk"]["step_s"] / r["disk"]["direct_floor_s"] for r in rounds] == pytest.approx([1.2] * 3)
    table = disk.render(
        {
            "args": dict(
                width=8, depth=1, context=4, batch=1, steps=3, host_limit="1MiB", device_limit="1MiB", dir=str(tmp_path)
            ),
            "rows": {},
            "rounds": rounds,
        }
    )
    assert "| **1.20** |" in table and "disk tier stepped in backward (the default), memory capped" in table


def test_disk_table_shows_deepspeed_beside_the_disk_tier_and_a_kill_in_the_cgroup_as_such():
    """The DeepSpeed rows, which CI cannot run (no deepspeed there): its step against the disk tier's, the state
    ratio of the same GPT, and a capped child the OOM killer ended named as killed, never as a number."""
    disk = load("disk")
    row = lambda step, **kw: {"step_times": [9.0, step, step], "peak_rss": 2 << 30, "baseline_rss": 1 << 30, **kw}  # noqa: E731
    res = {
        "args": dict(width=8, depth=1, context=4, batch=1, steps=3, host_limit="1MiB", device_limit="1MiB", dir="/x"),
        "rows": {
            "memory": row(0.5, params=1 << 20),
            "disk": row(
                1.0,
                params=1 << 20,
                stats=dict(disk_shards=3, chunks=4, disk_chunk_bytes=1),
                last_step=dict(disk_read_bytes=1, disk_write_bytes=1, disk_wait_s=0.1),
            ),
            "deepspeed": row(2.0),
            "deepspeed_capped": {"failed": "killed (SIGKILL) inside the 1024 MiB memory cgroup", "returncode": -9},
        },
        "memory_cap": 1 << 30,
    }
    out = disk.render(res)
    ds = next(line for line in out.splitlines() if line.startswith("| DeepSpeed ZeRO-Infinity (nvme) |"))
    assert "| 2.00 |" in ds and "| 16.0× |" in ds and "the disk tier's step is 0.50× this one" in ds
    assert "| DeepSpeed ZeRO-Infinity (nvme), memory capped | — |" in out and "killed (SIGKILL)" in out
