"""Parameters written between steps, through ``full_parameters`` and outside it; state dicts, copies and gradients
read between steps ([Note: parameters outside a step], [Note: writes through .data], [Note: a replaced .data]).

Before: what a callback wrote into a resident payload was lost at the next gather; a ``.data`` assignment was lost
without a word; Lightning's WeightAveraging and StochasticWeightAveraging callbacks crashed on two ranks or left the
raw weights where the averaged ones belonged."""

import contextlib
import copy
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch import callbacks as pl_callbacks
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning, StochasticWeightAveraging

from lightning_chunk.engine import ChunkError
from tests.callbacks import ClampFirstBlock, LoadsWeights
from tests.compare import EXACT, assert_same_params
from tests.integration.test_parameters_between_steps import chunked
from tests.models import ParityNet, fit, token_data


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_full_parameters_reads_and_writes_like_plain_lightning(placement):
    ref_cb, got_cb = ClampFirstBlock(), ClampFirstBlock()
    ref = fit("auto", steps=10, callbacks=[ref_cb])
    got = fit(chunked(placement=placement), steps=10, callbacks=[got_cb])
    assert got_cb.norms == ref_cb.norms  # read inside the block: the trained values, bit for bit
    assert_same_params(ref, got, EXACT)  # the clamps were written into the shards and trained on
    assert all(p.abs().max() <= 0.05 for p in got.blocks[0].parameters())
    # outside the block: resident payloads (one rank, fp32: the payload is the shard), or placeholders, whose reads
    # raise
    assert got_cb.seen_outside == ["value" if placement == "auto" else "refused"] * 10
    assert got_cb.seen_kept == got_cb.seen_outside and ref_cb.seen_kept == ["value"] * 10


def test_a_write_outside_the_block_is_refused_where_it_would_be_lost_and_trains_where_it_is_kept():
    """One rank in bf16-mixed: the payload is a bf16 copy of the fp32 master, rewritten after every step, so a clamp
    written into it vanished without a word. One rank in fp32 with everything resident the payload is the master:
    the clamp trains as in plain Lightning. Released (host placement): the placeholder refuses the write."""
    with pytest.raises(ChunkError, match=r"'blocks\.0\.\d\.\w+' was written in place outside a step"):
        fit(chunked(), steps=4, precision="bf16-mixed", callbacks=[ClampFirstBlock(use_block=False)])
    ref = fit("auto", steps=6, callbacks=[ClampFirstBlock(use_block=False)])
    got = fit(chunked(), steps=6, callbacks=[ClampFirstBlock(use_block=False)])
    assert_same_params(ref, got, EXACT)
    with pytest.raises(ChunkError, match=r"clamp_ wrote into parameter 'blocks\.0\.\d\.\w+' between steps.*lost"):
        fit(chunked(placement="host"), steps=4, callbacks=[ClampFirstBlock(use_block=False)])


@pytest.mark.parametrize("write", ["assign", "through .data"])
@pytest.mark.parametrize("placement", ["auto", "host"])
def test_data_assigned_or_written_through_inside_the_block_trains_like_plain_lightning(placement, write):
    """``p.data = x`` gives the parameter another storage and leaves its version counter alone: the block wrote back
    the value it had handed out, and the assignment was lost without a word ([Note: a replaced .data])."""
    ref = fit("auto", steps=6, callbacks=[ClampFirstBlock(write=write)])
    got = fit(chunked(placement=placement), steps=6, callbacks=[ClampFirstBlock(write=write)])
    assert_same_params(ref, got, EXACT)
    assert all(p.abs().max() <= 0.05 for p in got.blocks[0].parameters())


@pytest.mark.parametrize("write", ["assign", "through .data"])
def test_data_assigned_or_written_through_outside_the_block_is_refused_where_lost_and_trains_where_kept(write):
    """Before: lost at the next gather or step (host placement, bf16-mixed: 0.2 off plain Lightning after 4 steps
    through ``.data``) or, assigned on one rank in fp32, the forward read the new tensor while the optimizer stepped
    the payload it no longer viewed (0.02 off). Released, a placeholder refuses a write through ``.data``
    ([Note: a released parameter]) and an assignment is seen by its storage."""
    outside = dict(use_block=False, write=write)
    said = "had its \\.data replaced" if write == "assign" else "was written through \\.data"
    with pytest.raises(ChunkError, match=rf"'blocks\.0\.\d\.\w+' {said} outside a step"):
        fit(chunked(), steps=4, precision="bf16-mixed", callbacks=[ClampFirstBlock(**outside)])
    with pytest.raises(ChunkError, match=r"had its \.data replaced|'blocks\.0\.\d\.\w+' between steps"):
        fit(chunked(placement="host"), steps=4, callbacks=[ClampFirstBlock(**outside)])
    ref = fit("auto", steps=6, callbacks=[ClampFirstBlock(**outside)])
    got = fit(chunked(), steps=6, callbacks=[ClampFirstBlock(**outside)])
    assert_same_params(ref, got, EXACT)


class ReadsEveryWeight(L.Callback):
    """Reads every parameter between steps and writes nothing: weight norms, as a logging callback takes them, after
    a step and before a backward (which steps the chunks as their gradients land)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.norms = [float(p.float().norm()) for p in pl_module.parameters()]

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.on_train_batch_end(trainer, pl_module, None, None, 0)


def test_reading_weights_between_steps_is_not_taken_for_a_write(tmp_path):
    """The values noted at a read between steps ([Note: writes through .data]) are dropped by the engine's own writes
    (the step's write-back, a save, validation's gathers): a run that only reads trains exactly as one that does not."""
    kw = dict(
        precision="bf16-mixed",
        val_dataloaders=token_data(16, seed=1),
        limit_val_batches=2,
        val_check_interval=2,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2)],
    )
    ref = fit(chunked(), steps=6, **kw)
    got = fit(
        chunked(),
        steps=6,
        **{**kw, "callbacks": [ReadsEveryWeight(), ModelCheckpoint(tmp_path / "b", every_n_train_steps=2)]},
    )
    assert_same_params(ref, got, EXACT)
    # read between the forward and its backward: the check armed there left the thread's modes with the backward
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("write", ["in place", "assign", "through .data"])
def test_a_write_after_the_last_step_or_before_a_save_is_refused_where_it_would_be_lost(tmp_path, write):
    """No micro-batch follows the last step's callbacks: what they wrote into a bf16 copy was lost when ``fit``
    gave the parameters their master values back, or left out of a checkpoint saved after it, without a word. One
    rank in fp32 the payload is the master: the write is in the model after ``fit``, as in plain Lightning."""
    outside = dict(use_block=False, write=write)
    with pytest.raises(ChunkError, match="after the last step"):
        fit(chunked(), steps=1, precision="bf16-mixed", callbacks=[ClampFirstBlock(**outside)])
    saves = dict(callbacks=[ClampFirstBlock(**outside), ModelCheckpoint(tmp_path, every_n_train_steps=1)])
    with pytest.raises(ChunkError, match="before a checkpoint save"):
        fit(chunked(), steps=1, precision="bf16-mixed", enable_checkpointing=True, **saves)
    ref = fit("auto", steps=1, callbacks=[ClampFirstBlock(**outside)])
    got = fit(chunked(), steps=1, callbacks=[ClampFirstBlock(**outside)])
    assert_same_params(ref, got, EXACT)


class MaxNormEmbedding(ParityNet):
    """``nn.Embedding(max_norm=0.5)``: its forward renormalises the rows it looks up in place, a write during a step."""

    def build(self) -> None:
        super().build()
        self.embed.max_norm = 0.5


class RenormLookedUpRows(L.Callback):
    """The way out the error names: ``max_norm=None`` and the same renormalisation before the forward, in the block."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with trainer.strategy.full_parameters(pl_module.embed), torch.no_grad():
            torch.embedding_renorm_(pl_module.embed.weight, batch[0].reshape(-1), 0.5, 2.0)


@pytest.mark.parametrize(
    "kw,kept",
    [(dict(placement="host"), False), (dict(device_memory_limit=100_000), False), ({}, True)],
    ids=["host", "evicting_limit", "payload_is_master"],
)
def test_a_write_during_a_step_is_refused_where_it_would_be_lost_and_the_way_out_trains_like_plain_lightning(kw, kept):
    """The embedding's renormalised rows went with the released payload and the model trained away from plain
    Lightning without a word (8 steps: 3.6 apart). Where the payload is the master (one rank, fp32, resident) the
    write is kept and trains; elsewhere the release raises, naming the parameter and the way out."""
    ref = fit("auto", steps=8, cls=MaxNormEmbedding)
    if kept:
        assert_same_params(ref, fit(chunked(**kw), steps=8, cls=MaxNormEmbedding), EXACT)
    else:
        with pytest.raises(ChunkError, match=r"'embed\.weight' was written in place during a step.*max_norm=None"):
            fit(chunked(**kw), steps=2, cls=MaxNormEmbedding)
    way_out = fit(chunked(**kw), steps=8, callbacks=[RenormLookedUpRows()])
    assert_same_params(ref, way_out, EXACT)
    if "device_memory_limit" in kw:  # the limit did release payloads, the written rows' among them
        assert way_out.trainer_ref.strategy.memory_stats()["evictions"] > 0
    if kept:  # resident, but a bf16 copy of the master: the next step's check sees it
        with pytest.raises(ChunkError, match=r"'embed\.weight' was written in place outside a step or in the last"):
            fit(chunked(**kw), steps=2, precision="bf16-mixed", cls=MaxNormEmbedding)


class SavesStateDicts(L.Callback):
    def __init__(self) -> None:
        self.saved = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.saved.append({k: v.clone() for k, v in pl_module.state_dict().items()})


@pytest.mark.parametrize("placement,precision", [("host", "32-true"), ("auto", "32-true"), ("auto", "bf16-mixed")])
def test_state_dict_between_steps_gives_the_master_values(placement, precision):
    """One rank: ``module.state_dict()`` in a callback gave NaN placeholders (host placement; a crash before them),
    or the bf16 payload of an fp32 model (bf16-mixed). Its entries are now the masters, in the parameters' dtype."""
    ref_cb, got_cb = SavesStateDicts(), SavesStateDicts()
    strategy = chunked(placement=placement)
    fit(strategy, steps=4, precision=precision, callbacks=[got_cb])
    assert all(v.dtype == torch.float32 for sd in got_cb.saved for v in sd.values() if v.is_floating_point())
    if precision == "32-true":
        fit("auto", steps=4, callbacks=[ref_cb])
        for a, b in zip(ref_cb.saved, got_cb.saved, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kw", [dict(placement="host"), dict(device_memory_limit=100_000), {}])
def test_load_state_dict_after_set_up_trains_like_plain_lightning(kw):
    """[Note: a module's state dict between steps]: ``load_state_dict`` in ``on_fit_start`` or between steps failed
    ("more than one element of the written-to tensor refers to a single memory location": host placement) or was
    refused (bf16-mixed). Each loaded value now goes into the shards: the whole tied model, then a submodule's keys
    with one missing; plain Lightning's parameters bit for bit; in bf16-mixed the fp32 masters take the values
    whole (restored in ``on_train_end``, the model after ``fit`` is the state dict to the bit)."""
    ref = fit("auto", variant="tied", steps=6, callbacks=[LoadsWeights()])
    assert_same_params(ref, fit(chunked(**kw), variant="tied", steps=6, callbacks=[LoadsWeights()]), EXACT)
    restores = LoadsWeights(at_end=True)
    got = fit(chunked(**kw), variant="tied", steps=4, precision="bf16-mixed", callbacks=[restores])
    assert got.state_dict().keys() == restores.state.keys()
    assert all(torch.equal(v, restores.state[k]) for k, v in got.state_dict().items())
    with pytest.raises(ChunkError, match=r"assign=True\) would replace 'embed\.weight'"):
        got = fit(chunked(**kw), variant="tied", steps=1, callbacks=[AssignsWeights()])


class AssignsWeights(L.Callback):
    def on_train_start(self, trainer, pl_module):
        pl_module.load_state_dict(pl_module.state_dict(), assign=True)


class LookOnly(L.Callback):
    def __init__(self) -> None:
        self.dtypes = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with trainer.strategy.full_parameters(pl_module.blocks):
            self.dtypes |= {p.dtype for p in pl_module.blocks.parameters()}


class Bf16Weights(ParityNet):
    """Weights made in bf16 (a checkpoint loaded with ``torch_dtype=torch.bfloat16``), trained in bf16-mixed: their
    masters are fp32."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.to(torch.bfloat16)


def test_writeback_keeps_the_fp32_masters_of_bf16_weights_when_nothing_was_written():
    """The values inside are in the parameters' own dtype (bf16), their masters fp32: writing back what was only
    looked at changes no bit of the masters."""
    plain = fit(chunked(), steps=6, precision="bf16-mixed", cls=Bf16Weights)
    look = LookOnly()
    looked = fit(chunked(), steps=6, precision="bf16-mixed", cls=Bf16Weights, callbacks=[look])
    assert look.dtypes == {torch.bfloat16}
    assert_same_params(plain, looked, EXACT)


class ForwardInside(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with trainer.strategy.full_parameters():
            pl_module(batch[0])


class EnterAfterForward(ParityNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        with self.trainer.strategy.full_parameters():
            pass
        return loss


def test_a_forward_inside_and_entering_between_forward_and_backward_are_refused():
    with pytest.raises(ChunkError, match="a forward inside full_parameters"):
        fit(chunked(), steps=2, callbacks=[ForwardInside()])
    with pytest.raises(ChunkError, match="between a forward and its backward"):
        fit(chunked(), steps=2, cls=EnterAfterForward)


@pytest.mark.parametrize(
    "callback",
    [
        lambda: StochasticWeightAveraging(swa_lrs=1e-2),
        pytest.param(
            lambda: pl_callbacks.WeightAveraging(),
            marks=pytest.mark.skipif(not hasattr(pl_callbacks, "WeightAveraging"), reason="Lightning 2.6 brought it"),
        ),
        lambda: ModelPruning("l1_unstructured"),
    ],
)
def test_averaging_and_pruning_callbacks_are_refused_before_anything_is_built(callback):
    cb = callback()
    with pytest.raises(ValueError, match=f"{type(cb).__name__} does not work with chunk_offload"):
        fit(chunked(), steps=2, callbacks=[cb])


class CopiedTeacher(ParityNet):
    """An EMA teacher made by deep-copying the blocks after set-up (``on_fit_start``): a plain module of its own."""

    def on_fit_start(self):
        full = getattr(self.trainer.strategy, "full_parameters", None)
        with full() if full else contextlib.nullcontext():
            self.teacher = [
                copy.deepcopy(self.embed),
                copy.deepcopy(self.blocks),
            ]  # a list: never packed, never stepped

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            t = self.teacher[0](x)
            for blk in self.teacher[1]:
                t = t + blk(t)
        return super().training_step(batch, batch_idx) + 0.0 * t.sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for t in self.teacher[1].parameters():
                t.mul_(0.9)


def test_a_deep_copy_made_after_set_up_is_a_plain_module():
    """A copy keeps the engine's hooks (closures are shared by ``deepcopy``); they used to run the original's
    gathers for every forward of the copy. Now they leave the copy alone: the same gathers as without it."""
    ref = fit("auto", steps=6, cls=CopiedTeacher)
    strategy = chunked(placement="host")
    got = fit(strategy, steps=6, cls=CopiedTeacher)
    assert_same_params(ref, got, EXACT)
    for a, b in zip(ref.teacher[1].parameters(), got.teacher[1].parameters(), strict=True):
        assert torch.equal(a, b)
    plain = chunked(placement="host")
    fit(plain, steps=6)
    assert strategy.memory_stats()["gathers"] == plain.memory_stats()["gathers"]


@pytest.mark.parametrize(
    "placement,precision,disk",
    [("auto", "32-true", False), ("host", "32-true", False), ("auto", "bf16-true", False), ("host", "32-true", True)],
)
def test_grad_norm_and_gradient_edits_inside_full_parameters_with_grads_are_plain_lightning_s(
    placement, precision, disk, tmp_path
):
    """[Note: gradients in full_parameters]: Lightning's ``grad_norm(self)`` in ``on_before_optimizer_step`` found
    no gradient at all (an empty dict: every ``.grad`` is ``None`` while gradients live in the shards). Inside the
    block it reads the gradients plain Lightning has, and what it changes (one block's halved, a parameter's
    dropped) is what the step uses."""
    from tests.callbacks import GradNormsAndEdits

    ref_cb, got_cb = GradNormsAndEdits(), GradNormsAndEdits()
    ref = fit("auto", steps=6, precision=precision, callbacks=[ref_cb])
    tier = dict(host_memory_limit="140kB", disk_dir=str(tmp_path)) if disk else {}  # gradient shards in files
    strategy = chunked(placement=placement, **tier)
    got = fit(strategy, steps=6, precision=precision, callbacks=[got_cb])
    assert (strategy.memory_stats().get("disk_grad_bytes", 0) > 0) == disk
    assert len(ref_cb.norms[0]) == 17  # 16 parameters and the total
    assert got_cb.norms == ref_cb.norms
    assert got_cb.sharded == ref_cb.sharded  # strategy.grad_norm, without the block ([Note: gradient norms from...])
    assert_same_params(ref, got, EXACT)


def test_what_full_parameters_with_grads_cannot_do_is_refused():
    class GivesAGradient(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            with trainer.strategy.full_parameters(with_grads=True):
                pl_module.embed.weight.grad = torch.ones_like(pl_module.embed.weight)

    with pytest.raises(ChunkError, match=r"'embed\.weight' got no gradient in this step"):
        fit(chunked(), variant="frozen", steps=2, callbacks=[GivesAGradient()])
    from tests.callbacks import GradNormsAndEdits

    with pytest.raises(ValueError, match="not possible with step_in_backward=True"):
        fit(chunked(step_in_backward=True), steps=3, callbacks=[GradNormsAndEdits()])


class GradsAfterTheStep(L.Callback):
    """Counts the parameters with a gradient after each step, as a callback logging gradient histograms reads them
    (``grads``: the counts), or only reads the weights' shapes (``grads=False``)."""

    def __init__(self, grads: bool = True) -> None:
        self.grads, self.counts = grads, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.grads:
            self.counts.append(sum(p.grad is not None for p in pl_module.parameters()))
        else:
            self.counts.append(sum(p.numel() for p in pl_module.parameters()))

    def on_validation_batch_end(self, trainer, pl_module, *args):
        # after Lightning's zero_grad before validation: None in plain Lightning too
        self.in_validation = sum(p.grad is not None for p in pl_module.parameters())


@pytest.mark.parametrize("kw", [dict(), dict(placement="host")], ids=["defaults", "host"])
def test_gradients_read_after_the_step_warn_once_naming_where_they_are(kw):
    """Plain Lightning keeps each step's gradients on the parameters until the next backward; here they are in the
    shards, and a callback reading them after the step found none, without a word ([Note: gradients read after the
    step]). Lightning's own reads between steps (the model summary, ``zero_grad`` before validation) and reads after
    that ``zero_grad`` (in validation, where plain Lightning has none either) say nothing."""
    ref_cb, got_cb = GradsAfterTheStep(), GradsAfterTheStep()
    fit("auto", steps=3, callbacks=[ref_cb])
    with pytest.warns(UserWarning, match=r"param\.grad of 'embed\.weight' was read between steps and is None") as w:
        fit(chunked(**kw), steps=3, callbacks=[got_cb])
    assert ref_cb.counts == [16] * 3 and got_cb.counts == [0] * 3
    assert sum("param.grad of" in str(x.message) for x in w) == 1
    quiet: dict = dict(
        steps=4, callbacks=[GradsAfterTheStep(grads=False)], enable_model_summary=True,
        val_dataloaders=token_data(16, seed=1), limit_val_batches=1, val_check_interval=2,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="param.grad of")
        fit(chunked(**kw), **quiet)
    assert quiet["callbacks"][0].in_validation == 0


def test_a_checkpointed_block_recomputed_in_backward_is_not_taken_for_reads_between_steps(monkeypatch):
    """Lightning runs backward after ``training_step`` returns, where no step's reader is set, so a checkpointed
    block's recomputation read its parameters as between steps: each read noted its payload's bits (a kernel a
    parameter, dropped unread by the step's write-back) and armed the between-steps mode, through which every op of
    the recomputation then went in Python."""
    from lightning_chunk import ChunkOffloadStrategy
    from lightning_chunk.engine.memory import full_params
    from tests.precision_models import AutocastOff

    in_backward = lambda: torch._C._current_graph_task_id() != -1  # noqa: E731
    noted, modes = [], []
    bits = full_params.bits
    monkeypatch.setattr(full_params, "bits", lambda t: noted.append(in_backward()) or bits(t))

    class Watched(AutocastOff):
        def routed(self, h):
            scale = self.codebook.embed.shape[-1]  # a read by attribute
            if in_backward():  # the recomputation (torch stops it once it has what backward needs: before the end)
                modes.append(torch._C._len_torch_function_stack())
            return super().routed(h) * (scale / scale)

    # a user's defaults (chunk size chosen, every shard where auto puts it), accumulating two micro-batches a step
    fit(
        ChunkOffloadStrategy(),
        steps=4,
        variant="checkpointed",
        precision="bf16-mixed",
        cls=Watched,
        accumulate_grad_batches=2,
    )
    assert len(modes) == 8 and not any(modes)
    assert not any(noted)
