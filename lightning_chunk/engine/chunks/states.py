"""Tensor states and the table of legal transitions.

[Note: tensor states]
Every parameter packed into a chunk carries one state. The state says whether
the chunk's payload (the gathered, compute-dtype buffer the parameter is a view
into) must be resident, and why:

====================  =========  ===================================================
state                 resident   meaning
====================  =========  ===================================================
FREE                  no         payload storage released; the parameter has no data
HOLD                  yes        resident and idle: may be evicted
COMPUTE               yes        a module that uses it is running: never evicted
HOLD_AFTER_FWD        yes        forward done, backward will need it again
READY_FOR_REDUCE      yes        its gradient is in the chunk's gradient buffer and
                                 the chunk waits for its other tensors to reduce
READY_FOR_REDUCE_FREE no         the same, with the payload released under memory
                                 pressure ([Note: a gradient waits without its payload])
HOLD_AFTER_BWD        yes        backward done for this tensor: may be evicted
====================  =========  ===================================================

A chunk's state is derived from its tensors (``Chunk.is_resident``,
``Chunk.is_evictable``); it is never stored beside them, so it cannot drift.
A transition outside ``LEGAL_TRANSITIONS`` raises ``IllegalTransitionError``
naming the parameter, the chunk, the rank and both states: an illegal
transition is always a hook-order bug, and hiding it (as Gemini does) turns it
into silent corruption later.

[Note: a gradient waits without its payload]
A chunk waits in READY_FOR_REDUCE until every tensor in it has its gradient and
its turn in the reduce order has come ([Note: reduce order] in ``reduce.py``).
Its gradients wait in a buffer of their own (the gradient payload with several
ranks, the gradient shard with one), never in the payload, so nothing that waits
needs the parameter values. Yet a waiting chunk used to pin its payload: in the
warm-up of a model registered in another order than it runs (whose layout is
registration order until the warm-up has seen the use order), backward held the
head's chunk (one gradient in, the rest of its tensors' backward still ahead), the
chunk of every block's norms and biases, and the chunk in use, each with its payload
and its gradient payload: more than a limit the trained layout fits well under, and
the automatic chunk size's first step failed. So when room is short and nothing plainly
evictable is left, the hooks release such a chunk's payload (``ChunkManager.release``
with ``waiting_grads=True``): its waiting tensors go to READY_FOR_REDUCE_FREE, the others to
FREE; a later gather brings them back to READY_FOR_REDUCE and HOLD, and the reduce takes
them to FREE. It is the last resort, not a policy: a chunk released this way is
gathered again when its other tensors' backward comes.
"""

from __future__ import annotations

import enum

from ..errors import IllegalTransitionError


class TensorState(enum.Enum):
    FREE = "FREE"
    HOLD = "HOLD"
    COMPUTE = "COMPUTE"
    HOLD_AFTER_FWD = "HOLD_AFTER_FWD"
    READY_FOR_REDUCE = "READY_FOR_REDUCE"
    READY_FOR_REDUCE_FREE = "READY_FOR_REDUCE_FREE"
    HOLD_AFTER_BWD = "HOLD_AFTER_BWD"

    # members are singletons compared by identity, so identity's hash (in C) agrees with ``==``; Enum's own hashes the
    # name in Python, 0.2 us a lookup, and the hooks look states up some 4,000 times a step
    __hash__ = object.__hash__


S = TensorState

LEGAL_TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    # gathered (all-gather or host-to-device copy) into the payload
    S.FREE: frozenset({S.HOLD}),
    # accessed by a module, or released
    S.HOLD: frozenset({S.COMPUTE, S.FREE}),
    # nested use; forward done (grad mode / no grad); gradient arrived;
    # end of backward for a tensor that got no gradient
    S.COMPUTE: frozenset({S.COMPUTE, S.HOLD_AFTER_FWD, S.HOLD, S.READY_FOR_REDUCE, S.HOLD_AFTER_BWD}),
    # re-gathered for backward or reused; released between forward and backward;
    # gradient arrived without a pre-backward; end of step or of backward
    S.HOLD_AFTER_FWD: frozenset({S.COMPUTE, S.FREE, S.HOLD, S.READY_FOR_REDUCE, S.HOLD_AFTER_BWD}),
    # the chunk's gradients were reduced; the payload was released while they wait
    S.READY_FOR_REDUCE: frozenset({S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE_FREE}),
    # gathered again; the chunk's gradients were reduced
    S.READY_FOR_REDUCE_FREE: frozenset({S.READY_FOR_REDUCE, S.FREE}),
    # reused (next forward, recompute); released; end of step
    S.HOLD_AFTER_BWD: frozenset({S.COMPUTE, S.FREE, S.HOLD}),
}

RESIDENT_STATES = frozenset(s for s in TensorState if s not in (S.FREE, S.READY_FOR_REDUCE_FREE))
PINNED_STATES = frozenset({S.COMPUTE, S.READY_FOR_REDUCE})


def check_transition(old: TensorState, new: TensorState, *, param_name: str, chunk_id: int, rank: int) -> None:
    """Raise ``IllegalTransitionError`` unless ``old -> new`` is in the table."""
    if new not in LEGAL_TRANSITIONS[old]:
        allowed = ", ".join(sorted(s.name for s in LEGAL_TRANSITIONS[old]))
        raise IllegalTransitionError(
            f"[rank {rank}] illegal tensor-state transition for parameter {param_name!r} in chunk {chunk_id}: "
            f"{old.name} -> {new.name} (from {old.name} only {allowed} are legal). "
            "This is a hook-order bug: a parameter was used outside the module that owns it, "
            "or a hook fired out of order. A module whose forward reads a child module's parameters without calling "
            "the child must be a leaf: pass its class in leaf_modules (ChunkOffloadStrategy(leaf_modules=[...]))."
        )
