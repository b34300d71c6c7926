"""Disk chunks stepped during backward from their gradients in memory, their files staged ahead of need.

[Note: stepping disk chunks in backward]
After backward, the disk tier's optimizer phase reads each disk chunk's master, gradient and optimizer state from
its files, steps it and writes master and state back ([Note: staged optimizer steps] in ``disk_staging.py``), beside
no compute: where memory cannot cache the files that phase was most of the step (1.0-1.3 s of 1.7-2.2 on the 85M GPT
of ``benchmarks/disk.py``). Stepped in backward, a disk chunk steps from the host buffer its gradients gathered in
(``GradBuffers.in_memory`` in ``tiers/disk_grads.py``), which is then kept for the next chunks without being written
(``GradBuffers.drop``): the gradient file is neither written nor read back, 8 of the 40 bytes a parameter the fp32
step moves. Its master and optimizer state are staged as the optimizer phase stages them (the same two sets, the
same I/O thread, the same kernel and bits), but ahead of need: when a chunk steps, the disk chunk expected to finish
next is already being read (in the order the last backward finished them; by descending id before there is one, as
backward runs forward's first-use packing in reverse), and the first one is read when backward starts. So the reads
and write-backs go on beside backward's compute. A wrong guess costs its read and nothing else: the read is waited
for and the right chunk staged then. A view that has no state yet (its first step) cannot step on a staging buffer,
nor a chunk whose gradients are not all in memory: those write their gradients to the file first and step as after
backward. Everything written in backward is waited for at its end (``DiskStorage.settle_grads``), before anything
reads the files again. A disk chunk's gradient is "released" by a flag alone (its file keeps its bytes), so
``GradSlots.attach`` and ``finish`` treat it as a released shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..chunks.chunk import Chunk, Role, Tier
from ..memory.manager import ChunkManager
from ..tiers.disk_staging import Staged
from ..tiers.disk_storage import DiskStorage
from .binding import OptimizerBinding

STAGED = (Role.MASTER, Role.OPTIM)  # a disk chunk's files read for a step in backward (its gradients are in memory)


class DiskSteps:
    """Disk chunks stepped during backward, their files staged ahead of need ([Note: stepping disk chunks in
    backward]); the storage may stage them at their backward gather ([Note: staging at the backward gather] in
    ``disk_staging.py``)."""

    def __init__(self, manager: ChunkManager, binding: OptimizerBinding, disk: DiskStorage) -> None:
        self.manager = manager
        self.binding = binding
        self.staging = disk.staging
        self.grads = disk.grads
        self.order: list[int] = []  # disk chunk ids in the order the last backward stepped them
        self.seen: list[int] = []  # this backward's, so far
        self.missed = 0  # staged reads ahead that no step took (a wrong guess, read for nothing)
        self.on_disk: dict[int, Chunk] = {}  # this backward's disk chunks with something to step on this rank

    def begin(self) -> None:
        self.end()
        self.on_disk = {
            c.chunk_id: c
            for c in self.manager.chunks
            if c.shard_tier is Tier.DISK and c.trainable and self.binding.steps_on_this_rank(c)
        }
        self.staging.expect_steps([self.on_disk[cid] for cid in self._order()], STAGED)
        first = self._expected(None)
        if first is not None:
            self.staging.stage_in(first, STAGED)

    def step(self, chunk: Chunk, clip: Callable[[list[torch.Tensor]], None]) -> bool:
        """Step disk chunk ``chunk`` now, from its gradients in memory (``clip``ped first); False when it must step
        from its files."""
        staging = self.staging
        if not self.binding.steps_on_this_rank(chunk):  # padding alone here: nothing to read, step or write
            self.grads.drop(chunk)
            return True
        grads = self.grads.in_memory(chunk)
        staged = self._staged(chunk)
        self.seen.append(chunk.chunk_id)
        staging.stepped(chunk)
        nxt = self._expected(chunk.chunk_id)
        if nxt is not None and staging.held(nxt) is None and staging.can_stage():
            staging.stage_in(nxt, STAGED)  # read while this one steps and backward goes on
        if grads is None or staged is None or not self.binding.disk.step_staged_chunk(chunk, staged, grads, clip):
            staging.let_go(staged)
            return False
        self.grads.drop(chunk)
        return True

    def end(self) -> None:
        """Backward is over (or starts again): keep its order; a staged read no step took is waited for."""
        if self.seen:
            self.order, self.seen = self.seen, []
        for c in self.on_disk.values():
            staged = self.staging.held(c)
            if staged is not None:
                self.staging.let_go(staged)
                self.missed += 1
        self.staging.expect_steps([], ())

    def _staged(self, chunk: Chunk) -> Staged | None:
        """``chunk``'s files staged: the read started ahead when the guess was right, else one started now (a set
        a wrong guess holds gives way)."""
        staging = self.staging
        staged = staging.held(chunk)
        if staged is not None:
            return staged
        held = [s for s in (staging.held(c) for c in self.on_disk.values()) if s is not None]
        if held and not staging.can_stage():  # a wrong guess: the one expected last gives its set, its read wasted
            order = self._order()
            staging.let_go(max(held, key=lambda s: order.index(s.chunk.chunk_id)))
            self.missed += 1
        return staging.stage_in(chunk, STAGED)

    def _order(self) -> list[int]:
        """The disk chunks in the order the last backward stepped them (by descending id where it stepped none)."""
        on_disk = self.on_disk
        known = [cid for cid in self.order if cid in on_disk]
        return known + sorted((cid for cid in on_disk if cid not in known), reverse=True)

    def _expected(self, after: int | None) -> Chunk | None:
        """The disk chunk this backward should finish after chunk ``after`` (first when ``None``)."""
        order = self._order()
        if after in order:
            order = order[order.index(after) + 1 :]
        seen = set(self.seen)
        return next((self.on_disk[cid] for cid in order if cid not in seen), None)
