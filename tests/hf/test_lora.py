"""LoRA with the ``peft`` library: a Hugging Face model with adapters, its base weights frozen, trained under
chunk_offload in parity with plain Lightning under a device limit that evicts."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_chunk import ChunkOffloadStrategy, ChunkPrecision, MemoryOptions, OffloadOptions  # noqa: E402
from tests.hf.models import Batches, save_pretrained  # noqa: E402
from tests.models import quiet_trainer  # noqa: E402

LIMIT = 1_700_000  # the tiny Llama's traced activations and a few chunks: placement evicts every step


class LoRA(L.LightningModule):
    """What a user writes: the pretrained model with LoRA adapters on the attention's projections."""

    def __init__(self, pretrained: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True).train()
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        self.model = peft.get_peft_model(base, lora)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def fit(strategy, pretrained, model=None, **trainer_kw) -> tuple[LoRA, L.Trainer]:
    L.seed_everything(3, verbose=False)
    model = model or LoRA(str(pretrained))
    t = quiet_trainer(strategy=strategy, max_steps=6, **trainer_kw)
    t.fit(model, Batches())
    return model, t


def test_lora_with_peft_trains_like_plain_lightning_holds_no_state_for_its_base_and_exports(tmp_path):
    """Bit for bit plain Lightning's adapters under an evicting limit; the frozen base holds one copy; after fit the
    module is plain, so peft's ``save_pretrained`` writes the adapters alone and ``merge_and_unload`` the merged
    model, both loading back with the trained model's logits."""
    from transformers import AutoModelForCausalLM

    pretrained = save_pretrained("llama", tmp_path / "llama")
    ref, _ = fit("auto", pretrained)
    strategy = ChunkOffloadStrategy(
        device_memory_limit=LIMIT,
        memory=MemoryOptions(chunk_numel=16384),
        offload=OffloadOptions(optimizer_kernel="loop"),
    )
    got, _ = fit(strategy, pretrained)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    stats = strategy.memory_stats()
    assert stats["evictions"] > 0
    trainable = sum(p.numel() for p in got.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in got.parameters() if not p.requires_grad)
    # fp32 AdamW: 16 bytes an adapter parameter (master, gradient, two moments), 4 a frozen one (one copy: on one
    # rank its master is its payload); the chunks' padding at most 16. A full fine-tune of this model holds 19.3 bytes
    # a parameter; the LoRA run 5.1
    held = stats["device_chunk_bytes"] + stats["host_chunk_bytes"]
    assert held <= 4 * frozen + 16 * trainable + 16 * stats["padding_numel"], (held, trainable, frozen)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = got.model.eval()(input_ids=x).logits
        got.model.save_pretrained(tmp_path / "adapters")
        base = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
        adapters = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
        torch.testing.assert_close(adapters(input_ids=x).logits, want, rtol=0, atol=0)
        got.model.merge_and_unload().save_pretrained(tmp_path / "merged")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
        torch.testing.assert_close(merged(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)
    adapter_file = tmp_path / "adapters" / "adapter_model.safetensors"  # the adapters alone, not the base
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()
    assert adapter_file.stat().st_size < 4 * sum(p.numel() for p in got.parameters()) / 10


def test_frozen_weights_in_the_compute_dtype_cost_a_third_and_train_the_same(tmp_path):
    """[Note: frozen weights in the compute dtype]: under bf16-mixed the frozen base keeps one bf16 copy, 2 bytes a
    parameter instead of 6 (an fp32 master beside it); the adapters train bit for bit as without it, and the frozen
    weights come back after fit as the bf16 rounding of the pretrained ones."""
    pretrained = save_pretrained("llama", tmp_path / "llama")
    runs = {}
    for on in (False, True):
        strategy = ChunkOffloadStrategy(
            device_memory_limit=LIMIT, memory=MemoryOptions(chunk_numel=16384, frozen_in_compute_dtype=on)
        )
        model, _ = fit(strategy, pretrained, plugins=[ChunkPrecision("bf16-mixed")])
        stats = strategy.memory_stats()
        runs[on] = model, stats["device_chunk_bytes"] + stats["host_chunk_bytes"], stats["padding_numel"]
    (off, held_off, _), (got, held_on, padding) = runs[False], runs[True]
    frozen = sum(p.numel() for p in got.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in got.parameters() if p.requires_grad)
    for (n, a), (_, b) in zip(off.named_parameters(), got.named_parameters(), strict=True):
        want = a if a.requires_grad else a.to(torch.bfloat16).float()
        torch.testing.assert_close(b, want, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    assert held_on <= 2 * frozen + 16 * trainable + 6 * padding < held_off, (held_on, held_off, frozen, trainable)


class MetaLoRA(L.LightningModule):
    """The same adapters on a base built in ``configure_model``: on the meta device under chunk_offload, the base's
    weights streamed from the file into each rank's shards ([Note: LoRA adapters on the meta device])."""

    def __init__(self, pretrained: str, **lora: Any) -> None:
        super().__init__()
        self.pretrained, self.lora, self.model = pretrained, lora, None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from lightning_chunk.hf import HFInit

        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.pretrained, local_files_only=True))
        self.trainer.strategy.param_init_fn = HFInit(base)  # the rotary frequencies, which no file holds
        config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **self.lora)
        self.model = peft.get_peft_model(base, peft.LoraConfig(**config))

    training_step = LoRA.training_step
    configure_optimizers = LoRA.configure_optimizers


class StartValues(L.Callback):
    def on_train_start(self, trainer, pl_module):
        with trainer.strategy.full_parameters():
            self.values = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_adapters_on_a_base_built_on_the_meta_device_start_as_peft_does_and_train_like_plain_lightning(tmp_path, kind):
    """No rank builds the base: its weights come from the file under peft's moved names, each adapter is initialised
    as peft does (A kaiming-uniform, B zero), and training from those values is plain Lightning's bit for bit.
    Mixtral's experts, saved one by one, start merged as from_pretrained merges them ([Note: converted checkpoints])."""
    pretrained = save_pretrained(kind, tmp_path / kind)
    mixtral = kind == "mixtral"
    strategy = ChunkOffloadStrategy(
        weights=pretrained,
        device_memory_limit=2_200_000 if mixtral else LIMIT,
        memory=MemoryOptions(chunk_numel=32768 if mixtral else 16384),  # Mixtral's experts: 32768 elements
        offload=OffloadOptions(optimizer_kernel="loop"),
    )
    start = StartValues()
    got, _ = fit(strategy, pretrained, model=MetaLoRA(str(pretrained)), callbacks=[start])
    L.seed_everything(3, verbose=False)
    ref = LoRA(str(pretrained))
    init = dict(ref.named_parameters())
    for n, v in start.values.items():
        if "lora_B" in n:
            assert not v.any(), n
        elif "lora_A" in n:
            assert v.any() and v.abs().max() <= v.shape[1] ** -0.5, n  # kaiming-uniform(a=sqrt(5)): 1/sqrt(fan_in)
        else:
            torch.testing.assert_close(v, init[n], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")  # the file's
    ref.load_state_dict(start.values, strict=False)
    ref, _ = fit("auto", pretrained, model=ref)
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def test_an_adapter_init_that_reads_the_base_weights_is_refused_on_the_meta_device(tmp_path):
    pretrained = save_pretrained("llama", tmp_path / "llama")
    strategy = ChunkOffloadStrategy(weights=pretrained)
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa'.*\[Note: LoRA adapters on the meta device\]"):
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False).fit(
            MetaLoRA(str(pretrained), init_lora_weights="pissa"), Batches()
        )


def test_an_init_that_reads_the_base_weights_still_works_on_a_base_built_eagerly(tmp_path):
    pretrained = save_pretrained("llama", tmp_path / "llama")

    class PiSSA(LoRA):
        def __init__(self, pretrained: str) -> None:
            L.LightningModule.__init__(self)
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True).train()
            lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa")
            self.model = peft.get_peft_model(base, lora)

    model, _ = fit(ChunkOffloadStrategy(), pretrained, model=PiSSA(str(pretrained)))
    assert all(not p.isnan().any() for p in model.parameters())
