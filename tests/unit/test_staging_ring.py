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


def test_with_torch_s_pinning_too_every_staged_copy_of_a_run_takes_a_slice_of_one_block(monkeypatch):
    """``pin_memory=True`` on a GPU (CUDA faked): before, each gradient staged for a conversion or an add asked torch's
    pinned allocator for a block of its own, rounded to a power of two; now one block of ``max_staged_bytes`` is
    asked for once, and the copies land right through it."""
    from lightning_chunk.engine.tiers import offload

    made: list[int] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(offload, "torch_pinned", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))

    class Landed:  # a copy done at once
        def synchronize(self) -> None:
            pass

    class Copies(offload.GradOffload):
        def _launch(self, to, src):
            to.copy_(src)
            return Landed()

    off = Copies(torch.device("cuda"), pinned=True, max_staged_bytes=4096)
    off._crosses = lambda dst, src: True  # type: ignore[method-assign]
    for step in range(3):
        dst = [torch.zeros(300) for _ in range(8)]
        src = [torch.randn(300, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(8)]
        for d, s in zip(dst, src, strict=True):
            off.copy(d, s.bfloat16(), add=False)  # converted on the host: staged
            off.copy(d, s.bfloat16(), add=True)  # added on the host: staged
        off.drain()
        for d, s in zip(dst, src, strict=True):
            assert torch.equal(d, 2 * s.bfloat16().float())
    assert made == [4096] and off.ring is not None and len(off.ring) == 0
