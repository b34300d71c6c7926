"""Dynamic loss scaling for fp16 on master-shard gradients, agreed across ranks.

Same rule as ``torch.amp.GradScaler``: multiply the loss by ``scale``; after
backward divide the gradients by it and look for inf/NaN; if any rank found
one, every rank skips the step and multiplies ``scale`` by ``backoff_factor``;
after ``growth_interval`` clean steps in a row it grows by ``growth_factor``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..comm.collectives import Collectives


class DynamicLossScaler:
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1.0 or not (0.0 < backoff_factor < 1.0) or growth_interval < 1:
            raise ValueError(
                f"loss scaler settings init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval} are not allowed: "
                "init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1."
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(
        self,
        grads: Sequence[torch.Tensor],
        comm: Collectives,
        runs: Iterable[tuple[contextlib.AbstractContextManager, list[torch.Tensor]]] | None = None,
        found_before: bool = False,
    ) -> bool:
        """Divide ``grads`` by the scale in place; True when any rank saw inf or NaN. ``runs``: the gradients in
        groups of one device, each unscaled inside its context (a disk shard's gradients paged in around it);
        ``found_before``: this rank saw one already, in gradients unscaled earlier."""
        inv = 1.0 / self.scale
        found = torch.full((1,), float(found_before))
        if runs is None:
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
            runs = [(contextlib.nullcontext(), gs) for gs in by_device.values()]
        for ctx, gs in runs:
            device = gs[0].device
            with ctx:
                f = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(gs, f, torch.full((1,), inv, device=device))
            found += f.cpu()
        if comm.world_size > 1:  # every rank skips if any overflowed
            found = comm.all_reduce(found.to(comm.tensor_device()), op="max", what="the fp16 overflow vote").cpu()
        return bool(found.item() > 0)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
