"""What each rank's process is given at start ([Note: every rank's thread count] in lightning_chunk/ranks.py)."""

import pytest
import torch

from lightning_chunk.ranks import THREADS, barrier_device_ids, process_group_device, take_rank_threads, threads_for_rank

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "8"}


def test_a_rank_torchrun_started_with_its_one_thread_default_takes_its_share_of_the_cores():
    assert threads_for_rank(TORCHRUN, cores=96) == 12
    assert threads_for_rank({**TORCHRUN, "LOCAL_WORLD_SIZE": "128"}, cores=96) == 1
    assert threads_for_rank({**TORCHRUN, "OMP_NUM_THREADS": "4"}, cores=96) is None  # the user's own count stays
    assert threads_for_rank({"OMP_NUM_THREADS": "1"}, cores=96) is None  # not torchrun: whoever set it meant it
    assert threads_for_rank({**TORCHRUN, THREADS: "1"}, cores=96) == 1  # torchrun's one thread, asked for
    for bad in ("two", "0"):
        with pytest.raises(ValueError, match=f"{THREADS}="):
            threads_for_rank({THREADS: bad}, cores=4)


def test_the_rank_s_threads_are_set_when_it_starts(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for k, v in TORCHRUN.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.setattr("lightning_chunk.ranks.cores_here", lambda: 3)
        take_rank_threads()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_nccl_is_told_the_rank_s_gpu():
    """As DDPStrategy does: without it torch guesses ``rank % devices``, wrong for ranks not numbered node by node."""
    assert process_group_device(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert barrier_device_ids(torch.device("cuda", 3), "nccl") == [3]
    assert barrier_device_ids(torch.device("cuda", 3), "gloo") is None  # gloo takes no device_ids
    assert process_group_device(torch.device("cpu")) is None and barrier_device_ids(torch.device("cpu"), "gloo") is None


def test_the_pinned_blocks_a_repack_frees_go_back_to_the_os(monkeypatch):
    """[Note: pinned blocks a repack leaves behind]: on CUDA the warm-up's host shards, freed when the repack moves them
    to the device, stayed page-locked in torch's host cache for the whole run. The cache is emptied after every
    repack and at teardown (here with CUDA and the cache's entry point stood in for, on a CPU machine)."""
    from lightning_chunk.engine import ChunkConfig, ChunkEngine
    from tests.engine_steps import step
    from tests.models import ReorderedNet, token_data

    emptied = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(True), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    # torch's optimizers then ask whether a CUDA graph is being captured: on a CUDA build without a driver, it raised
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    torch.manual_seed(0)
    model = ReorderedNet()  # registered in another order than it runs, in four chunks: the warm-up ends in a repack
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = ChunkEngine(model, [opt], config=ChunkConfig(chunk_numel=4096), device=torch.device("cpu"))
    after_setup = len(emptied)
    x, _ = next(iter(token_data()))
    for _ in range(2):  # the warm-up, its repack at the first step, one traced step
        step(eng, model, opt, x)
    repacked = len(emptied)
    eng.teardown()
    assert after_setup >= 1 and repacked > after_setup and len(emptied) > repacked


def test_models_that_differ_are_described_by_their_first_difference_and_the_ranks_on_each_side():
    """[Note: the same model on every rank]: what every rank's error says, from every rank's parameters and buffers."""
    from lightning_chunk.engine.runtime.same_model import describe

    a = [("parameter", "w", (4, 4), "torch.float32", True, 0), ("parameter", "b", (4,), "torch.float32", True, 1)]
    bf16 = [a[0], ("parameter", "b", (4,), "torch.bfloat16", True, 1)]
    said = describe([a, bf16, a])
    assert "differ first at entry 1 (from 0" in said and "(rank" not in said.split(".")[0]
    assert (
        "ranks 0, 2: parameter 'b' of shape (4,), float32, trainable, param group 1; rank 1: parameter 'b' of shape "
        "(4,), bfloat16" in said
    )
    said = describe([a, a[:1] + [("parameter", "b", (4,), "torch.float32", False, None)], a[:1]])
    assert "(rank 0: 2, rank 1: 2, rank 2: 1)" in said
    assert "rank 1: parameter 'b' of shape (4,), float32, frozen, in no param group; rank 2: nothing there" in said
    said = describe(
        [[*a, ("buffer", "n", (), "torch.int64", False, None)], [*a, ("buffer", "n", (2,), "torch.int64", False, None)]]
    )
    assert "rank 0: buffer 'n' of shape (), int64; rank 1: buffer 'n' of shape (2,), int64" in said
