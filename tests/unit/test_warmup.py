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
