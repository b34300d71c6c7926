"""Models trained by optimizers that are not torch's: state in their param groups, parameters written outside
``step()``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import VOCAB, ParityNet, ReorderedNet, token_data


class _Stepped(torch.optim.Optimizer):
    """``step(closure)`` as torch's optimizers take it (Lightning passes the closure); ``update`` steps."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update()
        return loss

    def update(self) -> None:
        raise NotImplementedError


class GroupCountedSGD(_Stepped):
    """SGD whose learning rate warms up by a count kept in each param group, as schedule-free AdamW keeps ``k`` and
    ``weight_sum`` there: an update that reads the group's own state, advanced by every ``step()`` call."""

    def __init__(self, params, lr: float = 1e-2, warmup: int = 8) -> None:
        super().__init__(params, dict(lr=lr, warmup=warmup, k=0))
        for g in self.param_groups:
            g["weight_sum"] = torch.zeros(())  # a tensor each call changes in place

    def update(self) -> None:
        for g in self.param_groups:
            g["k"] += 1
            g["weight_sum"].add_(min(1.0, g["k"] / g["warmup"]))
            g["scheduled_lr"] = g["lr"] * g["weight_sum"].item() / g["k"]  # an entry the first call adds
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["scheduled_lr"])


class TrustRatioSGD(_Stepped):
    """SGD scaled by each parameter's trust ratio ``|p| / |g|``, as LAMB and LARS scale theirs: not element-wise, its
    update of an element reads the whole parameter."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    def update(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] * float(p.norm() / (p.grad.norm() + 1e-12)))


class GroupNormalizedSGD(_Stepped):
    """SGD on gradients divided by the norm of the whole group's, as Prodigy's step size sums over the group: its
    update of an element reads every parameter of the group."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    def update(self) -> None:
        for g in self.param_groups:
            grads = [p.grad for p in g["params"] if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([x.norm() for x in grads]))) if grads else 1.0
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] / (norm + 1e-12))


class ClosureSGD(torch.optim.Optimizer):
    """SGD whose ``step`` calls its closure whatever it is given (``loss = closure()``), as some third-party
    optimizers do. ``when``: ``first`` (then steps with the gradients), ``again`` (then moves the weights and calls it
    a second time to step with the gradients there, as SAM does, Foret et al. 2021, in its Lightning-ready form), or
    ``moved`` (moves the weights first and calls it once there, as schedule-free's closure variants do)."""

    def __init__(self, params, lr: float = 0.05, when: str = "first") -> None:
        super().__init__(params, dict(lr=lr))
        self.when = when

    def _move(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=0.01)

    @torch.no_grad()
    def step(self, closure=None):
        if self.when == "moved":
            self._move()
        with torch.enable_grad():
            loss = closure()
        if self.when == "again":
            self._move()
            with torch.enable_grad():
                closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])
        return loss


class ClosureNet(ParityNet):
    def __init__(self, when: str = "first", **kw) -> None:
        super().__init__(**kw)
        self.when = when

    def configure_optimizers(self):
        return ClosureSGD(self.parameters(), when=self.when)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as its widely copied implementation steps (``first_step`` moves the weights up the
    gradient, a second forward and backward there, ``second_step`` puts them back and steps a base SGD), with the
    weights put back by ``p.data = old`` as there, or in place (``in_place``)."""

    def __init__(self, params, lr: float = 0.05, rho: float = 0.05, in_place: bool = False) -> None:
        super().__init__(params, dict(lr=lr, rho=rho))
        self.base = torch.optim.SGD(self.param_groups, lr=lr, momentum=0.9)
        self.param_groups = self.base.param_groups
        self.in_place = in_place

    @torch.no_grad()
    def first_step(self) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self._with_grads()]))
        for p in self._with_grads():
            self.state[p]["old"] = p.detach().clone()
            p.add_(p.grad * (self.param_groups[0]["rho"] / (norm + 1e-12)))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for p in self._with_grads():
            if self.in_place:
                p.copy_(self.state[p]["old"])
            else:
                p.data = self.state[p]["old"]
        self.base.step()
        self.zero_grad()

    def _with_grads(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]


class SharpnessAwareManual(ParityNet):
    """SAM in manual optimization, as Lightning's users write it: two forward and backward passes a step."""

    def __init__(self, in_place: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.in_place = in_place
        self.automatic_optimization = False

    def configure_optimizers(self):
        return SAM(self.parameters(), in_place=self.in_place)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers().optimizer
        x, y = batch
        for second in (False, True):
            self.manual_backward(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1)))
            opt.second_step() if second else opt.first_step()


class GroupCounted(ParityNet):
    def configure_optimizers(self):
        return GroupCountedSGD(_two_groups(self))


def _two_groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay}, {"params": [p for p in model.parameters() if p.dim() < 2]}]


class ScheduleFreeSGD(_Stepped):
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

    def update(self) -> None:
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


class ScheduleFreeNet(ParityNet):
    """Trained by ``ScheduleFreeSGD`` and validated at its average, as schedule-free's documentation asks:
    ``optimizer.eval()`` before each validation, ``optimizer.train()`` after. ``val_losses``: each batch's loss."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.val_losses: list[float] = []

    def configure_optimizers(self):
        return ScheduleFreeSGD(_two_groups(self))

    def on_validation_epoch_start(self) -> None:
        self.optimizers().optimizer.eval()

    def on_validation_epoch_end(self) -> None:
        self.optimizers().optimizer.train()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1)).item())

    def val_dataloader(self):
        return token_data(16, seed=3)


class ScheduleFreeAveragedAtTheEnd(ScheduleFreeNet):
    """Moved to its average when fit ends, as schedule-free asks before the weights are used (``on_fit_end`` comes
    after the strategy's teardown)."""

    def on_fit_end(self) -> None:
        self.trainer.optimizers[0].eval()


class ScheduleFreeEvaluatedByHand(ScheduleFreeNet):
    """Evaluated at its average by hand at the end of each epoch, between ``optimizer.eval()`` and ``.train()``: a
    forward outside any step, as a callback's sample is; with ``modes``, the module in eval mode for it; with
    ``twice``, evaluated at the training weights first."""

    modes = twice = False

    def on_train_epoch_end(self) -> None:
        optimizer = self.trainer.optimizers[0]
        x, y = next(iter(token_data(8, seed=5)))
        self.train(not self.modes)
        with torch.no_grad():
            if self.twice:
                self.val_losses.append(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1)).item())
            optimizer.eval()
            self.val_losses.append(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1)).item())
        self.train()
        optimizer.train()


class ClipsOptimizerParams(ParityNet):
    """torch's clipping over the optimizer's own parameters (``optimizer.param_groups``), not the module's, as a
    training loop written for plain PyTorch does: ``how`` is ``group_norms`` (a norm a param group, in
    ``on_before_optimizer_step``), ``total_norm`` (``get_total_norm`` in ``on_after_backward``), ``manual`` (norm
    clipping after a manual backward) or ``value``."""

    def __init__(self, how: str = "value", **kw) -> None:
        super().__init__(**kw)
        self.how = how
        self.automatic_optimization = how != "manual"

    def _params(self, optimizer) -> list[torch.Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"]]

    def on_after_backward(self):
        if self.how == "total_norm":
            torch.nn.utils.get_total_norm([p.grad for p in self._params(self.optimizers()) if p.grad is not None])

    def on_before_optimizer_step(self, optimizer):
        if self.how == "group_norms":
            for g in optimizer.param_groups:
                torch.nn.utils.clip_grad_norm_(g["params"], 0.05)
        elif self.how == "value":
            torch.nn.utils.clip_grad_value_(self._params(optimizer), 2e-3)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1)))
        torch.nn.utils.clip_grad_norm_(self._params(opt), 0.05)
        opt.step()


class MuonNet(ParityNet):
    """Matrices only (no norms, no biases), trained by ``torch.optim.Muon`` alone in automatic optimization."""

    def build(self) -> None:
        d, hidden = self.shape["dim"], self.shape["hidden"]
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden, bias=False), nn.GELU(), nn.Linear(hidden, d, bias=False))
            for _ in range(self.shape["depth"])
        )
        self.norm = nn.Identity()
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def configure_optimizers(self):
        return torch.optim.Muon(self.parameters(), lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


class MuonWithAdamW(ParityNet):
    """Muon for the blocks' matrices and AdamW for the rest, as Muon is used: two optimizers, manual optimization."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def configure_optimizers(self):
        matrices = [p for n, p in self.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
        rest = [p for n, p in self.named_parameters() if not (n.startswith("blocks.") and p.dim() == 2)]
        return [torch.optim.Muon(matrices, lr=0.02, nesterov=False), torch.optim.AdamW(rest, lr=1e-2)]

    def training_step(self, batch, batch_idx):
        muon, adamw = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        muon.zero_grad()
        adamw.zero_grad()
        self.manual_backward(loss)
        muon.step()
        adamw.step()
        return loss


class AdafactorNet(ParityNet):
    """``torch.optim.Adafactor`` with weight decay on the matrices, over matrices, vectors (norms, biases) and two
    matrices whose factored state has the parameter's own shape: a gate ``(1, dim)`` (its ``col_var``) and a lift
    ``(dim, 1)`` (its ``row_var``)."""

    def build(self) -> None:
        super().build()
        d = self.shape["dim"]
        self.gate = nn.Linear(d, 1)
        self.lift = nn.Linear(1, d, bias=False)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.embed(x)
        for blk in self.blocks:
            h = h + blk(h)
        h = h + self.lift(torch.sigmoid(self.gate(h)))
        return self.head(self.norm(h))

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.Adafactor(
            [{"params": matrices, "weight_decay": 0.1}, {"params": vectors}], lr=self.lr, foreach=self.foreach
        )

    foreach: bool | None = None


class HeadAddedLater(ParityNet):
    """The head is in no param group at first (``callbacks.AddHeadGroup`` adds one), and frozen where ``frozen``;
    ``head_group``: the group that callback adds is there from the start (a run resumed after it was added)."""

    def __init__(self, frozen: bool = True, head_group: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.head.requires_grad_(not frozen)
        self.head_group = head_group

    def configure_optimizers(self):
        rest = [p for n, p in self.named_parameters() if not n.startswith("head.")]
        opt = torch.optim.AdamW(rest, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        if self.head_group:
            opt.add_param_group({"params": [self.head.weight], "lr": self.lr / 10, "weight_decay": 0.0})
        return opt


class HeadAddedLaterReordered(HeadAddedLater, ReorderedNet):
    """``HeadAddedLater`` registered in another order than it is used (``ReorderedNet``'s)."""
