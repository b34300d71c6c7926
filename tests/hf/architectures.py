"""Tiny ``transformers`` models of many architectures, each with its batches, and a sweep of them against plain
Lightning, run by hand (not collected by pytest; ``test_architectures.py`` runs a few):

    .venv/bin/python tests/hf/architectures.py [KIND ...] [--tight] [--devices 2 [--as-nccl]] [--precision P]
        [--accumulate N] [--fp32-layers]

One rank: each model trains a few steps under plain Lightning and under chunk_offload with every shard on the host
(each chunk gathered at each use and released after it; ``--tight``: under the smallest device limit that fits, found
from the limits the refusals name, evicting) in ``32-true`` with the loop kernel, and a line says ``OK`` (the same
parameters to the bit), ``DIFF`` (how far), ``ERROR`` (chunk_offload's error) or ``SKIP`` (plain Lightning itself
failed: a config this file shrinks wrongly for that kind). ``--devices 2``: DDP against chunk_offload on two
gloo ranks, each fit in a child process (``--as-nccl``: gloo run as NCCL runs; ``--tight``: limits that differ by
rank, the second half as large again as the first, raised to what each refusal names until they fit).
``--precision bf16-mixed`` (or ``bf16-true``, ``16-mixed``: Lightning's fp16 autocast and a ``GradScaler``, which
``Trainer(precision="16-mixed")`` on a CPU replaces by bf16), where payloads round by design: ``OK`` where chunk_offload
is off the reference's update by at most twice what the reference itself is off fp32, else ``BAD``. ``--accumulate N``:
N micro-batches a step.

The decoder-only LMs are ``AutoConfig.for_model(kind)`` shrunk (``SMALL``); encoder-decoders, encoders, vision,
contrastive and speech models are built from configs written here. Together they read parameters in the ways users'
models do: a relative position bias computed by the first layer and passed to the others (T5), one layer run at
every depth (ALBERT), a temperature read by the root's forward (CLIP), relative embeddings every layer reads
(DeBERTa), recurrences and selective scans (RWKV, Mamba, Jamba), mixtures of experts with 3D expert weights.
Measured on 2026-12-07 at d21bf4e (transformers 5.25, torch 2.13): in 32-true every kind trained to the same bits on one
rank, also under the smallest device limit that fits (auto placement evicting; CLIP had not since e00ef22: a norm moved
within a chunk that kept its buffers, fixed in c63a34a), and all 73 on two ranks run as NCCL to DDP's. In bf16-mixed the
dense kinds land 0.7-1.6x as far from plain Lightning's update as plain Lightning is from fp32 (payloads round where
autocast casts per op). A mixture of experts routes by top-k: one rounding flips a route, so its figure jumps either way
(granitemoe 0.18 against 0.04, mixtral 0.05 against 0.16; on 2026-12-07 minimax 0.14 against 0.02, and the same bits in
32-true). Plain Lightning itself, its weights perturbed by bf16's rounding, moves as far: mixtral 0.17, granitemoe
0.05-0.14 over four draws. On 2026-12-07 at 94286b6, two ranks as NCCL under tight limits that differ by rank: all 73
the same bits as DDP. Six (ctrl, opt, jetmoe, jamba, recurrent_gemma, rwkv) had been refused in the warm-up's backward
one chunk more at each try ([Note: gradient payloads before the trace] in engine/memory/grads.py). With ``--accumulate
2`` too (76fe328): gpt2, llama, t5, clip, bart, albert, deberta_v2, mixtral, mamba, ctrl, gemma3_text and qwen3_moe 1e-8
to 1e-6 from DDP, clip 1.2e-3 (Adam's step is about lr where a gradient is about zero, whatever its size): the default
``sharded_accumulation=True`` reduce-scatters each micro-batch, a sum in another order than DDP's one all-reduce; with
it False, gpt2 and clip gave DDP's bits. ``--precision bf16-mixed --fp32-layers`` on one rank (0d0b419): 53 of 73 kinds
0.000 off plain Lightning's update (the dense LMs, encoder-decoders, encoders, whisper); the others read parameters that
are neither an embedding nor a norm in ops autocast leaves alone (a state space's A_log, ViT's and CLIP's class and
position embeddings as bare parameters, RWKV's time mixing: mamba 0.005, vit 0.095, rwkv 0.138 against its own 0.068) or
route by top-k (mixtral 0.072, gpt_oss 0.210). Two ranks as NCCL, tight, bf16-mixed without it (3a6d43f): 13 of 14 kinds
OK, mixtral BAD at 0.158 against 0.055 (a route flipped). On 2026-12-08 in 16-mixed with ``--fp32-layers``: siglip BAD,
0.85 off (its scalar ``logit_bias`` took a gradient that overflowed fp16: a step skipped that plain Lightning took);
with scalars and vectors in fp32 too, 61 of 73 kinds at plain Lightning's bits, also under the tightest limits (olmo2
and exaone4 skip every step in both), and 60 of 73 in bf16-mixed (siglip, clip, rwkv, recurrent_gemma and apertus
joined); the others read a matrix uncast (mamba's A_log, ViT's position embeddings), route by top-k, or run one layer at
every depth (albert, bf16 only). Two ranks as NCCL, tight, 16-mixed with it: 11 of 12 kinds DDP's bits (mixtral routes
apart, 0.010 against 0.010).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[2]
VOCAB, STEPS = 128, 4

# a decoder-only config shrunk: each key set where the kind's config has it
SMALL: dict[str, Any] = dict(
    hidden_size=32, n_embd=32, d_model=32, num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2,
    num_attention_heads=4, n_head=4, n_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, ffn_dim=64,
    n_inner=64, ffn_hidden_size=64, vocab_size=VOCAB, max_position_embeddings=64, n_positions=64, rotary_dim=4,
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    shared_expert_intermediate_size=32, sliding_window=16, attention_window_size=16, state_size=8, expand=2,
    conv_kernel=4, time_step_rank=4, ssm_state_size=8, mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32,
    mamba_d_state=8, mamba_chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    use_cache=False, tie_word_embeddings=True,
)  # fmt: skip
CAUSAL = (
    "gpt2 gpt_neo gpt_neox gptj gpt_bigcode codegen ctrl openai-gpt bloom falcon mpt opt xglm biogpt persimmon phi "
    "phi3 llama mistral gemma gemma2 gemma3_text qwen2 qwen3 starcoder2 olmo2 cohere cohere2 stablelm granite "
    "nemotron glm glm4 smollm3 exaone4 helium hunyuan_v1_dense ernie4_5 seed_oss arcee apertus mixtral qwen2_moe "
    "qwen3_moe granitemoe olmoe phimoe jetmoe gpt_oss llama4_text minimax mamba falcon_mamba jamba recurrent_gemma "
    "rwkv falcon_h1 lfm2"
).split()
# encoder-decoders, encoders and others: (config class, model class, config keywords, the batch's kind)
SEQ2SEQ = dict(
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_ff=64, d_kv=8,
)  # fmt: skip
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TOWERS = dict(
    text_config=dict(vocab_size=VOCAB, max_position_embeddings=16, **ENCODER),
    vision_config=dict(image_size=16, patch_size=4, **ENCODER),
)
OTHERS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "t5": ("T5Config", "T5ForConditionalGeneration", SEQ2SEQ, "seq2seq"),
    "bart": ("BartConfig", "BartForConditionalGeneration", SEQ2SEQ, "seq2seq"),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", SEQ2SEQ, "seq2seq"),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", SEQ2SEQ, "seq2seq"),
    "marian": ("MarianConfig", "MarianMTModel", SEQ2SEQ, "seq2seq"),
    "bert": ("BertConfig", "BertForMaskedLM", ENCODER, "masked"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", ENCODER, "masked"),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", {**ENCODER, "embedding_size": 16}, "masked"),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", {**ENCODER, "embedding_size": 16}, "masked"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", ENCODER, "masked"),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", ENCODER, "masked"),
    "vit": ("ViTConfig", "ViTForImageClassification", {**ENCODER, "image_size": 16, "patch_size": 4}, "image"),
    "clip": ("CLIPConfig", "CLIPModel", {**TOWERS, "projection_dim": 16}, "contrastive"),
    "siglip": ("SiglipConfig", "SiglipModel", TOWERS, "contrastive"),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        {**SEQ2SEQ, "num_mel_bins": 8, "max_source_positions": 16, "max_target_positions": 32},
        "speech",
    ),
}
KINDS = [*CAUSAL, *OTHERS]


def build(kind: str) -> torch.nn.Module:
    """The tiny model of ``kind``, its weights drawn from torch's seed."""
    import transformers

    transformers.logging.set_verbosity_error()
    if kind in OTHERS:
        cfg_cls, model_cls, kw, _ = OTHERS[kind]
        ids = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        cfg = getattr(transformers, cfg_cls)(**({} if "text_config" in kw else ids), **kw)
        return getattr(transformers, model_cls)(cfg)
    cfg = transformers.AutoConfig.for_model(kind)
    for key, value in SMALL.items():
        if hasattr(cfg, key):
            with contextlib.suppress(AttributeError):  # derived from others (Falcon's head_dim)
                setattr(cfg, key, value)
    for key in ("layer_types", "layers_block_type"):  # one entry a layer, where it is not derived
        if getattr(cfg, key, None) is not None:
            with contextlib.suppress(AttributeError):
                setattr(cfg, key, getattr(cfg, key)[: SMALL["num_hidden_layers"]])
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def batch(kind: str, g: torch.Generator) -> dict[str, Any]:
    """A batch of 4 for ``kind``, drawn from ``g``."""
    what = OTHERS[kind][3] if kind in OTHERS else "causal"
    ids = torch.randint(3, VOCAB, (4, 12), generator=g)
    if what in ("causal", "masked"):
        return dict(input_ids=ids, labels=ids)
    if what == "seq2seq":
        return dict(input_ids=ids, labels=torch.randint(3, VOCAB, (4, 8), generator=g))
    if what == "image":
        return dict(pixel_values=torch.randn(4, 3, 16, 16, generator=g), labels=torch.randint(0, 2, (4,), generator=g))
    if what == "contrastive":
        return dict(input_ids=ids[:, :10], pixel_values=torch.randn(4, 3, 16, 16, generator=g), return_loss=True)
    return dict(input_features=torch.randn(4, 8, 32, generator=g), labels=ids[:, :8])  # speech


class Tiny(L.LightningModule):
    """``kind``'s tiny model; each batch of the loader is a seed its inputs are drawn from (so ranks differ)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(0)
        self.model = build(kind)

    def training_step(self, seeds: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(**batch(self.kind, torch.Generator().manual_seed(int(seeds.sum())))).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(
    kind: str,
    strategy: Any,
    devices: int = 1,
    precision: str = "32-true",
    limit: int | None = None,
    accumulate: int = 1,
    fp32_layers: bool = False,
) -> dict[str, torch.Tensor]:
    """``kind``'s parameters after ``STEPS`` steps of ``accumulate`` micro-batches under ``strategy`` ("chunk":
    chunk_offload, every shard on the host, or under ``limit`` device bytes placed by the trace; the automatic chunk
    size; the loop kernel), in fp32; ``fp32_layers``: chunk_offload's embeddings and norms compute in fp32, as
    autocast's do (``ChunkPrecision(fp32_embeddings_and_norms=True)``)."""
    from lightning_chunk import ChunkOffloadStrategy, ChunkPrecision, OffloadOptions

    model = Tiny(kind)
    low = [ChunkPrecision(precision, fp32_embeddings_and_norms=True)] if fp32_layers and strategy == "chunk" else None
    if precision == "16-mixed" and strategy != "chunk":  # Trainer(precision="16-mixed") on a CPU runs bf16-mixed
        from lightning.pytorch.plugins import MixedPrecision

        low = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    elif precision == "16-mixed" and low is None:
        low = [ChunkPrecision(precision, fp32_embeddings_and_norms=False)]  # as DeepSpeed: every payload fp16
    if strategy == "chunk":
        strategy = ChunkOffloadStrategy(
            placement="auto" if limit else "host",
            device_memory_limit=limit,
            offload=OffloadOptions(optimizer_kernel="loop"),
        )
    elif strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(find_unused_parameters=True)  # a mixture's experts no token chose
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        precision=None if low else precision,
        plugins=low,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(torch.arange(8 * STEPS * devices * accumulate), batch_size=2))
    if hasattr(trainer.strategy, "full_parameters"):
        with trainer.strategy.full_parameters():
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def verdict(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], kind: str, fp32: dict | None = None) -> str:
    """32-true: the same bits. A lower precision (``fp32``: plain Lightning's fp32 parameters): how far from the
    reference, relative to its update, against how far the reference itself is from fp32; ``BAD`` past twice that."""
    diff = max((ref[n] - got[n]).abs().max().item() for n in ref)
    size = f"params={sum(t.numel() for t in ref.values())}"
    if fp32 is None:
        return f"{'OK ' if diff == 0 else 'DIFF'} maxdiff={diff:.1e} {size}"
    init = {n: p.detach().float() for n, p in Tiny(kind).named_parameters()}

    def off(a: dict, b: dict) -> float:  # 0 where they agree, though ``a`` did not move (fp16: every step skipped)
        apart = float(sum((a[n] - b[n]).pow(2).sum() for n in a))
        return 0.0 if apart == 0 else (apart / float(sum((a[n] - init[n]).pow(2).sum() for n in a))) ** 0.5

    err, own = off(ref, got), off(fp32, ref)
    ok = err <= 2 * own and all(torch.isfinite(t).all() for t in got.values())
    return f"{'OK ' if ok else 'BAD'} off the reference's update {err:.3f}, the reference off fp32 {own:.3f} {size}"


def next_limit(error: str) -> int | None:
    """The limit to try after a refusal: a tenth above the smallest it names, more where it could not yet count the
    activations; ``None`` where it names none."""
    named = re.search(r"smallest limit that (would|could) work is (\d+)", error)
    if named is None:  # several ranks, the warm-up's backward: the limit with room for every payload still to come
        room = re.search(r"a limit of (\d+) bytes .*has room for them all", error)
        return int(room[1]) if room else None
    # "could": before any activations were traced; "would ... plus the activations": before the warm-up
    return int(named[2]) * 11 // 10 + (0 if named[1] == "would" and "plus the" not in error else 1 << 18)


def one_rank(kind: str, precision: str, tight: bool = False, accumulate: int = 1, fp32_layers: bool = False) -> str:
    """``tight``: under the smallest device limit that fits, found from the limits chunk_offload's refusals name."""
    try:
        ref = fit(kind, "auto", precision=precision, accumulate=accumulate)
        fp32 = fit(kind, "auto", accumulate=accumulate) if precision != "32-true" else None
    except Exception as e:  # noqa: BLE001 - a config this file shrinks wrongly for the kind
        return f"SKIP plain Lightning failed: {type(e).__name__}: {str(e)[:200]}"
    limit = 1 if tight else None
    for _ in range(8):
        try:
            got = fit(kind, "chunk", precision=precision, limit=limit, accumulate=accumulate, fp32_layers=fp32_layers)
            line = verdict(ref, got, kind, fp32)
            return line + (f" limit={limit}" if tight else "")
        except Exception as e:  # noqa: BLE001 - the line says which
            limit = next_limit(str(e)) if limit is not None else None
            if limit is None:
                return f"ERROR {type(e).__name__}: {str(e)[:400]}"
    return f"ERROR no limit fitted in eight tries, the last {limit}"


def two_ranks(
    kind: str,
    out: Path,
    as_nccl: bool,
    precision: str,
    tight: bool = False,
    accumulate: int = 1,
    fp32_layers: bool = False,
) -> str:
    """DDP, then chunk_offload, each two ranks started by Lightning's launcher from a child of this script.
    ``tight``: limits that differ by rank, the first the smallest that fits, the second half as large again, both
    raised to what a refusal names until they fit."""
    from tests.distributed.launch import AS_NCCL

    paths, limits = {}, None
    for side in ("ddp", "chunk") if precision == "32-true" else ("ddp32", "ddp", "chunk"):
        paths[side] = out / f"{kind}.{side}.pt"
        env = {**os.environ, **(AS_NCCL if as_nccl and side == "chunk" else {})}
        cmd = [sys.executable, __file__, "--one", kind, side.removesuffix("32"), str(paths[side])]
        cmd += ["--precision", "32-true" if side == "ddp32" else precision, "--accumulate", str(accumulate)]
        cmd += ["--fp32-layers"] if fp32_layers and side == "chunk" else []
        limit = 1 if tight and side == "chunk" else None
        for _ in range(8):
            limits = [limit, limit * 3 // 2] if limit else None
            try:
                r = subprocess.run(
                    cmd + (["--limits", f"{limits[0]},{limits[1]}"] if limits else []),
                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                return f"HANG ({side}{f' limits={limits}' if limits else ''})"
            said = [line.strip() for line in r.stderr.splitlines() if "Error" in line] or ["killed?"]
            limit = next_limit(said[-1]) if limit and r.returncode else None
            if not limit:
                break
        if r.returncode:
            return f"{'ERROR' if side == 'chunk' else 'SKIP DDP failed'}: {said[-1][:400]}"
    fp32 = torch.load(paths["ddp32"]) if "ddp32" in paths else None
    line = verdict(torch.load(paths["ddp"]), torch.load(paths["chunk"]), kind, fp32)
    return line + (f" limits={limits}" if limits else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kinds", nargs="*", help=f"default: all {len(KINDS)}", metavar="KIND")
    parser.add_argument("--devices", type=int, choices=(1, 2), default=1)
    parser.add_argument("--as-nccl", action="store_true", help="with --devices 2: gloo run as NCCL runs")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed", "bf16-true", "16-mixed"), default="32-true")
    parser.add_argument("--tight", action="store_true", help="the smallest device limit that fits, evicting")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches a step (accumulate_grad_batches)")
    parser.add_argument("--fp32-layers", action="store_true", help="embeddings and norms in fp32, as autocast's")
    parser.add_argument("--limits", help=argparse.SUPPRESS)  # a child's: each rank's device limit
    parser.add_argument("--out", type=Path, default=Path("/tmp/lightning_chunk_architectures"))
    parser.add_argument("--one", nargs=3, metavar=("KIND", "SIDE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {' '.join(KINDS)}")
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_chunk"):  # a table of lines, not their banners
        logging.getLogger(name).setLevel(logging.ERROR)
    sys.path.insert(0, str(ROOT))
    if args.one:
        kind, side, path = args.one
        limit = int(args.limits.split(",")[int(os.environ.get("LOCAL_RANK", 0))]) if args.limits else None
        params = fit(
            kind, side, devices=2, precision=args.precision, limit=limit, accumulate=args.accumulate,
            fp32_layers=args.fp32_layers,
        )  # fmt: skip
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            torch.save(params, path)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in args.kinds or KINDS:
        line = (
            one_rank(kind, args.precision, args.tight, args.accumulate, args.fp32_layers)
            if args.devices == 1
            else two_ranks(kind, args.out, args.as_nccl, args.precision, args.tight, args.accumulate, args.fp32_layers)
        )
        print(f"{kind:18s} {line}", flush=True)
    print(json.dumps({"transformers": __import__("transformers").__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
