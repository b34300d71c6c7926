"""The check that every rank ran the same modules (``engine/comm/sequence.py``): where ranks ran different children
of one module, as a mixture of experts running only the experts its tokens chose does, the error names that module
and the two ways out. The ranks' sequences are given by a stand-in for the collectives; the two-rank run of such a
model is ``mixture_of_experts`` in tests/distributed/rank_cases.py."""

from __future__ import annotations

import pytest
import torch.nn as nn

from lightning_chunk.engine.comm.collectives import CollectiveMismatchError
from lightning_chunk.engine.comm.sequence import ModuleSequence
from lightning_chunk.engine.runtime.owners import leaf_hint


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(2))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.moe = Router()
        self.head = nn.Linear(4, 8)


class TwoRanks:
    """What ``ModuleSequence.check`` asks of the collectives, with the ranks' sequences given."""

    world_size, all_size, rank, all_rank = 2, 2, 0, 0

    def __init__(self, seqs: list[list[tuple[str, str]]]) -> None:
        self.seqs = seqs

    def agree_on_value(self, value: int, *, what: str) -> bool:
        return False

    def all_gather_object(self, obj: object) -> list:
        return self.seqs


def mismatch(seqs: list[list[tuple[str, str]]]) -> str:
    sequence = ModuleSequence()
    sequence.moments = list(seqs[0])
    with pytest.raises(CollectiveMismatchError) as info:
        sequence.check(TwoRanks(seqs), lambda key: (0,), lambda keys: leaf_hint(Net(), keys))
    return str(info.value)


def test_ranks_that_ran_different_experts_are_told_which_module_to_run_whole_or_make_a_leaf():
    common = [("fwd", "embed"), ("fwd", "moe.gate")]
    said = mismatch([[*common, ("fwd", "moe.experts.0.0")], [*common, ("fwd", "moe.experts.1.0")]])
    assert "rank 0: fwd of module 'moe.experts.0.0' (chunks [0]); rank 1: fwd of module 'moe.experts.1.0'" in said
    # the ModuleList has no forward: the module holding it chose
    assert "If 'moe' (Router) chooses from the data which of its children run (a mixture of experts)" in said
    assert "run every child, on no rows where none was chosen" in said
    assert 'MemoryOptions(leaf_modules=["Router"])' in said


def test_ranks_that_differ_across_the_whole_model_get_no_module_to_make_a_leaf():
    for other in ("head", "<root>"):  # under the root only, or the root itself: no leaf to offer
        said = mismatch([[("fwd", "embed")], [("fwd", other)]])
        assert "ranks ran different modules" in said and "leaf_modules" not in said, said
    said = mismatch([[("fwd", "embed"), ("fwd", "head")], [("fwd", "embed")]])  # one rank ran nothing more
    assert "rank 1: nothing more" in said and "leaf_modules" not in said, said
