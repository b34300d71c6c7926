"""Multi-rank cases on CPU with gloo, run as a script by every rank (``tests.faults.common.Ranks`` starts them).

    python tests/distributed/runner.py OUTDIR CASE [CASE ...]

For each parity case (``parity_cases.CASES``): a DDP run and a chunk_offload run with the same global batch; rank 0
saves both parameter sets, every rank saves its memory stats; each rank prints ``CASE-DONE <case> rank=<r>`` when
the case finished. The other cases (``RUNS``) live in ``checkpoint_cases.py``, ``training_cases.py`` and
``parting_cases.py``; what every case runs with, in ``harness.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_chunk import ChunkPrecision, ChunkTelemetry  # noqa: E402
from lightning_chunk.engine.system import torch_features  # noqa: E402
from tests import backward_models, callbacks, precision_models  # noqa: E402
from tests.distributed import checkpoint_cases as ck  # noqa: E402
from tests.distributed import parting_cases as pa  # noqa: E402
from tests.distributed import peer_cases, rank_models  # noqa: E402
from tests.distributed import training_cases as tr  # noqa: E402
from tests.distributed.harness import DEVICE_BYTES, STEPS, CommMode, chunk_strategy, fit_or_resume  # noqa: E402
from tests.distributed.parity_cases import CASES  # noqa: E402

# the cases that are not parity cases (``CASES``), by name
RUNS = {
    "skip_module": pa.run_skip,
    "swap_module": pa.run_swap,
    "batchnorm": tr.run_batchnorm,
    "fp16_overflow_one_rank": pa.run_overflow,
    "unfreeze": tr.run_unfreeze,
    "full_parameters": tr.run_full_parameters,
    "grad_penalty_limit": tr.run_grad_penalty_limit,
    "uneven_batches": tr.run_uneven_batches,
    "static_limits": tr.run_static_limits,
    "fits_again": tr.run_fits_again,
    "clip_over_optimizer": tr.run_clip_over_optimizer,
    "models_differ": pa.run_models_differ,
    "written_after_a_forward": tr.run_written_after_a_forward,
    "backward_raised": tr.run_backward_raised,
    "save_after_fit": ck.run_save_after_fit,
    "save_inside_a_step": ck.run_save_inside_a_step,
    "resume": ck.run_resume,
    "reshard_save": ck.run_reshard_save,
    "reshard_resume": ck.run_reshard_resume,
    "resume_defaults": ck.run_resume_defaults,
    "edited_checkpoint": ck.run_edited_checkpoint,
    "ema": ck.run_ema,
    "backbone_resume": ck.run_backbone_resume,
    "peer_resume": peer_cases.run_peer_resume,
}


def model_class(name: str) -> type:
    """A case's model, by name: from ``tests.models``, ``precision_models``, ``optimizer_models`` or, where its use
    differs across ranks, ``rank_models`` (``backward_models.model_class`` looks in the others)."""
    return (
        getattr(rank_models, name, None) or getattr(precision_models, name, None) or backward_models.model_class(name)
    )


_DDP_RUNS: dict[str, tuple[dict[str, torch.Tensor], int]] = {}  # DDP's trained state and parameter bytes, by setup


def _bf16_sum(state, bucket):
    """torch's ``bf16_compress_hook`` (which refuses a CPU): each rank's bucket rounded to bf16 and divided by the
    ranks there, summed in bf16, written back into the fp32 bucket."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_(torch.distributed.get_world_size())

    def back(fut):
        return buffer.copy_(fut.value()[0])

    return torch.distributed.all_reduce(low, async_op=True).get_future().then(back)


DDP_HOOKS = {"bf16": _bf16_sum}


def _hooked(hook):
    """DDPStrategy with a comm hook on CPU too: Lightning registers ``ddp_comm_hook`` on CUDA only."""

    class HookedDDP(DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            self.model.register_comm_hook(None, hook)

    return HookedDDP


def run_parity(case: str, out: Path) -> None:
    spec = CASES[case]
    variant, model_kw, tkw = spec.get("variant", "plain"), spec.get("model", {}), spec.get("trainer", {})
    cls = model_class(spec.get("cls", "ParityNet"))
    fp16, bf16 = spec.get("fp16", False), spec.get("bf16", False)
    init_scale = spec.get("init_scale", 2.0**16)
    steps, resume_at = spec.get("steps", STEPS), spec.get("resume_at")
    unused = variant == "unused" or spec.get("ddp_unused", False)
    seed = 7 + (int(os.environ.get("RANK", 0)) if spec.get("rank_seeds") else 0)
    both = spec.get("both_callbacks", ())  # callbacks that change what is trained: DDP's run has them too
    ddp_only = spec.get("ddp_callbacks", ())  # the same change as DDP makes it
    # cases that differ only in chunk_offload's settings share one DDP run (the same bits: DDP is deterministic here)
    key = json.dumps(
        [
            cls.__name__,
            variant,
            model_kw,
            tkw,
            fp16,
            init_scale,
            bf16,
            steps,
            unused,
            "weights" in spec,
            spec.get("rank_seeds", False),  # the same key on every rank: they must all run DDP or none
            resume_at,
            both,
            ddp_only,
            spec.get("ddp_comm_hook"),
        ],
        sort_keys=True,
        default=str,
    )
    if key not in _DDP_RUNS:

        def make_ref():
            L.seed_everything(seed, verbose=False)
            ref = cls(variant=variant, **model_kw)
            if "weights" in spec:
                ref.load_state_dict(torch.load(out / "start.pt"))
            plugins = (
                [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]
                if fp16
                else [MixedPrecision("bf16-mixed", "cpu")]
                if bf16
                else None
            )
            hook = spec.get("ddp_comm_hook")  # "bf16": DDP's gradients summed in bf16
            ddp = DDPStrategy if hook is None else _hooked(DDP_HOOKS[hook])
            return (
                ref,
                ddp(find_unused_parameters=unused, static_graph=spec.get("ddp_static_graph", False)),
                plugins,
            )

        shared = [getattr(callbacks, name)() for name in (*both, *ddp_only)]
        _, ref, _ = fit_or_resume(make_ref, steps, resume_at, out / f"{case}.ddp_ckpt", shared, **tkw)
        _DDP_RUNS[key] = (
            {k: v.clone() for k, v in ref.state_dict().items()},
            sum(p.numel() * p.element_size() for p in ref.parameters()),
        )
    ref_state, param_bytes = _DDP_RUNS[key]
    skw = {"chunk_numel": 4096, **spec.get("strategy", {})}
    if "limit_fraction" in spec:
        skw["device_memory_limit"] = int(param_bytes * spec["limit_fraction"])  # below this rank's share
    if "limit_fractions" in spec:  # each rank its own limit, as each GPU's free memory gives ([Note: one limit ...])
        fractions = spec["limit_fractions"]
        skw["device_memory_limit"] = int(param_bytes * fractions[int(os.environ.get("RANK", 0)) % len(fractions)])
    if "host_memory_limit" in spec:
        skw.update(host_memory_limit=spec["host_memory_limit"], disk_dir=str(out / f"{case}.disk"))
    if "weights" in spec:
        skw["weights"] = json.loads((out / "weights.json").read_text())[spec["weights"]]

    def make_chunk():
        L.seed_everything(seed, verbose=False)  # the distributed sampler's order follows the seed: keep DDP's
        got = model_class(spec.get("chunk_cls", spec.get("cls", "ParityNet")))(variant=variant, **model_kw)
        layers = spec.get("fp32_layers", False)  # embeddings and norms in fp32, as autocast computes them
        plugins = (
            [ChunkPrecision("16-mixed", init_scale=init_scale, fp32_embeddings_and_norms=layers)]
            if fp16
            else [ChunkPrecision("bf16-mixed", fp32_embeddings_and_norms=layers)]
            if bf16
            else None
        )
        if "reduce_dtype" in spec:  # gradients summed across ranks in another dtype
            plugins = [
                ChunkPrecision(plugins[0].precision if plugins else "32-true", reduce_dtype=spec["reduce_dtype"])
            ]
        if spec.get("async_save"):  # checkpoints written beside training ([Note: training beside a save])
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            plugins = [*(plugins or []), AsyncCheckpointIO()]
        return got, chunk_strategy(**skw), plugins

    telemetry = ChunkTelemetry(picture=False) if spec.get("telemetry") else None
    comm_mode = CommMode()
    extra = [getattr(callbacks, name)() for name in (*spec.get("callbacks", ()), *both)]
    DEVICE_BYTES.clear()
    cbs = [comm_mode, *extra, *([telemetry] if telemetry else [])]
    swaps = torch_features.SWAP_STORAGES
    torch_features.SWAP_STORAGES = swaps and not spec.get("no_swaps")  # as a torch before 2.12 ([Note: torch versions])
    try:
        t, got, strategy = fit_or_resume(make_chunk, steps, resume_at, out / f"{case}.ckpt", cbs, **tkw)
    finally:
        torch_features.SWAP_STORAGES = swaps
    if telemetry is not None and t.global_rank == 0:
        (out / f"{case}.breakdown.json").write_text(json.dumps(telemetry.breakdown))
    rank = t.global_rank
    stats = dict(
        strategy.memory_stats(),
        limit=skw.get("device_memory_limit"),
        comm=comm_mode.seen,
        disk_left=sorted(p.name for p in Path(skw["disk_dir"]).iterdir() if f"-rank{strategy.global_rank}-" in p.name)
        if "disk_dir" in skw
        else [],
        host_memory_limit=strategy.config.host_memory_limit,
        param_bytes=sum(p.numel() * p.element_size() for p in got.parameters()),
        buffers={n: b.float().sum().item() for n, b in got.named_buffers()},
        # every rank ends with the same parameters (replicas of a shard group too; buffers as BatchNorm's running
        # statistics differ after the last forward, as under DDP): compared across ranks
        digest=hashlib.sha256(b"".join(p.detach().float().numpy().tobytes() for p in got.parameters())).hexdigest(),
        seen=[getattr(cb, "seen", None) for cb in extra],
        device_bytes=DEVICE_BYTES,
    )
    (out / f"{case}.stats{rank}.json").write_text(json.dumps(stats))
    if rank == 0:
        L.seed_everything(7, verbose=False)
        init = cls(variant=variant, **model_kw).state_dict()
        torch.save({"ref": ref_state, "got": got.state_dict(), "init": init}, out / f"{case}.pt")
    print(f"CASE-DONE {case} rank={rank}", flush=True)


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        started = time.monotonic()
        RUNS.get(name, lambda out, name=name: run_parity(name, out))(out_dir)
        print(f"CASE-TIME {name} {time.monotonic() - started:.1f} s", flush=True)  # which cases the launch spends on
    if torch.distributed.is_initialized():  # a clean exit: gloo aborts at interpreter exit otherwise
        torch.distributed.destroy_process_group()
