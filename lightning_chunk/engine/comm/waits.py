"""Waiting for a collective: a buffer and its work together (``Pending``), every wait bounded, and what a failed
wait leaves behind.

[Note: naming a lost rank]
A rank that dies (SIGKILL, the OOM killer, a crash in native code) sends no message. With gloo its
peers see the connection close at once; a rank that is alive but stuck is seen only when the bounded
wait runs out. Either way the survivor's error should say *which* rank is gone, not only that a
socket closed. At set-up every rank learns every rank's pid and host (one fixed-size all-gather);
when a wait fails, each peer on this host is looked up in ``/proc`` (a killed child of Lightning's
launcher stays a zombie until it is reaped, so "exists" is not "alive"), and the error names the
ranks that are gone, or says that the peers on other hosts could not be checked from here.
After a failed wait the process must still be able to exit: gloo joins its worker threads at interpreter
exit, and one still receiving from a live but stuck peer never returns (aborting the group does not
release it). So the first failed wait registers an ``atexit`` handler that ends the process with
``os._exit(1)`` once the error has been reported and Lightning has torn down; this is what torch's NCCL
watchdog does on a timeout, too. Every collective after the first failed one fails at once without being
issued (a forward hook that runs while the error unwinds would otherwise wait out a second timeout).
On NCCL the waits stay stream-ordered (no host sync) and the process group's
``timeout`` bounds them through NCCL's watchdog.


[Note: memory a failed collective may still use]
When one wait fails, the collectives issued after it (a forward's prefetched gathers, the reduce-scatters
of a backward) are still queued on gloo's worker threads. Each is run when a thread takes it up: it copies
this rank's input into its output before its first message fails. The work holds its tensors, but not
their memory: a storage resized to nothing (a dropped chunk) or swapped out (the payload pool) takes the
memory from under it, and the copy lands in freed memory, a segmentation fault in gloo's thread or a
corrupted heap that crashed Python later. ``tests/faults/test_rank_dies.py``'s rank killed in the optimizer
step did this in 4 of 25 runs beside a busy loop: the survivor died in Lightning's teardown, after the
engine's teardown had freed every chunk. So once a collective failed (``Collectives.broken``) the engine
frees nothing explicitly: its teardown only lets go of its references, and each buffer goes with its last
holder, the gloo work included, or at the exit that follows.

"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import ChunkError
from .agreement import Check


class CollectiveTimeoutError(ChunkError):
    """A collective did not complete within the bounded wait."""


_exit_armed = False
_broken: list[str] = []  # the first failed wait of this process: no collective is attempted after it


def refuse_if_broken_now(what: str | Callable[[], str]) -> None:
    """After one failed wait the group is unusable (a peer is gone, or stuck in an earlier collective): fail at
    once instead of waiting out another timeout, e.g. in a forward hook that runs while the error unwinds.
    ``what`` may be a callable, so that a chunk collective names itself only when it fails."""
    if _broken:
        what = what() if callable(what) else what
        raise CollectiveTimeoutError(f"{what} was not attempted: an earlier collective failed ({_broken[0]})")


def exit_after_a_failed_collective() -> None:
    """See [Note: naming a lost rank]: gloo joins its worker threads at interpreter exit, and a thread still
    waiting on a live peer never returns, so the process would hang after it reported its error."""
    global _exit_armed
    if _exit_armed:
        return
    _exit_armed = True

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    atexit.register(leave)


def mark_broken(error: str) -> None:
    """The group can no longer be trusted: refuse every later collective and leave the process at exit without
    joining gloo's threads ([Note: naming a lost rank])."""
    exit_after_a_failed_collective()
    _broken.append(error)


def is_broken() -> bool:
    return bool(_broken)


class Pending(NamedTuple):
    """A buffer and the work that fills it travel together (FSDP2's habit)."""

    buffer: torch.Tensor
    work: Any | None
    describe: Callable[[], str] | None = None
    timeout_s: float | None = None
    diagnose: Callable[[], str] | None = None
    clock: Any | None = None  # a StepClock: the wait is charged to ``cause``
    cause: str = "sync_wait"
    before: Check = None  # the agreement check this wait must pass first

    def wait(self) -> torch.Tensor:
        if self.before is not None:
            self.before()
        if self.work is not None:
            with self.clock.measure(self.cause) if self.clock is not None else contextlib.nullcontext():
                self._wait()
        return self.buffer

    def _wait(self) -> None:
        if self.work is not None:
            try:
                if self.timeout_s is not None:
                    self.work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
                else:
                    self.work.wait()
            except RuntimeError as e:
                exit_after_a_failed_collective()
                what = self.describe() if self.describe else "a collective"
                lost = self.diagnose() if self.diagnose else ""
                reason = (
                    f"{lost}. "
                    if lost
                    else "Another rank stopped or issued a different collective: a module ran "
                    "on some ranks and not on others (data-dependent control flow, such as a mixture of experts "
                    "running only the experts its tokens chose; verify_collectives=True names the first "
                    "collective where the ranks differ), or another rank failed; see its error. "
                )
                error = CollectiveTimeoutError(
                    f"{what} did not complete (waited at most {self.timeout_s} s). {reason}"
                    f"[{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}]"
                )
                _broken.append(str(error))
                raise error from None
