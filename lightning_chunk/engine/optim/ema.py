"""An exponential moving average of the weights, kept in shards beside the masters.

[Note: a sharded EMA]
Lightning's ``EMAWeightAveraging`` (``WeightAveraging`` with ``torch.optim.swa_utils.AveragedModel``) keeps a deep
copy of the whole model on every rank and writes the module's parameters to swap it in: under ZeRO-3 it would hold
the model the sharding exists to split, and the parameters it writes are payload views (refused at set-up, [Note:
parameters outside a step]). The average is element-wise, ``ema = decay * ema + (1 - decay) * weight``, so each
rank can keep it for the elements of its own master shards: one fp32 tensor per trainable chunk, the size of the
rank's shard, in host memory (the masters' bytes over the ranks; a device-tier master is copied to the host for
each update, so ``update_every_n_steps`` bounds that traffic). The arithmetic is ``get_ema_avg_fn``'s, op for op, on
the same fp32 values, so the average equals ``AveragedModel``'s bit for bit; the first update copies, as
``AveragedModel``'s does.

Parameters frozen from the start are not averaged: they never change, so each is its own average (a LoRA run does
not pay for an average of its frozen base; ``AveragedModel`` computes ``decay * p + (1 - decay) * p``, which can
differ from ``p`` in the last bit). A chunk averaged once stays averaged if its parameters are frozen later (its
average moves on towards the frozen weights, as ``AveragedModel``'s does). A repack (a parameter frozen or unfrozen,
inputs that grew) carries the shards like the optimizers' state (``take``/``give``, the ``ExtraShards`` protocol);
a parameter frozen from the start and trainable now starts from its weights.

``swap`` exchanges the masters and the averages (validation with the averaged weights, then back: exact, nothing is
recomputed) and ``copy_to_masters`` makes the average the weights (the end of training); both refresh the
compute-dtype copies and drop stale payloads as the end of a step does. Checkpoints save the shards as
``chunk.<c>.ema`` beside the masters and load them on any world size (``checkpoint.py``).

[Note: the same averages on every rank]
Every rank must hold an average for the same chunks: a repack all-gathers each chunk's (``take``), and a full save
gathers each one, so a chunk averaged on one rank and not on another pairs one rank's gather with the next chunk's
on the other (a hang on NCCL, or payloads built from different chunks). Updates give every trainable chunk one.
A resume reads on each rank only the saved chunks its shards reach ([Note: a resume reads what the rank holds]), so
a chunk whose shard on a rank is padding alone (a small parameter alone in a chunk that is not the last of its kind,
as a Llama's final norm between its last layer and its head) got none there: the resumed warm-up's repack hung on two
ranks. ``after_load`` gives each such chunk its weights, as an update would.

[Note: the average under a host limit]
With ``host_memory_limit`` the host holds what the placement counted and no more, so an average in host memory
(4 bytes a trainable parameter over the ranks) would break the bound it promises. There each chunk's average is a
file under ``disk_dir`` (``DiskStorage.alloc_beside``, role ``ema``), whatever tier the chunk's shard lives on, and
every use pages it in and out as the disk tier pages its own files (``DiskStorage.reading``/``writing``; the repack
writes it through the mapping and the build pages it out): the host holds a chunk's average while it is used. An
update reads and writes each file once (8 bytes a parameter over the ranks, from the page cache where it holds them),
which ``update_every_n_steps`` bounds: 64 ms an update for a 71.5 MB average against 12 ms in memory (one rank,
files cached, 2026-12-03); reading each file into a buffer and writing it back (``preadv``/``pwritev``, as the
optimizer steps disk shards) took 54-62 ms, not worth a chunk-sized buffer. The arithmetic is the same on a view of
the file, so the average is the same bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..chunks.chunk import Chunk, Role
from ..chunks.repack import piece_range
from ..tiers.disk import check_room

_HOST = torch.device("cpu")
BLOCK = 1 << 20  # elements an update step takes at a time (4 MB in fp32: the second pass reads from cache)
KEY = "<ema>"  # its key among the shards a repack carries (optimizer state keys are names without brackets)


def average_bytes(manager: Any) -> int:
    """This rank's share of an average of the weights: each trainable chunk's shard in its master dtype."""
    return sum(c.shard_numel * c.master_dtype.itemsize for c in manager.chunks if c.trainable)


class ShardedEMA:
    def __init__(self, manager: Any, buffers: BufferAverage | None = None, *, in_files: bool = False) -> None:
        self.manager = manager
        self.shards: dict[Chunk, torch.Tensor] = {}  # trainable chunk -> this rank's averaged master shard
        self._filled: dict[Chunk, torch.Tensor] = {}  # during a repack: which elements ``give`` filled
        self.buffers = buffers  # the module's buffers beside the average ([Note: averaged buffers])
        # the disk tier, where the averages are files ([Note: the average under a host limit]); else host memory
        self._disk = manager.tiers.disk if in_files else None

    @property
    def started(self) -> bool:
        return bool(self.shards)

    @property
    def nbytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.shards.values())

    def stats(self) -> dict[str, int]:
        """This rank's share of the average: in host memory, or in files ([Note: the average under a host limit])."""
        in_files = self._disk is not None
        return {"ema_host_bytes": 0 if in_files else self.nbytes, "ema_disk_bytes": self.nbytes if in_files else 0}

    # ------------------------------------------------------------ storage
    def _new(self, c: Chunk, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._disk is None:
            return torch.empty(numel, dtype=dtype)
        return self._disk.alloc_beside(c, Role.EMA, numel, dtype)

    def _from_master(self, c: Chunk) -> torch.Tensor:
        """A new average for the chunk, a copy of its master (a first update copies, as ``AveragedModel``'s)."""
        with self.manager.tiers.reading(c, (Role.MASTER,)):
            m = c.master_tensor_for_read().detach()
            e = self.shards[c] = self._new(c, m.numel(), m.dtype)
            with self._paged(c, write=True):
                e.copy_(m)
        return e

    def _drop(self, c: Chunk) -> torch.Tensor | None:
        """The chunk's average leaves ``shards``; its file goes (a tensor viewing it stays readable)."""
        e = self.shards.pop(c, None)
        if self._disk is not None:
            self._disk.drop(c, Role.EMA)
        return e

    def _paged(self, c: Chunk, *, write: bool) -> contextlib.AbstractContextManager[Any]:
        """Bracket a use of the chunk's average: a file is paged in, then out."""
        if self._disk is None:
            return contextlib.nullcontext()
        return (self._disk.writing if write else self._disk.reading)(c, (Role.EMA,))

    def _check_room(self) -> None:
        """Before the first file: the filesystem holds every trainable chunk's average, for each rank of the host."""
        if self._disk is None or self.shards:
            return
        ranks = self._disk.ranks_here
        check_room(
            self._disk.directory.root,
            average_bytes(self.manager) * ranks,
            "the average of the weights (ChunkEMA)",
            ranks,
        )

    def update(self, decay: float) -> None:
        """One step of the average; the first copies the weights. A chunk frozen after it was averaged goes on
        being averaged (its average moves on towards its frozen weights, as ``AveragedModel``'s).

        ``get_ema_avg_fn``'s ``decay * e + (1 - decay) * m``, each op rounded as there, in place and a block at a
        time through one scratch buffer: a chunk-sized temporary (130 MB for a chunk of a 100M model on one rank)
        was a fresh mapping whose page faults cost 100 ms an update, against 9 ms for the arithmetic."""
        self.manager.readers.before_change()  # [Note: training beside a save] in state/background_save.py
        if self.buffers is not None:
            self.buffers.update(decay)
        self._check_room()
        scratch: dict[torch.dtype, torch.Tensor] = {}
        for c in self.manager.chunks:
            e = self.shards.get(c)
            if e is None:
                if c.trainable:
                    self._from_master(c)
                continue
            buf = scratch.setdefault(e.dtype, torch.empty(BLOCK, dtype=e.dtype))
            with self.manager.tiers.reading(c, (Role.MASTER,)), self._paged(c, write=True):
                m = c.master_tensor_for_read().detach()
                for a in range(0, e.numel(), BLOCK):
                    b = min(a + BLOCK, e.numel())
                    tmp = buf[: b - a]
                    torch.mul(m[a:b].to(_HOST), 1 - decay, out=tmp)
                    e[a:b].mul_(decay).add_(tmp)

    def swap(self) -> None:
        """The masters take the averages and the averages the masters (and the buffers theirs), a block at a time
        in place."""
        self.manager.readers.before_change()
        if self.buffers is not None:
            self.buffers.swap()
        for c, e in self.shards.items():
            with self.manager.tiers.writing(c, (Role.MASTER,)), self._paged(c, write=True):
                m = c.master_tensor_for_read()
                for a in range(0, e.numel(), BLOCK):
                    b = min(a + BLOCK, e.numel())
                    old = m[a:b].to(_HOST, copy=True)
                    m[a:b].copy_(e[a:b])
                    e[a:b].copy_(old)
        self.manager.write_back(chunks=list(self.shards))

    def copy_to_masters(self) -> None:
        if self.buffers is not None:
            self.buffers.copy_to_module()
        for c, e in self.shards.items():
            with self.manager.tiers.writing(c, (Role.MASTER,)), self._paged(c, write=False):
                c.master_tensor_for_read().copy_(e)
        self.manager.write_back(chunks=list(self.shards))

    # ------------------------------------------------------------- checkpoint
    def shard(self, c: Chunk) -> torch.Tensor | None:
        return self.shards.get(c)

    def whole(self) -> dict[int, torch.Tensor]:
        """Each averaged parameter's whole value on the host, by index (a collective with several ranks)."""
        out = {}
        for c in self.manager.chunks:
            e = self.shards.get(c)
            if e is not None:
                with self._paged(c, write=False):
                    full = self.manager.gather_shard(c, e)
                for t in c.tensors:
                    out[t.slot.param_index] = full[t.offset : t.offset + t.numel].view(t.shape).clone()
        return out

    def load(self, values: dict[int, torch.Tensor]) -> None:
        """Whole averaged values by parameter index: each rank keeps its pieces (a saved chunk at a time)."""
        self._check_room()
        for c in self.manager.chunks:
            lo, _ = c.shard_range
            pieces = [(t, values[t.slot.param_index]) for t in c.tensors if t.slot.param_index in values]
            if not pieces:
                continue
            e = self.shards.get(c)
            if e is None:  # elements no saved value reaches (padding) start from the weights
                e = self._from_master(c)
            with self._paged(c, write=True):
                for t, value in pieces:
                    a, b = piece_range(c, t.offset, t.numel)
                    if a < b:
                        e[a - lo : b - lo].copy_(value.reshape(-1)[a - t.offset : b - t.offset])

    def after_load(self) -> None:
        """Once every saved average is read: every trainable chunk has one on every rank ([Note: the same averages
        on every rank])."""
        self._check_room()
        for c in self.manager.chunks:
            if c.trainable and c not in self.shards:
                self._from_master(c)

    # ----------------------------------------------------------------- repack
    def take(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        e = self._drop(chunk)
        return {} if e is None else {KEY: e}

    def give(self, param_index: int, pieces: dict[str, torch.Tensor], chunk: Chunk, offset: int) -> None:
        """``offset``: where the piece starts in ``chunk``'s shard."""
        piece = pieces.get(KEY)
        if piece is None:
            return
        e = self.shards.get(chunk)
        if e is None:  # a file's pages are written through the mapping; the build pages the chunk out after
            e = self.shards[chunk] = self._new(chunk, chunk.shard_numel, piece.dtype)
            self._filled[chunk] = torch.zeros(chunk.shard_numel, dtype=torch.bool)
        e[offset : offset + piece.numel()].copy_(piece.reshape(-1))
        self._filled[chunk][offset : offset + piece.numel()] = True

    def after_repack(self) -> None:
        """What the repack left: elements no old average reached (a parameter frozen from the start and trainable
        now, padding) start from the weights; a chunk of parameters never averaged and still frozen has none."""
        started = self.started or bool(self._filled)
        for c in list(self.shards):
            if c not in self.manager.chunks:
                self._drop(c)
        if started:
            for c in self.manager.chunks:
                e, filled = self.shards.get(c), self._filled.get(c)
                if e is None and not c.trainable:
                    continue
                if e is None:
                    self._from_master(c)
                elif filled is not None:
                    with self.manager.tiers.reading(c, (Role.MASTER,)), self._paged(c, write=True):
                        m = c.master_tensor_for_read().detach().to(_HOST)
                        e.copy_(torch.where(filled, e, m))
        self._filled = {}


class BufferAverage:
    """The module's buffers as ``AveragedModel`` keeps them beside its averaged parameters.

    [Note: averaged buffers]
    Buffers are not chunked: every rank holds them whole, on the device, and they change in forward (BatchNorm's
    running statistics), not in the optimizer step. Lightning's ``EMAWeightAveraging`` (``use_buffers=True``, its
    default) averages them with the weights: ``decay * avg + (1 - decay) * buffer`` after each update, the first
    update a copy; with ``use_buffers=False`` ``AveragedModel`` copies them at each update instead. Either way its
    validation swaps them in with the averaged weights and the end of training copies them into the model. This
    keeps the same copy, one tensor per buffer on the buffer's own device, updated with the same expression
    (``get_ema_avg_fn``'s, so an integer buffer such as ``num_batches_tracked`` is rounded towards zero as there),
    and each rank averages its own buffers, as each DDP rank's ``AveragedModel`` does. Checkpoints carry the
    persistent ones (``ema_buffers`` beside the masters' layout, read by ``consolidate --ema``)."""

    def __init__(self, module: torch.nn.Module, *, average: bool) -> None:
        self.module = module
        self.average = average
        self.values: dict[str, torch.Tensor] = {}  # named_buffers() name -> its average (or its copy)

    def update(self, decay: float) -> None:
        first = not self.values
        for name, b in self.module.named_buffers():
            kept = self.values.get(name)
            if first or kept is None or not self.average or kept.shape != b.shape:
                self.values[name] = b.detach().clone()
            else:
                kept.copy_(decay * kept + (1 - decay) * b.detach())

    def swap(self) -> None:
        for name, b in self.module.named_buffers():
            kept = self.values.get(name)
            if kept is not None and kept.shape == b.shape:
                current = b.detach().clone()
                b.detach().copy_(kept)
                kept.copy_(current)

    def copy_to_module(self) -> None:
        for name, b in self.module.named_buffers():
            kept = self.values.get(name)
            if kept is not None and kept.shape == b.shape:
                b.detach().copy_(kept)

    def saved(self, keys: Any) -> dict[str, torch.Tensor]:
        """The values of the buffers among ``keys`` (a state_dict's buffer keys), on the host."""
        return {k: v.detach().cpu() for k, v in self.values.items() if k in keys}

    def load(self, values: dict[str, torch.Tensor]) -> None:
        """Saved values by buffer name (where the module still has that buffer), onto each buffer's device."""
        current = dict(self.module.named_buffers())
        if not self.values:  # buffers no saved value reaches start from the module's, as a first update would
            self.values = {n: b.detach().clone() for n, b in current.items()}
        for name, v in values.items():
            if name in current:
                self.values[name] = v.detach().to(device=current[name].device, dtype=current[name].dtype, copy=True)


class Extras:
    """Two ``ExtraShards`` carried through one repack: the optimizers' state and the EMA's, told apart by key."""

    def __init__(self, carrier: Any, ema: ShardedEMA) -> None:
        self.carrier, self.ema = carrier, ema

    def take(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        return {**self.carrier.take(chunk), **self.ema.take(chunk)}

    def give(self, param_index: int, pieces: dict[str, torch.Tensor], chunk: Chunk, offset: int) -> None:
        theirs = {k: v for k, v in pieces.items() if k != KEY}
        if theirs:
            self.carrier.give(param_index, theirs, chunk, offset)
        self.ema.give(param_index, pieces, chunk, offset)
