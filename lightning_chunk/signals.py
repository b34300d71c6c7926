"""Signals sent to every rank (SLURM's requeue signal, SIGTERM), handled by every rank at the same step.

[Note: signals on several ranks]
Lightning handles two signals in the middle of whatever the main thread is doing. Under ``SLURMEnvironment(
auto_requeue=True)`` the requeue signal (``SIGUSR1``, sent to every task some seconds before the job's time ends)
saves a checkpoint and asks SLURM to requeue the job; SIGTERM (SLURM's preemption, torchrun's shutdown) broadcasts a
flag from rank 0 so that every rank stops at the end of the batch. Under DDP that is harmless: its collectives run
in autograd's engine, so every rank has issued the same ones wherever the handler lands. Here each module's forward
hook issues its chunks' all-gathers, and ranks run some modules apart: a handler that landed on rank 0 after module
3's gather and on rank 1 after module 5's began a save (a roll call, then DCP's collectives) or a broadcast that
rank 1's gather of module 4 waited on. Measured on two gloo ranks (2026-12-05), the requeue signal: rank 0 in the
save's roll call, rank 1 in an all-gather, both failing after the collective timeout, no checkpoint, no requeue;
SIGTERM as NCCL runs: the broadcast paired with an all-gather, both failing after the timeout. On NCCL: a hang
until the job is killed, a save written in the background lost with it.

So while training, or an evaluation outside it (alone, or a fit's sanity check), runs on several ranks these
handlers only note that the signal came. Each step's start already exchanges one integer from every rank
(``same_batches.py``); it carries which signals came, and where any rank's did, every rank runs Lightning's handler
there, before the step's forward: the same save on every rank and rank 0's requeue, the same broadcast. The end of
training or of the evaluation exchanges them once more. A rank whose own signal lands after that (on the other side
of the step) has had it handled, and ignores it. Lightning's SIGTERM check at the end of the batch then stops every
rank together. During set-up, or after the end, no step follows to carry a signal: Lightning's handlers run as they
are.
"""

from __future__ import annotations

import functools
import operator
import signal
import threading
from types import FrameType
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment


class SignalsAtSteps:
    """Holds the handlers of SIGTERM and SLURM's requeue signal from ``install`` to ``remove`` ([Note: signals on
    several ranks]). Signal ``i`` of ``signums`` is bit ``i`` of the masks."""

    def __init__(self) -> None:
        self.signums: list[int] = []
        self.handlers: list[Any] = []  # Lightning's, called at a step
        self.came: list[int] = []  # per signal: received here, not yet handled
        self.ahead: list[int] = []  # per signal: handled at a step before this rank's own came

    def install(self, environment: Any) -> None:
        self.remove()
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (Lightning sets none there either)
        wanted = [signal.SIGTERM]  # the requeue signal first: its save before the stop
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
            wanted.insert(0, environment.requeue_signal)
        for signum in wanted:
            handler = signal.getsignal(signum)
            if callable(handler):
                self.signums.append(signum)
                self.handlers.append(handler)
                signal.signal(signum, self._note)
        self.came, self.ahead = [0] * len(self.signums), [0] * len(self.signums)

    def remove(self) -> None:
        for signum, handler in zip(self.signums, self.handlers, strict=True):
            if signal.getsignal(signum) == self._note and threading.current_thread() is threading.main_thread():
                signal.signal(signum, handler)
        self.signums, self.handlers, self.came, self.ahead = [], [], [], []

    def _note(self, signum: int, frame: FrameType | None) -> None:
        i = self.signums.index(signum)
        if self.ahead[i]:
            self.ahead[i] -= 1
        else:
            self.came[i] += 1

    def mask(self) -> int:
        """The signals this rank received and not yet handled, a bit each."""
        return sum(1 << i for i, n in enumerate(self.came) if n)

    def run(self, mask: int) -> None:
        """Every rank calls this at the same point with every rank's masks or-ed: Lightning's handler of each signal
        any rank received."""
        for i, signum in enumerate(list(self.signums)):
            if not mask >> i & 1:
                continue
            if self.came[i]:
                self.came[i] -= 1
            else:
                self.ahead[i] += 1
            self.handlers[i](signum, None)

    def at_end(self, comm: Any) -> None:
        """The end of training, where every rank is together and no step follows."""
        if self.signums:
            masks = comm.values_of_ranks(self.mask(), what="the ranks telling which signals came")
            self.run(functools.reduce(operator.or_, masks, 0))
