"""Two-rank cases beyond a plain fit, each against DDP or the same run without a limit: parameters unfrozen and
frozen mid-run, parameters read and written outside a step, a gradient penalty under a limit, BatchNorm's buffers.
Ranks that part are ``parting_cases.py``'s."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_chunk import CheckOptions, ChunkOffloadStrategy, MemoryOptions
from tests import backward_models, callbacks, models, optimizer_models
from tests.distributed import rank_models
from tests.distributed.harness import chunk_strategy, trainer
from tests.models import ParityNet, token_data


def run_unfreeze(out: Path) -> None:
    """[Note: requires_grad changed]: blocks[0] unfrozen at step 6 and the embedding frozen from 6 to 14, with the
    defaults; DDP trains everything and drops the gradients the schedule freezes (``DropFrozenGrads``)."""
    L.seed_everything(7, verbose=False)
    ref = ParityNet()
    trainer(DDPStrategy(), steps=20, callbacks=[callbacks.DropFrozenGrads()]).fit(ref, token_data())
    L.seed_everything(7, verbose=False)
    model = ParityNet(variant="frozen")
    strategy = chunk_strategy()
    t = trainer(strategy, steps=20, callbacks=[callbacks.FlipRequiresGrad()])
    t.fit(model, token_data())
    state = {"ref": ref.state_dict(), "got": model.state_dict(), "stats": strategy.memory_stats()}
    if t.global_rank == 0:
        torch.save(state, out / "unfreeze.pt")
    print(f"CASE-DONE unfreeze rank={t.global_rank}", flush=True)


def run_full_parameters(out: Path) -> None:
    """[Note: parameters outside a step]: weights clamped after every step and a norm read between steps, with the
    defaults and with host placement, against DDP doing the same on its parameters."""
    L.seed_everything(7, verbose=False)
    ref, ref_cb, ref_grads = ParityNet(), callbacks.ClampFirstBlock(), callbacks.GradNormsAndEdits()
    trainer(DDPStrategy(), steps=12, callbacks=[ref_cb, ref_grads]).fit(ref, token_data())
    state: dict = {"ref": ref.state_dict(), "ref_norms": ref_cb.norms, "ref_grad_norms": ref_grads.norms}
    state["ref_sharded_norms"] = ref_grads.sharded
    for placement in ("auto", "host"):
        L.seed_everything(7, verbose=False)
        model, cb, grads = ParityNet(), callbacks.ClampFirstBlock(), callbacks.GradNormsAndEdits()
        t = trainer(
            chunk_strategy(placement=placement),
            steps=12,
            callbacks=[cb, grads],
        )
        t.fit(model, token_data())
        state[placement] = {
            "got": model.state_dict(),
            "norms": cb.norms,
            "seen_outside": cb.seen_outside,
            "seen_kept": cb.seen_kept,
            "saved_inside": cb.saved,
            "grad_norms": grads.norms,
            "sharded_norms": grads.sharded,
        }
    # the defaults under a limit below this rank's share, on a model used in another order than registered, with
    # gradient accumulation (the block runs between micro-batches, while gradients wait in the shards), against the
    # same run without the limit: what the block writes must not depend on what was evicted. (Against DDP, sharded
    # accumulation differs by its rounding: ROUNDING["accumulate"].)
    hard: dict = {}
    for limited in (False, True):
        L.seed_everything(7, verbose=False)
        model = models.ReorderedNet(dim=256, hidden=1024, depth=4)
        limit = int(sum(p.numel() * p.element_size() for p in model.parameters()) * 0.45) if limited else None
        strategy = chunk_strategy(device_memory_limit=limit)
        grads = callbacks.GradNormsAndEdits()
        trainer(strategy, steps=8, callbacks=[callbacks.ClampFirstBlock(), grads], accumulate_grad_batches=2).fit(
            model, token_data()
        )
        hard[limited] = {
            "state": model.state_dict(),
            "evictions": strategy.memory_stats()["evictions"],
            "sharded_norms": grads.sharded,
        }
    state["hard"] = hard
    # ranks that differ: a gate's parameter gets a gradient on one rank and not the other, a different one each
    # step; strategy.grad_norm names it as DDP's grad_norm does (the vote's rule), with the defaults
    gated: dict = {}
    for name, make in (("ref", lambda: DDPStrategy(find_unused_parameters=True)), ("got", chunk_strategy)):
        L.seed_everything(7, verbose=False)
        grads = callbacks.GradNormsAndEdits()
        trainer(make(), steps=8, callbacks=[grads]).fit(rank_models.RankGatedNet(), token_data())
        gated[name] = grads.sharded
    state["gated"] = gated
    try:  # outside the block, a state_dict needs every rank's shards: refused with the way to get it
        t2 = trainer(
            ChunkOffloadStrategy(checks=CheckOptions(collective_timeout_s=60)),
            steps=2,
            callbacks=[callbacks.StateDictOutside()],
        )
        t2.fit(ParityNet(), token_data())
    except Exception as e:  # noqa: BLE001 -- the message is what the test reads
        state["outside_error"] = f"{type(e).__name__}: {e}"
    try:  # unsharded accumulation: between micro-batches the gradients wait in the payloads, not in the shards
        trainer(
            ChunkOffloadStrategy(
                memory=MemoryOptions(sharded_accumulation=False), checks=CheckOptions(collective_timeout_s=60)
            ),
            steps=2,
            callbacks=[callbacks.GradsAfterBackward()],
            accumulate_grad_batches=2,
        ).fit(ParityNet(), token_data())
    except Exception as e:  # noqa: BLE001 -- the message is what the test reads
        state["waiting_error"] = f"{type(e).__name__}: {e}"
    if t.global_rank == 0:
        torch.save(state, out / "full_parameters.pt")
    print(f"CASE-DONE full_parameters rank={t.global_rank}", flush=True)


def run_grad_penalty_limit(out: Path) -> None:
    """[Note: a backward that delivers no gradient] with the defaults under a device limit (the automatic chunk size,
    payloads evicted and gathered again), on a model used in another order than registered, with accumulation,
    stepping in backward and after it: each as the same run without the limit, bit for bit."""
    kw = dict(dim=64, hidden=512, depth=3)
    params = backward_models.ReorderedGradPenalty(**kw).parameters()
    limit = int(sum(p.numel() * p.element_size() for p in params) * 1.8)
    results = {}
    for name, extra in [
        ("free", {}),
        ("limited", dict(device_memory_limit=limit)),
        ("limited_early", dict(device_memory_limit=limit, step_in_backward=True)),
    ]:
        L.seed_everything(7, verbose=False)
        model = backward_models.ReorderedGradPenalty(**kw)
        strategy = chunk_strategy(**extra, chunk_numel_min=4096)
        t = trainer(strategy, steps=6, accumulate_grad_batches=2)
        t.fit(model, token_data())
        results[name] = {
            "state": model.state_dict(),
            **{k: v for k, v in strategy.memory_stats().items() if k in ("evictions", "chunks_stepped_in_backward")},
        }
    if t.global_rank == 0:
        torch.save(results, out / "grad_penalty_limit.pt")
    print(f"CASE-DONE grad_penalty_limit rank={t.global_rank}", flush=True)


def run_batchnorm(out: Path) -> None:
    """Buffers follow DDP's ``broadcast_buffers`` on every rank: rank 0's running statistics before each forward
    in ``fit`` that DDP syncs (after a training forward outside ``no_sync``), none after evaluation or a
    non-stepping micro-batch. Each rank saves its own buffers, parameters and validation losses: for a run DDP
    matches bit for bit, and for the defaults (automatic chunk size, sharded accumulation) under a device limit
    below the parameter bytes, resumed from a step-4 checkpoint as DDP is."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    params = sum(p.numel() * 4 for p in models.BatchNormNet(depth=4, dim=256, hidden=1024).parameters())
    seen = {}
    for name in ("ddp", "chunk", "ddp_resumed", "defaults_resumed"):
        if name == "ddp" or name == "ddp_resumed":
            make = DDPStrategy
        elif name == "chunk":

            def make():
                return chunk_strategy(chunk_numel=4096, sharded_accumulation=False)
        else:

            def make():
                return chunk_strategy(device_memory_limit=int(0.45 * params), chunk_numel_min=4096)

        resumed = name.endswith("resumed")
        model_kw = dict(depth=4, dim=256, hidden=1024) if resumed else {}
        ckpt_path = None
        if resumed:  # the first half, with a checkpoint at step 4
            L.seed_everything(7, verbose=False)
            cb = ModelCheckpoint(dirpath=out / f"bn_{name}", every_n_train_steps=4, filename="{step}")
            t = trainer(
                make(),
                steps=4,
                accumulate_grad_batches=2,
                limit_val_batches=2,
                val_check_interval=6,
                num_sanity_val_steps=1,
                callbacks=[cb],
                enable_checkpointing=True,
            )
            t.fit(models.BatchNormNet(**model_kw), token_data(), token_data(n=16, seed=1))
            ckpt_path = out / f"bn_{name}" / "step=4.ckpt"
        L.seed_everything(7, verbose=False)
        model = models.BatchNormNet(**model_kw)
        strategy = make()
        t = trainer(
            strategy,
            steps=8,
            accumulate_grad_batches=2,
            limit_val_batches=2,
            val_check_interval=6,
            num_sanity_val_steps=1,
        )
        t.fit(model, token_data(), token_data(n=16, seed=1), ckpt_path=ckpt_path)
        if isinstance(strategy, ChunkOffloadStrategy):
            with strategy.full_parameters():
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            evictions = strategy.memory_stats()["evictions"]
        else:
            state, evictions = {k: v.detach().clone() for k, v in model.state_dict().items()}, 0
        seen[name] = {"state": state, "val": model.val_seen, "evictions": evictions}
    torch.save(seen, out / f"batchnorm.rank{t.global_rank}.pt")
    print(f"CASE-DONE batchnorm rank={t.global_rank}", flush=True)


class _Stream(torch.utils.data.IterableDataset):
    """``n`` samples of ``token_data`` with no length, as a stream's shard gives them."""

    def __init__(self, n: int) -> None:
        self.samples = token_data(n).dataset

    def __iter__(self):
        return iter(self.samples)


class _Logits(ParityNet):
    """Predicts its logits, and counts its ``predict_step`` calls."""

    predicted = 0

    def predict_step(self, batch, batch_idx):
        self.predicted += 1
        return self(batch[0])


def _predict_like_ddp(loader, **kw) -> dict:
    """DDP's and chunk_offload's predictions of the same loader: how many batches each returned, whether they are
    equal, and how many times chunk_offload's ``predict_step`` ran."""
    L.seed_everything(7, verbose=False)
    ref = trainer(DDPStrategy()).predict(_Logits(), loader())
    L.seed_everything(7, verbose=False)
    model = _Logits()
    got = trainer(chunk_strategy(**kw)).predict(model, loader())
    same = len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    return {"batches": len(got), "same_as_ddp": same, "calls": model.predicted}


def run_uneven_batches(out: Path) -> None:
    """[Note: the same number of batches on every rank]: rank 0 has 3 batches and rank 1 has 2 (sized dataloaders
    without the distributed sampler), in training and in validation: every rank raises at the batch where one's
    batches end, before running it. ``limit_val_batches`` giving both ranks 2 runs. Predict, where Lightning's own
    sampler does not pad (17 samples: 9 and 8 on two ranks, 5, 4, 4, 4 on four), under an evicting limit, and a
    stream with no length, against DDP. Each rank saves what each stage did: ``"ran"``, the error's words, or
    predict's batches."""
    from lightning_chunk.engine.comm.agreement import CollectiveMismatchError

    rank = int(os.environ.get("RANK", 0))
    n = [12, 8][rank % 2]  # samples: 3 and 2 batches of 4 (on four ranks, ranks 1 and 3 have 2)
    done: dict[str, str] = {}

    def attempt(stage: str, call: str, *loaders, **kw) -> None:
        L.seed_everything(7, verbose=False)
        t = trainer(chunk_strategy(placement="host"), use_distributed_sampler=False, **kw)
        try:
            getattr(t, call)(ParityNet(), *loaders)
            done[stage] = "ran"
        except CollectiveMismatchError as e:
            done[stage] = str(e)

    attempt("train", "fit", token_data(n), steps=-1, max_epochs=1)
    attempt(
        "validation", "fit", token_data(), token_data(n, seed=1), steps=2, limit_val_batches=1.0, val_check_interval=2
    )
    attempt("validate_limited", "validate", token_data(n, seed=1), limit_val_batches=2)
    done["predict"] = _predict_like_ddp(lambda: torch.utils.data.DataLoader(_Stream(n), batch_size=4), placement="host")
    limit = dict(device_memory_limit=100_000, chunk_numel=4096)
    done["predict_sampled"] = _predict_like_ddp(lambda: token_data(17), **limit)
    (out / f"uneven_batches.rank{rank}.json").write_text(json.dumps(done))
    print(f"CASE-DONE uneven_batches rank={rank}", flush=True)


def run_fits_again(out: Path) -> None:
    """Six fits in one process (a sweep, or fit then test): each fit's engine made gloo groups (sockets to every peer
    and threads) that were never destroyed, until the process ran out of descriptors. Each rank saves its open
    descriptors and threads after each fit."""
    rank = int(os.environ.get("RANK", 0))
    seen = []
    for _ in range(6):
        L.seed_everything(7, verbose=False)
        trainer(chunk_strategy(placement="host"), steps=2).fit(ParityNet(), token_data())
        seen.append((len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))))
    (out / f"fits_again.rank{rank}.json").write_text(json.dumps(seen))
    print(f"CASE-DONE fits_again rank={rank}", flush=True)


def run_static_limits(out: Path) -> None:
    """[Note: the shards a placement keeps on the device]: ``static`` under 1.3x the parameter bytes (shards on the
    device and a module's payloads beside them do not fit) and under 2x (they fit, but not with the activations
    too; rank 1 asks 2.2x, and the ranks agree on the smaller), with a sanity check; then at the limit the second
    error names, beside DDP."""
    import re

    from lightning_chunk import DeviceMemoryLimitError

    param_bytes = sum(p.numel() * p.element_size() for p in ParityNet().parameters())
    done: dict = {}

    def attempt(stage: str, strategy) -> None:
        L.seed_everything(7, verbose=False)
        model = ParityNet()
        t = trainer(strategy, steps=4, limit_val_batches=2, num_sanity_val_steps=1, val_check_interval=2)
        try:
            t.fit(model, token_data(), token_data(16))
            done[stage] = model.state_dict()
        except DeviceMemoryLimitError as e:
            done[stage] = str(e)

    rank = int(os.environ.get("RANK", 0))
    for stage, fraction in (("set-up", 1.3), ("warm-up", 2.0 + 0.2 * rank)):
        attempt(stage, chunk_strategy(placement="static", device_memory_limit=int(param_bytes * fraction)))
    named = re.search(r"The smallest limit that would work is (\d+) bytes", str(done["warm-up"]))
    done["named_limit"] = int(named.group(1)) if named else None
    if named:
        attempt("named", chunk_strategy(placement="static", device_memory_limit=done["named_limit"]))
    attempt("ddp", DDPStrategy())
    torch.save({"param_bytes": param_bytes, **done}, out / f"static_limits.rank{rank}.pt")
    print(f"CASE-DONE static_limits rank={rank}", flush=True)


def run_clip_over_optimizer(out: Path) -> None:
    """[Note: a norm over the optimizer's gradient shards]: torch's norm clipping over the optimizer's own parameters
    (a call a param group before the step, ``get_total_norm`` after backward, after a manual backward) raises on
    every rank; clipping by value there trains as DDP. Each rank saves what each did: the error's words, or the
    value run's parameters beside DDP's."""
    from lightning_chunk.engine import ChunkError

    rank = int(os.environ.get("RANK", 0))
    done: dict = {}
    for how in ("group_norms", "total_norm", "manual"):
        L.seed_everything(7, verbose=False)
        try:
            trainer(chunk_strategy(), steps=2).fit(optimizer_models.ClipsOptimizerParams(how), token_data())
            done[how] = "ran"
        except ChunkError as e:
            done[how] = str(e)
    states = []
    for strategy in (DDPStrategy(), chunk_strategy()):
        L.seed_everything(7, verbose=False)
        model = optimizer_models.ClipsOptimizerParams("value")
        trainer(strategy, steps=6).fit(model, token_data())
        states.append(model.state_dict())
    done["value_as_ddp"] = all(torch.equal(states[0][k], v) for k, v in states[1].items())
    (out / f"clip_over_optimizer.rank{rank}.json").write_text(json.dumps(done))
    print(f"CASE-DONE clip_over_optimizer rank={rank}", flush=True)


def run_backward_raised(out: Path) -> None:
    """[Note: a backward that raised]: every batch's backward runs out of memory part way on both ranks and the
    user's ``backward`` hook catches it; the step goes on, clipped by norm, with the gradients that arrived: after
    backward, and stepped in backward on guesses undone. Each rank saves the largest difference from DDP on a model
    that has no gradient below the failure (which DDP's own reducer could not go on from)."""
    rank = int(os.environ.get("RANK", 0))
    got: dict = {}
    runs = {
        "ddp": (DDPStrategy(find_unused_parameters=True), backward_models.DetachedSizedNet),
        "after": (chunk_strategy(placement="host", chunk_numel=4000), backward_models.BackwardSizedNet),
        "guessed": (
            chunk_strategy(placement="host", chunk_numel=4000, step_in_backward=True),
            backward_models.BackwardSizedNet,
        ),
    }
    states = {}
    for name, (strategy, cls) in runs.items():
        L.seed_everything(7, verbose=False)
        model = cls(2, swallow=True)
        model.batch_size = 3
        trainer(strategy, steps=3, gradient_clip_val=0.05).fit(model)
        states[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if name == "guessed":
            stats = strategy.memory_stats()
            got.update({k: stats.get(k, 0) for k in ("speculation_rollbacks", "chunks_stepped_in_backward")})
    for name in ("after", "guessed"):
        got[name] = max((states[name][k] - v).abs().max().item() for k, v in states["ddp"].items())
    (out / f"backward_raised.rank{rank}.json").write_text(json.dumps(got))
    print(f"CASE-DONE backward_raised rank={rank}", flush=True)


def run_written_after_a_forward(out: Path) -> None:
    """[Note: the optimizer's views written outside its step]: outside a step the ranks agree to make the copies
    again at the first forward only; at the epoch's end a forward at the training weights, ``optimizer.eval()``, then
    a forward at the average. Each rank saves the error the fit raised."""
    from lightning_chunk.engine import ChunkError

    rank = int(os.environ.get("RANK", 0))
    model = type("Twice", (optimizer_models.ScheduleFreeEvaluatedByHand,), {"twice": True})()
    strategy = chunk_strategy(assume_elementwise_optimizer=True, device_memory_limit=150_000, chunk_numel=4096)
    try:
        trainer(strategy, steps=3, limit_train_batches=2).fit(model, token_data())
        said = "ran"
    except ChunkError as e:
        said = str(e)
    (out / f"written_after_a_forward.rank{rank}.json").write_text(json.dumps(said))
    print(f"CASE-DONE written_after_a_forward rank={rank}", flush=True)
