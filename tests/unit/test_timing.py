"""``StepClock``: each second charged once, to the innermost measurement ([Note: where a step's time goes])."""

import time

import pytest
import torch

from lightning_chunk.engine.system.timing import StepClock


def test_nested_measurements_charge_each_second_to_the_innermost_and_survive_errors():
    clock = StepClock()
    with clock.measure("hooks"):
        time.sleep(0.02)
        with clock.measure("gather_wait"):
            time.sleep(0.05)
            with clock.measure("hooks"):  # the same cause nested in itself (a hook inside a wait)
                time.sleep(0.02)
        with pytest.raises(RuntimeError), clock.measure("tier_copy"):
            time.sleep(0.03)
            raise RuntimeError("a copy failed")
    s = clock.seconds
    assert 0.05 <= s["gather_wait"] < 0.065 and 0.03 <= s["tier_copy"] < 0.045
    assert 0.04 <= s["hooks"] < 0.055  # its own 0.02 and the nested 0.02: not the wait's, nor the copy's
    assert not clock._open  # the error closed its measurement
    with clock.measure("optimizer"):
        pass
    assert s["optimizer"] < 0.01 and s["hooks"] < 0.055  # nothing left open was charged


def test_under_torch_s_profiler_each_measurement_is_a_range_named_by_its_cause():
    clock = StepClock()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with clock.measure("hooks"), clock.measure("grad_copy"):
            torch.ones(4).add_(1)
    names = {e.name for e in prof.events()}
    assert {"lc:hooks", "lc:grad_copy"} <= names
    assert clock.seconds["grad_copy"] > 0
