"""Sharded checkpoints: every rank writes its own shards in parallel; any world size loads them.

[Note: the checkpoint layout]
A checkpoint is a directory ``NAME.ckpt/`` holding

- ``.metadata`` and ``__<rank>_<group>_0.distcp``: a ``torch.distributed.checkpoint`` (DCP) save in which
  each rank wrote, for every chunk, its shard of the fp32 master (``chunk.<c>.master``) and of
  each per-element optimizer state (``chunk.<c>.optim<o>.<key>``, e.g. Adam's ``exp_avg``), as
  DTensors sharded on dim 0 over the ranks (plain tensors with one rank), a chunk or two a file
  ([Note: a save streams the shards] in shard_writer.py);
- ``meta.pt``, written by rank 0 last: whatever the caller passed (Lightning: loops, callbacks, LR
  schedulers, precision state such as the loss scale), the library version, the chunk layout that
  maps each parameter to a chunk and offset, the buffers, the optimizers' param groups and their
  scalar state (``step``). The engine does not interpret the caller's part; ``lightning_chunk/consolidate.py``
  knows how a Lightning checkpoint keeps the model and the optimizers.

No rank ever holds more than its own shards plus one chunk. A save goes to ``.NAME.ckpt.partial``
next to the target and is renamed into place only after every rank's shards and ``meta.pt`` are
on disk: a save that dies half-way leaves the previous checkpoint untouched, and the dot-named
partial directory is never taken for a checkpoint (``ckpt_path="last"`` matches ``last*.ckpt``).

Loading never assumes the saver's layout or world size: it streams the saved chunks one at a
time (each rank reads whole chunks, ``no_dist``), and every rank copies out the pieces of each
parameter that its *own* current layout assigns to it, optimizer state included. Peak memory is
one saved chunk beyond this rank's shards.
"""

from __future__ import annotations

from ..errors import CheckpointError
from .background_save import BackgroundSave
from .checkpoint_dir import (
    DCP_INDEX,
    FORMAT_VERSION,
    META,
    check_checkpoint_dir,
    check_compatible,
    is_sharded_checkpoint,
    partial_path,
    read_meta,
    weights_key,
)
from .load import load_sharded, offered_state_dict
from .save import CheckpointSaveError, Selection, placeholder_state_dict, save_sharded, when_saved
from .saved_chunks import KEY, iter_saved_chunks, rank_regions, saved_state_dtype

__all__ = [
    "DCP_INDEX",
    "FORMAT_VERSION",
    "KEY",
    "META",
    "BackgroundSave",
    "CheckpointError",
    "CheckpointSaveError",
    "Selection",
    "check_checkpoint_dir",
    "check_compatible",
    "is_sharded_checkpoint",
    "iter_saved_chunks",
    "load_sharded",
    "offered_state_dict",
    "partial_path",
    "placeholder_state_dict",
    "rank_regions",
    "read_meta",
    "save_sharded",
    "saved_state_dtype",
    "weights_key",
    "when_saved",
]
