"""Any Hugging Face causal LM trained with chunk_offload, driven by LightningCLI. One file, top to bottom.

    python examples/hf/main.py fit --config examples/hf/configs/cpu_tiny_llama.yaml

- ``CausalLM``: wraps an ``AutoModelForCausalLM``, built from a config (``model.config``: a ``model_type`` and
  its fields, from scratch) or from a local ``save_pretrained`` directory (``model.pretrained``, to fine-tune).
  It is built in ``configure_model``: under ``chunk_offload`` on the meta device, so no rank ever holds the
  whole model; the strategy then initialises it chunk by chunk with the model's own ``_init_weights``
  (``lightning_chunk.hf.HFInit``), or streams the ``pretrained`` weights straight into each rank's shards.
  Under any other strategy it is an ordinary ``from_config`` / ``from_pretrained``. Options: Hugging Face
  gradient checkpointing, ``torch.compile``. Its checkpoints carry the model's config, so
  ``lightning-chunk consolidate --format hf CKPT OUT_DIR`` writes a directory ``from_pretrained`` loads.
- ``TextData``: next-token windows over text with no download (``examples/corpus.py``: the Python standard
  library's sources by default), tokenised bytewise (256 ids) or with the tokenizer saved in a local directory
  (``data.tokenizer``: what ``AutoTokenizer.save_pretrained`` writes, e.g. the real model's).
"""

import math
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_chunk
from lightning_chunk.hf import HF_CONFIG_KEY, HFInit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corpus import WindowsData  # noqa: E402  (examples/corpus.py: the text, no download)


# ----------------------------------------------------------------------------- model
class CausalLM(L.LightningModule):
    """``pretrained``: a local ``save_pretrained`` directory to start from (its config, then ``config``'s fields
    over it). Else ``config``: ``{"model_type": "llama", "hidden_size": 256, ...}`` for a model from scratch."""

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        gradient_checkpointing: bool = False,
        compile: bool | str = False,
    ) -> None:
        super().__init__()
        if pretrained is None and not (config or {}).get("model_type"):
            raise ValueError(
                "model.pretrained (a save_pretrained directory) or model.config with a 'model_type' "
                f"(e.g. {{'model_type': 'llama', ...}}) is needed; got pretrained=None, config={config!r}."
            )
        if pretrained is not None and not Path(pretrained, "config.json").is_file():
            raise ValueError(f"model.pretrained={pretrained!r} is not a save_pretrained directory (no config.json).")
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def hf_config(self) -> Any:
        from transformers import AutoConfig

        overrides = dict(self.hparams.config or {})
        if self.hparams.pretrained is None:
            return AutoConfig.for_model(overrides.pop("model_type"), **overrides)
        overrides.pop("model_type", None)
        return AutoConfig.from_pretrained(self.hparams.pretrained, local_files_only=True, **overrides)

    def configure_model(self) -> None:
        if self.model is not None:  # built already (an earlier fit)
            return
        from transformers import AutoModelForCausalLM

        strategy = self.trainer.strategy if self._trainer is not None else None
        chunked = isinstance(strategy, lightning_chunk.ChunkOffloadStrategy)
        on_meta = torch.empty(0).is_meta  # chunk_offload's configure_model, or `lightning-chunk plan --shapes-only`
        if self.hparams.pretrained is not None and not chunked and not on_meta:
            model = AutoModelForCausalLM.from_pretrained(
                self.hparams.pretrained, local_files_only=True, config=self.hf_config()
            )
            model.train()  # from_pretrained gives a model in eval mode (no dropout), which Lightning keeps
        else:  # under chunk_offload: on the meta device, nothing allocated until setup
            model = AutoModelForCausalLM.from_config(self.hf_config())
        if chunked:
            # both are read at setup, after configure_model: the init of what the weights do not provide (rotary
            # frequencies, or everything from scratch), and the weights streamed into each rank's shards
            if strategy.param_init_fn is None:
                strategy.param_init_fn = HFInit(model)
            if self.hparams.pretrained is not None and strategy.weights is None:
                strategy.weights = self.hparams.pretrained
        if self.hparams.gradient_checkpointing:
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # the new name; the old one goes in transformers 6
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        model.config.use_cache = False  # training: no key/value cache
        if self.hparams.compile:  # True: torch's default backend; or a backend's name ("aot_eager" needs no compiler)
            backend = self.hparams.compile if isinstance(self.hparams.compile, str) else "inductor"
            model = torch.compile(model, backend=backend)
        self.model = model

    @property
    def hf_model(self) -> torch.nn.Module:
        """The ``PreTrainedModel`` (the compiled wrapper's original module when compiled)."""
        return getattr(self.model, "_orig_mod", self.model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss  # the model shifts the labels itself

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        other = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        total, warmup = max(self.trainer.max_steps, 1), max(self.hparams.warmup_steps, 1)

        def schedule(step: int) -> float:  # linear warm-up, then cosine decay to zero
            return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_fit_start(self) -> None:
        data, config = self.trainer.datamodule, self.hf_model.config
        vocab = getattr(data, "vocab_size", None)
        if vocab is not None and vocab > config.vocab_size:
            raise ValueError(
                f"the data has {vocab} token ids but the model's vocab_size is {config.vocab_size}: set "
                "model.config.vocab_size, or data.tokenizer to the model's own tokenizer."
            )
        context = getattr(getattr(data, "hparams", None), "context", None)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if context is not None and positions is not None and context > positions:
            raise ValueError(
                f"data.context={context} is longer than the model's {positions} positions "
                "(max_position_embeddings): lower data.context."
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # what `lightning-chunk consolidate --format hf` needs to write config.json
        config = self.hf_model.config.to_dict()
        config["architectures"] = [type(self.hf_model).__name__]
        checkpoint[HF_CONFIG_KEY] = config


# ------------------------------------------------------------------------------ data
class TextData(WindowsData):
    """``tokenizer``: a local directory with a saved tokenizer (``AutoTokenizer.from_pretrained``); ``None``: bytes.
    ``context``: tokens a sample, what the model sees (it shifts the labels itself)."""

    extra_tokens = 0

    def __init__(
        self,
        corpus: str | None = None,
        tokenizer: str | None = None,
        context: int = 128,
        batch_size: int = 4,
        max_bytes: int = 4_000_000,
        train_windows: int = 20_000,
        val_windows: int = 256,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = 256
        if tokenizer is not None:
            from transformers import AutoTokenizer

            if not Path(tokenizer).is_dir():
                raise ValueError(f"data.tokenizer={tokenizer!r} is not a directory with a saved tokenizer.")
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
            self.vocab_size = len(self.tokenizer)

    def tokens(self, text: bytes) -> torch.Tensor:
        if self.hparams.tokenizer is None:
            return torch.frombuffer(bytearray(text), dtype=torch.uint8)  # a token a byte
        ids = self.tokenizer(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)


def main(args: list[str] | None = None) -> LightningCLI:
    torch.set_float32_matmul_precision("high")
    return LightningCLI(CausalLM, TextData, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    try:
        main()
    except (ValueError, lightning_chunk.engine.ChunkError) as e:  # a configuration mistake: its message, not a wall
        sys.exit(f"error: {e}")
