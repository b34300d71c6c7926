"""Inputs that grow after the warm-up: detect them and trace again.

[Note: inputs that grow after the warm-up]
Placement is planned from one traced micro-batch: at each moment the budget is the device limit less the
activations the warm-up measured there. If later inputs are larger (a longer sequence, a bigger batch: a
curriculum, a data loader with variable lengths), their activations are larger too, and a plan that left room
for the warm-up's would push the device past the limit (Colossal-AI #4470 is this failure). So, under a device
limit, each training micro-batch's input bytes (every tensor the step was handed) are compared with the largest
the current trace saw. The ranks agree on the largest over all of them first (one one-element all-reduce a
micro-batch): one rank re-planning alone would pair different collectives. A larger input starts a new warm-up
on that micro-batch: the trace is dropped, so the micro-batch gathers each module's chunks only while it runs,
and, when no gradient is held in the shards (the first micro-batch after an optimizer step), the shards go back
to the tiers they had before any trace (``auto``: the host), leaving the device to the new activations. The
next optimizer step finalises the new trace exactly as the first one: the limit is checked against the
measured activations (too small: ``DeviceMemoryLimitError`` with the numbers), the layout and tiers are planned
again, and optimizer state moves along. Inputs only ever have to grow past the largest seen, so a run re-plans
at most a few times. Without a device limit nothing is compared and nothing is exchanged.
"""

from __future__ import annotations

import torch

from ..comm.collectives import Collectives


class InputGrowth:
    def __init__(self, comm: Collectives, *, enabled: bool) -> None:
        self.comm, self.enabled = comm, enabled
        self.traced_bytes = 0  # the largest input the current trace was measured with (agreed over ranks)
        self.replans = 0

    def _largest(self, nbytes: int) -> int:
        if self.comm.world_size == 1:
            return nbytes
        t = torch.tensor([nbytes], dtype=torch.int64, device=self.comm.tensor_device())
        return int(self.comm.all_reduce(t, "max", what="the agreement on micro-batch input sizes").item())

    def must_retrace(self, nbytes: int | None, *, recording: bool) -> bool:
        """Called by every rank at each training micro-batch; True when this one must be traced again."""
        if not self.enabled or nbytes is None:
            return False
        largest = self._largest(nbytes)
        grew = not recording and largest > self.traced_bytes
        self.traced_bytes = max(self.traced_bytes, largest)
        self.replans += grew
        return grew
