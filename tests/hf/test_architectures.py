"""Tiny ``transformers`` models whose parameters are read in different ways, trained from the user's side (the model
in a LightningModule, a Trainer) against plain Lightning: every shard on the host, so each chunk is gathered at each
use and released after it. ``architectures.py`` runs all of its kinds by hand, on one rank or two."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf.architectures import fit, one_rank  # noqa: E402

KINDS = {
    "gpt2": "Conv1D layers, the head tied to the embedding",
    "t5": "a relative position bias the first layer computes and every later one adds",
    "bart": "encoder and decoder sharing one embedding, tied to the head",
    "albert": "one layer run at every depth",
    "deberta_v2": "relative embeddings every layer reads",
    "clip": "two towers and a temperature the root's forward reads",
    "whisper": "convolutions over audio features, sinusoidal positions",
    "mixtral": "3D expert weights, experts no token chose left unused",
    "gpt_oss": "experts with biases, attention sinks",
    "jamba": "selective-scan layers beside attention and experts",
    "rwkv": "a recurrence over time-mixing parameters",
    "recurrent_gemma": "recurrent blocks beside local attention",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_transformers_architecture_trains_like_plain_lightning(kind):
    try:
        ref = fit(kind, "auto")
    except Exception as e:  # noqa: BLE001 - transformers is unpinned: a kind it renamed or changed is its matter
        pytest.skip(f"plain Lightning cannot train {kind} with this transformers: {type(e).__name__}: {e}")
    got = fit(kind, "chunk")
    assert ref.keys() == got.keys()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{kind} {n}: {m}")


def test_clip_under_the_smallest_device_limit_that_fits_trains_like_plain_lightning():
    """CLIP's root reads its temperature, so after the warm-up a module adopts it and a second trace repacks with
    Adam's state, moving a norm within a chunk that keeps its buffers ([Note: a chunk that keeps its buffers]): under
    the smallest limit that fits it trained 1.1 away from plain Lightning, in 32-true."""
    line = one_rank("clip", "32-true", tight=True)
    if line.startswith("SKIP"):
        pytest.skip(line)
    assert line.startswith("OK ") and "maxdiff=0.0e+00" in line, line


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_embeddings_and_norms_in_fp32_give_plain_lightning_s_bf16_mixed_bits(kind):
    """``ChunkPrecision(fp32_embeddings_and_norms=True)`` finds transformers' own norms by their class names
    (``LlamaRMSNorm``) beside ``nn.LayerNorm`` and ``nn.Embedding``: the layers autocast computes in fp32. Without it
    the bf16 payloads of those layers left gpt2 6e-3 and llama 2e-3 from plain Lightning after these steps."""
    ref = fit(kind, "auto", precision="bf16-mixed")
    got = fit(kind, "chunk", precision="bf16-mixed", fp32_layers=True)
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{kind} {n}: {m}")
