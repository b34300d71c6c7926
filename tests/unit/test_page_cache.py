"""``disk_io="auto"``: whether the disk tier's files can stay in the page cache, from ``/proc`` and the memory
cgroups (here fake trees under a temporary directory)."""

from pathlib import Path

from lightning_chunk.engine.system.page_cache import files_stay_cached, page_cache_room, use_direct

GiB = 1 << 30


def _tree(tmp_path: Path, cgroup: str, files: dict[str, str], available_kib: int = 8 * GiB >> 10) -> tuple[Path, Path]:
    proc, sys_cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kib} kB\n")
    (proc / "self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        (sys_cgroup / rel).parent.mkdir(parents=True, exist_ok=True)
        (sys_cgroup / rel).write_text(text)
    return proc, sys_cgroup


def test_without_a_cgroup_limit_the_room_is_what_memory_has_available(tmp_path):
    proc, sys_cgroup = _tree(tmp_path, "0::/user.slice\n", {"user.slice/memory.max": "max\n"})
    assert page_cache_room(proc, sys_cgroup) == 8 * GiB


def test_a_cgroup_v2_limit_anywhere_above_bounds_the_room_less_its_anonymous_memory(tmp_path):
    proc, sys_cgroup = _tree(
        tmp_path,
        "0::/jobs/run1\n",
        {
            "jobs/run1/memory.max": "max\n",
            "jobs/run1/memory.stat": f"anon {GiB}\nfile 5\n",
            "jobs/memory.max": f"{3 * GiB}\n",
            "jobs/memory.stat": f"anon {2 * GiB}\nfile 7\n",
        },
    )
    assert page_cache_room(proc, sys_cgroup) == GiB  # the parent's 3 GiB less its 2 GiB of anonymous memory


def test_a_cgroup_v1_hierarchical_limit_bounds_the_room_less_its_rss(tmp_path):
    proc, sys_cgroup = _tree(
        tmp_path,
        "12:cpu,cpuacct:/x\n7:memory:/bench\n",
        {
            "memory/bench/memory.limit_in_bytes": f"{4 * GiB}\n",
            "memory/bench/memory.stat": f"cache 1\nrss 5\nhierarchical_memory_limit {GiB}\ntotal_rss {GiB // 4}\n",
        },
    )
    assert page_cache_room(proc, sys_cgroup) == GiB - GiB // 4
    # v1's "no limit" is a huge number: only MemAvailable then
    (sys_cgroup / "memory/bench/memory.stat").write_text(f"hierarchical_memory_limit {2**63 - 4096}\ntotal_rss 0\n")
    assert page_cache_room(proc, sys_cgroup) == 8 * GiB


def test_nothing_readable_means_no_room_known(tmp_path):
    assert page_cache_room(tmp_path / "none", tmp_path / "none") is None


def test_auto_goes_past_the_page_cache_only_where_the_files_cannot_stay_cached():
    assert files_stay_cached(GiB, 0, None)  # nothing known: the kernel's default
    assert files_stay_cached(GiB, GiB, 2 * GiB) and not files_stay_cached(GiB + 1, GiB, 2 * GiB)
    assert use_direct("auto", 4 * GiB, GiB // 2, 2 * GiB)
    assert not use_direct("auto", GiB, GiB // 2, 20 * GiB)
    assert use_direct("direct", GiB, 0, 20 * GiB) and not use_direct("buffered", 4 * GiB, 0, GiB)
