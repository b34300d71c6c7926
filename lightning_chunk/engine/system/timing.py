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

import contextlib
import time
from collections.abc import Iterator

import torch

_profiling = torch._C._autograd._profiler_enabled

CAUSES = ("gather_wait", "reduce_wait", "sync_wait", "tier_copy", "grad_copy", "optimizer", "hooks")


class StepClock:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CAUSES, 0.0)
        self._inner: list[float] = []  # per open measurement: seconds its nested measurements took

    @contextlib.contextmanager
    def measure(self, cause: str) -> Iterator[None]:
        # under torch's profiler each measurement is a range too (``lc:CAUSE``): what the ops inside cost, by name
        marked = torch.autograd.profiler.record_function(f"lc:{cause}") if _profiling() else contextlib.nullcontext()
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            with marked:
                yield
        finally:
            took = time.perf_counter() - start
            nested = self._inner.pop()
            self.seconds[cause] += took - nested
            if self._inner:
                self._inner[-1] += took

    def stats(self) -> dict[str, float]:
        return {f"time_{k}_s": v for k, v in self.seconds.items()}
