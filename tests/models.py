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
        elif self.optimizer_name == "adamw_amsgrad_matrices":  # the groups keep different state keys
            groups[0]["amsgrad"] = True
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
    ckpt_path: str | None = None,
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
    trainer.fit(model, token_data(), val_dataloaders, ckpt_path=ckpt_path)
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


class CompiledNet(ParityNet):
    """Its forward compiled in place as training starts (AOTAutograd with the eager backend: no C compiler), as a
    user of DDP compiles: dynamo breaks the graph around the engine's hooks, whose gathers then run eagerly."""

    def on_fit_start(self) -> None:
        torch._dynamo.reset()  # a fresh cache: each run compiles its own model
        self.forward = torch.compile(ParityNet.forward.__get__(self), backend="aot_eager")  # type: ignore[method-assign]


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


class PaddedTransformerNet(TorchTransformerNet):
    """torch's encoder given a padding mask, its nested-tensor fast path on (evaluation: the outputs at padded positions
    are zeros), beside an encoder frozen in eval mode that runs under ``no_grad`` in every step, as a frozen backbone
    does: both take torch's fast paths out of training mode ([Note: torch's fast paths in checked steps])."""

    def build(self) -> None:
        super().build()
        dim = self.shape["dim"]
        layer = nn.TransformerEncoderLayer(dim, 4, self.shape["hidden"], dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=self.shape["depth"], enable_nested_tensor=True)
        self.frozen = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False).requires_grad_(False)

    def forward(self, x, use_branch=True):
        pad = torch.zeros_like(x, dtype=torch.bool)
        pad[::2, -2:] = True  # every other sequence ends in two padded positions
        h = self.embed(x)
        self.frozen.eval()  # Lightning's fit put it in training mode
        with torch.no_grad():
            context = self.frozen(h)
        return self.head(self.norm(self.encoder(h + context, src_key_padding_mask=pad)))


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


class SizedNet(ParityNet):
    """Reads ``batch_size`` for its loaders, as the tuner asks. ``fits``: the largest batch whose forward does not
    raise the allocator's out-of-memory; ``None``: every batch fits."""

    def __init__(self, fits: int | None) -> None:
        super().__init__(scheduler=False)
        self.batch_size, self.fits = 2, fits

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for blk in self.blocks:
            h = h + blk(h)
            if self.fits is not None and x.shape[0] > self.fits:  # after a module ran: chunks are in use
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.head(self.norm(h))

    def train_dataloader(self):
        x = torch.randint(0, VOCAB, (256, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (x * 3 + 1) % VOCAB), batch_size=self.batch_size)

    def val_dataloader(self):
        return self.train_dataloader()


class ReadsGrads(ParityNet):
    """Reads the gradients (``read_grads``, a subclass's) where a user does: in ``on_before_optimizer_step``, or with
    ``manual`` in a manually optimized ``training_step`` between its backward and its step."""

    def __init__(self, manual: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.automatic_optimization = not manual

    def read_grads(self) -> None:
        raise NotImplementedError

    def on_before_optimizer_step(self, optimizer):
        if self.automatic_optimization:
            self.read_grads()

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        self.read_grads()
        opt.step()
