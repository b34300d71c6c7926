"""One training step driven on a ``ChunkEngine`` directly (no Lightning), as the reference loop of the tests."""

from __future__ import annotations

import torch


def step(eng, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()  # as the reference loop does: gradients stay after a step until zero_grad, as in torch
    with eng.micro_batch(training=True) as outputs:
        loss = model(x).float().pow(2).mean()
        outputs(loss)  # what backward starts from: a root that owns parameters re-gathers them on it
    loss.backward()
    eng.after_backward()
    eng.prepare_step()
    opt.step()
    eng.finish_step(stepped=True)
