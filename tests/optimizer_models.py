"""Models trained by optimizers that are not torch's: state in their param groups, parameters written outside
``step()``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.models import VOCAB, ParityNet, token_data


class ScheduleFreeSGD(torch.optim.Optimizer):
    """Schedule-free SGD as ``schedulefree.SGDScheduleFree`` steps it (Defazio et al., 2024), without warm-up: the
    parameter is ``y`` while training and its average ``x`` while evaluating; ``eval()`` and ``train()`` move every
    parameter between the two in place, outside ``step()``, and the step count and averaging weights live in the
    param groups (``k``, ``weight_sum``)."""

    def __init__(self, params, lr: float = 0.2, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta, k=0, weight_sum=0.0, train_mode=True))

    @torch.no_grad()
    def eval(self) -> None:
        self._move(train=False)

    @torch.no_grad()
    def train(self) -> None:
        self._move(train=True)

    def _move(self, *, train: bool) -> None:
        for g in self.param_groups:
            if g["train_mode"] == train:
                continue
            for p in g["params"]:
                z = self.state[p].get("z")
                if z is not None:  # y -> x with 1 - 1/beta, x -> y with 1 - beta
                    p.lerp_(z, 1 - g["beta"] if train else 1 - 1 / g["beta"])
            g["train_mode"] = train

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            g["k"] += 1
            g["weight_sum"] += g["lr"] ** 2
            ckp1 = g["lr"] ** 2 / g["weight_sum"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                z = self.state[p].setdefault("z", p.clone())
                p.lerp_(z, ckp1)
                p.add_(p.grad, alpha=g["lr"] * (g["beta"] * (1 - ckp1) - 1))
                z.sub_(p.grad, alpha=g["lr"])
        return loss


class ScheduleFreeNet(ParityNet):
    """Trained by ``ScheduleFreeSGD`` and validated at its average, as schedule-free's documentation asks:
    ``optimizer.eval()`` before each validation, ``optimizer.train()`` after. ``val_losses``: each batch's loss."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.val_losses: list[float] = []

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        return ScheduleFreeSGD([{"params": decay}, {"params": [p for p in self.parameters() if p.dim() < 2]}])

    def on_validation_epoch_start(self) -> None:
        self.optimizers().optimizer.eval()

    def on_validation_epoch_end(self) -> None:
        self.optimizers().optimizer.train()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1)).item())

    def val_dataloader(self):
        return token_data(16, seed=3)
