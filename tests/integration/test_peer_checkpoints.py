"""Resuming under chunk_offload from what Lightning's FSDP and ModelParallel strategies save: optimizer state keyed by
parameter name, their sharded directories, and their one-file consolidations ([Note: optimizer state keyed by
name], [Note: resuming a peer's sharded checkpoint]). The reference is plain Lightning resuming the same state from
a plain file; the real ModelParallel directory on two ranks is ``tests/distributed/test_peer_resume.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine.errors import CheckpointError
from lightning_chunk.engine.state import peer_checkpoint
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, fit


def chunk(**kw):
    return ChunkOffloadStrategy(**grouped({"optimizer_kernel": "loop", "chunk_numel": 4096, **kw}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Plain Lightning after 4 steps: its checkpoint file, and the same state as the peers write it."""
    d = tmp_path_factory.mktemp("peers")
    model = fit("auto", steps=4, variant="tied")
    model.trainer_ref.save_checkpoint(d / "plain.ckpt")
    plain = torch.load(d / "plain.ckpt", weights_only=False)
    by_name = get_optimizer_state_dict(
        model, model.trainer_ref.optimizers[0], options=StateDictOptions(full_state_dict=True)
    )
    assert list(by_name["state"])[0] == "embed.weight"
    rest = {k: v for k, v in plain.items() if k not in ("state_dict", "optimizer_states")}
    torch.save({**plain, "optimizer_states": [by_name]}, d / "by_name.ckpt")
    torch.save({**rest, "state_dict": plain["state_dict"], "optimizer_0": by_name}, d / "consolidated.ckpt")
    for root in ("state_dict", "model"):  # ModelParallelStrategy's, FSDPStrategy's
        dcp.save({root: plain["state_dict"], "optimizer_0": by_name}, checkpoint_id=d / f"{root}.ckpt", no_dist=True)
        torch.save(rest, d / f"{root}.ckpt" / "meta.pt")
    return {"dir": d, "by_name": by_name}


def resume(strategy, path: Path, steps: int = 8):
    return fit(strategy, steps=steps, variant="tied", ckpt_path=str(path))


@pytest.mark.parametrize("source", ["by_name.ckpt", "consolidated.ckpt", "state_dict.ckpt", "model.ckpt"])
def test_resumes_as_plain_lightning_resumes_its_own_file(saved, source):
    """Before, optimizer state keyed by name failed with ``invalid literal for int()``, a directory with "holds no
    'chunk_checkpoint' section", and a consolidated file (``optimizer_0``) trained on with fresh Adam moments."""
    ref = resume("auto", saved["dir"] / "plain.ckpt")
    got = resume(chunk(placement="host"), saved["dir"] / source)
    assert_same_params(ref, got, EXACT)
    assert (
        ref.trainer_ref.optimizers[0].state_dict()["param_groups"][0]["lr"]
        == got.trainer_ref.optimizers[0].state_dict()["param_groups"][0]["lr"]
    )


def test_a_directory_is_read_a_parameter_at_a_time(saved, monkeypatch):
    reads = []
    real = peer_checkpoint.DCPTree.read

    def read(self, keys):
        reads.append(list(keys))
        return real(self, keys)

    monkeypatch.setattr(peer_checkpoint.DCPTree, "read", read)
    got = resume(chunk(placement="host", device_memory_limit=120_000), saved["dir"] / "state_dict.ckpt")
    ref = resume("auto", saved["dir"] / "plain.ckpt")
    assert_same_params(ref, got, EXACT)
    values = [r for r in reads if r[0].startswith("state_dict.") and len(r) == 1]
    states = [r for r in reads if ".state." in r[0]]
    params = dict(ref.named_parameters())  # the tied head once
    assert len(values) == len(params) + 1  # and the one buffer
    assert len(states) == len(params) and all(len(r) == 3 for r in states)  # step, exp_avg, exp_avg_sq


def test_a_state_of_another_model_is_refused_naming_its_parameters(saved, tmp_path):
    state = dict(saved["by_name"])
    state["state"] = {k.replace("blocks.1.", "layers.1."): v for k, v in state["state"].items()}
    groups = [dict(g, params=[n.replace("blocks.1.", "layers.1.") for n in g["params"]]) for g in state["param_groups"]]
    plain = torch.load(saved["dir"] / "plain.ckpt", weights_only=False)
    torch.save({**plain, "optimizer_states": [{**state, "param_groups": groups}]}, tmp_path / "other.ckpt")
    with pytest.raises(
        ValueError,
        match=r"names 6 parameter\(s\) this optimizer does not hold: layers\.1\.1\.weight, layers\.1\.3\.weight",
    ):
        resume(chunk(), tmp_path / "other.ckpt")
    swapped = [dict(g) for g in saved["by_name"]["param_groups"]]
    moved = swapped[1]["params"][0]
    swapped[0]["params"], swapped[1]["params"] = [*swapped[0]["params"], moved], swapped[1]["params"][1:]
    torch.save({**plain, "optimizer_states": [{**saved["by_name"], "param_groups": swapped}]}, tmp_path / "moved.ckpt")
    with pytest.raises(ValueError, match=rf"puts {moved} in param group 0; this optimizer has it in group 1"):
        resume(chunk(), tmp_path / "moved.ckpt")


def test_a_file_without_optimizer_state_is_refused_as_lightning_refuses_it(saved, tmp_path):
    """Before, the fit trained on from fresh Adam moments without a word."""
    plain = torch.load(saved["dir"] / "plain.ckpt", weights_only=False)
    del plain["optimizer_states"]
    torch.save(plain, tmp_path / "weights_only.ckpt")
    with pytest.raises(KeyError, match="Trying to restore optimizer state but checkpoint contains only the model"):
        resume("auto", tmp_path / "weights_only.ckpt")
    with pytest.raises(CheckpointError, match=r"weights_only\.ckpt' holds no optimizer state"):
        resume(chunk(), tmp_path / "weights_only.ckpt")


@pytest.mark.parametrize("root", ["state_dict", "model"])
def test_weights_from_a_directory_start_a_new_fit_as_load_state_dict_does(saved, root):
    """``ChunkOffloadStrategy(weights=dir)``: the directory's weights, then a fresh optimizer."""
    plain = torch.load(saved["dir"] / "plain.ckpt", weights_only=False)

    class Loaded(ParityNet):
        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.load_state_dict(plain["state_dict"])

    ref = fit("auto", steps=4, variant="tied", cls=Loaded)
    got = fit(chunk(placement="host", weights=str(saved["dir"] / f"{root}.ckpt")), steps=4, variant="tied")
    assert_same_params(ref, got, EXACT)


def test_a_deepspeed_directory_is_refused_saying_how_to_start_from_its_weights(tmp_path):
    """What Lightning's DeepSpeedStrategy saves: ``latest`` and DeepSpeed's own files under the tag."""
    (tmp_path / "run.ckpt" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run.ckpt" / "latest").write_text("checkpoint")
    (tmp_path / "run.ckpt" / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is a DeepSpeed checkpoint.*convert_zero_checkpoint_to_fp32_state_dict"):
        resume(chunk(), tmp_path / "run.ckpt")


@pytest.mark.parametrize("root", ["state_dict", "model"])
def test_load_from_checkpoint_reads_a_directory_as_plain_lightning_reads_the_file(saved, root):
    """Lightning's own ``load_from_checkpoint`` fails on a directory (``IsADirectoryError``)."""
    want = ParityNet.load_from_checkpoint(saved["dir"] / "plain.ckpt", variant="tied")
    got = ParityNet.load_from_checkpoint(saved["dir"] / f"{root}.ckpt", variant="tied")
    assert_same_params(want, got, EXACT)
    assert torch.equal(got.calls, want.calls) and got.head.weight is got.embed.weight
