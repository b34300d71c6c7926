"""Where each optimizer view's gradient is (``GradSlot``), and attaching them to the views for ``step()`` and
clipping ([Note: zero_grad on a rebound optimizer])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..memory.manager import ChunkManager


class GradSlot(NamedTuple):
    """A view the optimizer steps and where its gradient is."""

    param: int  # the parameter's index in the manager
    view: torch.Tensor  # the optimizer's view of the parameter's piece of the master shard
    chunk: Chunk
    info: TensorInfo  # the parameter's state in its chunk (whether it got a gradient this step)
    grad: torch.Tensor | None  # its slice of the chunk's gradient shard


class GradSlots:
    """The gradient slots of one optimizer's views, and which views hold a gradient now."""

    def __init__(self, manager: ChunkManager, group_params: list[list[int]]) -> None:
        self.manager = manager
        self.group_params = group_params
        self.views: dict[int, torch.Tensor] = {}
        self._attached: set[int] = set()  # views whose gradient ``attach`` set (see ``sync_zero_grad``)
        self._slots: list[GradSlot] | None = None  # built on first use
        self._by_chunk: dict[int, list[GradSlot]] | None = None

    def rebind(self, views: dict[int, torch.Tensor]) -> None:
        """New views (a bind): the slots are built anew on first use."""
        self.views = views
        self._attached = set()
        self._slots = None
        self._by_chunk = None

    def all(self) -> list[GradSlot]:
        """The ``GradSlot`` of every view. Gradient buffers persist until the next repack (a released one keeps its
        storage object): the slices can be kept."""
        if self._slots is None:
            mgr = self.manager
            self._slots = [
                GradSlot(i, v, *mgr.lookup(mgr.params[i]), mgr.grads.slice(i)) for i, v in self.views.items()
            ]
        return self._slots

    def of_chunk(self, chunk: Chunk, *, with_grad: bool = True) -> list[GradSlot]:
        """The slots of ``chunk``'s views (``with_grad``: those that got a gradient this step)."""
        if self._by_chunk is None:  # built whole, then published: the host step thread may read it too
            by_chunk: dict[int, list[GradSlot]] = {}
            for slot in self.all():
                by_chunk.setdefault(slot.chunk.chunk_id, []).append(slot)
            self._by_chunk = by_chunk
        slots = self._by_chunk.get(chunk.chunk_id, ())
        return [s for s in slots if not with_grad or (s.info.has_grad and s.grad is not None)]

    def attach(self) -> None:
        """Give each view its gradient (``None`` where the parameter got none), for ``step()`` and clipping.

        [Note: zero_grad on a rebound optimizer] As ``param.grad`` in plain PyTorch, the gradients are
        attached at the end of every backward and stay attached after the step. ``optimizer.zero_grad()``
        then sets them to ``None`` (or zeroes them in place, with ``set_to_none=False``) through the
        views, and ``sync_zero_grad`` reads that back before the flags are used again (the next backward,
        the next step): a gradient the user cleared is overwritten, one that was not is accumulated into,
        exactly as in ``torch.optim`` (a GAN's ``opt_g.zero_grad()`` drops the generator gradients of the
        discriminator's backward, also before ``opt_g`` first stepped). Reading the views rather than
        wrapping ``zero_grad`` also works through Lightning's ``LightningOptimizer``, which calls the
        optimizer class's method on itself."""
        attached = set()
        for i, v, chunk, info, g in self.all():
            if info.has_grad and g is not None and not chunk.grad_released:  # released: stepped in backward
                if v.grad is not g:
                    v.grad = g
                attached.add(i)
            elif v.grad is not None:
                v.grad = None
        self._attached = attached

    @contextlib.contextmanager
    def for_the_call(self, mine: list[GradSlot], shard: torch.Tensor | None = None) -> Iterator[None]:
        """The slots' views hold their gradients for the block, and none after it (also on an error). ``shard``:
        a stand-in for their chunk's gradient shard, whose slices they hold instead."""
        for s in mine:
            s.view.grad = s.grad if shard is None else _same_slice(shard, s)
        try:
            yield
        finally:
            for s in mine:
                s.view.grad = None
            self._attached.difference_update(s.param for s in mine)

    def detach_released(self) -> None:
        """Views whose chunk gave its gradient shard back hold no gradient (as after ``zero_grad()``)."""
        for s in self.all():
            if s.chunk.grad_released:
                s.view.grad = None
                self._attached.discard(s.param)

    def sync_zero_grad(self) -> None:
        """Forget the gradients ``zero_grad()`` set to ``None`` since they were attached: those parameters', and
        (as the optimizer's ``zero_grad`` ran) those of this optimizer's parameters this rank holds no piece of."""
        if not self._attached:
            return
        cleared = [i for i in self._attached if self.views[i].grad is None]
        self._attached.difference_update(cleared)
        if cleared:
            elsewhere = [i for g in self.group_params for i in g if i not in self.views]
            self.manager.grads.clear(cleared + elsewhere)

    def detach(self) -> None:
        for v in self.views.values():
            v.grad = None
        self._attached = set()

    def grads(self) -> list[torch.Tensor]:
        return [v.grad for v in self.views.values() if v.grad is not None]

    def grad_chunks(self) -> list[tuple[Chunk, torch.Tensor]]:
        """``grads()`` with the chunk each gradient lives in (to page disk shards around a pass over them)."""
        mgr = self.manager
        return [(mgr.lookup(mgr.params[i])[0], v.grad) for i, v in self.views.items() if v.grad is not None]


def _same_slice(shard: torch.Tensor, slot: GradSlot) -> torch.Tensor:
    """The slice of ``shard`` at the place of ``slot.grad`` in its chunk's gradient shard."""
    assert slot.grad is not None and slot.chunk.grad is not None
    start = slot.grad.storage_offset() - slot.chunk.grad.storage_offset()
    return shard[start : start + slot.grad.numel()]
