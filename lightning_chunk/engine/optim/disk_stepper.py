"""The disk tier's stepper: the optimizer steps each disk chunk's views on their own, on staged copies of the
chunk's files, while the I/O thread reads the next and writes the last back ([Note: stepping disk shards])."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..chunks.chunk import Chunk, Role, Tier
from ..system.host_heap import release_freed_memory
from ..tiers.disk_io import beside_io
from ..tiers.disk_staging import Staged
from ..tiers.disk_storage import DiskStorage
from .kernels import split_at_cache_lines

if TYPE_CHECKING:
    from .binding import OptimizerBinding


class DiskStepper:
    """Steps one optimizer's views of disk chunks, one chunk at a time.

    [Note: stepping disk shards] With shards on the disk tier one ``step()`` over every view
    would page the whole tier in at once. Here the views of memory-resident shards step
    first, in one call, and then each disk chunk's views in a call of their own: its
    master and optimizer state are paged in (the next chunk's are being read ahead meanwhile),
    stepped, and written back while the next one steps. ``param_groups`` are narrowed to
    the chunk's views for the call and restored after, so hyperparameters, LR schedulers
    and per-parameter ``step`` counts are untouched; an element-wise optimizer computes the
    same bits whichever call a view is stepped in. Optimizer state the step creates (the
    first step) moves into the chunk's file at once. Step hooks run once per call."""

    def __init__(self, binding: OptimizerBinding, disk: DiskStorage) -> None:
        self.binding = binding
        self.disk = disk

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        return self.binding.optimizer

    def chunks(self) -> dict[int, Chunk]:
        """Chunks on the disk tier with a view in ``param_groups`` (as narrowed now: ``step_chunk`` steps one
        chunk's) that holds a gradient, in id order."""
        mgr = self.binding.manager
        if not mgr.ledger[Tier.DISK]:  # no shard on the disk tier: asked at every chunk's step in backward
            return {}
        stepping = {id(v) for g in self._optimizer.param_groups for v in g["params"]}
        found = {}
        for i, v in self.binding.views().items():
            if id(v) not in stepping or v.grad is None:  # a chunk with nothing to step is not read
                continue
            c = mgr.lookup(mgr.params[i])[0]
            if c.shard_tier is Tier.DISK:
                found[c.chunk_id] = c
        return dict(sorted(found.items()))

    def keep_state(self, chunks: Sequence[Chunk] | None = None) -> bool:
        """Move the per-element state of views into disk shards (``chunks``, all when ``None``) into their files;
        True when some state moved (it had been created in memory)."""
        mgr = self.binding.manager
        moved = False
        wanted = None if chunks is None else {c.chunk_id for c in chunks}
        for i, v in self.binding.views().items():
            c = mgr.lookup(mgr.params[i])[0]
            if c.shard_tier is not Tier.DISK or (wanted is not None and c.chunk_id not in wanted):
                continue
            st = self._optimizer.state.get(v)
            if not st:
                continue
            for key in list(st):
                kept = mgr.tiers.keep_state(c, v, key, st[key])
                moved = moved or kept is not st[key]
                st[key] = kept
        return moved

    def _state_in_files(self, c: Chunk) -> bool:
        """Every view of ``c`` that will step has its per-element state in the chunk's file already."""
        state, keeps = self._optimizer.state, self.binding.manager.tiers.keeps
        for t in c.tensors:
            v = self.binding.views().get(t.slot.param_index)
            if v is None or v.grad is None:
                continue
            st = state.get(v)
            if not st or not all(keeps(c, val) for val in st.values() if torch.is_tensor(val) and val.dim()):
                return False
        return True

    def _beside_io(self) -> contextlib.AbstractContextManager[None]:
        # the I/O thread copies while this one steps: leave it a core, where the kernel's bits do not depend on it
        return beside_io() if split_at_cache_lines(self._optimizer) else contextlib.nullcontext()

    def step(self, disk: dict[int, Chunk], **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)`` over the views in ``param_groups``: the memory shards' in one call, then
        the ``disk`` chunks' one at a time."""
        mgr, opt, storage = self.binding.manager, self._optimizer, self.disk
        chunk_of = {id(v): mgr.lookup(mgr.params[i])[0].chunk_id for i, v in self.binding.views().items()}
        out = None
        with self.binding.narrowed(lambda v: chunk_of.get(id(v)) not in disk):
            if any(g["params"] for g in opt.param_groups):
                out = opt.step(**kwargs)
        order = list(disk.values())
        staged = {c.chunk_id: self._state_in_files(c) for c in order}  # else through the mapping (a first step)
        with self._beside_io():
            pending = storage.staging.stage_in(order[0]) if staged[order[0].chunk_id] else None
            for k, c in enumerate(order):
                current, nxt = pending, (order[k + 1] if k + 1 < len(order) else None)
                pending = None
                if nxt is not None:  # read while this chunk steps
                    if staged[nxt.chunk_id]:
                        pending = storage.staging.stage_in(nxt)
                    else:
                        storage.prefetch(nxt, (Role.MASTER, Role.OPTIM), write=True)
                        storage.prefetch(nxt, (Role.GRAD,))
                with self.binding.narrowed(functools.partial(_in_chunk, chunk_of, c.chunk_id)):
                    if current is not None:
                        storage.staging.wait(current)
                        out = self._step_on(current, **kwargs)
                        storage.staging.stage_out(current, (Role.MASTER, Role.OPTIM))
                        continue
                    with storage.writing(c, (Role.MASTER, Role.OPTIM)), storage.reading(c, (Role.GRAD,)):
                        out = opt.step(**kwargs)
                        moved = self.keep_state([c])
                if moved:  # the state this step created in memory went to the file: give its pages back
                    release_freed_memory()
        storage.flush()  # what comes next reads the files through the mapping
        return out

    def _step_on(self, staged: Staged, **kwargs: Any) -> Any:
        """Step the narrowed param groups on the staged twins of their views ([Note: staged optimizer steps] in
        ``disk_staging.py``): twin parameters, gradients and per-element state; scalar state (``step``) is
        shared."""
        opt = self._optimizer
        state = opt.state
        twins = {}
        for g in opt.param_groups:
            new = []
            for v in g["params"]:
                tw = staged.like(v, Role.MASTER)
                if v.grad is not None:
                    tw.grad = staged.like(v.grad, Role.GRAD)
                st = state.get(v)
                if st:
                    state[tw] = {
                        k: (staged.like(x, Role.OPTIM) if torch.is_tensor(x) and staged.holds(x, Role.OPTIM) else x)
                        for k, x in st.items()
                    }
                twins[id(tw)] = (v, tw)
                new.append(tw)
            g["params"] = new
        try:
            return opt.step(**kwargs)
        finally:
            for v, tw in twins.values():
                st = state.pop(tw, None)
                if st is not None:  # scalars the step replaced rather than updated in place
                    for k, x in st.items():
                        if not (torch.is_tensor(x) and x.dim()):
                            state[v][k] = x
                tw.grad = None

    def step_staged_chunk(
        self,
        chunk: Chunk,
        staged: Staged,
        grads: torch.Tensor,
        clip: Callable[[list[torch.Tensor]], None] | None = None,
        **kwargs: Any,
    ) -> bool:
        """``step(**kwargs)`` over the views of disk chunk ``chunk`` alone, on ``staged`` (its master and optimizer
        state, being read by ``StagingSets.stage_in``) with ``grads`` (the uint8 buffer its gradients gathered in)
        as the gradient file's twin (``clip`` given the views' gradients in it first), then the master and state
        written back on the I/O thread ([Note: stepping disk chunks in backward] in ``disk_in_backward.py``). False,
        with nothing stepped, when a view would step for the first time (its state would be created in the staging
        buffer): step it otherwise."""
        b = self.binding
        mine = b.slots.of_chunk(chunk)
        if not mine:
            return True
        ids = {id(s.view) for s in mine}
        with b.slots.for_the_call(mine):
            if not self._state_in_files(chunk):
                return False
            self.disk.staging.wait(staged)  # its read iterates ``staged.files``: the twin below is a new object
            rec = self.disk.record(chunk)
            assert rec is not None
            with_grads = dataclasses.replace(
                staged,
                files={**staged.files, Role.GRAD: rec.files[Role.GRAD]},
                bufs={**staged.bufs, Role.GRAD: grads},
            )
            if clip is not None:
                clip([with_grads.like(s.grad, Role.GRAD) for s in mine])  # type: ignore[arg-type]
            with b.narrowed(lambda v: id(v) in ids), b.kernel(), self._beside_io():
                self._step_on(with_grads, **kwargs)
            self.disk.staging.stage_out(staged, (Role.MASTER, Role.OPTIM))
            return True


def _in_chunk(chunk_of: dict[int, int], cid: int, v: torch.Tensor) -> bool:
    return chunk_of.get(id(v)) == cid
