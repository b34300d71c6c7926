"""``bits``: the checksum a parameter read between steps is noted with ([Note: writes through .data]). Its bytes are
summed as 64-bit words where they lie whole and one by one at either end, so views at any offset, of any length and
dtype must still see a change in any one element."""

import pytest
import torch

from lightning_chunk.engine.memory.full_params import bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
@pytest.mark.parametrize(("offset", "numel"), [(0, 40), (1, 39), (3, 5), (1, 1), (2, 0), (5, 17)])
def test_a_change_in_any_one_element_changes_the_checksum(dtype, offset, numel):
    torch.manual_seed(0)
    flat = (torch.rand(64) * 100).to(dtype)
    before = bits(flat[offset : offset + numel])
    assert torch.equal(bits(flat.clone()[offset : offset + numel]), before)  # the same bits, another storage
    for i in range(numel):
        for new in (flat[offset + i] + 1, -flat[offset + i] - 1):  # another value; the sign bit alone in floats
            changed = flat.clone()
            changed[offset + i] = new
            assert not torch.equal(bits(changed[offset : offset + numel]), before), (i, new)


def test_a_strided_view_is_summed_too():
    torch.manual_seed(0)
    t = torch.randn(6, 8)
    before = bits(t[:, 1:].t())
    t[4, 5] += 1
    assert not torch.equal(bits(t[:, 1:].t()), before)
    assert bits(t[:, 1:].t()).shape == bits(t).shape  # one shape, as a check compares notes of either kind
