"""Models whose backward is out of the ordinary: activation checkpointing (a module's forward runs again inside
backward), a block run twice a step, frozen layers beside trainable adapters (LoRA's shape, and a checkpoint that
keeps the adapters only), a gradient penalty (a backward through the graph of another), a save asked for in
backward, gradients zeroed in place rather than set to ``None``, a backward that runs out of memory part way."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models
from tests.models import ParityNet, ReorderedNet, SizedNet


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


class ComposableCheckpointedNet(ParityNet):
    """Activation checkpointing applied from outside the model's code, as torchtitan does beside FSDP2: torch's
    composable ``checkpoint(module)`` hooks each block (its parameter names unchanged), and backward calls the block
    again. Each block drops out, so the recomputation must draw the forward's masks (torch restores the random
    state) and the engine must neither run a forward twice nor draw random numbers of its own."""

    def build(self) -> None:
        from torch.distributed._composable import checkpoint

        super().build()
        for blk in self.blocks:
            blk.insert(3, nn.Dropout(0.1))  # after the GELU: no parameters, so the initial values are unchanged
            checkpoint(blk)


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


class ZeroesInPlace(ParityNet):
    """``zero_grad(set_to_none=False)``: a parameter unused in a step keeps a zero gradient, which AdamW steps."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class ReorderedZeroesInPlace(ZeroesInPlace, ReorderedNet):
    """The same, registered in another order than it is used (with ``variant="unused"`` the branch comes first)."""


class ReusedCheckpointedNet(ParityNet):
    """The first block applied three times, as ALBERT shares its layers: twice inside reentrant activation
    checkpointing (``use_reentrant=True``, Hugging Face's default before transformers 5) and once outside, so its
    gradient arrives in three pieces, one from each checkpoint's own backward ([Note: gradients in pieces])."""

    def forward(self, x, use_branch=True):
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        h = h + checkpoint(self.blocks[0], h, use_reentrant=True)
        for blk in self.blocks:
            h = h + checkpoint(blk, h, use_reentrant=True)
        h = h + self.blocks[0](h)
        return self.head(self.norm(h))


class ReusedBlockNet(ParityNet):
    """The first block runs twice a forward (weights shared by calling one module again, as ALBERT does)."""

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        h = h + self.blocks[0](h)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


class LateNormBlock(nn.Module):
    """Registered as Llama's blocks are: both norms first, the second used after the weights."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm_in, self.norm_out = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, h):
        return self.norm_out(self.fc2(F.gelu(self.fc1(self.norm_in(h)))))


class LateNormNet(ParityNet):
    """Blocks whose first-use order differs from their registration order inside each block only: the warm-up keeps
    the chunks that hold what they held as they are ([Note: a chunk's parameters in their old places])."""

    def build(self) -> None:
        super().build()
        self.blocks = nn.ModuleList(
            LateNormBlock(self.shape["dim"], self.shape["hidden"]) for _ in range(self.shape["depth"])
        )


class CheckpointedAdapterNet(AdapterNet):
    """LoRA's shape with activation checkpointing around each frozen block and its adapter (PEFT with
    ``gradient_checkpointing_enable()``)."""

    def forward(self, x, use_branch=True):
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        for blk, adapter in zip(self.blocks, self.adapters, strict=True):
            h = checkpoint(lambda t, b=blk, a=adapter: t + b(t) + a(t), h, use_reentrant=False)
        return self.head(self.norm(h))


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


AT = 4  # SavesInsideAStep asks for its save inside the step that takes global_step from 4 to 5


class SavesInsideAStep(ParityNet):
    """Asks for a checkpoint once, at global step ``at``: in a tensor hook half-way through backward (``"backward"``),
    or when ``backward()`` has returned (``"after_backward"``); ``"batch_start"`` is where plain Lightning is asked,
    at the start of the next batch, where the deferred save is written."""

    def __init__(self, where: str, path=None, at: int = AT, then=None) -> None:
        super().__init__()
        self.where, self.path, self.at, self.then, self.saved = where, str(path), at, then, False

    def _save(self, where: str) -> None:
        if where == self.where and self.global_step == self.at and not self.saved:
            self.saved = True
            self.trainer.save_checkpoint(self.path)
            if self.then is not None:
                self.then(self.trainer)

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for i, blk in enumerate(self.blocks):
            h = h + blk(h)
            if i == 0 and torch.is_grad_enabled():  # its gradient comes after the head's chunk stepped
                h.register_hook(lambda g: (self._save("backward"), g)[1])
        return self.head(self.norm(h))

    def backward(self, loss, *args, **kwargs):
        loss.backward(*args, **kwargs)
        self._save("after_backward")

    def on_train_batch_start(self, batch, batch_idx):
        self._save("batch_start")


class ReorderedSavesInsideAStep(SavesInsideAStep, ReorderedNet):
    """SavesInsideAStep on ReorderedNet's registration order."""


def edited(strict: bool = False, replace_head: bool = False):
    return type("Edited", (KeepsAdaptersOnly, AdapterNet), {"strict_loading": strict, "replace_head": replace_head})


class OutOfMemoryInBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory for a batch larger than ``fits``."""

    @staticmethod
    def forward(ctx, x, too_large):  # noqa: ANN001, ANN205
        ctx.too_large = too_large
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        if ctx.too_large:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return g, None


class BackwardSizedNet(SizedNet):
    """``SizedNet`` whose too-large batches run out of memory in backward, after some chunks took their gradients;
    ``swallow``: its ``backward`` hook catches that and the step goes on with the gradients that arrived."""

    def __init__(self, fits, swallow=False):  # noqa: ANN001
        super().__init__(fits)
        self.swallow = swallow

    def forward(self, x, use_branch=True):  # noqa: ANN001, ANN201
        too_large = self.fits is not None and x.shape[0] > self.fits
        h = OutOfMemoryInBackward.apply(self.embed(x), too_large)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))

    def backward(self, loss, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        try:
            loss.backward(*args, **kwargs)
        except torch.OutOfMemoryError:
            if not self.swallow:
                raise


class DetachedSizedNet(BackwardSizedNet):
    """What ``BackwardSizedNet`` trains where its backward runs out of memory and is caught: no gradient below the
    failure (the embedding), every one above it (DDP's reference, with ``find_unused_parameters``)."""

    def forward(self, x, use_branch=True):  # noqa: ANN001, ANN201
        h = self.embed(x).detach()
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


def model_class(name: str) -> type:
    """A test model by its class name, from this module, ``tests.models``, ``tests.layer_models``,
    ``tests.optimizer_models`` or ``tests.distributed.rank_models``."""
    from tests import layer_models, optimizer_models
    from tests.distributed import rank_models

    found = globals().get(name) or getattr(models, name, None) or getattr(layer_models, name, None)
    return found or getattr(optimizer_models, name, None) or getattr(rank_models, name)
