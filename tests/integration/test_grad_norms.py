"""``strategy.grad_norm``: Lightning's ``grad_norm(self)`` from the gradient shards, without gathering ([Note: gradient
norms from the shards] in ``engine/optim/gradients.py``). Before it, ``grad_norm(self)`` logged nothing under
chunk_offload (``param.grad`` is ``None`` there), and the only way to the norms gathered the whole model with its
gradients on every rank (two ranks: ``test_two_rank_paths.py``'s ``full_parameters`` case)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import grad_norm

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, ReadsGrads, fit, quiet_trainer, token_data

LOOP = OffloadOptions(optimizer_kernel="loop")


class LogsGradNorms(ReadsGrads):
    """Logs the gradient norms as Lightning's docs do: the strategy's ``grad_norm`` where it has one, else
    Lightning's."""

    def __init__(self, norm_type: float | str = 2, manual: bool = False, **kw) -> None:
        super().__init__(manual, **kw)
        self.norm_type = norm_type
        self.seen: list[dict[str, float]] = []

    def read_grads(self) -> None:
        norms = getattr(self.trainer.strategy, "grad_norm", lambda p: grad_norm(self, p))(self.norm_type)
        self.log_dict(norms)
        self.seen.append({k: float(v) for k, v in norms.items()})


CASES = {  # strategy, the model's arguments, the Trainer's
    "resident": (dict(), dict(), dict()),
    "host_accumulated": (dict(placement="host"), dict(), dict(accumulate_grad_batches=2)),
    "limit_unused_branch_inf": (dict(device_memory_limit="80KB"), dict(variant="unused", norm_type="inf"), dict()),
    "disk_tied_l1": (
        dict(placement="host", host_memory_limit="70KB", memory=MemoryOptions(chunk_numel=2048)),
        dict(variant="tied", norm_type=1),
        dict(gradient_clip_val=0.05),
    ),
    "frozen_manual": (dict(), dict(variant="frozen", manual=True), dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_strategy_s_grad_norm_is_lightning_s_bit_for_bit_on_one_rank(case, tmp_path):
    strategy_kw, model_kw, trainer_kw = CASES[case]
    model_kw = dict(model_kw)
    trainer_kw = dict(trainer_kw, variant=model_kw.pop("variant", "plain"))
    if "host_memory_limit" in strategy_kw:
        strategy_kw = {**strategy_kw, "offload": OffloadOptions(optimizer_kernel="loop", disk_dir=str(tmp_path))}
    ref = fit("auto", cls=LogsGradNorms, model_kwargs=model_kw, **trainer_kw)
    strategy = ChunkOffloadStrategy(**{"offload": LOOP, **strategy_kw})
    got = fit(strategy, cls=LogsGradNorms, model_kwargs=model_kw, **trainer_kw)
    assert len(got.seen) == len(ref.seen) == 20 and got.seen[0]
    assert got.seen == ref.seen  # the same names (a parameter without a gradient left out), the same values
    assert_same_params(ref, got, EXACT)
    if "host_memory_limit" in strategy_kw:
        assert strategy.memory_stats()["disk_shards"] > 0


def test_after_a_resume_in_the_middle_the_norms_are_plain_lightning_s(tmp_path):
    """Host placement, accumulation, an unused branch: resumed from step 5 (mid-epoch: Lightning starts the epoch's
    batches again), the norms logged after the resume are plain Lightning's resumed the same way, bit for bit."""
    kw = dict(variant="unused", steps=10, accumulate_grad_batches=2, default_root_dir=tmp_path)
    seen = {}
    for name, make in (("ref", lambda: "auto"), ("got", lambda: ChunkOffloadStrategy(placement="host", offload=LOOP))):
        saves = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=5, save_top_k=-1, filename="{step}")
        fit(make(), cls=LogsGradNorms, callbacks=[saves], enable_checkpointing=True, **kw)
        seen[name] = fit(make(), cls=LogsGradNorms, ckpt_path=str(tmp_path / name / "step=5.ckpt"), **kw)
    assert len(seen["ref"].seen) == 5 and seen["got"].seen == seen["ref"].seen
    assert_same_params(seen["ref"], seen["got"], EXACT)


class Asks(ParityNet):
    """Asks for the norms in ``on_before_optimizer_step``."""

    def __init__(self, norm_type):
        super().__init__()
        self.norm_type = norm_type

    def on_before_optimizer_step(self, optimizer):
        self.trainer.strategy.grad_norm(self.norm_type)


class AsksAfterTheStep(ParityNet):
    """Asks for the norms in ``on_train_batch_end`` only: no hook ``step_in_backward=None`` looks at."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        norms = getattr(self.trainer.strategy, "grad_norm", lambda p: grad_norm(self, p))(2)
        self.seen.append({k: float(v) for k, v in norms.items()})


def test_bad_norm_types_and_gradients_stepped_away_are_refused_naming_what_to_do():
    with pytest.raises(ValueError, match=r"`norm_type` must be a positive number or 'inf' \(infinity norm\)\. Got 0"):
        quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=1).fit(Asks(0), token_data())
    # stepping in backward, asked for or chosen by the default (nothing it knows of reads the gradients after the
    # step): the gradients are gone, and the error says where the call works and what to pass
    for strategy, model in (
        (ChunkOffloadStrategy(step_in_backward=True), Asks(2)),
        (ChunkOffloadStrategy(), AsksAfterTheStep()),
    ):
        with pytest.raises(ValueError, match=r"Call it in on_before_optimizer_step .* or pass step_in_backward=False"):
            quiet_trainer(strategy=strategy, max_steps=2).fit(model, token_data())
    # after the step, with step_in_backward=False: the step's gradients, as plain Lightning's grad_norm there
    ref, got = AsksAfterTheStep(), AsksAfterTheStep()
    for model, strategy in ((ref, "auto"), (got, ChunkOffloadStrategy(step_in_backward=False, offload=LOOP))):
        L.seed_everything(7, verbose=False)
        model.load_state_dict(ParityNet().state_dict())
        quiet_trainer(strategy=strategy, max_steps=3).fit(model, token_data())
    assert got.seen == ref.seen and len(got.seen[0]) == 17


def test_before_and_after_fit_it_is_lightning_s_own():
    model = ParityNet()
    strategy = ChunkOffloadStrategy()
    quiet_trainer(strategy=strategy, max_steps=2).fit(model, token_data())
    assert strategy.grad_norm(2, module=model) == {}  # no engine, no gradient on the plain parameters
    model.head.weight.grad = torch.ones_like(model.head.weight)
    assert strategy.grad_norm(2, module=model) == grad_norm(model, 2)
