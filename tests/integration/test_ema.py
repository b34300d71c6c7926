"""ChunkEMA ([Note: a sharded EMA]): Lightning's EMAWeightAveraging, with the average sharded like the weights.

Before, an EMA of the weights was only possible by hand inside ``full_parameters()``, holding a whole copy of the
model on every rank; Lightning's own callbacks are refused at set-up (they keep that copy and write payload views)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

try:
    from lightning.pytorch.callbacks import EMAWeightAveraging
except ImportError:  # Lightning 2.6 brought it
    pytest.skip("this Lightning has no EMAWeightAveraging", allow_module_level=True)

from lightning_chunk import ChunkEMA, ChunkOffloadStrategy
from lightning_chunk.cli import main as cli_main
from lightning_chunk.options import grouped
from tests.callbacks import FlipRequiresGrad
from tests.models import BatchNormNet, fit, quiet_trainer, token_data

EXACT = dict(rtol=0, atol=0)


class Recording(BatchNormNet):
    """BatchNorm after the embedding: running statistics, which EMAWeightAveraging averages by default."""

    losses: list = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        type(self).losses.append(torch.nn.functional.cross_entropy(self(x).float().reshape(-1, 48), y.reshape(-1)))


def run(strategy, callbacks, steps=8, **kw):
    Recording.losses = []
    model = fit(
        strategy,
        steps=steps,
        cls=Recording,
        callbacks=callbacks,
        limit_val_batches=2,
        val_check_interval=3,
        val_dataloaders=token_data(16, seed=1),
        **kw,
    )
    return model, [float(x) for x in Recording.losses]


def chunked(**kw):
    return ChunkOffloadStrategy(**grouped({**kw, "chunk_numel": 4096, "optimizer_kernel": "loop"}))


def assert_same(ref, got):
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, **EXACT, msg=k)


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_chunk_ema_is_lightning_s_ema_weight_averaging_bit_for_bit(placement):
    """Validation inside fit sees the averaged weights and buffers and the model ends with them, as with
    EMAWeightAveraging (whose default averages the buffers, [Note: averaged buffers])."""
    ref, ref_losses = run("auto", [EMAWeightAveraging(decay=0.9, update_starting_at_step=2)])
    strategy = chunked(placement=placement)
    got, losses = run(strategy, [ChunkEMA(decay=0.9, update_starting_at_step=2)])
    masters = sum(p.numel() for p in got.parameters()) * 4
    assert masters <= strategy.memory_stats()["ema_host_bytes"] < masters + 4 * 4096  # padding of the last chunk
    assert losses == ref_losses and len(losses) == 4  # validation at steps 3 and 6, 2 batches each
    assert_same(ref, got)
    plain, _ = run(chunked(placement=placement), [])
    assert not torch.equal(plain.head.weight, got.head.weight)  # the average is not the trained weights
    assert not torch.equal(plain.bn.running_mean, got.bn.running_mean)  # nor the buffers the trained ones


def test_without_use_buffers_the_buffers_are_copied_at_each_update_as_averaged_model_does():
    """``use_buffers=False``: ``AveragedModel`` copies the buffers at each update, and validation and the end of
    training still put that copy in; updated every other step, so the copy is a step older than the model's."""
    ref, ref_losses = run("auto", [EMAWeightAveraging(decay=0.9, use_buffers=False, update_every_n_steps=2)])
    got, losses = run(chunked(), [ChunkEMA(decay=0.9, use_buffers=False, update_every_n_steps=2)])
    assert losses == ref_losses and len(losses) == 4
    assert_same(ref, got)
    averaged, _ = run(chunked(), [ChunkEMA(decay=0.9, update_every_n_steps=2)])
    assert not torch.equal(averaged.bn.running_var, got.bn.running_var)


def in_files(tmp_path, limit="140kB", **kw):
    """A host limit, so the average is kept in files under disk_dir ([Note: the average under a host limit]);
    140 kB: every shard on the disk tier too (the smallest limit that works is 131,072 bytes); 300 kB: none."""
    return chunked(placement="host", host_memory_limit=limit, disk_dir=tmp_path / "scratch", **kw)


def saved_at_step_4(tmp_path, state_dict_type, files=False):
    """Plain Lightning with EMAWeightAveraging, then chunk_offload (host) with ChunkEMA, each trained 4 steps with a
    checkpoint at the end: yields (name, a maker of its EMA callback, the checkpoint). ``files``: the average in
    files."""
    chunk = (
        (lambda: in_files(tmp_path, state_dict_type=state_dict_type))
        if files
        else (lambda: chunked(placement="host", state_dict_type=state_dict_type))
    )
    for name, make, ema in [
        ("auto", lambda: "auto", lambda: EMAWeightAveraging(decay=0.8)),
        ("chunk", chunk, lambda: ChunkEMA(decay=0.8)),
    ]:
        cb = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=4, filename="{step}")
        run(make(), [ema(), cb], steps=4, enable_checkpointing=True)
        yield name, ema, tmp_path / name / "step=4.ckpt"


@pytest.mark.parametrize("files", [False, True], ids=["memory", "files"])
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_a_resumed_average_goes_on_as_lightning_s_does(tmp_path, state_dict_type, files):
    """Saved at step 4 (sharded: its shards beside the masters; full: a whole copy), resumed to step 8 on another
    placement (``files``: saved from the average in files with every shard on disk, resumed into files with the
    shards in memory): as plain Lightning resuming EMAWeightAveraging from its own checkpoint."""
    finals = []
    for name, ema, ckpt in saved_at_step_4(tmp_path, state_dict_type, files):
        L.seed_everything(7, verbose=False)
        model = Recording()
        resumed = in_files(tmp_path / "resumed", "300kB") if files else chunked()
        quiet_trainer(
            strategy=resumed if name == "chunk" else "auto",
            max_steps=8,
            limit_val_batches=2,
            val_check_interval=3,
            callbacks=[ema()],
        ).fit(model, token_data(), token_data(16, seed=1), ckpt_path=ckpt)
        finals.append(model)
    assert_same(*finals)
    ckpt = tmp_path / "chunk" / "step=4.ckpt"
    if state_dict_type == "sharded":
        ck = torch.load(ckpt / "meta.pt", weights_only=False)["chunk_checkpoint"]
        assert ck["ema_chunks"] == list(range(len(ck["chunks"])))
        # consolidated with --ema: the state_dict plain Lightning's EMAWeightAveraging wrote (the average)
        assert cli_main(["consolidate", str(ckpt), str(tmp_path / "ema.pt"), "--ema", "--no-progress"]) == 0
        got = torch.load(tmp_path / "ema.pt", weights_only=False)["state_dict"]
        want = torch.load(tmp_path / "auto" / "step=4.ckpt", weights_only=False)["state_dict"]
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, **EXACT, msg=k)
    else:  # Lightning's WeightAveraging layout: the average as state_dict, the trained weights beside it
        got, want = (torch.load(p, weights_only=False) for p in (ckpt, tmp_path / "auto" / "step=4.ckpt"))
        for part in ("state_dict", "current_model_state"):
            assert sorted(got[part]) == sorted(want[part])
            for k, v in want[part].items():
                torch.testing.assert_close(got[part][k], v, **EXACT, msg=f"{part} {k}")
        assert int(got["averaging_state"]["n_averaged"]) == int(want["averaging_state"]["n_averaged"]) == 4
        # so plain Lightning resumes from it as from its own
        L.seed_everything(7, verbose=False)
        plain = Recording()
        quiet_trainer(
            max_steps=8, limit_val_batches=2, val_check_interval=3, callbacks=[EMAWeightAveraging(decay=0.8)]
        ).fit(plain, token_data(), token_data(16, seed=1), ckpt_path=ckpt)
        assert_same(finals[0], plain)


def test_the_average_follows_a_repack_when_parameters_are_frozen_and_unfrozen():
    """A repack (requires_grad changed) carries the shards: the embedding, trained, frozen and trained again, is
    averaged throughout; the first block, frozen from the start, starts from its weights when it is unfrozen."""
    ref, _ = run("auto", [EMAWeightAveraging(decay=0.9), FlipRequiresGrad(unfreeze=3, refreeze=6)], variant="frozen")
    got, _ = run(chunked(), [ChunkEMA(decay=0.9), FlipRequiresGrad(unfreeze=3, refreeze=6)], variant="frozen")
    # AveragedModel also averages the first block with itself while it is frozen, which can move it by a last bit
    for k, v in ref.state_dict().items():
        exact = EXACT if not k.startswith("blocks.0.") else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.state_dict()[k], v, **exact, msg=k)


class FilesAfterEachStep(L.Callback):
    """The average's files in the scratch directory after each step's update (ChunkEMA's, registered before)."""

    def __init__(self, root):
        self.root, self.seen = root, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(sorted(p.name for p in self.root.rglob("*-ema.bin")))


@pytest.mark.parametrize("limit", ["140kB", "300kB"], ids=["shards_on_disk", "shards_in_memory"])
def test_under_a_host_limit_the_average_is_in_files_and_lightning_s_bit_for_bit(tmp_path, limit):
    """[Note: the average under a host limit]: ChunkEMA was refused with ``host_memory_limit`` (its shards would sit
    in host memory beside the limit). Now each chunk's average is a file under disk_dir, paged in for each update,
    swap and copy, whatever tier the shards live on: validation and the end of training as EMAWeightAveraging's,
    nothing of the average in host memory, no file left once the run is over. The defaults step in backward here,
    so disk chunks are stepped from their staged files before the average reads them."""
    ref, ref_losses = run("auto", [EMAWeightAveraging(decay=0.9, update_starting_at_step=2)])
    strategy, files = in_files(tmp_path, limit), FilesAfterEachStep(tmp_path / "scratch")
    got, losses = run(strategy, [ChunkEMA(decay=0.9, update_starting_at_step=2), files])
    assert losses == ref_losses and len(losses) == 4
    assert_same(ref, got)
    assert [len(f) for f in files.seen] == [0, 0] + [4] * 6  # a file a chunk from the first update (step 2) on
    stats, masters = strategy.memory_stats(), sum(p.numel() for p in got.parameters()) * 4
    assert stats["ema_host_bytes"] == 0 and masters <= stats["ema_disk_bytes"] < masters + 4 * 4096
    assert stats["disk_shards"] == {"140kB": stats["chunks"], "300kB": 0}[limit] and stats["chunks"] == 4
    assert list((tmp_path / "scratch").iterdir()) == []


def test_the_average_in_files_follows_a_repack_when_parameters_are_frozen_and_unfrozen(tmp_path):
    """A repack carries each old chunk's average out of its file into the new chunks' files."""
    flips = dict(unfreeze=3, refreeze=6)
    ref, _ = run("auto", [EMAWeightAveraging(decay=0.9), FlipRequiresGrad(**flips)], variant="frozen")
    got, _ = run(in_files(tmp_path), [ChunkEMA(decay=0.9), FlipRequiresGrad(**flips)], variant="frozen")
    for k, v in ref.state_dict().items():  # as in the test above without files: blocks.0 averaged with itself
        exact = EXACT if not k.startswith("blocks.0.") else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.state_dict()[k], v, **exact, msg=k)


def test_chunk_ema_is_refused_elsewhere_and_lightning_s_averaging_names_it():
    with pytest.raises(ValueError, match="ChunkEMA works with the chunk_offload strategy"):
        fit("auto", steps=1, callbacks=[ChunkEMA()])
    with pytest.raises(ValueError, match="use lightning_chunk.ChunkEMA"):
        fit(chunked(), steps=1, callbacks=[EMAWeightAveraging()])
    with pytest.raises(ValueError, match="decay must be in"):
        ChunkEMA(decay=1.5)
    with pytest.raises(ValueError, match="use_buffers='yes'"):
        ChunkEMA(use_buffers="yes")
    with pytest.raises(
        ValueError,
        match=r"ChunkEMA with host_memory_limit=1000000 keeps the average in files under "
        r"disk_dir.*no disk_dir is set",
    ):
        fit(chunked(placement="host", host_memory_limit="1MB"), steps=1, callbacks=[ChunkEMA()])


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_evaluating_a_checkpoint_uses_the_average_as_lightning_s_does(tmp_path, state_dict_type):
    """Lightning's EMAWeightAveraging writes the average as a checkpoint's state_dict, so validate(ckpt_path=...)
    evaluates the average; a sharded checkpoint's masters are the trained weights and its average sits beside them."""
    losses = []
    for name, _, ckpt in saved_at_step_4(tmp_path, state_dict_type):
        Recording.losses = []
        quiet_trainer(
            strategy=chunked() if name == "chunk" else "auto", limit_val_batches=2, enable_checkpointing=True
        ).validate(Recording(), token_data(16, seed=1), ckpt_path=ckpt, verbose=False)
        losses.append([float(x) for x in Recording.losses])
    assert losses[0] == losses[1] and len(losses[0]) == 2
