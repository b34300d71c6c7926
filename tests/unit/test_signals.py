"""``SignalsAtSteps`` on one process: what a rank notes, runs and restores ([Note: signals on several ranks])."""

from __future__ import annotations

import os
import signal
import threading

from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from lightning_chunk.signals import SignalsAtSteps


def _handlers(calls: list) -> None:
    signal.signal(signal.SIGUSR1, lambda s, f: calls.append(("usr1", f is None)))
    signal.signal(signal.SIGTERM, lambda s, f: calls.append(("term", f is None)))


def test_signals_are_noted_then_run_where_any_rank_s_came_and_a_later_own_one_is_not_run_again():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    calls: list = []
    try:
        _handlers(calls)
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
    finally:
        signal.signal(signal.SIGUSR1, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_without_slurm_s_requeue_only_sigterm_is_held_and_nothing_off_the_main_thread():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    calls: list = []
    try:
        _handlers(calls)
        held = SignalsAtSteps()
        held.install(LightningEnvironment())
        assert held.signums == [signal.SIGTERM]
        held.remove()
        off = SignalsAtSteps()
        t = threading.Thread(target=off.install, args=(SLURMEnvironment(),))
        t.start()
        t.join()
        assert off.signums == [] and signal.getsignal(signal.SIGUSR1) is not off._note
    finally:
        signal.signal(signal.SIGUSR1, before[0])
        signal.signal(signal.SIGTERM, before[1])
