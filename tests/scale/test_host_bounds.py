"""Host memory a rank holds in each phase, bounded by its own share, at several ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import AS_NCCL
from tests.faults.common import Ranks

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

WORKER = Path(__file__).with_name("repack_worker.py")
CHUNK_BYTES = 65536 * 4  # the worker's chunks: 65,536 fp32 elements


@pytest.mark.parametrize("world,cases", [(2, {"auto": 4_000_000, "device": 12_000_000}), (4, {"auto": 2_000_000})])
def test_a_repack_under_a_device_limit_holds_only_this_rank_s_share_on_the_host(tmp_path, world, cases):
    """[Note: a repack under a device limit]: with a limit (always, on a GPU) and shards on the device, the repack at
    the end of the warm-up read every old chunk whole first: the whole model's values and gradients on every rank's
    host at once (4x the rank's master shards on 2 ranks, 8x on 4). Now a rank holds at most its own values and
    gradients (the old device shards, staged) and two chunks' whole values and gradients."""
    ranks = Ranks(
        WORKER, tmp_path, *(f"{p}:{limit}" for p, limit in cases.items()), world_size=world, env=AS_NCCL
    ).wait(timeout=180)
    assert all(rc == 0 for rc, *_ in ranks), "".join(so + se for _, so, se, _ in ranks)[-3000:]
    for placement in cases:
        for r in range(world):
            got = json.loads((tmp_path / f"repack.{placement}.{r}.json").read_text())
            assert 0 < got["held"] <= 2 * got["shards"] + 2 * 2 * CHUNK_BYTES, (placement, got)


def test_a_repack_on_several_ranks_gathers_only_the_chunks_that_change(tmp_path):
    """[Note: a chunk that keeps its buffers]: a model used in its registration order keeps its layout at the
    warm-up, and the chunks that stay on the host keep their shards on every rank, with no all-gather; before, the
    repack all-gathered every old chunk. A model whose norms cross the chunks' bounds in first-use order keeps them
    too (it rebuilt them all), and where parameters move within them, the same bits as rebuilt."""
    ranks = Ranks(WORKER, tmp_path, "ordered-auto:4000000", "shifted", "moved", world_size=2, env=AS_NCCL)
    ranks = ranks.wait(timeout=180)
    assert all(rc == 0 for rc, *_ in ranks), "".join(so + se for _, so, se, _ in ranks)[-3000:]
    got = [json.loads((tmp_path / f"repack.ordered-auto.{r}.json").read_text()) for r in range(2)]
    assert got[0]["tiers"] == ["DEVICE", "HOST"] and got[0]["gathered"] == got[1]["gathered"], got
    assert 0 < got[0]["gathered"] < got[0]["chunks"], got  # the chunks moved to the device, and those only
    # norms that crossed the chunks' bounds: the chunks keep their shards, the same bits as rebuilt
    shifted = [json.loads((tmp_path / f"repack.shifted.{r}.json").read_text()) for r in range(2)]
    assert shifted[0] == shifted[1] and shifted[0]["same"], shifted
    kept, rebuilt = shifted[0]["kept"], shifted[0]["rebuilt"]
    assert kept["repacked"] == rebuilt["repacked"] > kept["kept"] >= kept["repacked"] - 1 > 0 == rebuilt["kept"], kept
    assert kept["loaded"] <= 1 < rebuilt["loaded"] == rebuilt["repacked"], shifted
    # each kept chunk's master and gradient no longer all-gathered (16,384 fp32 elements each), only what left it
    saved = rebuilt["all_gather_bytes"] - kept["all_gather_bytes"]
    assert 0.95 * kept["kept"] * 2 * 16384 * 4 <= saved <= kept["kept"] * 2 * 16384 * 4, shifted
    # parameters moved within the chunks that keep their buffers: copied out and written back, with Adam's state
    moved = [json.loads((tmp_path / f"repack.moved.{r}.json").read_text()) for r in range(2)]
    assert moved[0] == moved[1] and moved[0]["same"] and moved[0]["kept"] == 8 and moved[0]["rebuilt"] == 0, moved
