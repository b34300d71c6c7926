"""``strategy.full_optimizer_state()``: an optimizer's whole state of some parameters between steps, and writes into
it ([Note: the whole optimizer state of a parameter]).

Before, a callback that logged Adam's moments per parameter, or zeroed them for a layer it re-initialised, could
not: ``optimizer.state[p]`` raises under chunk_offload (the state is keyed by this rank's pieces), and DeepSpeed's
``safe_get_full_optimizer_state`` had no counterpart."""

import contextlib

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine import ChunkError
from lightning_chunk.options import grouped
from tests.compare import EXACT, assert_same_params
from tests.models import ParityNet, fit

STEPS = 5
RESET_AT = 2  # the batch after whose step the head's state is reset


def chunked(**kw):
    return ChunkOffloadStrategy(**grouped({"optimizer_kernel": "loop", **kw}))


def whole_state(trainer, module, **kw):
    """The block under chunk_offload; plain Lightning's optimizer state, as a user reads it there."""
    full = getattr(trainer.strategy, "full_optimizer_state", None)
    if full is not None:
        return full(module, **kw)
    opt = trainer.optimizers[0]
    return contextlib.nullcontext({p: opt.state[p] for p in module.parameters()})


class ReadsAndResets(ParityNet):
    """Records every parameter's whole optimizer state after each step; after step ``RESET_AT`` zeroes the head's
    moments and starts its step count again, as after re-initialising a layer (``how``: in place; or by assigning
    new tensors to the keys, and then every parameter's)."""

    def __init__(self, how: str = "in place", **kw) -> None:
        super().__init__(**kw)
        self.how, self.seen = how, []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with whole_state(self.trainer, self) as state:
            names = {p: n for n, p in self.named_parameters()}
            self.seen.append({names[p]: {k: v.clone() for k, v in st.items()} for p, st in state.items()})
        if batch_idx != RESET_AT or self.how == "none":
            return
        with whole_state(self.trainer, self.head if self.how == "in place" else self) as state:
            for st in state.values():
                if self.how == "in place":
                    st["exp_avg"].zero_()
                    st["exp_avg_sq"].zero_()
                    st["step"].zero_()
                else:
                    st.update(
                        exp_avg=torch.zeros_like(st["exp_avg"]),
                        exp_avg_sq=torch.zeros_like(st["exp_avg_sq"]),
                        step=torch.tensor(0.0),
                    )


def assert_same_states(ref, got):
    assert len(ref.seen) == len(got.seen) == STEPS
    for step, (a, b) in enumerate(zip(ref.seen, got.seen, strict=True)):
        assert a.keys() == b.keys(), f"step {step}: parameters {sorted(a)} against {sorted(b)}"
        for name in a:
            assert a[name].keys() == b[name].keys(), f"step {step}, {name}: keys"
            for k in a[name]:
                x, y = a[name][k], b[name][k]
                assert x.dtype == y.dtype and x.shape == y.shape, f"step {step}, {name}.{k}: {y.dtype} {y.shape}"
                torch.testing.assert_close(y, x, rtol=0, atol=0, msg=lambda m, n=name, k=k: f"{step} {n}.{k}: {m}")


CASES = {
    "defaults": dict(),
    "host": dict(placement="host"),
    "limit": dict(device_memory_limit=80_000, chunk_numel=4096),
    "in backward": dict(placement="host", chunk_numel=4096, step_in_backward=True),
}


@pytest.mark.parametrize("kw", list(CASES.values()), ids=list(CASES))
def test_the_whole_state_read_and_reset_between_steps_equals_plain_lightnings(kw):
    """Every parameter's state after each step equals what plain Lightning's optimizer holds, keys, dtypes, shapes
    and bits; the head's moments and count reset in place after a step train on as plain Lightning's do."""
    run = dict(steps=STEPS, cls=ReadsAndResets)
    ref, got = fit("auto", **run), fit(chunked(**kw), **run)
    assert_same_states(ref, got)
    assert_same_params(ref, got, EXACT)
    after = got.seen[RESET_AT + 1]["head.weight"]
    assert float(after["step"]) == 1.0  # the reset went in: one step since


@pytest.mark.parametrize("kw", [dict(), dict(device_memory_limit=100_000)], ids=["defaults", "limit"])
@pytest.mark.parametrize("base", ["RootTiedNet", "BatchNormNet"])
def test_a_tied_head_read_in_forward_and_a_batch_norm_read_and_reset_as_in_plain_lightning(base, kw):
    """A user's own models: GPT-2's head written as ``F.linear(h, self.embed.weight)`` in the root's forward (the
    root co-owns the embedding), and a BatchNorm before blocks used in reverse order; every parameter reset."""
    from tests import layer_models, models

    cls = type(base, (ReadsAndResets, getattr(layer_models, base, None) or getattr(models, base)), {})
    run = dict(steps=STEPS, cls=cls, model_kwargs=dict(how="assigned"))
    ref, got = fit("auto", **run), fit(chunked(**kw), **run)
    assert_same_states(ref, got)
    assert_same_params(ref, got, EXACT)


def test_state_assigned_to_the_keys_is_written_back_and_a_disk_shard_keeps_it(tmp_path):
    """New tensors given to the keys count as a change too, and reach the shards on the disk tier, whose state
    lives in their files."""
    run = dict(steps=STEPS, cls=ReadsAndResets, model_kwargs=dict(how="assigned"))
    ref = fit("auto", **run)
    strategy = chunked(host_memory_limit=140_000, disk_dir=tmp_path / "scratch", chunk_numel=2048)
    got = fit(strategy, **run)
    assert strategy.memory_stats()["disk_shards"] > 0
    assert_same_states(ref, got)
    assert_same_params(ref, got, EXACT)


class Misuses(ParityNet):
    """Each way the block refuses, tried once after the first step."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx:
            return
        strategy, self.errors = self.trainer.strategy, {}
        for what, change in (
            ("added", lambda st: st.update(momentum_buffer=torch.zeros(1))),
            ("removed", lambda st: st.pop("exp_avg_sq")),
            ("shape", lambda st: st.update(exp_avg=torch.zeros(3))),
        ):
            with pytest.raises(ChunkError) as e, strategy.full_optimizer_state(self.head) as state:
                change(state[self.head.weight])
            self.errors[what] = str(e.value)
        for what, which in (("index", 3), ("other", torch.optim.SGD([torch.zeros(1)], lr=1.0))):
            with pytest.raises(ValueError) as e, strategy.full_optimizer_state(optimizer=which):
                pass
            self.errors[what] = str(e.value)
        with strategy.full_optimizer_state(self.head, optimizer=self.optimizers(), writeback=False) as state:
            state[self.head.weight]["exp_avg"].fill_(1e6)  # let go, as asked
            state[self.head.weight]["step"].fill_(1e6)  # a copy too, though this rank's own count is on the host
            self.errors["keys"] = sorted(state[self.head.weight])


def test_the_block_refuses_changed_keys_and_shapes_and_unknown_optimizers_naming_them():
    ref, got = fit("auto", steps=3), fit(chunked(placement="host"), steps=3, cls=Misuses)
    assert_same_params(ref, got, EXACT)  # nothing refused was written, nor what writeback=False let go
    e = got.errors
    assert "'head.weight' gained ['momentum_buffer']" in e["added"] and "lost ['exp_avg_sq']" in e["removed"]
    assert "state 'exp_avg' of 'head.weight' was given shape (3,)" in e["shape"] and "(48, 32)" in e["shape"]
    assert "optimizer=3" in e["index"] and "from 0 to 0" in e["index"]
    assert "optimizer=SGD" in e["other"] and "not one of the 1" in e["other"]
    assert e["keys"] == ["exp_avg", "exp_avg_sq", "step"]


class InsideBackward(ParityNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        strategy = self.trainer.strategy
        loss.register_hook(lambda g: strategy.full_optimizer_state().__enter__())
        return loss


def test_the_block_is_refused_inside_a_backward():
    with pytest.raises(ChunkError, match=r"full_optimizer_state\(\) cannot be called inside a backward"):
        fit(chunked(placement="host"), steps=2, cls=InsideBackward)


def test_before_fit_there_is_no_state_and_after_it_the_block_gives_the_optimizers_own():
    """After ``fit`` on one rank the optimizer holds its state keyed by the parameters again, and the block reads it
    as plain Lightning's."""
    strategy = chunked(placement="host")
    with pytest.raises(ValueError, match="has no optimizer yet"), strategy.full_optimizer_state():
        pass
    ref, got = fit("auto", steps=3), fit(strategy, steps=3)
    opt = ref.trainer_ref.optimizers[0]
    with strategy.full_optimizer_state(got) as state:
        assert len(state) == len(list(got.parameters()))
        for (n, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
            for k, v in opt.state[p].items():
                torch.testing.assert_close(state[q][k], v, rtol=0, atol=0, msg=n)


class FrozenThenUnfrozen(L.LightningModule):
    """A parameter the optimizer steps that has had no gradient yet has ``{}``, as in plain torch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.seen: list[dict[str, list[str]]] = []

    def training_step(self, batch, batch_idx):
        return self.a(batch[0]).sum()  # b gets no gradient

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with whole_state(self.trainer, self) as state:
            names = {p: n for n, p in self.named_parameters()}
            self.seen.append({names[p]: sorted(st) for p, st in state.items()})

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def test_a_parameter_without_state_yet_has_an_empty_one():
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    runs = []
    for strategy in ("auto", chunked(placement="host")):
        model = FrozenThenUnfrozen()
        L.Trainer(
            strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        ).fit(model, data)  # fmt: skip
        runs.append(model.seen)
    assert runs[0] == runs[1]
    assert runs[1][0]["b.weight"] == [] and runs[1][0]["a.weight"] == ["exp_avg", "exp_avg_sq", "step"]


class ZeroesMomentsInRegions(ParityNet):
    """After the second step, zeroes every moment inside the block and reads them back in a second one."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx != 1:
            return
        strategy = self.trainer.strategy
        opt = strategy.engine.bindings[0].optimizer
        pieces = lambda: {id(v): st["exp_avg"] for v, st in opt.state.items() if st}  # noqa: E731
        before = pieces()
        with strategy.full_optimizer_state() as state:
            for st in state.values():
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
        with strategy.full_optimizer_state(writeback=False) as state:
            self.read_back = [float(st[k].abs().max()) for st in state.values() for k in ("exp_avg", "exp_avg_sq")]
        after = pieces()
        self.same_objects = before.keys() == after.keys() and all(after[k] is t for k, t in before.items())
        self.in_regions = all(t._base is not None for t in after.values())


def test_moments_kept_in_the_one_pass_kernels_regions_are_written_in_place():
    """The one-pass kernel keeps a host chunk's moments in flat regions that each piece's state slices ([Note: Adam's
    moments in flat regions]): a write that replaced the slices would leave the kernel a stale region or none."""
    strategy = chunked(placement="host", optimizer_kernel="one_pass")
    got = fit(strategy, steps=3, precision="bf16-mixed", cls=ZeroesMomentsInRegions)
    assert got.read_back and max(got.read_back) == 0.0
    assert got.same_objects and got.in_regions


class ReadsAtTrainStart(ParityNet):
    def on_train_start(self):
        with whole_state(self.trainer, self) as state:
            names = {p: n for n, p in self.named_parameters()}
            self.at_start = {names[p]: {k: v.clone() for k, v in st.items()} for p, st in state.items()}


class SavesAtTheEnd(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:  # during fit: a sharded directory under chunk_offload
            trainer.save_checkpoint(self.path)


def test_a_resumed_state_is_read_before_the_first_step_as_plain_lightning_restored_it(tmp_path):
    """A resumed checkpoint's optimizer state is read into the chunks at the first step ([Note: optimizer state read
    after the warm-up]); the block reads it in first."""
    got = []
    for name, strategy in (("ref", lambda: "auto"), ("got", lambda: chunked(device_memory_limit=80_000))):
        fit(strategy(), steps=3, callbacks=[SavesAtTheEnd(tmp_path / name)])
        got.append(fit(strategy(), steps=5, cls=ReadsAtTrainStart, ckpt_path=str(tmp_path / name)))
    assert (tmp_path / "got").is_dir()
    ref, chunk = got
    assert ref.at_start and ref.at_start.keys() == chunk.at_start.keys()
    for n, st in ref.at_start.items():
        assert st.keys() == chunk.at_start[n].keys() and float(st["step"]) == 3.0
        for k, v in st.items():
            torch.testing.assert_close(chunk.at_start[n][k], v, rtol=0, atol=0, msg=f"{n}.{k}")
    assert_same_params(ref, chunk, EXACT)


@pytest.mark.parametrize(
    "kw",
    [dict(placement="host"), dict(device_memory_limit=80_000, chunk_numel=4096), dict(host_memory_limit=160_000)],
    ids=["host", "limit", "disk"],
)
def test_groups_keeping_different_state_keys_keep_them_in_reads_checkpoints_resumes_and_after_fit(kw, tmp_path):
    """[Note: state keys a parameter has]: amsgrad in the matrices' group alone, so a chunk holds parameters with and
    without ``max_exp_avg_sq``. Each keeps plain torch's keys in every read, in a sharded checkpoint consolidated
    and resumed, and in ``optimizer.state`` after fit. Before, the chunk's zeros of that key came back as state of
    every parameter beside a matrix."""
    from lightning_chunk.consolidate import consolidate

    model = dict(optimizer="adamw_amsgrad_matrices")
    if "host_memory_limit" in kw:  # the state of disk shards lives in their files
        kw = dict(kw, disk_dir=tmp_path / "scratch", chunk_numel=2048)
    runs = []
    for name, strategy in (("ref", lambda: "auto"), ("got", lambda: chunked(**kw))):
        saves = SavesAtTheEnd(tmp_path / name)
        runs.append(
            fit(strategy(), steps=STEPS, cls=ReadsAndResets, model_kwargs=dict(how="none", **model), callbacks=[saves])
        )
    ref, got = runs
    assert_same_states(ref, got)
    assert {k for st in got.seen[-1].values() for k in st} == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"}
    after = (r.trainer_ref.optimizers[0] for r in runs)
    assert [sorted(st) for st in next(after).state.values()] == [sorted(st) for st in next(after).state.values()]

    consolidate(tmp_path / "got", tmp_path / "got.ckpt", with_optimizer=True, progress=False)
    plain, mine = (
        torch.load(tmp_path / n, weights_only=False)["optimizer_states"][0]["state"] for n in ("ref", "got.ckpt")
    )
    assert {i: sorted(st) for i, st in plain.items()} == {i: sorted(st) for i, st in mine.items()}

    resumed = [
        fit(s, steps=STEPS, cls=ReadsAtTrainStart, model_kwargs=model, ckpt_path=str(tmp_path / n))
        for n, s in (("ref", "auto"), ("got", chunked(**kw)))
    ]
    for n, st in resumed[0].at_start.items():
        assert st.keys() == resumed[1].at_start[n].keys(), n
    assert_same_params(*resumed, EXACT)


class ReadsBeforeTheStep(ParityNet):
    def on_before_optimizer_step(self, optimizer):
        with whole_state(self.trainer, self.head) as state:
            self.seen = [{k: v.clone() for k, v in st.items()} for st in state.values()]


def test_the_block_is_refused_between_a_backward_that_stepped_and_the_optimizer_step():
    """Stepping in backward, the chunks' state is already this step's when ``on_before_optimizer_step`` runs, where
    plain Lightning's is the last step's."""
    with pytest.raises(ChunkError, match=r"chunks have stepped already.*step_in_backward=False"):
        fit(chunked(placement="host", step_in_backward=True), steps=2, cls=ReadsBeforeTheStep)
    ref, got = (
        fit("auto", steps=3, cls=ReadsBeforeTheStep),
        fit(chunked(placement="host"), steps=3, cls=ReadsBeforeTheStep),
    )
    assert_same_params(ref, got, EXACT)  # the defaults step after backward where this hook is overridden
    assert ref.seen[0].keys() == got.seen[0].keys() == {"exp_avg", "exp_avg_sq", "step"}
    for k, v in ref.seen[0].items():
        torch.testing.assert_close(got.seen[0][k], v, rtol=0, atol=0)


class AsksBeforeReading(L.Callback):
    """A callback that asks first, as code written for plain torch does: ``if p in optimizer.state``."""

    def __init__(self) -> None:
        self.found: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = pl_module.optimizers()
        self.found += [p in opt.state or opt.state.get(p) is not None for p in pl_module.parameters()]


def test_asking_whether_a_module_parameter_has_state_warns_once_that_it_never_will_during_fit():
    """Before, ``p in optimizer.state`` answered False at every step without a word: the callback logged nothing."""
    seen = AsksBeforeReading()
    with pytest.warns(UserWarning, match=r"`in optimizer.state`.*full_optimizer_state\(module\)") as caught:
        got = fit(chunked(placement="host"), steps=3, callbacks=[seen])
    assert len([w for w in caught if "`in optimizer.state`" in str(w.message)]) == 1
    assert seen.found and not any(seen.found)
    assert_same_params(fit("auto", steps=3, callbacks=[AsksBeforeReading()]), got, EXACT)


class ReadsInValidation(L.Callback):
    def on_validation_epoch_end(self, trainer, pl_module):
        with whole_state(trainer, pl_module) as state:
            self.seen = [{k: v.clone() for k, v in st.items()} for st in state.values()]


def test_validate_after_fit_reads_the_state_fit_left_as_plain_lightning_does():
    """``trainer.validate`` after ``fit`` sets up no optimizer of its own: the block reads the one fit left."""
    from tests.models import token_data

    seen = []
    for strategy in ("auto", chunked(device_memory_limit=80_000)):
        cb = ReadsInValidation()
        model = fit(strategy, steps=3, callbacks=[cb], limit_val_batches=2)  # no validation data in fit
        model.trainer_ref.validate(model, token_data(16, seed=1), verbose=False)
        seen.append(cb.seen)
    assert len(seen[0]) == len(seen[1]) > 0
    for a, b in zip(*seen, strict=True):
        assert a.keys() == b.keys() == {"exp_avg", "exp_avg_sq", "step"}
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)


class HalvesEveryState(L.Callback):
    """After the second step, every tensor of every parameter's state but its count halved."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            with whole_state(trainer, pl_module) as state:
                for st in state.values():
                    for k, v in st.items():
                        if k != "step":
                            v.mul_(0.5)


@pytest.mark.parametrize("name", ["AdafactorNet", "MuonNet"])
def test_state_of_optimizers_stepped_whole_is_written_back_as_plain_lightning_s(name):
    """Adafactor's row and column statistics are a whole parameter's state kept on every rank holding a piece
    ([Note: optimizers that need whole parameters]): written back whole, beside Muon's per-element momentum."""
    from tests import optimizer_models

    run = dict(steps=4, cls=getattr(optimizer_models, name), callbacks=[HalvesEveryState()])
    ref, got = fit("auto", **run), fit(chunked(placement="host", chunk_numel=4096), **run)
    assert_same_params(ref, got, EXACT)
