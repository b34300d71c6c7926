"""One rank of an engine run whose warm-up ends in a repack under a device limit; prints how many bytes of parameter
values, gradients and optimizer state the repack held on the host at once, against this rank's shards.

    RANK=.. WORLD_SIZE=.. python tests/scale/repack_worker.py OUTDIR PLACEMENT:LIMIT_BYTES [...]
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import lightning_chunk.engine.chunks.repack as repack  # noqa: E402
from lightning_chunk.engine import ChunkConfig, ChunkEngine, Collectives  # noqa: E402
from tests.engine_steps import step  # noqa: E402

peak = {"held": 0}
_init, _load, _stage = repack.OldChunks.__init__, repack.OldChunks._load, repack.OldChunks._stage


def held(self) -> int:
    tensors = [*self._values.values(), *self._grads.values(), *(t for e in self._extra.values() for t in e.values())]
    for master, grad, extra in self._staged.values():
        tensors += [master, *([grad] if grad is not None else []), *extra.values()]
    # views of a gathered chunk keep all of it ([Note: reading an old chunk in place]): count each buffer once, whole
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def watch(fn):
    def wrapped(self, *a, **k):
        out = fn(self, *a, **k)
        peak["held"] = max(peak["held"], held(self))
        return out

    return wrapped


repack.OldChunks.__init__, repack.OldChunks._load, repack.OldChunks._stage = watch(_init), watch(_load), watch(_stage)
gathered: list[int] = []  # the old chunks a repack read whole (all-gathered with several ranks)
repack.OldChunks._load = lambda self, c, _load=repack.OldChunks._load: (  # noqa: E731
    gathered.append(c.chunk_id) if c.chunk_id not in self.loaded else None,
    _load(self, c),
)[1]


class Reversed(nn.Module):
    """Registered in the reverse of its use order: the warm-up repacks into use order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(16))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = layer(x)
        return x


class Ordered(Reversed):
    """Used in the order it is registered in: the warm-up's layout is the one it had."""

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run(out: Path, rank: int, placement: str, limit: int) -> None:
    peak["held"] = 0
    gathered.clear()
    torch.manual_seed(0)
    ordered = placement.startswith("ordered-")
    placement = placement.removeprefix("ordered-")
    model = Ordered() if ordered else Reversed()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    eng = ChunkEngine(
        model,
        [opt],
        config=ChunkConfig(placement=placement, device_memory_limit=limit, chunk_numel=65536),
        device=torch.device("cpu"),
        collectives=Collectives(timeout_s=30),
    )
    for _ in range(2):  # the warm-up and its repack; a step in the new layout (Adam's state exists from here on)
        step(eng, model, opt, torch.randn(8, 256))
    shards = sum(c.shard_numel * 4 for c in eng.manager.chunks)
    name = f"{'ordered-' if ordered else ''}{placement}"
    report = dict(held=peak["held"], shards=shards, gathered=len(gathered), chunks=len(eng.manager.chunks))
    report["tiers"] = sorted({c.shard_tier.name for c in eng.manager.chunks})
    (out / f"repack.{name}.{rank}.json").write_text(json.dumps(report))
    eng.teardown(materialize=False)


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for case in sys.argv[2:]:
        placement, limit = case.split(":")
        run(Path(sys.argv[1]), int(os.environ["RANK"]), placement, int(limit))
    dist.destroy_process_group()
