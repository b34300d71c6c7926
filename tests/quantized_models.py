"""QLoRA models: bitsandbytes' 4-bit linear layers with low-rank adapters ([Note: quantized weights] in
``engine/config.py``), built by hand or through transformers and peft. Run as a script
(``python -m tests.quantized_models OUT``), the hand-built one fits on two ranks under DDP and then chunk_offload,
rank 0 saving what each trained to OUT."""

from __future__ import annotations

import sys

import bitsandbytes as bnb
import lightning as L
import torch
from torch import nn

VOCAB = 50


class QLoRALinear(nn.Module):
    """A frozen 4-bit base (nf4, its codes in a ``storage`` container) plus a trainable rank-4 adapter; ``quantize``:
    quantized here (on the host), else by the first ``.to(device)``, as bitsandbytes does."""

    def __init__(self, n_in: int, n_out: int, storage: torch.dtype, quantize: bool, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
        self.base = bnb.nn.Linear4bit(
            n_in, n_out, bias=False, compute_dtype=torch.float32, quant_type="nf4", quant_storage=storage
        )
        self.base.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", quant_storage=storage)
        if quantize:
            self.base.to("cpu")
        self.a = nn.Parameter(torch.randn(4, n_in, generator=g) * 0.01)
        self.b = nn.Parameter(torch.zeros(n_out, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


class QLoRANet(L.LightningModule):
    """A frozen embedding, two QLoRA layers and a trainable head; the adapters and head train with AdamW."""

    def __init__(self, storage: str = "bfloat16", quantize: bool = False) -> None:
        super().__init__()
        dtype = getattr(torch, storage)
        self.emb = nn.Embedding(VOCAB, 64)
        self.emb.weight.requires_grad_(False)
        self.l1 = QLoRALinear(64, 128, dtype, quantize, seed=1)
        self.l2 = QLoRALinear(128, 64, dtype, quantize, seed=2)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.l2(torch.relu(self.l1(self.emb(x))))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class HFQLoRA(L.LightningModule):
    """A tiny Llama saved at ``path``, loaded 4-bit through transformers' ``BitsAndBytesConfig`` (codes in bf16),
    prepared for k-bit training and given LoRA adapters by ``peft``; ``train``: put in training mode, else left in
    eval mode as ``from_pretrained`` leaves it ([Note: bitsandbytes' CPU layout] in ``quantized.py``)."""

    def __init__(self, path: str, train: bool = True) -> None:
        super().__init__()
        import peft
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.float32,
            bnb_4bit_quant_storage=torch.bfloat16,
        )
        base = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization, device_map={"": "cpu"}, dtype=torch.float32
        )
        base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        torch.manual_seed(1)
        self.model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        self.model.train(train)

    def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def save_tiny_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    )
    LlamaForCausalLM(config).save_pretrained(path)


def qlora_data(n: int = 32) -> torch.utils.data.DataLoader:
    x = torch.randint(0, VOCAB, (n, 8), generator=torch.Generator().manual_seed(3))
    return torch.utils.data.DataLoader(list(zip(x, (x + 1) % VOCAB, strict=True)), batch_size=4)


def trained(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


if __name__ == "__main__":  # DDP's fit, then chunk_offload's, in the same two processes
    from lightning_chunk import ChunkOffloadStrategy

    results = {}
    for which in ("ddp", "chunk"):
        L.seed_everything(0, verbose=False)
        model = QLoRANet()
        strategy = "ddp" if which == "ddp" else ChunkOffloadStrategy(placement="host", optimizer_kernel="loop")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            precision="bf16-mixed",
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, qlora_data())
        results[which] = {"trained": trained(model), "codes": model.l1.base.weight.detach().clone()}
    if trainer.global_rank == 0:
        torch.save(results, sys.argv[1])
