"""SLURM's requeue signal on several ranks: handled by every rank at the same batch boundary.

[Note: the requeue signal on several ranks]
Under ``SLURMEnvironment(auto_requeue=True)`` Lightning saves a checkpoint from its handler of the requeue signal
(``SIGUSR1``, sent to every task some seconds before the job's time ends) and asks SLURM to requeue the job. A
handler runs between two Python operations of whatever the main thread is doing. Under DDP that is harmless: its
collectives run in autograd's engine, so every rank has issued the same all-reduces wherever the handler lands. Here
each module's forward hook issues its chunks' all-gathers, and ranks run some modules apart: a handler that landed on
rank 0 after module 3's gather and on rank 1 after module 5's started a save (a roll call, then DCP's collectives)
that rank 1's gather of module 4 waited on. Measured on two gloo ranks (2026-12-05): rank 0 in the save's roll call,
rank 1 in an all-gather, both failing after the collective timeout with no checkpoint written and no requeue; on
NCCL, a hang until the job's time ended.

So while a fit runs on several ranks the handler only notes that the signal came. At every training batch's start
and at the end of training, points every rank reaches together, the ranks say whether theirs came (a roll call on
the gloo group beside training, on the host: no device synchronisation); where any rank's did, every rank runs
Lightning's handler there, the same save on every rank and rank 0's requeue. A rank whose own signal lands after that
(on another side of the boundary) has had it handled and ignores it. The roll call costs one all-gather of an int
on the host a batch, under SLURM with auto-requeue only. A signal during validation is handled at the next training
batch or the end of training.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment


class RequeueAtBoundary:
    """Holds the requeue signal's handler from ``install`` to ``remove`` ([Note: the requeue signal on several
    ranks])."""

    def __init__(self) -> None:
        self.signum: signal.Signals | None = None
        self.handler: Any = None  # Lightning's, called at a boundary
        self.came = 0  # signals this rank received and the ranks have not handled yet
        self.ahead = 0  # signals handled at a boundary before this rank's own came

    def install(self, environment: Any) -> None:
        signum = getattr(environment, "requeue_signal", None)
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue or signum is None:
            return
        handler = signal.getsignal(signum)
        if not callable(handler) or handler is self._note:
            return
        self.signum, self.handler, self.came, self.ahead = signum, handler, 0, 0
        signal.signal(signum, self._note)

    def remove(self) -> None:
        if self.signum is not None and signal.getsignal(self.signum) == self._note:
            signal.signal(self.signum, self.handler)
        self.signum = self.handler = None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.ahead:
            self.ahead -= 1
        else:
            self.came += 1

    def at_boundary(self, comm: Any) -> None:
        """Every rank calls this at the same point: Lightning's handler runs on every rank where any rank's signal
        came."""
        if self.signum is None:
            return
        came = comm.beside().failed_ranks(self.came == 0, what="the roll call of the requeue signal")
        if not came:
            return
        if self.came:
            self.came -= 1
        else:
            self.ahead += 1
        self.handler(self.signum, None)
