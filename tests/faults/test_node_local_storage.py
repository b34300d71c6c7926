"""A checkpoint path on storage each node has to itself ([Note: one directory every rank sees]): two nodes of one
rank, each working in a directory of its own and naming ``/proc/self/cwd/ckpt``, as ``/local/ckpt`` on a node-local
disk names another directory on each node."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.faults.common import Ranks
from tests.models import ParityNet

pytestmark = pytest.mark.slow  # two ranks

WORKER = Path(__file__).with_name("local_disk_worker.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("local_disk")
    return out, Ranks(WORKER, out, world_size=2, nodes=2).wait(timeout=240)


def test_a_save_to_storage_each_node_has_to_itself_fails_on_every_rank_before_writing_and_names_shared_storage(saved):
    """Before, each node's ranks wrote their shards into a partial directory of their own node's (DCP's writer made
    it), the save returned on every rank, and rank 0's node held a checkpoint without the other node's shards, found
    when a resume failed; the other node kept a partial directory nothing removed. Now every rank fails before a
    shard is written, naming the storage needed; nothing is left on either node, and the job goes on: a save to a
    shared path after it works, and training goes on."""
    out, results = saved
    for rank, (rc, so, se, _) in enumerate(results):
        assert rc == 0 and "SAVED-SHARED" in so and "FIT-DONE" in so, (so + se)[-3000:]
        failed = next((ln for ln in so.splitlines() if ln.startswith("SAVE-FAILED")), None)
        assert failed is not None and "SAVED-LOCAL" not in so, so[-3000:]
        assert "CheckpointSaveError" in failed and "nothing was written" in failed.lower(), failed
        if rank == 1:  # the rank that cannot see rank 0's directory says why
            assert "rank 1 does not see the directory" in failed and "storage every node shares" in failed, failed
        else:
            assert "failed on rank(s) [1] while finding rank 0's directory" in failed, failed
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (out / node).iterdir()) == [], node  # no checkpoint, no partial left
    assert (out / "shared.ckpt" / "meta.pt").is_file()


def test_a_resume_from_a_checkpoint_one_node_holds_is_refused_on_every_rank_naming_those_without(saved, tmp_path):
    """Before, the rank that did not find it raised alone ("Checkpoint file not found") and rank 0 waited in the
    load's first collective: on NCCL until the watchdog's timeout, with nothing said of the path."""
    shutil.copytree(saved[0] / "shared.ckpt", tmp_path / "node0" / "ckpt")
    (tmp_path / "node1").mkdir()
    for rc, so, se, _ in Ranks(WORKER, tmp_path, "resume", world_size=2, nodes=2).wait(timeout=240):
        failed = next((ln for ln in so.splitlines() if ln.startswith("RESUME-FAILED")), None)
        assert rc == 0 and failed is not None, (so + se)[-3000:]
        assert "FileNotFoundError: checkpoint '/proc/self/cwd/ckpt' is not found on rank(s) [1]" in failed, failed
        assert "storage every node shares" in failed, failed


def test_weights_one_node_holds_are_refused_on_every_rank_naming_those_without(tmp_path):
    """Before, the rank without the file raised alone at setup and rank 0 went on into the start-up exchange, where it
    was told of data-dependent control flow (gloo) or waited for the watchdog (NCCL)."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    torch.save(ParityNet().state_dict(), tmp_path / "node0" / "w.pt")
    ran = Ranks(WORKER, tmp_path, "weights", world_size=2, nodes=2).wait(timeout=240)
    errors = [next((ln for ln in so.splitlines() if ln.startswith("WEIGHTS-FAILED")), so + se) for _, so, se, _ in ran]
    assert errors[0].startswith("WEIGHTS-FAILED PeerFailedError: [rank 0] opening weights"), errors[0][-3000:]
    assert "failed on rank(s) [1]" in errors[0], errors[0]
    assert errors[1] == "WEIGHTS-FAILED WeightsError: weights '/proc/self/cwd/w.pt': no such file or directory.", errors
