"""[Note: agreeing without a barrier]: on gloo the chunk collectives' tags are compared at the wait, the
collectives of a size checked once go without a barrier, and ranks that disagree get ``CollectiveMismatchError``,
never an abort, even when the collectives they issue differ in size. [Note: checking once a micro-batch]: by
default the ranks compare what they issued at ``verify_issued()`` instead; a swap of two same-size collectives is
named there, and ranks left waiting on collectives of different sizes time out, never abort.

Two gloo ranks of bare ``Collectives`` (no Lightning), each in its own spawned process; every rank writes what
it saw to a JSON file before it exits (a rank that disagreed exits with status 1: see [Note: naming a lost
rank]). A rank that agreed destroys its process group before it exits, as Lightning does.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest


def _rank(rank: int, store: str, out: str, case: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_chunk.engine.comm.collectives import CollectiveMismatchError, Collectives, CollectiveTimeoutError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    batch = case.startswith("batch")
    comm = Collectives(timeout_s=5 if case == "batch_sizes" else 20, verify=None if batch else "each")
    seen: dict = {"barriers": [], "error": None}  # what this rank saw

    def gather(chunk: int, numel: int) -> torch.Tensor:
        shard = torch.full((numel,), float(10 * chunk + rank))
        out = torch.empty(2 * numel)
        comm.all_gather(out, shard, chunk=chunk, async_op=True).wait()
        seen["barriers"].append(comm.agreement.barriers)
        return out

    try:
        if batch:
            assert comm.agreement.mode == "batch"  # the default on gloo
            gather(0, 8)
            gather(1, 4)
            gather(2, 8)
            comm.verify_issued()  # three collectives, one exchange
            if case == "batch_agree":
                outs = [gather(c, 8) for c in (3, 4)]
                comm.verify_issued()
                # NCCL's form (one stream-ordered group, no keyed groups to make): no barrier at all
                from lightning_chunk.engine.comm.agreement import Agreement

                comm.agreement = Agreement(comm, lazy=False, mode="batch")
                outs += [gather(c, n) for c, n in ((5, 8), (6, 2))]
                seen["right"] = all(
                    o.tolist() == [10.0 * c] * n + [10.0 * c + 1] * n
                    for o, (c, n) in zip(outs, ((3, 8), (4, 8), (5, 8), (6, 2)), strict=True)
                )
            else:
                gather(
                    3 if rank == 0 else (4 if case == "batch_swap" else 5),
                    8 if case == "batch_swap" or rank == 0 else 4,
                )
                gather(6, 8)
            comm.verify_issued()
            seen["error"] = "none"
        elif case == "agree":  # one size, another, the first again; then sizes past MAX_KEYS (4), checked every time
            sizes = ((0, 8), (1, 8), (2, 8), (3, 4), (4, 8), (5, 8), (6, 2), (7, 6), (8, 10), (9, 10), (10, 8))
            outs = [gather(c, n) for c, n in sizes]
            seen["right"] = all(
                o.tolist() == [10.0 * c] * n + [10.0 * c + 1] * n for o, (c, n) in zip(outs, sizes, strict=True)
            )
            full = torch.full((8,), float(rank + 1))
            comm.reduce_scatter(full[4 * rank : 4 * rank + 4], full, chunk=6).wait()
            seen["reduced"] = full[4 * rank : 4 * rank + 4].tolist()
            # unchecked ([Note: a gloo group per kind of collective]): right data, on groups of their own
            comm = Collectives(timeout_s=20, verify=False)
            full = torch.full((8,), float(rank + 1))
            comm.reduce_scatter(full[4 * rank : 4 * rank + 4], full, chunk=0, async_op=True).wait()
            gathered = torch.empty(8)
            comm.all_gather(gathered, full[4 * rank : 4 * rank + 4], chunk=0, async_op=True).wait()
            seen["unchecked"] = [gathered.tolist(), comm.agreement is None, len(set(map(id, comm._op_groups.values())))]
        else:
            gather(0, 8)
            gather(1, 4)
            gather(2, 8)  # both sizes were checked once: from here on neither goes through a barrier
            if case == "new" and rank == 1:
                gather(4, 16)  # skipped chunk 3 and gathers a size never seen: a barrier, then the error
            elif case == "sizes" and rank == 1:
                gather(4, 4)  # skipped chunk 3 and gathers the other known size: no barrier on either rank
            else:
                gather(3, 8)
            gather(5, 8)
            seen["error"] = "none"
    except (CollectiveMismatchError, CollectiveTimeoutError) as e:
        seen["error"] = f"{type(e).__name__}: {e}"
    finally:
        Path(out).write_text(json.dumps(seen))
    if not comm.broken:
        # as Lightning does at exit. A rank that leaves its gloo groups to the interpreter's exit can abort there
        # ("terminate called without an active exception", pytorch/pytorch#190489: a worker thread's finished
        # work drops its tensors while the interpreter is torn down); it did once in CI after every check passed
        dist.destroy_process_group()


CASES = ("agree", "new", "sizes", "batch_agree", "batch_swap", "batch_sizes")


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case at once (twelve processes). Started from a fork server that imported torch once: spawned, each
    process imported it anew, and that was most of the time (34 s of the suite on two cores)."""
    tmp = tmp_path_factory.mktemp("agreement")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning_chunk.engine.comm.collectives"])
    procs = [
        ctx.Process(target=_rank, args=(r, str(tmp / f"{c}.store"), str(tmp / f"{c}.{r}.json"), c))
        for c in CASES
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode is not None and p.exitcode >= 0, f"a rank aborted or hung (exit code {p.exitcode})"
    return {c: [json.loads((tmp / f"{c}.{r}.json").read_text()) for r in (0, 1)] for c in CASES}


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_ranks_that_agree_check_each_size_once_and_get_the_right_data(seen):
    for _r, got in enumerate(seen["agree"]):
        assert got["error"] is None and got["right"], got
        # a barrier for each size the first time it is seen, none after; past four sizes, one every time
        assert got["barriers"] == [1, 1, 1, 2, 2, 2, 3, 4, 5, 6, 6], got
        assert got["reduced"] == [3.0] * 4  # 1 + 2, each rank's slice of the sum
        assert got["unchecked"] == [[3.0] * 8, True, 2], got


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
@pytest.mark.parametrize("case", ["new", "sizes"])
def test_ranks_that_disagree_raise_instead_of_aborting(seen, case):
    """Rank 1 skips chunk 3 and gathers chunk 4, of a size never seen (``new``: it checks with a barrier) or of
    the other size seen before (``sizes``: neither rank checks before issuing), where rank 0 gathers chunk 3
    without a barrier: both ranks name the two collectives."""
    for r, got in enumerate(seen[case]):
        assert got["error"] and got["error"] != "none", (r, got)
        assert f"[rank {r}] ranks disagree" in got["error"]
        assert "rank 0: all_gather of chunk 3; rank 1: all_gather of chunk 4" in got["error"]


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_by_default_ranks_that_agree_check_once_a_batch(seen):
    for got in seen["batch_agree"]:
        assert got["error"] == "none" and got["right"], got
        # a barrier for each new size only, none per collective; none at all with one group (NCCL's form)
        assert got["barriers"] == [1, 2, 2, 2, 2, 0, 0], got


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_by_default_a_swap_of_two_same_size_collectives_is_named_at_the_next_check(seen):
    for r, got in enumerate(seen["batch_swap"]):
        assert got["error"].startswith(f"CollectiveMismatchError: [rank {r}] ranks disagree on a chunk collective"), got
        assert (
            "rank 0: all_gather of chunk 3; rank 1: all_gather of chunk 4; collective 1 since the last check"
            in got["error"]
        ), got


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_by_default_ranks_left_waiting_on_different_sizes_time_out_instead_of_aborting(seen):
    """Rank 1 gathers chunk 5 of the other known size where rank 0 gathers chunk 3: each waits on a group the other
    does not use, and the bounded wait ends it (the fixture checks that neither process aborted)."""
    for got in seen["batch_sizes"]:
        assert got["error"].startswith("CollectiveTimeoutError"), got
