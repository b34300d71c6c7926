import itertools

import pytest

from lightning_chunk.engine.chunks.states import LEGAL_TRANSITIONS, TensorState, check_transition
from lightning_chunk.engine.errors import IllegalTransitionError

ALL_PAIRS = list(itertools.product(TensorState, TensorState))
LEGAL = [(a, b) for a, b in ALL_PAIRS if b in LEGAL_TRANSITIONS[a]]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if b not in LEGAL_TRANSITIONS[a]]


def test_table_covers_every_state():
    assert set(LEGAL_TRANSITIONS) == set(TensorState)
    assert len(LEGAL) + len(ILLEGAL) == len(TensorState) ** 2
    assert LEGAL and ILLEGAL


@pytest.mark.parametrize("old,new", LEGAL, ids=lambda s: s.name)
def test_legal_transition_passes(old, new):
    check_transition(old, new, param_name="w", chunk_id=3, rank=0)


@pytest.mark.parametrize("old,new", ILLEGAL, ids=lambda s: s.name)
def test_illegal_transition_names_param_chunk_rank_and_states(old, new):
    with pytest.raises(IllegalTransitionError) as e:
        check_transition(old, new, param_name="layer.weight", chunk_id=7, rank=1)
    msg = str(e.value)
    for part in ("'layer.weight'", "chunk 7", "rank 1", old.name, new.name):
        assert part in msg


def test_free_is_only_left_by_a_gather():
    assert LEGAL_TRANSITIONS[TensorState.FREE] == frozenset({TensorState.HOLD})
    assert TensorState.FREE not in LEGAL_TRANSITIONS[TensorState.COMPUTE]  # never released while in use
    assert TensorState.FREE not in LEGAL_TRANSITIONS[TensorState.READY_FOR_REDUCE]  # nor before reducing


def test_a_waiting_gradient_lets_the_payload_go_and_comes_back_or_is_reduced():
    """[Note: a gradient waits without its payload]"""
    S = TensorState
    assert LEGAL_TRANSITIONS[S.READY_FOR_REDUCE] == frozenset({S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE_FREE})
    assert LEGAL_TRANSITIONS[S.READY_FOR_REDUCE_FREE] == frozenset({S.READY_FOR_REDUCE, S.FREE})
    from lightning_chunk.engine.chunks.states import PINNED_STATES, RESIDENT_STATES

    assert S.READY_FOR_REDUCE_FREE not in RESIDENT_STATES and S.READY_FOR_REDUCE in PINNED_STATES
