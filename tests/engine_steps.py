"""One training step driven on a ``ChunkEngine`` directly (no Lightning), as the reference loop of the tests."""

from __future__ import annotations

import torch


def step(eng, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, *, through_engine=False) -> None:  # noqa: ANN001
    """``through_engine``: the optimizer steps as Lightning's precision steps it (``eng.step``: with
    ``step_in_backward`` the chunks left, one at a time), else by its own ``step()``."""
    opt.zero_grad()  # as the reference loop does: gradients stay after a step until zero_grad, as in torch
    with eng.micro_batch(training=True) as outputs:
        loss = model(x).float().pow(2).mean()
        outputs(loss)  # what backward starts from: a root that owns parameters re-gathers them on it
    loss.backward()
    eng.after_backward()
    eng.prepare_step()
    if through_engine:
        eng.step(opt)
    else:
        opt.step()
    eng.finish_step(stepped=True)


def train_beside_torch(model: torch.nn.Module, ref: torch.nn.Module, config, steps: int = 4, after_step=None, **kw):  # noqa: ANN001, ANN003, ANN201
    """``steps`` Adam steps of ``model`` on a ``ChunkEngine`` under ``config`` and of ``ref`` (given ``model``'s
    values) in plain torch, on the same batches of 3 x 8 (``after_step()`` after each; ``kw`` to ``step``); returns
    the engine and its optimizer."""
    from lightning_chunk.engine import ChunkEngine

    ref.load_state_dict(model.state_dict())
    opt, oref = torch.optim.Adam(model.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    eng = ChunkEngine(model, [opt], config=config)
    for i in range(steps):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
        step(eng, model, opt, x, **kw)
        if after_step is not None:
            after_step()
        oref.zero_grad()
        ref(x).pow(2).mean().backward()
        oref.step()
    return eng, opt


class InOrder(torch.nn.Module):
    """A block used in the order it registers its parameters: its chunk is laid out alike before and after the
    warm-up."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first_norm, self.linear = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)
        self.second_norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second_norm(torch.relu(self.linear(self.first_norm(x))))


def two_weights_traded(layout):  # noqa: ANN001, ANN201
    """``layout`` with each chunk's first two parameters of one size in each other's slots: a chunk that keeps its old
    buffers, most of it in the same slots, with two parameters moved within it ([Note: a chunk that keeps its
    buffers])."""
    from dataclasses import replace

    from lightning_chunk.engine.chunks.packing import Layout

    chunks = []
    for c in layout.chunks:
        slots, seen = list(c.slots), {}
        for k, s in enumerate(slots):
            j = seen.setdefault(s.numel, k)
            if j != k:
                a, b = slots[j], slots[k]
                slots[j], slots[k] = replace(a, param_index=b.param_index), replace(b, param_index=a.param_index)
                break
        chunks.append(replace(c, slots=tuple(slots)))
    return Layout(layout.capacity_numel, layout.world_size, tuple(chunks), layout.order)


def traded_at_the_warm_up():  # noqa: ANN201
    """A stand-in for ``keep_slots`` that trades two weights in every chunk at the warm-up's repack
    (``two_weights_traded``) and leaves later layouts as chosen, so a later repack trades them back."""
    repacks = []

    def keep_slots(new, old):  # noqa: ANN001, ANN202
        repacks.append(new)
        return two_weights_traded(new) if len(repacks) == 1 else new

    return keep_slots
