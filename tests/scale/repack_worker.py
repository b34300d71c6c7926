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


class LateNorms(nn.Module):
    """Blocks whose second norm is used after the next block's first (Llama's registration): first-use order moves
    norms across the bounds of chunks of three and a half blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(first=nn.LayerNorm(64), late=nn.LayerNorm(64), linear=nn.Linear(64, 64)))
            for _ in range(16)
        )

    def forward(self, x):
        for b in self.blocks:
            x = b["late"](x + b["linear"](b["first"](x)))
        return x


def shifted(out: Path, rank: int) -> None:
    """[Note: a chunk that keeps its buffers] on several ranks: the warm-up's repack keeps the host chunks whose
    norms crossed their bounds, all-gathering each only to copy out what left it; the same bits as rebuilding them."""
    from lightning_chunk.engine.chunks.kept import pair_chunks

    report: dict = {}
    for name, pairing in (("kept", pair_chunks), ("rebuilt", lambda *a: {})):
        repack.pair_chunks = pairing
        gathered.clear()
        torch.manual_seed(0)
        model = LateNorms()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        config = ChunkConfig(placement="host", chunk_numel=16384, check_invariants=True)
        comm = Collectives(timeout_s=30)
        eng = ChunkEngine(model, [opt], config=config, device=torch.device("cpu"), collectives=comm)
        for i in range(3):
            step(eng, model, opt, torch.randn(8, 64, generator=torch.Generator().manual_seed(rank + 2 * i)))
        stats = eng.memory_stats()
        report[name] = dict(kept=stats["kept_chunks"], repacked=stats["repacked_chunks"], loaded=len(gathered))
        report[name]["all_gather_bytes"] = stats["all_gather_bytes"]  # the steps' and the repack's
        report[name]["state"] = {k: v.clone() for k, v in eng.full_state_dict().items()}
        eng.teardown(materialize=False)
    repack.pair_chunks = pair_chunks
    a, b = report["kept"].pop("state"), report["rebuilt"].pop("state")
    report["same"] = all(torch.equal(v, b[k]) for k, v in a.items())
    (out / f"repack.shifted.{rank}.json").write_text(json.dumps(report))


def moved(out: Path, rank: int) -> None:
    """[Note: a chunk that keeps its buffers] on several ranks, where parameters move within the chunks that keep their
    buffers: two weights of each chunk trade slots at the warm-up and trade back at a repack after Adam made its
    state. The same bits as rebuilding every chunk."""
    from lightning_chunk.engine.chunks.kept import pair_chunks
    from lightning_chunk.engine.runtime import warmup
    from tests.engine_steps import InOrder, traded_at_the_warm_up

    keep_slots, report, states = warmup.keep_slots, {}, {}
    for name, pairing in (("kept", pair_chunks), ("rebuilt", lambda *a: {})):
        repack.pair_chunks, warmup.keep_slots = pairing, traded_at_the_warm_up()
        torch.manual_seed(0)
        model = nn.Sequential(*(InOrder(64) for _ in range(4)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        config = ChunkConfig(placement="host", chunk_numel=64 * 64 + 5 * 64, check_invariants=True)
        comm = Collectives(timeout_s=30)
        eng = ChunkEngine(model, [opt], config=config, device=torch.device("cpu"), collectives=comm)
        for i in range(4):
            if i == 2:
                eng.warm_up.replan(warmup.Replan.REQUIRES_GRAD)  # after Adam made its state: traded back
            step(eng, model, opt, torch.randn(8, 64, generator=torch.Generator().manual_seed(rank + 2 * i)))
        report[name] = eng.memory_stats()["kept_chunks"]
        states[name] = {k: v.clone() for k, v in eng.full_state_dict().items()}
        eng.teardown(materialize=False)
    repack.pair_chunks, warmup.keep_slots = pair_chunks, keep_slots
    report["same"] = all(torch.equal(v, states["rebuilt"][k]) for k, v in states["kept"].items())
    (out / f"repack.moved.{rank}.json").write_text(json.dumps(report))


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
        if case in ("shifted", "moved"):
            (shifted if case == "shifted" else moved)(Path(sys.argv[1]), int(os.environ["RANK"]))
            continue
        placement, limit = case.split(":")
        run(Path(sys.argv[1]), int(os.environ["RANK"]), placement, int(limit))
    dist.destroy_process_group()
