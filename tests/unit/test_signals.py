"""``SignalsAtSteps`` on one process: what a rank notes, runs and restores ([Note: signals on several ranks])."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from lightning_chunk.signals import SignalsAtSteps


@pytest.fixture
def calls():
    """Handlers standing for Lightning's, recording (signal, called outside a signal: frame None); put back after."""
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    out: list = []
    signal.signal(signal.SIGUSR1, lambda s, f: out.append(("usr1", f is None)))
    signal.signal(signal.SIGTERM, lambda s, f: out.append(("term", f is None)))
    yield out
    signal.signal(signal.SIGUSR1, before[0])
    signal.signal(signal.SIGTERM, before[1])


def test_signals_are_noted_then_run_where_any_rank_s_came_and_a_later_own_one_is_not_run_again(calls):
    held = SignalsAtSteps()
    held.install(SLURMEnvironment())  # the requeue signal (SIGUSR1) is bit 0, SIGTERM bit 1
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == [] and held.mask() == 0b10  # noted, not run
    held.run(0b11)  # another rank's requeue signal came too: both run here, at the step, the save first
    assert calls == [("usr1", True), ("term", True)]
    assert held.mask() == 0
    os.kill(os.getpid(), signal.SIGUSR1)  # this rank's own, handled already
    assert held.mask() == 0 and len(calls) == 2
    os.kill(os.getpid(), signal.SIGUSR1)  # a new one
    assert held.mask() == 0b01
    held.remove()
    os.kill(os.getpid(), signal.SIGUSR1)  # Lightning's handler again, at once
    assert calls[-1] == ("usr1", False)


def test_without_slurm_s_requeue_only_sigterm_is_held_and_nothing_off_the_main_thread(calls):
    held = SignalsAtSteps()
    held.install(LightningEnvironment())
    assert held.signums == [signal.SIGTERM]
    held.remove()
    off = SignalsAtSteps()
    t = threading.Thread(target=off.install, args=(SLURMEnvironment(),))
    t.start()
    t.join()
    assert off.signums == [] and signal.getsignal(signal.SIGUSR1) != off._note  # bound methods compare equal
