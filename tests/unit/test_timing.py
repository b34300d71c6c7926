"""``StepClock``: each second charged once, to the innermost measurement ([Note: where a step's time goes])."""

import pytest
import torch

from lightning_chunk.engine.system import timing
from lightning_chunk.engine.system.timing import StepClock


class FakeTime:
    """``perf_counter`` as a clock the test advances: exact seconds, whatever the machine's load."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now

    @classmethod
    def sleep(cls, seconds: float) -> None:
        cls.now += seconds


def test_nested_measurements_charge_each_second_to_the_innermost_and_survive_errors(monkeypatch):
    monkeypatch.setattr(timing, "time", FakeTime)
    clock, sleep = StepClock(), FakeTime.sleep
    with clock.measure("hooks"):
        sleep(2)
        with clock.measure("gather_wait"):
            sleep(5)
            with clock.measure("hooks"):  # the same cause nested in itself (a hook inside a wait)
                sleep(3)
        with pytest.raises(RuntimeError), clock.measure("tier_copy"):
            sleep(7)
            raise RuntimeError("a copy failed")
    s = clock.seconds
    assert (s["gather_wait"], s["tier_copy"]) == (5, 7)
    assert s["hooks"] == 5  # its own 2 and the nested 3: not the wait's, nor the copy's
    assert not clock._open  # the error closed its measurement
    with clock.measure("optimizer"):
        sleep(11)
    assert (s["optimizer"], s["hooks"]) == (11, 5)  # nothing left open was charged


def test_under_torch_s_profiler_each_measurement_is_a_range_named_by_its_cause():
    clock = StepClock()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with clock.measure("hooks"), clock.measure("grad_copy"):
            torch.ones(4).add_(1)
    names = {e.name for e in prof.events()}
    assert {"lc:hooks", "lc:grad_copy"} <= names
    assert clock.seconds["grad_copy"] > 0
