"""Where a fit starts ([Note: the launcher] in ``lightning_chunk/parallel.py``): one process, a notebook, launch
variables another ``Trainer`` left behind, torchrun's count of processes."""

import json
import sys
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_chunk import ChunkOffloadStrategy, OffloadOptions
from tests import forked
from tests.children import DIST_VARS, child_env
from tests.compare import EXACT, assert_same_params
from tests.models import fit

WORKER = Path(__file__).with_name("notebook_worker.py")


def _host():
    return ChunkOffloadStrategy(placement="host", offload=OffloadOptions(optimizer_kernel="loop"))


@pytest.fixture
def no_launch_variables(monkeypatch):
    for var in DIST_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_one_device_fits_in_a_notebook_as_plain_lightning_and_leaves_no_launch_variables(no_launch_variables):
    """Lightning's script launcher refused a notebook ("not compatible with an interactive environment"), where a
    single device needs no launcher at all, and left ``LOCAL_RANK`` behind: a later ``Trainer(devices=2)`` in the
    same process took its ranks as started outside and waited for a rank 1 that never came."""
    no_launch_variables.setattr("lightning.pytorch.trainer.connectors.accelerator_connector._IS_INTERACTIVE", True)
    ref = fit("auto", steps=6)
    got = fit(_host(), steps=6)
    assert_same_params(ref, got, EXACT)
    assert got.trainer_ref.strategy.launcher is None
    assert not LightningEnvironment().creates_processes_externally  # the next launcher starts its own ranks


def test_a_local_rank_another_trainer_s_launcher_left_does_not_move_a_one_device_fit(no_launch_variables):
    """A script that fits on one device and then on two is run again from the top by the second ``Trainer``'s
    launcher, with ``LOCAL_RANK=1``: the one-device fit there failed to find its device 1 (an ``IndexError``)."""
    no_launch_variables.setenv("LOCAL_RANK", "1")
    ref = fit("auto", steps=6)
    got = fit(_host(), steps=6)
    assert_same_params(ref, got, EXACT)
    assert got.trainer_ref.global_rank == 0


def test_torchrun_with_more_processes_than_devices_is_refused_as_lightning_refuses_it(no_launch_variables):
    env = dict(TORCHELASTIC_RUN_ID="1", RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for k, v in env.items():
        no_launch_variables.setenv(k, v)
    with pytest.raises(ValueError, match=r"You set `devices=1` and `num_nodes=1`.*does not match the world size \(2\)"):
        fit(_host(), steps=2)


@pytest.mark.slow
def test_two_devices_in_a_notebook_fork_as_ddp_notebook_and_bring_back_its_weights(tmp_path):
    """Several devices from a notebook are forked, as ``strategy="ddp_notebook"`` forks them; the notebook's model
    gets the trained weights (the same as DDP's, bit for bit), its ``Trainer`` the metrics, and ``validate`` forks
    again. A save from the notebook's process holds those weights and says what it cannot hold."""
    r = forked.run([sys.executable, str(WORKER), str(tmp_path / "after.ckpt")], env=child_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["launcher"] == "_MultiProcessingLauncher" and got["status"] == "finished"
    assert got["same_as_ddp"] and got["trained"], got
    assert got["val_loss"][0] == got["val_loss"][1] and got["validated"][0] == got["validated"][1], got
    assert got["saved_weights"] and len(got["save_said"]) == 1 and "ModelCheckpoint" in got["save_said"][0], got
