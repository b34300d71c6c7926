"""A save that cannot be written (a full disk, a write error on one rank) fails cleanly on every rank.

Two ranks (``save_worker.py``) save over a ``last.ckpt`` that holds the one-step checkpoint while one rank's
writes fail: with a real ``EFBIG`` from the kernel (``RLIMIT_FSIZE``, the error a full quota gives) or an
injected ``ENOSPC`` from the storage writer. Every rank must raise ``CheckpointSaveError`` naming the path and
the cause; the old checkpoint must still be ``last`` with every tensor unchanged; no directory but ``last.ckpt``
may be left; and a second save of the same in-memory state, the limit gone, must succeed and equal a save that
never failed (the training state was only read).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.faults.common import Zygotes, find_last, same_tensors, saved_tensors

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

WORKER = Path(__file__).with_name("save_worker.py")


@pytest.fixture(scope="module")
def zygotes():
    z = Zygotes(WORKER)
    yield z
    z.close()


@pytest.mark.parametrize("how", ["fsize:1", "enospc:0", "fsize:1+bg", "enospc:0+bg"])
def test_a_failed_write_on_one_rank_fails_every_rank_and_keeps_last(zygotes, tmp_path, how):
    for steps in (1, 2):
        results = zygotes.run(tmp_path / f"ref{steps}", str(steps), "count")
        assert all(rc == 0 for rc, *_ in results), results[0][2][-2000:]
    old = tmp_path / "ref1" / "last.ckpt"
    out = tmp_path / "run"
    shutil.copytree(old, out / "last.ckpt")
    results = zygotes.run(out, "2", how)
    for r, (rc, so, se, _) in enumerate(results):
        assert rc == 0, se[-3000:]
        assert "UNEXPECTED-SUCCESS" not in so
        failed = next(ln for ln in so.splitlines() if ln.startswith("SAVE-FAILED"))
        assert f"saving checkpoint '{out / 'last.ckpt'}' failed" in failed
        assert "is untouched" in failed
        if f":{r}" in how.removesuffix("+bg"):  # the rank whose write failed says why
            assert ("File too large" in failed) if how.startswith("fsize") else ("No space left" in failed)
        assert "LEFT last.ckpt" in so  # the partial directory is gone, nothing else was made
        assert f"SAVED rank={r}" in so  # the same state saved once the disk had room
    assert find_last(out) == str(out / "last.ckpt")
    assert same_tensors(saved_tensors(out / "last.ckpt"), saved_tensors(tmp_path / "ref2" / "last.ckpt"))
    assert sorted(p.name for p in out.iterdir()) == ["last.ckpt"]
