import pytest
import torch

from lightning_chunk.engine.chunks.packing import (
    ALIGN_NUMEL,
    ChunkKey,
    ChunkSpec,
    ParamSpec,
    Slot,
    build_layout,
    choose_chunk_numel,
    keep_slots,
    padding_waste,
)
from lightning_chunk.engine.errors import LayoutError

K0 = ChunkKey(0, True, torch.float32)
K1 = ChunkKey(1, True, torch.float32)
FROZEN = ChunkKey(0, False, torch.float32)
HALF = ChunkKey(0, True, torch.float16)


def specs(*items):
    return [ParamSpec(i, f"p{i}", n, k) for i, (n, k) in enumerate(items)]


def test_keys_never_share_a_chunk_and_order_is_kept():
    ps = specs((10, K0), (10, K1), (10, K0), (10, FROZEN), (10, HALF), (10, K0))
    layout = build_layout(ps, [0, 1, 2, 3, 4, 5], 100, world_size=1)
    for c in layout.chunks:
        assert len({ps[s.param_index].key for s in c.slots}) == 1
    k0 = next(c for c in layout.chunks if c.key == K0)
    assert [s.param_index for s in k0.slots] == [0, 2, 5]
    assert [s.offset for s in k0.slots] == [0, 16, 32]  # [Note: aligned parameters]


def test_every_parameter_starts_at_an_aligned_offset_and_the_gaps_count_as_padding():
    """A 3-element parameter no longer puts the ones after it at odd offsets (``torch.view_as_complex`` refused
    them; vectorised kernels take their scalar path)."""
    ps = specs((3, K0), (64, K0), (5, K0), (16, K0), (1, K0))
    layout = build_layout(ps, list(range(5)), 1000, world_size=2)
    (chunk,) = layout.chunks
    assert [s.offset for s in chunk.slots] == [0, 16, 80, 96, 112]
    assert all(s.offset % ALIGN_NUMEL == 0 for s in chunk.slots)
    assert chunk.capacity_numel == 114 and layout.padding_numel == 114 - 89
    # a parameter that fits only without its gap opens the next chunk
    assert [[s.param_index for s in c.slots] for c in build_layout(ps[:2], [0, 1], 70, 1).chunks] == [[0], [1]]


def test_capacity_padded_to_world_size_and_params_never_span():
    ps = specs((46, K0), (46, K0), (46, K0))
    layout = build_layout(ps, [2, 1, 0], 110, world_size=4)
    assert layout.capacity_numel == 112
    assert [[s.param_index for s in c.slots] for c in layout.chunks] == [[2, 1], [0]]
    # the last chunk of a key is trimmed to its contents, rounded up to the world size
    assert [c.capacity_numel for c in layout.chunks] == [112, 48]
    assert layout.padding_numel == (112 - 92) + 2


def test_small_groups_do_not_cost_a_whole_chunk():
    ps = specs((96, K0), (96, K0), (96, K0), (3, K1), (3, K1))
    layout = build_layout(ps, list(range(5)), 200, world_size=2)
    assert [(c.key, c.capacity_numel) for c in layout.chunks] == [(K0, 200), (K0, 96), (K1, 20)]


def test_parameter_larger_than_chunk_is_refused_with_sizes():
    with pytest.raises(LayoutError, match="'p1' has 50 elements, more than chunk_numel=40"):
        build_layout(specs((10, K0), (50, K0)), [0, 1], 40, world_size=1)


def test_chunk_size_search_picks_least_waste_and_respects_bounds():
    ps = specs(*[(96, K0)] * 12)
    order = list(range(12))
    best = choose_chunk_numel(ps, order, world_size=1, numel_min=150, numel_max=700, target_chunks=0)
    assert padding_waste(ps, order, best) == 0 and best % 96 == 0
    assert best == 672  # the largest zero-waste size within bounds (the tail is trimmed): fewer chunks
    capped = choose_chunk_numel(
        ps, order, world_size=1, numel_min=150, numel_max=700, max_payload_numel=450, target_chunks=0
    )
    assert capped <= 450 and padding_waste(ps, order, capped) == 0


def test_a_repack_keeps_the_chunk_size_where_it_pads_little_more():
    """[Note: the chunk size a repack keeps]: the capacity the chunks have is chosen again where it is within 1% of the
    search's size, pads at most a thousandth of the model more and is within the same bounds; else the search's."""
    ps = specs(*[(96_000, K0)] * 12)
    order = list(range(12))
    kw = dict(world_size=1, numel_min=150_000, numel_max=700_000, target_chunks=0)
    assert choose_chunk_numel(ps, order, **kw) == 672_000  # no padding
    assert padding_waste(ps, order, 672_016) == 16  # 16 elements of 1.152M: kept
    assert choose_chunk_numel(ps, order, **kw, keep=672_016) == 672_016
    assert padding_waste(ps, order, 675_000) == 3_000  # near in size, but 0.26% more padding
    assert choose_chunk_numel(ps, order, **kw, keep=675_000) == 672_000
    assert padding_waste(ps, order, 576_000) == 0  # no padding, but 14% smaller: more chunks
    assert choose_chunk_numel(ps, order, **kw, keep=576_000) == 672_000
    capped = choose_chunk_numel(ps, order, **kw, max_payload_numel=500_000, keep=672_016)  # over a device limit's cap
    assert capped <= 500_000
    two = dict(kw, world_size=2)
    assert choose_chunk_numel(ps, order, **two, keep=672_016) == 672_016
    assert choose_chunk_numel(ps, order, **two, keep=672_017) == 672_000  # not a multiple of the world size


def test_chunk_size_search_refuses_when_the_largest_param_cannot_fit():
    with pytest.raises(LayoutError, match="largest parameter has 500 elements"):
        choose_chunk_numel(specs((500, K0)), [0], world_size=1, numel_min=1, numel_max=1000, max_payload_numel=100)


def test_chunk_size_search_takes_a_parameter_larger_than_chunk_numel_max():
    """A 7B Llama's embedding (32000 x 4096 = 131M elements) is over the default chunk_numel_max (2**26): the bound
    rises to the parameter, a user who set nothing is not refused; the device limit stays a hard bound."""
    ps = specs((1310, K0), *[(200, K0)] * 40)
    order = list(range(len(ps)))
    best = choose_chunk_numel(ps, order, world_size=2, numel_min=100, numel_max=671)
    assert best >= 1310 and len(build_layout(ps, order, best, world_size=2).chunks) > 1
    with pytest.raises(LayoutError, match="largest parameter has 1310 elements"):
        choose_chunk_numel(ps, order, world_size=2, numel_min=100, numel_max=671, max_payload_numel=1000)


def test_chunk_size_search_keeps_the_model_in_several_chunks():
    # 32 "blocks" of 3 params each: without the granularity bound, one chunk of the whole
    # model wastes nothing (the tail is trimmed) and would win the tie.
    ps = specs(*[(n, K0) for _ in range(32) for n in (304, 96, 96)])
    order = list(range(len(ps)))
    whole = choose_chunk_numel(ps, order, world_size=1, numel_min=1, numel_max=20_000, target_chunks=0)
    assert whole == 15872
    best = choose_chunk_numel(ps, order, world_size=1, numel_min=1, numel_max=20_000)
    assert best <= 2 * 15872 // 32 and padding_waste(ps, order, best) == 0
    assert len(build_layout(ps, order, best, world_size=1).chunks) >= 16
    # numel_min is a floor the granularity bound never overrides
    assert choose_chunk_numel(ps, order, world_size=1, numel_min=4000, numel_max=20_000) >= 4000


def test_a_chunk_that_holds_what_it_held_keeps_its_slots_and_the_rest_follow_the_new_order():
    """[Note: a chunk's parameters in their old places]: as in a Llama block, p1 is registered before p2 and p3 but
    used after them; the first chunk holds the same parameters in either order and keeps its old slots (and the
    order its old order), so a repack can leave it as it was. The second chunk's members changed: it is the new one."""
    ps = specs((16, K0), (16, K0), (64, K0), (64, K0), (64, K0), (16, K0))
    old = build_layout(ps, [0, 1, 2, 3, 4, 5], 160, world_size=1)
    new = build_layout(ps, [0, 2, 3, 1, 5, 4], 160, world_size=1)
    assert [[s.param_index for s in c.slots] for c in old.chunks] == [[0, 1, 2, 3], [4, 5]]
    assert [[s.param_index for s in c.slots] for c in new.chunks] == [[0, 2, 3, 1], [5, 4]]
    kept = keep_slots(new, old)
    assert kept.chunks[0] == old.chunks[0] and kept.chunks[1] == old.chunks[1]  # both hold what they held
    assert kept == old
    moved = build_layout(ps, [0, 2, 3, 4, 1, 5], 160, world_size=1)  # p4 now comes before p1: the chunks differ
    assert [[s.param_index for s in c.slots] for c in moved.chunks] == [[0, 2, 3], [4, 1, 5]]
    kept = keep_slots(moved, old)  # the first holds most of what it held, where it held it; p1's place is padding
    assert kept.chunks[0] == ChunkSpec(0, K0, tuple(s for s in old.chunks[0].slots if s.param_index != 1), 160)
    assert kept.chunks[1] == moved.chunks[1]  # the last chunk is trimmed to another capacity: packed anew
    swapped = build_layout(ps, [2, 3, 0, 1, 4, 5], 160, world_size=1)  # same chunks, the first reordered
    kept = keep_slots(swapped, old)
    assert kept.chunks == old.chunks and kept.order == (0, 1, 2, 3, 4, 5)
    assert keep_slots(build_layout(ps, [0, 2, 3, 1, 5, 4], 160, world_size=2), old).chunks[0].slots[1].param_index == 2


def test_a_chunk_whose_small_parameters_cross_its_bounds_keeps_the_others_in_their_old_slots():
    """[Note: a chunk's parameters in their old places]: blocks of a norm (16), a weight (64) and a norm (16) used
    after the next block's first norm, two blocks a chunk. First-use order moves each chunk's last norm into the next
    chunk and the next chunk's first norm into it: no chunk holds what it held. Each keeps what stayed where it was,
    and the newcomer takes the place of the one that left."""
    ps = specs(*[(n, K0) for _ in range(6) for n in (16, 64, 16)])
    first_use = [0, 1, 3, 2, 4, 6, 5, 7, 9, 8, 10, 12, 11, 13, 15, 14, 16, 17]
    old = build_layout(ps, list(range(18)), 192, world_size=2)
    new = build_layout(ps, first_use, 192, world_size=2)
    assert [[s.param_index for s in c.slots] for c in new.chunks] == [
        [0, 1, 3, 2, 4, 6], [5, 7, 9, 8, 10, 12], [11, 13, 15, 14, 16, 17]]  # fmt: skip
    kept = keep_slots(new, old)
    at = [{s.param_index: s.offset for s in c.slots} for c in kept.chunks]
    assert at == [
        {0: 0, 1: 16, 2: 80, 3: 96, 4: 112, 6: 176},  # p6 where p5 was
        {5: 0, 7: 16, 8: 80, 9: 96, 10: 112, 12: 176},
        {11: 0, 13: 16, 14: 80, 15: 96, 16: 112, 17: 176},
    ]
    assert kept.order == (0, 1, 2, 3, 4, 6, 5, 7, 8, 9, 10, 12, 11, 13, 14, 15, 16, 17)
    # where what stayed is less than half of it, a chunk is packed anew; so is one whose newcomer finds no room
    assert keep_slots(build_layout(ps, list(range(17, -1, -1)), 192, world_size=2), old).chunks[0].slots[0].offset == 0
    tight = specs((16, K0), (96, K0), (16, K0), (32, K0))
    old = build_layout(tight, [0, 1, 2, 3], 128, world_size=1)
    new = build_layout(tight, [1, 3, 0, 2], 128, world_size=1)
    assert new.chunks[0] == ChunkSpec(0, K0, (Slot(1, 0, 0, 96), Slot(3, 0, 96, 32)), 128)
    assert keep_slots(new, old) == new  # p1 kept at 16 leaves 16 elements either side of it: p3 fits in neither
