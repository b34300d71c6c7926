"""Small LightningModules that cover what parity must hold for: param groups and a scheduler,
tied weights, frozen layers, a branch unused in some steps, buffers."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, HIDDEN, SEQ = 48, 32, 64, 8


class ParityNet(L.LightningModule):
    def __init__(
        self,
        variant: str = "plain",
        lr: float = 1e-2,
        optimizer: str = "adamw",
        scheduler: bool = True,
        depth: int = 2,
        dim: int = DIM,
        hidden: int = HIDDEN,
        build: bool = True,
    ) -> None:
        super().__init__()
        self.variant, self.lr, self.optimizer_name, self.use_scheduler = variant, lr, optimizer, scheduler
        self.shape = dict(depth=depth, dim=dim, hidden=hidden)
        self.built = False
        if build:
            self.build()

    def build(self) -> None:
        """The layers, in the order their constructors draw from the random stream."""
        variant, depth, DIM, HIDDEN = self.variant, self.shape["depth"], self.shape["dim"], self.shape["hidden"]  # noqa: N806
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        if variant == "tied":
            self.head.weight = self.embed.weight
        if variant == "frozen":
            for p in list(self.embed.parameters()) + list(self.blocks[0].parameters()):
                p.requires_grad_(False)
        if variant == "unused":
            self.branch = nn.Linear(DIM, DIM)
        self.built = True

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.embed(x)
        for blk in self.blocks:
            h = h + blk(h)
        if self.variant == "unused" and use_branch:
            h = h + self.branch(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        logits = self(x, use_branch=(batch_idx % 3 == 0))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.log("val_loss", loss)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "rmsprop":
            opt = torch.optim.RMSprop(groups, lr=self.lr * 0.1)
        else:
            opt = getattr(torch.optim, self.optimizer_name)(groups, lr=self.lr)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# a Trainer that logs, saves and shows nothing, on one CPU device unless told
QUIET = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def quiet_trainer(**kw: Any) -> L.Trainer:
    """``L.Trainer`` with ``QUIET``'s settings, each overridden by ``kw``."""
    return L.Trainer(**{**QUIET, **kw})


def token_data(n: int = 96, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.roll(x, -1, dims=1)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def fit(
    strategy,
    *,
    variant: str = "plain",
    steps: int = 20,
    precision="32-true",
    plugins=None,
    seed: int = 7,
    model_kwargs=None,
    accelerator: str = "cpu",
    cls=None,
    val_dataloaders=None,
    **trainer_kwargs,
) -> ParityNet:
    """Train a fresh ParityNet (same init for every strategy; or ``cls``) and return it."""
    L.seed_everything(seed, verbose=False)
    model = (cls or ParityNet)(variant=variant, **(model_kwargs or {}))
    trainer = quiet_trainer(
        **{
            **dict(
                accelerator=accelerator,
                strategy=strategy,
                precision=None if plugins else precision,
                plugins=plugins,
                max_steps=steps,
                num_sanity_val_steps=0,
                limit_val_batches=0,
            ),
            **trainer_kwargs,
        }
    )
    trainer.fit(model, token_data(), val_dataloaders)
    model.trainer_ref = trainer
    return model


class TokenData(L.LightningDataModule):
    def __init__(self, n: int = 96, seed: int = 0) -> None:
        super().__init__()
        self.n, self.seed = n, seed

    def train_dataloader(self) -> DataLoader:
        return token_data(self.n, self.seed)

    def val_dataloader(self) -> DataLoader:
        return token_data(16, self.seed + 1)


class ManualNet(ParityNet):
    """Manual optimization: manual_backward, an explicit step, and gradient accumulation by hand."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        return loss


class ReorderedNet(ParityNet):
    """ParityNet's parameters and values, registered in another order than they are used: head, norm, the
    blocks backwards, embed. The warm-up repacks such a model from registration order into use order,
    which moves every rank's piece of each parameter."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        embed, blocks, norm, head = self.embed, self.blocks, self.norm, self.head
        del self.embed, self.blocks, self.norm, self.head
        self.head, self.norm = head, norm
        self.blocks_reversed = nn.ModuleList(list(blocks)[::-1])
        self.embed = embed
        if self.variant == "tied":
            self.head.weight = self.embed.weight

    @property
    def blocks(self):  # use order, for ParityNet.forward
        return list(self.blocks_reversed)[::-1]


class TwoOptimizers(ParityNet):
    """Manual optimization with two optimizers over disjoint parameters, GAN style: each phase's backward
    also reaches the other optimizer's parameters, whose ``zero_grad()`` must drop those gradients.
    Each optimizer clips its own gradients in ``on_before_optimizer_step`` (after fp16 unscaling)."""

    def __init__(self, **kw) -> None:
        super().__init__(scheduler=False, **kw)
        self.automatic_optimization = False

    def configure_optimizers(self):
        first = [*self.embed.parameters(), *self.blocks[0].parameters()]
        ids = {id(p) for p in first}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return (
            torch.optim.AdamW(first, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1),
            torch.optim.SGD(rest, lr=self.lr * 5, momentum=0.9),
        )

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        opt_a.zero_grad()
        loss = F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.manual_backward(loss)
        opt_a.step()
        opt_b.zero_grad()  # drops what the first backward left on the second optimizer's parameters
        loss2 = 0.5 * F.cross_entropy(self(x).float().reshape(-1, VOCAB), torch.roll(y, 1, 1).reshape(-1))
        self.manual_backward(loss2)
        opt_b.step()
        return loss

    def on_before_optimizer_step(self, optimizer):
        if isinstance(optimizer, torch.optim.AdamW):
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        else:
            self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")


class FloatBuffer(ParityNet):
    """A float buffer added to the activations: in ``bf16-true`` it must be bf16 too."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, self.embed.embedding_dim))

    def forward(self, x, use_branch=True):
        h = self.embed(x) + self.shift
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


class RankBuffer(ParityNet):
    """A buffer initialised differently on each rank and used in forward: ranks must start from rank 0's."""

    def __init__(self, **kw) -> None:
        import os

        super().__init__(**kw)
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.register_buffer("offset", torch.full((self.embed.embedding_dim,), 0.05 * (rank + 1)))

    def forward(self, x, use_branch=True):
        h = self.embed(x) + self.offset
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


class BatchNormNet(ParityNet):
    """A BatchNorm after the embedding: running statistics that each rank's batches move, read in evaluation. The
    blocks run in the reverse of their registration order (the first layout is not the order of use)."""

    def build(self) -> None:
        super().build()
        self.bn = nn.BatchNorm1d(self.shape["dim"])
        self.val_seen: list[float] = []

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        h = self.bn(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        for blk in reversed(self.blocks):
            h = h + blk(h)
        return self.head(self.norm(h))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.val_seen.append(loss.item())


class DeferredNet(ParityNet):
    """ParityNet built in ``configure_model``: under ``chunk_offload`` on the meta device and initialised chunk
    by chunk at setup; the values must equal ParityNet's built eagerly from the same seed."""

    def __init__(self, **kw) -> None:
        super().__init__(build=False, **kw)

    def configure_model(self) -> None:
        if not self.built:
            self.build()

    def reset_parameters(self) -> None:  # the LightningModule owns a buffer directly
        self.calls.zero_()


class CheckpointedNet(ParityNet):
    """Activation checkpointing (``torch.utils.checkpoint``) around each block, as Hugging Face's
    ``gradient_checkpointing_enable()`` does: backward runs each block's forward again, so its chunk is needed a
    third time in a step, after the forward that released it. ``reentrant`` picks the older autograd.Function form,
    whose recomputation runs inside the backward of a node the engine's hooks never saw."""

    reentrant = False

    def forward(self, x, use_branch=True):
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        for blk in self.blocks:
            h = h + checkpoint(blk, h, use_reentrant=self.reentrant)
        return self.head(self.norm(h))


class ReentrantCheckpointedNet(CheckpointedNet):
    reentrant = True


class AdapterNet(ParityNet):
    """LoRA's shape: every block's layers frozen, a trainable low-rank adapter beside each block. The frozen
    weights are most of the parameters and never get a gradient, yet backward reads each of them once."""

    def build(self) -> None:
        super().build()
        dim = self.shape["dim"]
        self.adapters = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4, bias=False), nn.Linear(4, dim, bias=False))
            for _ in range(self.shape["depth"])
        )
        for p in self.blocks.parameters():
            p.requires_grad_(False)

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for blk, adapter in zip(self.blocks, self.adapters, strict=True):
            h = h + blk(h) + adapter(h)
        return self.head(self.norm(h))


class OffloadAndReload(L.Callback):
    """``offload_states()`` after the steps in ``offload_at`` and ``reload_states()`` before those in ``reload_at``
    (an offload with no reload is reloaded by the next step); ``seen`` keeps the device chunk bytes after each call."""

    def __init__(self, offload_at=(3, 9), reload_at=(6,)) -> None:
        self.offload_at, self.reload_at, self.seen = offload_at, reload_at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.offload_at:
            reducer = trainer.strategy.engine.manager.reducer  # the traced reduce schedule survives the round trip
            self.schedule = (list(reducer._order), reducer._due)
            trainer.strategy.offload_states()
            self.seen.append(("offloaded", trainer.strategy.memory_stats()["device_chunk_bytes"]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.reload_at:
            trainer.strategy.reload_states()
            self.seen.append(("reloaded", trainer.strategy.memory_stats()["device_chunk_bytes"]))
            reducer = trainer.strategy.engine.manager.reducer
            assert (list(reducer._order), reducer._due) == self.schedule, "the reduce schedule was not kept"


class FlipRequiresGrad(L.Callback):
    """Progressive unfreezing and a re-freeze, set before every batch (so a resumed run sets them too): ``ParityNet``'s
    "frozen" variant trains blocks[0] from step ``unfreeze`` on, and freezes its embedding for steps
    ``unfreeze`` to ``refreeze``."""

    def __init__(self, unfreeze: int = 6, refreeze: int = 14) -> None:
        self.unfreeze, self.refreeze = unfreeze, refreeze

    def frozen(self, pl_module, step: int) -> list:
        """The parameters frozen at ``step``."""
        return ([*pl_module.blocks[0].parameters()] if step < self.unfreeze else []) + (
            [*pl_module.embed.parameters()] if self.unfreeze <= step < self.refreeze else []
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        frozen = {id(p) for p in self.frozen(pl_module, trainer.global_step)}
        for p in [*pl_module.blocks[0].parameters(), *pl_module.embed.parameters()]:
            p.requires_grad_(id(p) not in frozen)


class DropFrozenGrads(FlipRequiresGrad):
    """The same schedule for DDP, whose reducer only all-reduces the parameters that required grad when it was built:
    everything trains, and the gradients of the parameters the schedule freezes are dropped before each step (so the
    optimizer skips them, as it skips a frozen parameter)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in self.frozen(pl_module, trainer.global_step):
            p.grad = None


class ClampFirstBlock(L.Callback):
    """WGAN's weight clipping after every step, and a weight's norm read between steps: plain Lightning on the
    parameters, chunk_offload inside ``trainer.strategy.full_parameters()`` ([Note: parameters outside a step]).
    ``seen_outside``: whether ``head.weight`` showed anything but NaN between steps, outside the block."""

    def __init__(self, bound: float = 0.05, use_block: bool = True) -> None:
        self.bound, self.norms, self.seen_outside, self.use_block = bound, [], [], use_block

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import contextlib

        full = getattr(trainer.strategy, "full_parameters", None) if self.use_block else None
        self.seen_outside.append(bool(not torch.isnan(pl_module.head.weight).all()))
        with full() if full else contextlib.nullcontext(), torch.no_grad():
            for p in pl_module.blocks[0].parameters():
                p.clamp_(-self.bound, self.bound)
            self.norms.append(float(pl_module.head.weight.norm()))
            self.saved = pl_module.blocks[0].state_dict()["0.weight"].clone()  # a whole value, clamped


class GradNormsAndEdits(L.Callback):
    """Lightning's ``grad_norm`` in ``on_before_optimizer_step``, then the gradients edited: one block's halved in
    place, ``norm.bias``'s dropped every other step (so the step skips it). Plain Lightning on the parameters,
    chunk_offload inside ``full_parameters(with_grads=True)`` ([Note: gradients in full_parameters])."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        import contextlib

        from lightning.pytorch.utilities import grad_norm

        full = getattr(trainer.strategy, "full_parameters", None)
        with full(with_grads=True) if full else contextlib.nullcontext():
            self.norms.append({k: float(v) for k, v in grad_norm(pl_module, norm_type=2).items()})
            blocks = pl_module.blocks if hasattr(pl_module, "blocks") else pl_module.blocks_reversed
            for p in blocks[1].parameters():
                if p.grad is not None:  # frozen (AdapterNet's blocks): none, as in plain Lightning
                    p.grad.mul_(0.5)
            if trainer.global_step % 2 == 0:
                pl_module.norm.bias.grad = None


class GradsAfterBackward(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        with trainer.strategy.full_parameters(with_grads=True):
            pass


class SparseEmbedding(ParityNet):
    """``nn.Embedding(sparse=True)``, stepped by SGD (which takes sparse gradients in plain PyTorch); ``dense``: the
    same model with a dense embedding."""

    def __init__(self, dense: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.embed.sparse = not dense

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class LogsValLoss(ParityNet):
    """Keeps each validation batch's loss (this rank's) in ``val_losses``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.val_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(float(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))))


class GradPenalty(ParityNet):
    """WGAN-GP's shape: the gradient of the logits with respect to the embeddings, taken with create_graph=True, and
    its norm penalised, so the step's backward runs through the graph that the first backward built
    ([Note: double backward])."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        out = h
        for blk in self.blocks:
            out = out + blk(out)
        logits = self.head(self.norm(out))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        (g,) = torch.autograd.grad(logits.float().pow(2).sum(), h, create_graph=True)
        return loss + 0.01 * (g.norm(2, dim=-1) - 1).pow(2).mean()


class ReorderedGradPenalty(GradPenalty, ReorderedNet):
    """The gradient penalty on a model registered in another order than it is used."""


class StateDictOutside(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.state_dict()


class ReusedBlockNet(ParityNet):
    """The first block runs twice a forward (weights shared by calling one module again, as ALBERT does)."""

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        h = h + self.blocks[0](h)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


class CheckpointedAdapterNet(AdapterNet):
    """LoRA's shape with activation checkpointing around each frozen block and its adapter (PEFT with
    ``gradient_checkpointing_enable()``)."""

    def forward(self, x, use_branch=True):
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        for blk, adapter in zip(self.blocks, self.adapters, strict=True):
            h = checkpoint(lambda t, b=blk, a=adapter: t + b(t) + a(t), h, use_reentrant=False)
        return self.head(self.norm(h))


class TorchTransformerNet(ParityNet):
    """torch's own nn.TransformerEncoder: MultiheadAttention reads ``out_proj``'s weights without calling it, and the
    encoder layer's fast path (evaluation) reads every child's tensors in one fused op."""

    def build(self) -> None:
        dim = self.shape["dim"]
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, self.shape["hidden"], dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=self.shape["depth"], enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x, use_branch=True):
        return self.head(self.norm(self.encoder(self.embed(x))))


class Peek(nn.Module):
    """Reads its child's weight in its own forward (``F.linear``) instead of calling the child."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return F.linear(self.norm(x), self.proj.weight, self.proj.bias)


class PeekNet(ParityNet):
    def build(self) -> None:
        super().build()
        self.blocks = nn.ModuleList(Peek(self.shape["dim"]) for _ in range(self.shape["depth"]))


class ToggledOptimizers(TwoOptimizers):
    """Lightning's documented GAN pattern: ``toggle_optimizer`` freezes the other optimizer's parameters for each phase,
    with no ``zero_grad()`` in between to hide what a phase left on them."""

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        self.toggle_optimizer(opt_a)
        loss = F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.manual_backward(loss)
        opt_a.step()
        opt_a.zero_grad()
        self.untoggle_optimizer(opt_a)
        self.toggle_optimizer(opt_b)
        loss2 = 0.5 * F.cross_entropy(self(x).float().reshape(-1, VOCAB), torch.roll(y, 1, 1).reshape(-1))
        self.manual_backward(loss2)
        opt_b.step()
        opt_b.zero_grad()
        self.untoggle_optimizer(opt_b)
        return loss

    def on_before_optimizer_step(self, optimizer):
        pass


class KeepsAdaptersOnly:
    """LoRA's checkpoint: ``on_save_checkpoint`` drops the frozen weights' keys and adds an entry of its own (an EMA's,
    say); ``on_load_checkpoint`` takes the entry back. Mixed into a model class by ``edited``."""

    strict_loading = False  # the frozen weights come from the model's own initialisation (pretrained, for LoRA)

    def on_save_checkpoint(self, checkpoint):
        sd = checkpoint["state_dict"]
        for name, p in self.named_parameters():
            if not p.requires_grad:
                del sd[name]
        sd["ema.scale"] = torch.tensor([3.0, 4.0])
        if self.replace_head:
            sd["head.weight"] = torch.full_like(self.head.weight, 0.25, device="cpu")

    def on_load_checkpoint(self, checkpoint):
        self.loaded_entry = checkpoint["state_dict"].pop("ema.scale")


def edited(strict: bool = False, replace_head: bool = False):
    return type("Edited", (KeepsAdaptersOnly, AdapterNet), {"strict_loading": strict, "replace_head": replace_head})


class RootTiedNet(ParityNet):
    """GPT-2's tied head written in the LightningModule's own ``forward``: ``F.linear(h, self.embed.weight)``
    (variant "matmul": ``h @ self.embed.weight.T``), beside a position table read by index there. Nothing is tied
    by assignment, so only the reads say that the root uses the embedding's weight."""

    def build(self) -> None:
        super().build()
        del self.head
        self.pos = nn.Embedding(SEQ, self.shape["dim"])

    def forward(self, x, use_branch=True):
        h = self.embed(x) + self.pos.weight[: x.shape[1]]
        for blk in self.blocks:
            h = h + blk(h)
        h = self.norm(h)
        return h @ self.embed.weight.T if self.variant == "matmul" else F.linear(h, self.embed.weight)


class BatchNormCNN(ParityNet):
    """A small CNN over token embeddings with BatchNorm 1d, 2d and 3d, as a user's CNN in mixed precision runs them:
    convolutions autocast to the low dtype, normalisation kernels taking its output beside fp32 statistics."""

    def build(self) -> None:
        d = self.shape["dim"]
        self.embed = nn.Embedding(VOCAB, d)
        self.conv1, self.bn1 = nn.Conv1d(d, d, 3, padding=1), nn.BatchNorm1d(d)
        self.conv2, self.bn2 = nn.Conv2d(d, d, 3, padding=1), nn.BatchNorm2d(d)
        self.bn3 = nn.BatchNorm3d(d)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x, use_branch=True):
        h = self.embed(x).transpose(1, 2)  # (batch, dim, seq)
        h = F.relu(self.bn1(self.conv1(h)))
        h = F.relu(self.bn2(self.conv2(h.unsqueeze(-1)))).squeeze(-1)
        h = self.bn3(h[..., None, None]).flatten(2)
        return self.head(h.transpose(1, 2))


class Gate(nn.Module):
    """A module that owns a parameter directly and uses it only when told: ``image_newline`` in a vision-language
    model, used only when the batch has images."""

    def __init__(self, dim: int, own_chunk: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        # a row (1, dim) decays with the weights, so it is packed beside its module's weight, away from the vector
        # params every rank uses: a chunk whose parameters one rank may all lack gradients for
        self.scale = nn.Parameter(torch.ones(1, dim) if own_chunk else torch.ones(dim))

    def forward(self, h: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.proj(h)
        # a new tensor either way: returning ``h`` itself would put the gate's backward hook on the projection's
        # output, where it runs before or after the projection's by the order they were added, so ranks would run
        # the two backward moments in different orders (which the module check refuses)
        return h * self.scale if use else h * 1.0


class RankGatedNet(ParityNet):
    """Every rank runs the same modules, but a gate's own parameter gets a gradient on some ranks and not others,
    differently at each step (DDP's ``find_unused_parameters=True`` case): rank r uses it when ``r + batch_idx`` is
    even, so in the warm-up too one rank has it and the other not. Variant ``own_chunk``: the gate's parameter is a
    row, packed with the weights."""

    def build(self) -> None:
        super().build()
        own = self.variant == "own_chunk"
        self.gates = nn.ModuleList(Gate(self.shape["dim"], own) for _ in range(self.shape["depth"]))

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for blk, gate in zip(self.blocks, self.gates, strict=True):
            h = h + blk(h)
            h = h + gate(h, use_branch)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        logits = self(x, use_branch=(self.global_rank + batch_idx) % 2 == 0)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


class RootGatedNet(ParityNet):
    """A table the LightningModule owns itself, read in its own ``forward`` on some ranks and not others, differently
    at each step (rank r reads it when ``r + batch_idx`` is even): the root's backward spans the whole backward."""

    def build(self) -> None:
        super().build()
        self.extra = nn.Parameter(torch.randn(8, self.shape["dim"]) * 0.02)

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        if use_branch:
            h = h + self.extra.sum(0)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))

    training_step = RankGatedNet.training_step


class SpareNet(ParityNet):
    """A layer no step ever uses (a head kept for later): it gets no gradient on any rank, so it never steps."""

    def build(self) -> None:
        super().build()
        self.spare = nn.Linear(self.shape["dim"], self.shape["dim"])
