"""Optimizers whose update reads whole parameters, stepped by the engine over this rank's pieces.

[Note: optimizers that need whole parameters]
The optimizer steps flat pieces of this rank's master shards ([Note: per-parameter views of the master shards] in
``binding.py``). That is exact for an element-wise update, and wrong for two of torch's optimizers whose update of
an element reads the rest of its parameter: ``Muon`` orthogonalizes each matrix ([Note: Muon over sharded
matrices] in ``muon.py``), ``Adafactor`` factors each matrix's second moment into row and column means and scales
each update by norms over the parameter ([Note: Adafactor over sharded matrices] in ``adafactor.py``). Stepped on
flat pieces, Muon refuses a 1-D tensor and Adafactor silently takes every matrix for a vector: it keeps a full
second moment and normalises by the piece, another optimizer. (DeepSpeed's ZeRO and FSDP's flat parameters hand
the optimizer flat shards too.)

So the engine runs these updates itself, chunk by chunk in chunk order. For each chunk holding such parameters,
every rank takes part in one all-gather of the pieces the update reads (``gather_whole``; none on one rank, where a
piece is the whole parameter), each rank computes the whole update of each parameter it holds a piece of with
torch's own functions, and keeps its own slice. A parameter cut at a shard boundary is computed by each rank that
holds a piece, from the same inputs, to the same bits, so the result is torch's step on whole parameters to the bit.
``optimizer.step()`` then runs over no view, so its hooks and an LR scheduler's count see one step.

On several ranks both step after backward: a chunk's gather is a collective the autograd thread should not wait in
(``check_optimizer`` refuses ``step_in_backward=True`` there, and ``step_in_backward=None`` chooses after). On one
rank nothing is gathered, so a chunk steps in backward as with Adam ([Note: stepping in backward]), its parameters
whole, and gives its gradient shard back: Adafactor then holds 4 bytes a parameter in fp32 (the master; its state
is a row and a column a matrix) where AdamW holds 12, and 6 in bf16-mixed where AdamW holds 14. Neither runs on the
disk tier, whose chunks step one at a time through ``step()``: a ``host_memory_limit`` is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..chunks.repack import piece_range

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk, TensorInfo
    from ..memory.manager import ChunkManager
    from .binding import OptimizerBinding

# what each reads whole, as the messages say it
_WHOLE = {
    "Muon": "orthogonalizes each matrix whole",
    "Adafactor": "factors each matrix's second moment by rows and columns",
}


def needs_whole(optimizer: torch.optim.Optimizer) -> str | None:
    """``"torch.optim.X, which ..."`` for torch's optimizers the engine steps whole, else ``None``."""
    name = type(optimizer).__name__
    if name in _WHOLE and isinstance(optimizer, getattr(torch.optim, name, ())):
        return f"torch.optim.{name}, which {_WHOLE[name]}"
    return None


def gather_whole(
    manager: ChunkManager,
    chunk: Chunk,
    pieces: dict[int, tuple[TensorInfo, list[torch.Tensor]]],
    count: int,
    dtype: torch.dtype | None = None,
) -> dict[int, list[torch.Tensor]]:
    """For each parameter index in ``pieces`` (its tensor info and ``count`` flat pieces this rank holds: values,
    gradient, state), the ``count`` whole tensors in the parameter's shape. One rank: the pieces themselves, viewed
    (they are whole). Several: one all-gather of the chunk's ``count`` stacked shards, every rank taking part with
    zeros where it holds nothing, in ``dtype`` (the master's by default); the tensors returned are scratch on the
    collectives' device."""
    comm = manager.comm
    if comm.world_size == 1:
        return {i: [p.view(t.shape) for p in ps] for i, (t, ps) in pieces.items()}
    lo, _ = chunk.shard_range
    n, device = chunk.shard_numel, comm.tensor_device()
    shard = torch.zeros(count, n, dtype=dtype or chunk.master_dtype, device=device)
    for t, ps in pieces.values():
        a, b = piece_range(chunk, t.offset, t.numel)
        for k, p in enumerate(ps):
            shard[k, a - lo : b - lo].copy_(p)
    out = torch.empty(comm.world_size, count, n, dtype=shard.dtype, device=device)
    comm.all_gather(out.view(-1), shard.view(-1), chunk=chunk.chunk_id).wait()

    def whole(t: TensorInfo, k: int) -> torch.Tensor:
        """Row ``k`` of ``t``'s elements, laid out rank by rank as the chunk is: a view where one rank's shard
        holds them all, else a copy of this parameter's alone (not of the whole chunk)."""
        end = t.offset + t.numel
        parts = [out[r, k, max(t.offset - r * n, 0) : min(end - r * n, n)] for r in range(t.offset // n, -(-end // n))]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(t.shape)

    return {i: [whole(t, k) for k in range(count)] for i, (t, _) in pieces.items()}


def own_slice(chunk: Chunk, t: TensorInfo, whole: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``whole`` (a tensor in parameter ``t``'s shape), flat like its view."""
    a, b = piece_range(chunk, t.offset, t.numel)
    return whole.reshape(-1)[a - t.offset : b - t.offset]


class WholeStep:
    """One optimizer's update, computed whole chunk by chunk: each subclass steps one chunk's parameters."""

    optimizer_class: type[torch.optim.Optimizer]  # the torch optimizer a subclass steps
    # the keys of its state that hold a whole parameter's state, kept beside ``step`` on every rank holding a piece
    # (checkpoints, repacks and the plain format carry them whole); the rest is per element
    state_keys: frozenset[str] = frozenset()

    def __init__(self, binding: OptimizerBinding) -> None:
        self.binding = binding
        self.regroup()

    def regroup(self) -> None:
        """Each parameter's param group (again after a group was added while training)."""
        self.group_of = {i: k for k, idx in enumerate(self.binding.group_params) for i in idx}

    @torch.no_grad()
    def step(self, views: dict[int, torch.Tensor], chunks: Sequence[Chunk] | None = None) -> None:
        """Step the parameters of ``chunks`` (every chunk: ``None``) that have a gradient; every rank calls it with
        the same chunks, in chunk order (the gathers pair up)."""
        for chunk in self.binding.manager.chunks if chunks is None else chunks:
            tensors = [t for t in chunk.tensors if t.slot.param_index in self.group_of]
            if tensors:
                self.step_chunk(chunk, tensors, views)

    def step_chunk(self, chunk: Chunk, tensors: list[TensorInfo], views: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError
