"""One optimizer step made of several ``step()`` calls, each over some of the views: the param groups narrowed for
a call (``only``) and the groups' own entries as one call would leave them (``PartialSteps``).

[Note: group state in partial steps]
Stepping in backward calls ``optimizer.step()`` once a chunk, the disk tier once a disk chunk, and the one-pass
host Adam leaves the rest to one more call: each call sees the param groups narrowed to some views. An element-wise
update of a view does not depend on which call steps it, but an optimizer may keep state in the param group itself
and advance it in every call: schedule-free AdamW (``schedulefree.AdamWScheduleFree``) counts its steps in
``group["k"]`` and sums its averaging weights in ``group["weight_sum"]``, and its update reads both. Called once a
chunk, it counted a step a chunk, warmed its learning rate up that many times faster and averaged with other
weights: trained otherwise than plain Lightning, silently, under the default ``step_in_backward``. torch's own
optimizers keep nothing there (their ``step`` is per parameter), so no test with them could see it.

So the first call of a step takes a copy of each group's entries but ``params`` (tensors cloned), and every later
call of the same step starts from that copy: each call updates its views from the hyperparameters and counters
the step began with, and the last call leaves the groups as one ``step()`` over every view leaves them (an
update of a group's entries reads the entries, not the views it was given). A step undone (fp16's overflow after
a speculated chunk stepped) puts the copy back, as a skipped ``step()`` leaves the groups. ``ChunkEngine.finish_step``
ends the step. For torch's optimizers every copy equals what it restores: a dictionary copy a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def only(optimizer: torch.optim.Optimizer, keep: Any, steps: PartialSteps | None = None) -> Iterator[None]:
    """Narrow every param group to the views ``keep`` accepts, and restore them after (also on an error):
    hyperparameters, LR schedulers and per-view state stay as they are. ``steps``: the step this call is part of,
    whose groups' own entries the call starts from ([Note: group state in partial steps])."""
    groups = optimizer.param_groups
    full = [g["params"] for g in groups]
    try:
        for g, params in zip(groups, full, strict=True):
            g["params"] = [v for v in params if keep(v)]
        if steps is not None:
            steps.call_starts()
        yield
    finally:
        for g, params in zip(groups, full, strict=True):
            g["params"] = params


_Entries = list[dict[str, tuple[Any, Any]]]  # per group: key -> (the value, a clone of it where it is a tensor)


class PartialSteps:
    """The groups' own entries as the current step found them ([Note: group state in partial steps])."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._start: _Entries | None = None  # taken by the step's first call

    def call_starts(self) -> None:
        """A call over some views begins: the first of a step takes the groups' entries, a later one puts them back."""
        if self._start is None:
            self._start = [
                {k: (v, v.clone() if torch.is_tensor(v) else None) for k, v in g.items() if k != "params"}
                for g in self.optimizer.param_groups
            ]
        else:
            self._put_back(self._start)

    def ended(self) -> None:
        """The step is over: the groups keep what its last call left."""
        self._start = None

    def undone(self) -> None:
        """The step is skipped after some calls: the groups go back to what it began with."""
        if self._start is not None:
            self._put_back(self._start)
        self._start = None

    def _put_back(self, start: _Entries) -> None:
        for g, entries in zip(self.optimizer.param_groups, start, strict=True):
            for k in [k for k in g if k != "params" and k not in entries]:  # an entry a call added
                del g[k]
            for k, (value, copy) in entries.items():
                if copy is not None:  # a tensor the call may have changed in place
                    value.copy_(copy)
                g[k] = value
