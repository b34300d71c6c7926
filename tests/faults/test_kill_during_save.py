"""SIGKILL during a two-rank save, at many points: ``ckpt_path="last"`` always finds a complete checkpoint.

Each point runs ``save_worker.py`` on two ranks, which trains two steps and saves over a ``last.ckpt`` that holds
the one-step checkpoint (A), and kills one rank or every rank just before its n-th event of the save (a file
written, renamed, synced or removed, a directory made, a collective agreement). After each kill, Lightning's own
resolution of ``ckpt_path="last"`` must name a complete checkpoint whose every tensor and whose meta equal either A
or the two-step checkpoint (B) saved without a kill: equal contents resume equally. A kill before the exchange
leaves A, after it B. The survivor of a one-rank kill exits non-zero, naming the lost rank, well within the
collective timeout. The points are every event of the save's end on rank 0 (where the directories are swapped)
plus a seeded sample of the rest on both ranks.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from lightning_chunk.engine.state.checkpoint import read_meta
from tests.faults.common import Zygotes, find_last, same_tensors, saved_tensors

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

WORKER = Path(__file__).with_name("save_worker.py")
TIMEOUT_S = 20.0  # save_worker.TIMEOUT_S
SLACK_S = 10.0


_zygotes = []


def run(out: Path, steps: int, kill: str):
    return _zygotes[0].run(out, str(steps), kill)


def events_of(results) -> list[list[str]]:
    lists = []
    for rc, so, se, _ in results:
        assert rc == 0, se[-3000:]
        line = next(ln for ln in so.splitlines() if ln.startswith("EVENTS "))
        lists.append(line.split()[2:])
    return lists


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    _zygotes.append(Zygotes(WORKER))
    yield _saves(tmp_path_factory)
    _zygotes.pop().close()


def _saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    events_of(run(root / "a", 1, "count"))
    a = root / "a" / "last.ckpt"
    shutil.copytree(a, root / "b" / "last.ckpt")
    events = events_of(run(root / "b", 2, "count"))  # over an existing checkpoint, as in every kill run
    return dict(
        root=root,
        a=a,
        b=root / "b" / "last.ckpt",
        events=events,
        tensors={1: saved_tensors(a), 2: saved_tensors(root / "b" / "last.ckpt")},
    )


def schedule(events: list[list[str]], n: int, who: str, seed: int) -> list[tuple[int, int]]:
    """``(rank, event)`` points: every event of rank 0's last stretch (from the meta write on) and a seeded
    spread over the rest of both ranks' events."""
    rank0 = events[0]
    tail_from = len(rank0) - rank0[::-1].index("torch.save")  # the meta.pt write, 1-based
    points = {(0, e) for e in range(tail_from, len(rank0) + 1)}
    rng = random.Random(seed)
    while len(points) < n:
        r = rng.randrange(2) if who == "one" else 0
        points.add((r, rng.randrange(1, len(events[r]) + 1)))
    return sorted(points)


def check_after_kill(saves, out: Path, rank: int, event: int, who: str, results) -> int:
    """Asserts on what the kill left; returns the steps of the checkpoint that "last" finds."""
    found = find_last(out)
    assert found is not None, f"kill at rank {rank} event {event} ({who}): ckpt_path='last' finds nothing"
    meta = read_meta(found)  # complete: meta.pt, the index, every shard at its size, both from the same save
    steps = meta["steps"]
    assert steps in (1, 2) and same_tensors(saved_tensors(Path(found)), saves["tensors"][steps])
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert visible in (["last.ckpt"], ["last.prev.ckpt"], ["last.ckpt", "last.prev.ckpt"]), visible
    if who == "one":
        survivor = results[1 - rank]
        rc, _, se, elapsed = survivor
        if rc != 0:  # it may have finished first when the kill came after its last collective
            assert "HUNG" not in se and elapsed < TIMEOUT_S + SLACK_S, se[-2000:]
            assert f"lost rank {rank}" in se, se[-3000:]
    return steps


def kill_points(saves, tmp_path, points, who, mode="", *, names=None, suffix=""):
    names = names or saves["events"]
    seen = []
    for rank, event in points:
        out = tmp_path / f"{who}{mode}-{rank}-{event}"
        shutil.copytree(saves["a"], out / "last.ckpt")
        results = run(out, 2, f"{rank}:{event}:{who}" + (f":{mode}" if mode else "") + suffix)
        assert results[rank][0] != 0, f"rank {rank} was not killed at event {event}: {results[rank][2][-2000:]}"
        steps = check_after_kill(saves, out, rank, event, who, results)
        seen.append((rank, event, names[rank][event - 1] if event <= len(names[rank]) else "?", steps))
    return seen


def test_killing_every_rank_at_20_points_of_a_save_always_leaves_a_complete_last(saves, tmp_path):
    points = schedule(saves["events"], 20, "all", seed=1)
    seen = kill_points(saves, tmp_path, points, "all")
    exchange_at = saves["events"][0].index("exchange") + 1
    for _rank, event, name, steps in seen:
        assert steps == (1 if event <= exchange_at else 2), (event, name, steps)  # the exchange is the commit
    assert {s for *_, s in seen} == {1, 2}


def test_killing_one_rank_at_20_points_the_survivor_names_it_and_last_is_complete(saves, tmp_path):
    points = schedule(saves["events"], 20, "one", seed=2)
    assert {r for r, _ in points} == {0, 1}
    kill_points(saves, tmp_path, points, "one")


def test_without_renameat2_the_old_checkpoint_stays_findable_between_the_renames(saves, tmp_path):
    # the fallback's event list: ... os.replace (meta.pt), exchange (refused), os.replace (old aside),
    # os.replace (new in), rmtree (old), os.fsync, agreement
    rank0 = saves["events"][0]
    ex = rank0.index("exchange") + 1
    points = [(0, e) for e in range(ex, ex + 5)]
    seen = kill_points(saves, tmp_path, points, "all", mode="fallback")
    assert [s for *_, s in seen] == [1, 1, 1, 2, 2]
    between = tmp_path / f"allfallback-0-{ex + 2}"  # killed just before the new one goes in
    assert sorted(p.name for p in between.iterdir() if not p.name.startswith(".")) == ["last.prev.ckpt"]


def test_the_next_save_after_a_kill_clears_what_it_left(saves, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(saves["a"], out / "last.ckpt")
    rank0 = saves["events"][0]
    results = run(out, 2, f"0:{rank0.index('exchange') + 2}:all")  # after the exchange, before the old is removed
    assert results[0][0] != 0
    assert any(p.name.endswith(".partial") for p in out.iterdir())  # the old checkpoint under the hidden name
    events_of(run(out, 2, "count"))
    assert sorted(p.name for p in out.iterdir()) == ["last.ckpt"]
    assert same_tensors(saved_tensors(out / "last.ckpt"), saves["tensors"][2])


def test_a_save_written_in_the_background_is_as_safe_against_kills(saves, tmp_path):
    # the save runs on its own thread while the ranks train a third step it must not see; killed at a sample of
    # its events (every rank, then one), "last" is A or the two-step B, bit for bit, and the exchange commits
    count = tmp_path / "count"
    shutil.copytree(saves["a"], count / "last.ckpt")
    events = events_of(run(count, 2, "count+bg"))
    assert same_tensors(saved_tensors(count / "last.ckpt"), saves["tensors"][2])
    seen = kill_points(saves, tmp_path, schedule(events, 8, "all", seed=3), "all", names=events, suffix="+bg")
    exchange_at = events[0].index("exchange") + 1
    assert all(steps == (1 if event <= exchange_at else 2) for _, event, _, steps in seen), seen
    kill_points(saves, tmp_path, schedule(events, 6, "one", seed=4), "one", names=events, suffix="+bg")
