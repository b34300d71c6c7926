"""Parameters read where the user turned autocast off.

[Note: parameters read outside autocast]
Under ``bf16-mixed`` and ``16-mixed`` payloads are in the compute dtype, where Lightning keeps fp32 parameters and
autocast casts per op. Code that turns autocast off to compute in fp32 — a mixture of experts' router
(``with torch.autocast("cuda", enabled=False): self.gate(x.float())``), a vector quantiser's codebook distances
under ``@torch.autocast("cuda", enabled=False)`` — met a bf16 weight beside its fp32 input and failed ("expected
m1 and m2 to have the same dtype") where plain Lightning trains; an op with no other tensor (``self.scale.exp()``)
computed in bf16 what plain Lightning computes in fp32.

While a checked step runs (the warm-up's micro-batches and the first evaluation step, under the torch-function mode that
looks for released parameters, ``reads.py``), an op run with autocast off for the engine's device that reads a parameter
whose payload is narrower than the parameter's own dtype (or a view of one) marks it: from the next repack on it keeps
its own dtype, in chunks of their own, as BatchNorm's parameters do ([Note: normalisation in mixed precision] in
``engine/config.py``), and so computes as under plain Lightning. Until then the op gets the payload cast up to the
widest floating dtype among its other tensors: the weights rounded to the compute dtype, as FSDP's ``MixedPrecision``
hands them, the gradient flowing back through the cast; so does a module's forward that activation checkpointing runs
again in that step's backward (``recomputing``: a mode pushed and popped by the module's own hooks, since a mode entered
around ``backward()`` is popped while its handler runs the call). An op that raises on a payload's dtype beside wider
tensors with autocast on (one autocast does not cast: ``layer_norm`` on CPU given an fp32 spectrum) marks its parameters
the same way and runs again cast up. And a vector or scalar parameter (a norm's weight, a temperature) read by an op
whose result is wider than the compute dtype (autocast ran it in fp32, as CUDA's does ``layer_norm`` and ``exp``, or it
promoted to an fp32 operand) is marked too: plain Lightning's op reads it whole, and such payloads cost little in fp32
(a matrix is left in the compute dtype: an L2 penalty's ``norm`` would move whole models). The ranks agree on the marked
parameters (a union) at the end of each checked step; they move at the next micro-batch that holds no gradients before
or after the warm-up, else at the warm-up's own repack. With Lightning's validation sanity check before training they
move before the first training step, and training equals plain Lightning's from it; without one, the first step computes
those ops with rounded weights. A sharded checkpoint names them (``outside_autocast`` in its ``meta.pt``), so a resume,
which runs no sanity check, moves them before its first step. A tensor made from payloads that keeps one's shape
(``self.weight + 1.0`` under autocast, handed to ``layer_norm`` with autocast off, as Nemotron's norm does) counts as
those parameters: an op with autocast off marks them, and one that fails on its dtype runs again with it cast up
(Nemotron's bias, read as it is, moved to fp32 and left the shifted weight in bf16 beside it). An op only a later
step runs (a branch the checked steps did not take) is not seen: its error gets a note naming the way out
(``explain_dtype_mismatch`` in ``errors.py``), ``ChunkPrecision(full_precision_modules=[...])`` with the module's class.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm.collectives import Collectives
from ..errors import dtype_mismatch
from ..memory.manager import ChunkManager
from .reads import CastUp


class OutsideAutocast:
    """Marks the parameters ops read with autocast off ([Note: parameters read outside autocast]) and casts their
    payloads up for those ops until they move. ``pending``: marked by every rank, not yet moved."""

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self.device_type = manager.device.type
        self._found: set[int] = set()  # marked on this rank since the last agreement
        self.pending: set[int] = set()
        self._recomputing: list[CastUp | None] = []  # the modes of the recomputed forwards running, innermost last
        # id -> (the tensor, weakly; the narrowed parameters it was computed from): shape-keeping results of ops on
        # payloads (``weight + 1``, ``weight * mask``) made since the last agreement
        self._derived: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[int]]] = {}
        self.moved: set[int] = set()  # given their own dtype; a checkpoint names them, for its resume to move

    @property
    def active(self) -> bool:
        """Whether steps run under autocast over payloads narrower than their parameters (a mixed precision)."""
        return self.manager.dtypes.mixed and self.manager.dtypes.autocast

    def _narrowed(self, i: int) -> bool:
        key = self.manager.specs[i].key
        return not key.own_dtype and self.manager.dtypes.compute_for(key.dtype) != key.dtype

    def call(self, func: Any, args: tuple, kwargs: dict, flat: list[Any], spec: Any) -> Any:
        """Run one op (``flat``, ``spec``: its arguments flattened) under the marks' cast; an op that failed on a
        payload's dtype beside wider tensors with autocast on (one autocast does not cast: ``layer_norm`` on CPU)
        marks its parameters and runs again cast up."""
        converted = self.convert(flat)
        if converted is not None:
            args, kwargs = tree_unflatten(converted, spec)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            made = any(self._sources(t, derived=True) - self._sources(t) for t in flat)  # from payloads
            again = None if converted is not None and not made else self.convert(flat, failed=e)
            if again is None:
                raise
            args, kwargs = tree_unflatten(again, spec)
            return func(*args, **kwargs)
        if converted is None:
            self._mark_widened(flat, out)
            self._derive(flat, out)
        return out

    def _derive(self, flat: list[Any], out: Any) -> None:
        """Remember ``out`` as computed from the narrowed parameters among ``flat`` where it keeps the shape and the
        compute dtype of one of them (``weight + 1.0`` under autocast, then read with autocast off: Nemotron's
        ``LayerNorm1P``), so that an op reading it with autocast off marks them (``convert``)."""
        if not isinstance(out, torch.Tensor) or out.dtype != self.manager.dtypes.compute_dtype:
            return
        sources: set[int] = set()
        shaped = False
        for t in flat:
            found = self._sources(t, derived=True)
            if found:
                sources |= found
                shaped = shaped or t.shape == out.shape
        if sources and shaped:
            self._derived[id(out)] = (weakref.ref(out), frozenset(sources))

    def _sources(self, t: Any, *, derived: bool = False) -> frozenset[int]:
        """The narrowed parameters ``t`` is (or views), or with ``derived`` was computed from (``_derive``)."""
        i = self._index(t)
        if i is not None:
            return frozenset((i,)) if self._narrowed(i) else frozenset()
        entry = self._derived.get(id(t)) if derived and isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is t else frozenset()

    def _mark_widened(self, flat: list[Any], out: Any) -> None:
        """A vector or scalar parameter (a norm's weight, a temperature) read by an op whose result is wider than the
        compute dtype (autocast runs it in fp32, as CUDA's does ``layer_norm`` and ``exp``, or it promoted to an fp32
        operand) is marked: plain Lightning's op reads it whole, and its payload costs little in fp32."""
        small = [i for t in flat if (i := self._index(t)) is not None and t.dim() <= 1 and self._narrowed(i)]
        if not small:
            return
        low = self.manager.dtypes.compute_dtype
        first = next((o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point()), None)
        if low is not None and first is not None and first.dtype.itemsize > low.itemsize:
            self._found.update(small)

    def _index(self, t: Any) -> int | None:
        """The managed parameter ``t`` is, or is a view of."""
        if not isinstance(t, torch.Tensor):
            return None
        i = self.manager.index_of.get(id(t))
        return self.manager.index_of.get(id(t._base)) if i is None and t._base is not None else i

    def convert(self, flat: list[Any], failed: BaseException | None = None) -> list[Any] | None:
        """The tensors of one op's arguments, with the marked parameters cast up; ``None`` when none changed.
        ``failed``: what the op raised as it was, cast up only for a dtype mismatch, then with the tensors made from
        payloads (``_derive``) too. Those mark their parameters in any case (an op that reads one beside a marked
        parameter would meet it in the compute dtype beside the moved one) but are cast up only where the op failed:
        cast where it promotes them, they would change what it saves for backward, which activation checkpointing's
        recomputation, outside any module's cast, compares."""
        if failed is None and torch.is_autocast_enabled(self.device_type):
            return None
        low = self.manager.dtypes.compute_dtype
        if failed is not None and (low is None or not dtype_mismatch(failed, low)):
            return None
        hits: list[int] = []
        widest: torch.dtype | None = None
        for k, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                continue
            sources = self._sources(t, derived=True)
            if sources:
                self._found.update(sources)
                if failed is not None or self._index(t) is not None:  # one made from payloads: where the op failed
                    hits.append(k)
            elif t.is_floating_point() and (widest is None or t.dtype.itemsize > widest.itemsize):
                widest = t.dtype
        if not hits or widest is None or widest.itemsize <= flat[hits[0]].dtype.itemsize:
            return None
        out = list(flat)
        for k in hits:
            out[k] = flat[k].to(widest)
        return out

    def recomputing(self, started: bool) -> None:
        """A module's forward starts (or ends) again in backward (activation checkpointing): while marked parameters
        wait to move, it runs under the cast, as the step's own forward did."""
        if started:
            mode = CastUp(self) if self.active and (self._found or self.pending) else None
            if mode is not None:
                mode.__enter__()
            self._recomputing.append(mode)
        elif self._recomputing and (mode := self._recomputing.pop()) is not None:
            mode.__exit__(None, None, None)

    def agree(self, comm: Collectives) -> None:
        """At the end of a checked step (every rank's): the parameters any rank marked become ``pending``."""
        found = sorted(self._found)
        self._found.clear()
        self._derived.clear()
        if comm.world_size > 1:
            found = sorted({i for part in comm.all_gather_object(found) for i in part})
        self.pending.update(found)

    def take(self) -> None:
        """Give the pending parameters their own dtype in the layout keys (the caller repacks)."""
        mgr = self.manager
        mgr.specs = [
            dataclasses.replace(s, key=dataclasses.replace(s.key, own_dtype=True)) if i in self.pending else s
            for i, s in enumerate(mgr.specs)
        ]
        self.moved |= self.pending
        self.pending.clear()

    def restore(self, names: Iterable[str]) -> None:
        """A resumed checkpoint's ``moved``: pending here, to move before the first step as in the run that saved it
        (a resumed fit runs no sanity check to find them)."""
        if self.active:
            index = {n: i for i, n in enumerate(self.manager.names)}
            self.pending.update(index[n] for n in names if n in index and self._narrowed(index[n]))
