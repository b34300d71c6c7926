"""Tiny Hugging Face causal LMs for the tests, built from configs (no download), and the example's module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256

CONFIGS: dict[str, dict[str, Any]] = {
    # tied input and output embeddings; Conv1D layers whose init lives in the model's _init_weights
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # rotary frequencies (non-persistent buffers), grouped-query attention, untied head
    "llama": dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
    # learned positions with an offset, tied head
    "opt": dict(
        model_type="opt",
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
    ),
}


# a mixture of experts, Llama's widths: the checkpoint holds a tensor per expert and projection, the model each layer's
# experts as 3D tensors ([Note: converted checkpoints] in lightning_chunk/hf_weights.py)
CONFIGS["mixtral"] = {
    **CONFIGS["llama"],
    "model_type": "mixtral",
    "intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def config(kind: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    d = {**CONFIGS[kind], **overrides}
    return AutoConfig.for_model(d.pop("model_type"), **d)


def save_pretrained(kind: str, path: Path, *, seed: int = 0, max_shard_size: str = "100KB", **overrides: Any) -> Path:
    """A tiny model as ``save_pretrained`` writes it: safetensors shards and their index, config.json."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, **overrides))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_main", ROOT / "examples/hf/main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def token_batches(n: int = 48, seq: int = 32, seed: int = 0, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, seq), generator=g)), batch_size=batch_size)


class Batches(L.LightningDataModule):
    """``token_batches`` as a data module (the example's module takes the batch tensor itself)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.kw = kw

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_batches(**self.kw).dataset.tensors[0], batch_size=self.kw.get("batch_size", 4))

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def generating(synced: bool | None):
    class Generates(load_example().CausalLM):
        """Each rank generates ``3 + 4 * rank`` tokens from the first 8 of each validation batch."""

        def on_validation_start(self) -> None:
            self.generated = []

        def validation_step(self, batch, batch_idx):
            prompt, n = batch[:1, :8], 3 + 4 * self.global_rank
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, synced_gpus=synced)
            self.generated.append((prompt, n, self.model.generate(prompt, **kw)))

    return Generates
