"""[Note: the warm-up's phases]: UNTRACED -> RECORDING -> TRACED -> PLANNED, the re-plans that go back, and the
moves the table refuses."""

import pytest
import torch

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.errors import IllegalTransitionError
from lightning_chunk.engine.runtime.warmup import NEXT, Replan, WarmUp, WarmUpPlanner
from tests.unit.test_engine import Reordered


def test_a_fit_goes_through_the_phases_and_a_replan_for_inputs_that_grew_goes_back():
    torch.manual_seed(0)
    m = Reordered()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=300, check_invariants=True))
    seen = [eng.warm_up.phase]
    x = torch.randn(3, 8)
    opt.zero_grad()
    with eng.micro_batch(training=True) as outputs:
        seen.append(eng.warm_up.phase)
        loss = m(x).pow(2).mean()
        outputs(loss)
    loss.backward()
    eng.after_backward()
    seen.append(eng.warm_up.phase)
    eng.prepare_step()
    seen.append(eng.warm_up.phase)
    opt.step()
    eng.finish_step(stepped=True)
    assert seen == [WarmUp.UNTRACED, WarmUp.RECORDING, WarmUp.TRACED, WarmUp.PLANNED] and eng.warmed_up
    eng.warm_up.replan(Replan.INPUTS_GREW)  # as micro_batch does for a larger batch: the trace is dropped
    assert eng.warm_up.phase is WarmUp.UNTRACED and eng.hooks.moments.trace is None and not eng.warmed_up


def test_the_table_refuses_a_move_it_does_not_list():
    planner = WarmUpPlanner(engine=None)  # type: ignore[arg-type]
    assert all(p in NEXT for p in WarmUp)
    with pytest.raises(IllegalTransitionError, match="the warm-up cannot go from untraced to planned"):
        planner.enter(WarmUp.PLANNED)
    planner.enter(WarmUp.RECORDING)
    with pytest.raises(IllegalTransitionError, match="from recording to planned"):
        planner.enter(WarmUp.PLANNED)


def test_a_chunk_s_payload_comes_at_its_first_traced_gradient_and_it_reduces_after_its_last():
    """[Note: gradients some ranks lack] and [Note: when a chunk reduces]: chunk 0's first gradient came after
    moment 1 (on some rank) and its last after the last moment (so it reduces at the end); chunk 1 got none (no
    payload moment); chunk 2's one gradient came after moment 2 (payload there, reduce at the next)."""
    from lightning_chunk.engine.schedule.tracer import BACKWARD, FORWARD, Moment, MomentKey, Trace

    moments = tuple(
        Moment(kind, module, (), (), 0)
        for kind, module in [(FORWARD, "a"), (FORWARD, "b"), (BACKWARD, "b"), (BACKWARD, "a")]
    )
    trace = Trace(moments, grad_positions=(2, 3, -1, 2), first_grad_positions=(2, 1, -1, 2))
    chunks = {0: [0, 1], 1: [2], 2: [3]}
    assert trace.payload_moments(chunks) == {MomentKey(FORWARD, "b", 0): [0], MomentKey(BACKWARD, "b", 0): [2]}
    assert trace.reduce_moments(chunks) == {0: None, 1: None, 2: MomentKey(BACKWARD, "a", 0)}
