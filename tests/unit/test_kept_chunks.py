"""[Note: a chunk's parameters in their old places] and [Note: a chunk that keeps its buffers]: what a repack after
the warm-up keeps of the chunks it replaces."""

import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.chunks import packing, repack
from lightning_chunk.engine.runtime import warmup
from tests.engine_steps import InOrder, traded_at_the_warm_up
from tests.unit.test_engine import assert_as_plain, steps_beside_plain


class NormAfter(nn.Module):
    """A block as Llama registers it: both norms before the attention, the second used after it."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.input_norm, self.post_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.o = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        h = x + self.o(torch.relu(self.q(self.input_norm(x))))
        return h + self.post_norm(h)


def test_chunks_the_warm_up_only_reorders_inside_are_left_as_they_are():
    """[Note: a chunk's parameters in their old places]: one block a chunk, in registration order and in first-use
    order alike, but each block's second norm moves within its chunk; the repack rebuilt every chunk, and kept none
    of its buffers. Now the warm-up leaves the layout and every buffer as they were, and training is as exact."""
    torch.manual_seed(0)
    m, ref = nn.Sequential(*(NormAfter() for _ in range(3))), nn.Sequential(*(NormAfter() for _ in range(3)))
    ref.load_state_dict(m.state_dict())
    opt, oref = torch.optim.Adam(m.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    block = sum(-(-p.numel() // 16) * 16 for p in m[0].parameters())  # [Note: aligned parameters]
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=block, check_invariants=True))
    layout = eng.manager.layout
    buffers = [c.master.data_ptr() for c in eng.manager.chunks]
    steps_beside_plain(eng, m, opt, ref, oref, steps=3, width=16)
    assert eng.warmed_up and len(layout.chunks) == 3
    assert eng.manager.layout == layout and [c.master.data_ptr() for c in eng.manager.chunks] == buffers
    assert_as_plain(eng, ref)


def late_norms(eng_config: ChunkConfig, steps: int = 4):
    """Six ``NormAfter`` blocks on an engine under ``eng_config`` beside their plain twin: the engine, its set-up
    chunks' master buffers, the twin."""
    torch.manual_seed(0)
    m, ref = nn.Sequential(*(NormAfter() for _ in range(6))), nn.Sequential(*(NormAfter() for _ in range(6)))
    ref.load_state_dict(m.state_dict())
    opt, oref = torch.optim.Adam(m.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=eng_config)
    buffers = {c.master.data_ptr() for c in eng.manager.chunks}
    steps_beside_plain(eng, m, opt, ref, oref, steps=steps, width=16)
    return eng, buffers, ref


def test_chunks_whose_small_parameters_cross_their_bounds_keep_their_buffers(monkeypatch):
    """A block and a bit a chunk: first-use order moves a block's second norm into the next chunk and the next
    block's out of it, so no chunk holds what it held, and the repack rebuilt every one. Now each keeps the old
    chunk's buffers and slots for what stayed, the norms that came are written where the ones that left were (their
    values and the warm-up step's gradients), and training is bit for bit what rebuilding them gave."""
    config = ChunkConfig(placement="host", chunk_numel=700, check_invariants=True)
    eng, buffers, ref = late_norms(config)
    before = [[s.param_index for s in c.slots] for c in eng.manager.layout.chunks]
    stats = eng.memory_stats()
    assert stats["repacked_chunks"] == 6 and stats["kept_chunks"] == 5  # the last, trimmed to its own size: anew
    assert sum(c.master.data_ptr() in buffers for c in eng.manager.chunks) == 5
    assert_as_plain(eng, ref)
    kept = eng.full_state_dict()
    monkeypatch.setattr(repack, "pair_chunks", lambda *a: {})  # every chunk rebuilt, as before
    again, _, _ = late_norms(config)
    assert [[s.param_index for s in c.slots] for c in again.manager.layout.chunks] == before
    assert again.memory_stats()["kept_chunks"] == 0
    assert all(torch.equal(v, again.full_state_dict()[k]) for k, v in kept.items())


def test_the_warm_up_keeps_the_automatic_chunk_size_and_so_the_chunks_buffers(monkeypatch):
    """[Note: the chunk size a repack keeps]: 12 blocks of width 384 (3.6M parameters) with the default chunk-size
    bounds, about six blocks a chunk. Chosen again for first-use order, where each block's second norm moved, the
    least-padding size was 2,081,280 elements against the set-up's 2,082,048, so no chunk could keep its buffers and
    the repack rebuilt both. Now the set-up's size stays, which pads a few elements more, and the first chunk keeps
    its buffers (the last, trimmed to its contents, is built anew); training is as exact."""

    def fit():
        torch.manual_seed(0)
        m, ref = (nn.Sequential(*(NormAfter(384) for _ in range(12))) for _ in range(2))
        ref.load_state_dict(m.state_dict())
        opt, oref = torch.optim.Adam(m.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
        eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", check_invariants=True))
        set_up = eng.manager.layout.capacity_numel
        buffers = {c.master.data_ptr() for c in eng.manager.chunks}
        steps_beside_plain(eng, m, opt, ref, oref, steps=3, width=384)
        assert eng.warmed_up
        assert_as_plain(eng, ref)
        in_place = sum(c.master.data_ptr() in buffers for c in eng.manager.chunks)
        return set_up, eng.manager.layout.capacity_numel, eng.memory_stats()["kept_chunks"], in_place

    assert fit() == (2082048, 2082048, 1, 1)
    monkeypatch.setattr(packing, "KEEP_PADDING", -1.0)  # the search's size, as before
    assert fit()[:3] == (2082048, 2081280, 0)


def test_a_kept_chunk_size_that_does_not_fit_gives_way_to_the_searchs(monkeypatch):
    """[Note: the chunk size a repack keeps]: where the kept size's layout does not fit the limit, the search's own
    size at the same bound is tried before any smaller one (the kept size is a few elements larger: halving from it
    skipped the search's size, which may fit)."""
    torch.manual_seed(0)
    m = nn.Sequential(*(NormAfter(384) for _ in range(12)))
    eng = ChunkEngine(m, [torch.optim.Adam(m.parameters())], config=ChunkConfig(device_memory_limit=1 << 30))
    first_use = [8 * b + i for b in range(12) for i in (0, 1, 4, 5, 6, 7, 2, 3)]  # each block's second norm last
    assert eng.layouts.choose(first_use, None, keep=2082048).capacity_numel == 2082048
    fits = eng.layouts.working_bytes
    monkeypatch.setattr(
        eng.layouts,
        "working_bytes",
        lambda layout, trace: 1 << 31 if layout.capacity_numel == 2082048 else fits(layout, trace),
    )
    assert eng.layouts.choose(first_use, None, keep=2082048).capacity_numel == 2081280


def test_parameters_moved_within_a_chunk_that_keeps_its_buffers_move_their_values(monkeypatch):
    """[Note: a chunk that keeps its buffers]: a new chunk keeps an old one's buffers where at least half of both are
    the same parameters in the same slots; the others it holds are written into their slots. It counted as staying
    every parameter the old chunk held, also one at another offset, so that one took whatever the old buffer held
    there: another parameter's values, and its Adam moments (a CLIP under a tight limit, whose second trace moved a
    norm within a chunk, trained to other weights, 1.1 apart). Here the warm-up's repack trades two norms' slots in
    every chunk, and a later repack (with Adam's state) trades them back: training stays as plain PyTorch's."""
    torch.manual_seed(0)
    m, ref = nn.Sequential(*(InOrder() for _ in range(3))), nn.Sequential(*(InOrder() for _ in range(3)))
    ref.load_state_dict(m.state_dict())
    opt, oref = torch.optim.Adam(m.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    block = sum(-(-p.numel() // 16) * 16 for p in m[0].parameters())  # [Note: aligned parameters]
    monkeypatch.setattr(warmup, "keep_slots", traded_at_the_warm_up())
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=block, check_invariants=True))
    set_up = eng.manager.layout
    steps_beside_plain(eng, m, opt, ref, oref, steps=2, width=16)
    traded = eng.manager.layout
    assert traded != set_up and eng.memory_stats()["kept_chunks"] == 3
    assert_as_plain(eng, ref)
    eng.warm_up.replan(warmup.Replan.REQUIRES_GRAD)  # a repack after Adam made its state: traded back
    assert eng.manager.layout == set_up and eng.memory_stats()["kept_chunks"] == 6
    steps_beside_plain(eng, m, opt, ref, oref, steps=2, width=16)
    assert_as_plain(eng, ref)
