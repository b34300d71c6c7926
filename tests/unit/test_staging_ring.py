"""[Note: staging in a ring]: slices of one buffer, given back first in, first out, never overlapping."""

import random
from collections import deque

import pytest
import torch

from lightning_chunk.engine.tiers.staging_ring import ALIGN, StagingRing


def test_slices_never_overlap_and_a_slice_that_fits_an_empty_ring_is_always_given():
    """Copies of random sizes staged and drained as GradOffload does: each slice keeps what was written into it
    until it is given back, every slice starts on ``ALIGN``, and with nothing in use any slice that fits is given."""
    made = []
    ring = StagingRing(64 * ALIGN + 100, lambda n: made.append(torch.empty(n, dtype=torch.uint8)) or made[-1])
    assert ring.capacity == 64 * ALIGN
    rng = random.Random(0)
    live: deque[tuple[torch.Tensor, float]] = deque()
    wrapped = 0
    for i in range(3000):
        dtype = rng.choice([torch.float32, torch.bfloat16])
        numel = rng.randint(1, 20 * ALIGN // dtype.itemsize)
        while (t := ring.take(numel, dtype)) is None:
            assert live, "nothing in use, yet no room"
            live.popleft()
            ring.give_back()
        assert (t.data_ptr() - made[0].data_ptr()) % ALIGN == 0 and t.numel() == numel and t.dtype == dtype
        wrapped += t.data_ptr() == made[0].data_ptr() and bool(live)
        t.fill_(i % 200)
        live.append((t, float(i % 200)))
        for s, v in live:
            assert bool((s == v).all()), "a slice in use was overwritten"
        while live and rng.random() < 0.4:
            live.popleft()
            ring.give_back()
        assert len(ring) == len(live)
    assert len(made) == 1 and wrapped > 100  # one buffer, made once; slices wrapped to its start while in use


def test_a_slice_larger_than_the_ring_is_not_given():
    ring = StagingRing(4 * ALIGN, lambda n: torch.empty(n, dtype=torch.uint8))
    assert not ring.fits(4 * ALIGN + 1) and ring.take(ALIGN + 1, torch.float32) is None
    assert ring.fits(4 * ALIGN) and ring.take(ALIGN, torch.float32) is not None


@pytest.mark.parametrize("first", [1, 3])
def test_the_start_is_used_only_once_the_oldest_slice_left_room_there(first):
    ring = StagingRing(4 * ALIGN, lambda n: torch.empty(n, dtype=torch.uint8))
    a = ring.take(first * ALIGN, torch.uint8)
    b = ring.take((4 - first) * ALIGN, torch.uint8)
    assert a is not None and b is not None and ring.take(1, torch.uint8) is None  # full
    ring.give_back()  # a's room at the start
    c = ring.take(first * ALIGN, torch.uint8)
    assert c is not None and c.data_ptr() == a.data_ptr()
    assert ring.take(1, torch.uint8) is None  # b and c fill it again
