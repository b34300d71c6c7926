"""A random sweep of two-rank configurations against DDP, run by hand (not collected by pytest):

    .venv/bin/python tests/distributed/sweep.py --seed 1 --runs 40 [--as-nccl] [--devices 4] [--resume]
                                            [--resume-devices 4] [--ema] [--late-copies]

Each run draws a test model, a precision, accumulation, clipping (by norm or value), an optimizer and
chunk_offload's options (placement, kernel, chunk size, ``step_in_backward``, ``reshard_after_forward``,
``sharded_accumulation``, a device limit as a fraction of the parameter bytes, sometimes one a rank), trains it on
two gloo ranks (``--devices``) with Lightning's launcher and compares the parameters with DDP's (one DDP run per
model, precision, accumulation, clipping and optimizer). ``--ema`` adds an average of the weights to both sides
(Lightning's ``EMAWeightAveraging`` to DDP, ``ChunkEMA`` to chunk_offload, decay 0.8): validation sees it and the
final weights are it. A line a run: ``OK`` within the tolerance (fp32 1e-4
absolute, the mixed and bf16 precisions 2% relative), ``BAD`` beyond it, ``FAIL`` with the error where the run
stopped (a limit too small names the smallest that works; some option combinations are refused), ``HANG`` past
five minutes. ``--as-nccl`` runs gloo as NCCL runs ([Note: gloo as NCCL]: one communicator in issue order, no
agreement check), where ranks whose collectives part hang or mix chunks instead of failing together. The
hand-written parity cases (``parity_cases.py``) pin what a sweep found; this looks for combinations nobody wrote down.
``--resume`` saves a checkpoint after a drawn number of optimizer steps and resumes from it with options drawn afresh
(placement, chunk size, limits), against DDP saved and resumed at the same step; ``--resume-devices 4`` (which
implies ``--resume``) resumes on four ranks, or one, what ``--devices`` saved. ``--reduce-dtype bfloat16`` sums
chunk_offload's gradients across ranks in bf16 (``ChunkPrecision(reduce_dtype=...)``), compared as the bf16
precisions are. ``--late-copies`` makes chunk_offload's gradient copies to host shards land late, as on CUDA, with
chunks stepped in backward on the worker thread (``tests.callbacks.LateGradientCopies``). ``--shard-size 2`` with
``--devices 4`` shards chunk_offload's chunks over groups of two ranks, replicated across the groups (FSDP's
``HYBRID_SHARD``), also when resumed on a rank count the size divides. ``--fp16`` trains ``16-mixed`` where
``bf16-mixed`` is drawn: fp16 payloads and dynamic loss scaling (``ChunkPrecision``) against DDP with autocast and
``GradScaler``, compared as the bf16 precisions are. ``--full-precision autocast`` sets
``fp32_embeddings_and_norms`` (seed 20261208, 12 runs with ``--fp16 --as-nccl``: all OK, 16-mixed within 9e-6 of
DDP's update).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = [
    ("ParityNet", "tied"),
    ("ParityNet", "unused"),
    ("ParityNet", "frozen"),
    ("CheckpointedNet", "plain"),
    ("ReentrantCheckpointedNet", "plain"),
    ("ReusedBlockNet", "plain"),
    ("AdapterNet", "plain"),
    ("ComposableCheckpointedNet", "plain"),
    ("ReorderedNet", "tied"),
    ("LateNormNet", "plain"),  # Llama's blocks: a norm registered before the weights it follows
    ("BatchNormNet", "plain"),
    ("RecurrentNet", "lstm"),
    ("RecurrentNet", "gru"),
    ("ParametrizedNet", "plain"),
    ("TwoPassNet", "rdrop"),
    ("TwoPassNet", "teacher"),
    ("ScheduleFreeNet", "plain"),  # its counters in the param groups; eval() and train() around each validation
    ("RankGatedNet", "plain"),  # a gate's parameter used on some ranks and not others, differently each step
    ("RankGatedNet", "own_chunk"),  # the same gate a row packed with the weights
    ("MixtureNet", "plain"),  # experts no token chose are not run: which run differs across ranks and steps
    ("RootTiedNet", "plain"),  # the head tied in the LightningModule's forward: the root adopts the embedding
    ("RootTiedNet", "matmul"),
    ("PeekNet", "plain"),  # a block reads its child's weight: it adopts it, and the chunks are traced again
]
UNUSED = {"RankGatedNet", "MixtureNet"}  # DDP needs find_unused_parameters=True, as for ParityNet's "unused"

# where DDP itself cannot train: torch's CPU LSTM and GRU refuse bf16 under autocast; an orthogonal map computed in
# bf16 goes to NaN within a few steps; the hand-written experts add bf16 rows into an fp32 sum
PRECISIONS = {
    "RecurrentNet": ["32-true", "bf16-true"],
    "ParametrizedNet": ["32-true", "bf16-mixed"],
    "MixtureNet": ["32-true", "bf16-true"],  # index_add of autocast's bf16 rows into fp32 fails in DDP too
}


def draw(rng: random.Random, models: list[tuple[str, str]]) -> tuple[dict, dict]:
    """(what DDP trains too, chunk_offload's options)."""
    cls, variant = rng.choice(models)
    base = dict(
        cls=cls,
        variant=variant,
        precision=rng.choice(PRECISIONS.get(cls, ["32-true", "bf16-mixed", "bf16-true"])),
        acc=rng.choice([1, 1, 2, 3]),
        clip=rng.choice([None, None, 0.5]),
        steps=rng.choice([6, 8, 9]),
        optimizer=rng.choice(["adamw", "adamw", "sgd", "Adam", "rmsprop", "Adafactor"]),
        clip_by=rng.choice(["norm", "norm", "value"]),
    )
    return base, draw_options(rng, cls)


def draw_options(rng: random.Random, cls: str) -> dict:
    """chunk_offload's options for a model of class ``cls``."""
    opts: dict = dict(
        placement=rng.choice(["auto", "host", "device", "static"]),
        optimizer_kernel=rng.choice(["loop", "auto"]),
        chunk_numel=rng.choice([None, 2048, 4096, 20000]),
    )
    if cls == "ScheduleFreeNet":  # not torch's: taken as element-wise, checked on twins
        opts["assume_elementwise_optimizer"] = True
    if cls == "MixtureNet":  # gathered whole at its forward, whichever experts run (docs/faq.md: without the leaf
        opts["leaf_modules"] = ["Experts"]  # the ranks' gathers part, a hang on NCCL)
    for name in ("step_in_backward", "reshard_after_forward", "sharded_accumulation"):
        if rng.random() < 0.3 and (name != "reshard_after_forward" or opts["placement"] == "host"):
            opts[name] = rng.choice([True, False])  # reshard_after_forward: host placement's alone
    if rng.random() < 0.4 and opts["placement"] != "device":
        opts["limit"] = rng.choice([0.8, 1.0, 1.3, 2.0, 3.0])
        if rng.random() < 0.3:  # ranks whose free device memory differs: a limit each
            opts["limit"] = [opts["limit"], rng.choice([1.0, 1.5, 2.0, 3.0])]
    return opts


def train(spec: dict, out: str) -> None:
    """One rank's fit (Lightning's launcher starts the other); rank 0 saves the state dict to ``out``."""
    sys.path.insert(0, str(ROOT))
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_chunk import ChunkOffloadStrategy
    from lightning_chunk.options import grouped
    from tests.backward_models import model_class
    from tests.models import token_data

    L.seed_everything(7, verbose=False)
    model = model_class(spec["cls"])(variant=spec["variant"], optimizer=spec.get("optimizer", "adamw"))
    opts = dict(spec.get("opts") or {})
    if "limit" in opts:
        limit = opts.pop("limit")
        if isinstance(limit, list):  # this rank's, in turn: Lightning's launcher starts the others with LOCAL_RANK set
            limit = limit[int(os.environ.get("LOCAL_RANK", 0)) % len(limit)]
        opts["device_memory_limit"] = int(limit * sum(p.numel() * p.element_size() for p in model.parameters()))
    late = opts.pop("late_copies", False)
    if late:
        opts["step_thread"] = True
    low: dict = {"precision": spec["precision"]}
    names = opts.pop("full_precision", ())
    full = [getattr(torch.nn, name) for name in names if name != "autocast"]
    if "reduce_dtype" in opts or spec["precision"] == "16-mixed" or names:  # on CPU Lightning makes 16-mixed bf16-mixed
        from lightning.pytorch.plugins import MixedPrecision

        from lightning_chunk import ChunkPrecision

        plugin = (
            ChunkPrecision(
                spec["precision"],
                reduce_dtype=opts.pop("reduce_dtype", None),
                full_precision_modules=full,
                fp32_embeddings_and_norms="autocast" in names,
            )
            if spec.get("opts") is not None
            else MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # scaled as ChunkPrecision
        )
        low = {"plugins": [plugin]}
    devices = spec.get("devices", 2)
    strategy = (
        ChunkOffloadStrategy(**grouped(opts))
        if spec.get("opts") is not None
        else DDPStrategy(find_unused_parameters=spec["variant"] == "unused" or spec["cls"] in UNUSED)
        if devices > 1
        else "auto"  # DDP on one device swaps in a DistributedSampler, whose order differs: plain Lightning's loader
    )
    saves = spec.get("save_at") is not None
    every = dict(every_n_train_steps=spec.get("save_at"), save_top_k=-1)  # kept: the one resumed from is the first
    callbacks = [ModelCheckpoint(spec["ckpt_dir"], filename="{step}", **every)] if saves else []
    if spec.get("ema"):
        from lightning.pytorch.callbacks import EMAWeightAveraging

        from lightning_chunk import ChunkEMA

        callbacks.append(ChunkEMA(decay=0.8) if spec.get("opts") is not None else EMAWeightAveraging(decay=0.8))
    if late:
        from tests.callbacks import LateGradientCopies

        callbacks.append(LateGradientCopies())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        **low,
        max_steps=spec["steps"],
        accumulate_grad_batches=spec["acc"],
        gradient_clip_val=spec["clip"],
        gradient_clip_algorithm=spec.get("clip_by", "norm"),
        limit_val_batches=2,
        val_check_interval=4,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=saves,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if spec.get("init_out") and trainer.global_rank == 0:  # DDP's first leg: what the update is measured from
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, spec["init_out"])
    trainer.fit(model, token_data(), token_data(16), ckpt_path=spec.get("ckpt_path"))
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)


def verdict(spec: dict, ref: Path, got: Path, init: Path | None = None) -> str:
    """``rel``: how far apart, over the size of DDP's parameters; ``upd``: over the size of DDP's update (from
    ``init``, where DDP's first fit saved it)."""
    import torch

    a, b = torch.load(ref), torch.load(got)
    keys = [k for k in a if a[k].is_floating_point()]
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in keys)
    num = sum((a[k].float() - b[k].float()).pow(2).sum() for k in keys) ** 0.5
    rel = float(num / sum(a[k].float().pow(2).sum() for k in keys) ** 0.5)
    exact = spec["precision"] == "32-true" and "reduce_dtype" not in (spec.get("opts") or {})
    ok = diff < 1e-4 if exact else rel < 0.02
    line = f"{'OK ' if ok else 'BAD'} maxdiff={diff:.1e} rel={rel:.1e}"
    if init is not None and init.exists():
        start = torch.load(init)
        moved = sum((a[k].float() - start[k].float()).pow(2).sum() for k in keys) ** 0.5
        line += f" upd={float(num / moved):.1e}"
    return line


def legs(base: dict, opts: dict | None, resumed: dict | None, out: Path, name: str) -> list[tuple[dict, Path]]:
    """The fits of one side (``opts`` None: DDP), each a (spec, state-dict path), the last the one compared: one fit,
    or with ``resumed`` one that saves at ``base["resume_at"]`` and one resumed from that save with ``resumed``'s
    options (DDP: its own again)."""
    spec = base if opts is None else {**base, "opts": opts}
    if "resume_at" not in base:
        return [(spec, out / f"{name}.pt")]
    ckpt_dir = out / f"{name}_ckpt"
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # a save over an older one is renamed: step=3-v1.ckpt
    save = {**spec, "save_at": base["resume_at"], "ckpt_dir": str(ckpt_dir)}
    resume = {**spec, "ckpt_path": str(ckpt_dir / f"step={base['resume_at']}.ckpt")}
    if "resume_devices" in base:  # resharded: DDP's checkpoint has no ranks in it; the global batch changes for both
        resume["devices"] = base["resume_devices"]
    if opts is not None:
        resume["opts"] = resumed
    return [(save, ckpt_dir / "uninterrupted.pt"), (resume, out / f"{name}.pt")]


def sweep(
    seed: int,
    runs: int,
    out: Path,
    only: set[str] | None = None,
    *,
    as_nccl: bool = False,
    devices: int = 2,
    resume: bool = False,
    resume_devices: int | None = None,
    reduce_dtype: str | None = None,
    ema: bool = False,
    late_copies: bool = False,
    shard_size: int | None = None,
    fp16: bool = False,
    full_precision: list[str] | None = None,
) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.distributed.launch import AS_NCCL

    rng = random.Random(seed)
    env = {**os.environ, **(AS_NCCL if as_nccl else {})}
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(runs):
        base, opts = draw(rng, [m for m in MODELS if only is None or m[0] in only])
        if fp16 and base["precision"] == "bf16-mixed":  # after the draws: fp16 payloads with dynamic loss scaling
            base["precision"] = "16-mixed"
        if devices != 2:  # the same draws as two ranks give, so a seed's runs compare across rank counts
            base["devices"] = devices
        if ema:  # after the draws, as below
            base["ema"] = True
        if reduce_dtype is not None:  # every chunk_offload fit, after the draws: a seed draws what it drew before
            opts["reduce_dtype"] = reduce_dtype
        if late_copies:
            opts["late_copies"] = True
        if full_precision and base["precision"].endswith("-mixed"):  # Lightning's AMP computes these in fp32
            opts["full_precision"] = full_precision
        if shard_size is not None:  # replicated across groups of this many ranks (FSDP's HYBRID_SHARD)
            opts["shard_size"] = shard_size
        resumed = None
        if resume:  # saved after this many optimizer steps, resumed with options drawn afresh
            base["resume_at"] = rng.randrange(2, base["steps"])
            resumed = draw_options(rng, base["cls"]) | ({"reduce_dtype": reduce_dtype} if reduce_dtype else {})
            resumed |= {"late_copies": True} if late_copies else {}
            resumed |= {"full_precision": opts["full_precision"]} if "full_precision" in opts else {}
            if shard_size and (resume_devices or devices) % shard_size == 0:
                resumed["shard_size"] = shard_size
            if resume_devices is not None:
                base["resume_devices"] = resume_devices
        ref = f"ddp_{hashlib.sha1(json.dumps(base, sort_keys=True).encode()).hexdigest()[:12]}"
        todo = [] if (out / f"{ref}.pt").exists() else legs(base, None, None, out, ref)
        if todo:
            todo[0] = ({**todo[0][0], "init_out": str(out / f"{ref}.init.pt")}, todo[0][1])
        for spec, path in todo + legs(base, opts, resumed, out, "got"):
            cmd = [sys.executable, __file__, "--one", json.dumps(spec), str(path)]
            try:  # a tiny model trains in well under a minute; ranks whose collectives part hang as NCCL
                r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            except subprocess.TimeoutExpired:
                print(f"HANG {json.dumps(spec)}", flush=True)
                break
            if r.returncode:
                lines = [line.strip()[:1200] for line in r.stderr.splitlines() if line.strip()]
                said = ([line for line in lines if "Error" in line] or lines or [""])[-1]  # else: killed by a signal?
                print(f"FAIL {json.dumps(spec)}\n    exit {r.returncode}: {said}", flush=True)
                break
        else:
            drawn = {**base, "opts": opts, **({"resumed_opts": resumed} if resume else {})}
            line = verdict(drawn, out / f"{ref}.pt", out / "got.pt", out / f"{ref}.init.pt")
            print(f"{line} {json.dumps(drawn)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("/tmp/lightning_chunk_sweep"))
    parser.add_argument("--models", help="draw only these classes, comma-separated (RecurrentNet,TwoPassNet)")
    parser.add_argument("--as-nccl", action="store_true", help="gloo run as NCCL runs: one communicator, no check")
    parser.add_argument("--devices", type=int, default=2, help="ranks a run (4: shards of a quarter)")
    parser.add_argument("--resume", action="store_true", help="save mid-run, resume with options drawn afresh")
    parser.add_argument("--resume-devices", type=int, help="resume on this many ranks (implies --resume)")
    parser.add_argument("--reduce-dtype", help="chunk_offload sums gradients across ranks in this dtype (bfloat16)")
    parser.add_argument("--ema", action="store_true", help="both average the weights (ChunkEMA; EMAWeightAveraging)")
    parser.add_argument("--late-copies", action="store_true", help="gradient copies to the host land late, as on CUDA")
    parser.add_argument("--shard-size", type=int, help="shard chunk_offload's chunks over groups of this many ranks")
    parser.add_argument("--fp16", action="store_true", help="16-mixed where bf16-mixed is drawn, with loss scaling")
    parser.add_argument(
        "--full-precision",
        help="module classes of torch.nn computing in fp32 (LayerNorm,Embedding; autocast: fp32_embeddings_and_norms)",
    )
    parser.add_argument("--one", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        train(json.loads(args.one[0]), args.one[1])
    else:
        sweep(
            args.seed,
            args.runs,
            args.out,
            set(args.models.split(",")) if args.models else None,
            as_nccl=args.as_nccl,
            devices=args.devices,
            resume=args.resume or args.resume_devices is not None,
            resume_devices=args.resume_devices,
            reduce_dtype=args.reduce_dtype,
            ema=args.ema,
            late_copies=args.late_copies,
            shard_size=args.shard_size,
            fp16=args.fp16,
            full_precision=args.full_precision.split(",") if args.full_precision else None,
        )


if __name__ == "__main__":
    main()
