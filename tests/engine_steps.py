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


def train_beside_torch(model: torch.nn.Module, ref: torch.nn.Module, config, steps: int = 4, after_step=None):  # noqa: ANN001, ANN201
    """``steps`` Adam steps of ``model`` on a ``ChunkEngine`` under ``config`` and of ``ref`` (given ``model``'s
    values) in plain torch, on the same batches of 3 x 8 (``after_step()`` after each); returns the engine and its
    optimizer."""
    from lightning_chunk.engine import ChunkEngine

    ref.load_state_dict(model.state_dict())
    opt, oref = torch.optim.Adam(model.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    eng = ChunkEngine(model, [opt], config=config)
    for i in range(steps):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
        step(eng, model, opt, x)
        if after_step is not None:
            after_step()
        oref.zero_grad()
        ref(x).pow(2).mean().backward()
        oref.step()
    return eng, opt
