"""Where a step's time goes, on this rank, by cause.

[Note: where a step's time goes]
A slow offloaded run is slow for one of a few reasons: it waits for all-gathers (parameters not fetched in
time), for reduce-scatters (gradients), for the small agreement collectives (tags, votes, norms), on copies
between tiers, on adding each parameter's gradient into its chunk's flat gradient (``grad_copy``), in the
optimizer, or in the engine's own Python at each module hook. ``StepClock`` adds up the
wall time of each on this rank since the engine started. Measurements nest, and each second is charged to
one cause only, the innermost: a gather waited for inside a forward hook is ``gather_wait``, and ``hooks`` is
what the hooks spent on their own (planning, bookkeeping, launching collectives). What no cause claims is
the model's own compute (and Lightning's loop). Reading the clock costs two ``perf_counter`` calls per
measurement, small next to a hook; under torch's profiler each measurement is also a range named ``lc:CAUSE``.

On CUDA the collectives and copies are stream-ordered: the host does not wait for them, so their causes show
host time only (launching), and a stream's wait appears where the host next synchronises; the host's waits for
gradient copies to land (``GradOffload.drain``: at the end of backward, and where a bound or a step needs them)
are ``tier_copy``. Use the profiler there; these counts are exact on CPU devices, where every wait blocks the host.
"""

from __future__ import annotations

import time
from typing import Any

import torch

_profiling = torch._C._autograd._profiler_enabled

CAUSES = ("gather_wait", "reduce_wait", "sync_wait", "tier_copy", "grad_copy", "optimizer", "hooks")


class StepClock:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CAUSES, 0.0)
        self._open: list[list[Any]] = []  # per open measurement: [its start, seconds its nested ones took, range]
        self._measures = {cause: _Measure(self, cause) for cause in CAUSES}

    def measure(self, cause: str) -> _Measure:
        """A context that charges its wall time, less its nested measurements', to ``cause``. One object per cause,
        made once: the hooks open about a thousand a step, and a ``contextlib.contextmanager`` generator cost three
        times as much as this (1.7 us against 0.5 on CPU)."""
        return self._measures[cause]

    def stats(self) -> dict[str, float]:
        return {f"time_{k}_s": v for k, v in self.seconds.items()}


class _Measure:
    """``StepClock.measure(cause)``: reentrant, since what is open lives on the clock's stack, not here."""

    __slots__ = ("clock", "cause")

    def __init__(self, clock: StepClock, cause: str) -> None:
        self.clock, self.cause = clock, cause

    def __enter__(self) -> None:
        marked = None
        if _profiling():  # under torch's profiler each measurement is a range too (``lc:CAUSE``)
            marked = torch.autograd.profiler.record_function(f"lc:{self.cause}")
            marked.__enter__()
        self.clock._open.append([time.perf_counter(), 0.0, marked])

    def __exit__(self, *exc: object) -> None:
        clock = self.clock
        start, nested, marked = clock._open.pop()
        took = time.perf_counter() - start
        if marked is not None:
            marked.__exit__(*exc)
        clock.seconds[self.cause] += took - nested
        if clock._open:
            clock._open[-1][1] += took
