"""One optimizer's whole state of some parameters, between steps, and what was written into it back into the pieces.

[Note: the whole optimizer state of a parameter]
During ``fit`` an optimizer's state is keyed by this rank's pieces of the parameters ([Note: optimizer state keyed
by shards] in ``shard_state.py``), so a callback that logs Adam's moments per parameter, or zeroes them for a layer
it re-initialised (a new head, an embedding resized), had no way in: ``optimizer.state[p]`` raises, and after ``fit``
only ``materialize_optimizer_state=True`` gathered everything. DeepSpeed offers ``safe_get_full_optimizer_state``
and ``safe_set_full_optimizer_state`` for one parameter at a time. ``full_optimizer_state`` is one block for many,
in the shape of ``full_parameters``:

- inside, a dict maps each requested parameter that the optimizer steps to its whole state as plain torch would keep
  it in ``optimizer.state[p]``: the same keys, per-element state (Adam's moments) in the parameter's shape and the
  state's own dtype, on the host, and ``step`` and other scalars as the optimizer holds them; ``{}`` for one the
  optimizer has not stepped yet. Each chunk holding one is gathered once per per-element key one of them has (a
  collective with several ranks: every rank enters with the same parameters), chunks in id order;
- on leaving, with ``writeback``, each rank writes its piece of every per-element value that changed (in place, or
  assigned to the key) into its own state, in place, so the one-pass kernel's flat regions ([Note: Adam's moments in
  flat regions] in ``host_adam.py``) and a disk chunk's state file keep serving; a changed scalar or whole-parameter
  state (``step``, Adafactor's ``row_var``) is written on every rank that holds a piece. Keys cannot be added or
  removed (a piece's state has the keys its kernel made), nor a value's shape changed: that raises, naming them.

A resumed checkpoint's state, left for the first step ([Note: optimizer state read after the warm-up] in
``load.py``), is read in first. Inside a backward the block is refused, and after it until the optimizer step where
chunks stepped in backward: their state is already this step's, where plain torch's is the last step's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..chunks.chunk import Role
from ..chunks.repack import piece_range
from ..errors import ChunkError
from ..memory.consolidate import _per_element, optimizer_state_parts, state_shard
from ..memory.full_params import param_indices

_ALONE = (
    "It reads every rank's pieces of the state, so every rank calls it: one under "
    "`if trainer.is_global_zero:` waits for ranks that never come. Call it on every rank; log or print on one."
)


@contextlib.contextmanager
def full_optimizer_state(
    engine: Any,
    binding: Any,
    params: torch.nn.Module | torch.Tensor | Iterable[torch.Tensor] | None = None,
    *,
    writeback: bool = True,
) -> Iterator[dict[torch.Tensor, dict[str, Any]]]:
    """Give the whole state ``binding``'s optimizer keeps for ``params`` (a module's parameters, one parameter or
    several; all it steps when ``None``) while the block runs; with ``writeback``, what was changed goes back into
    the pieces ([Note: the whole optimizer state of a parameter]). A collective with several ranks."""
    mgr = engine.manager
    settled_state(engine, "full_optimizer_state()")
    steps = {i for group in binding.group_params for i in group}
    wanted = sorted(steps & param_indices(mgr, params))
    views, state = binding.views(), binding.optimizer.state
    parts = optimizer_state_parts(mgr, views, state, binding.whole_keys)
    # copies: a rank's own ``step`` (on the host already) is the state itself, which writeback=False must not change
    given: dict[int, dict[str, Any]] = {i: _copied(parts.scalars.get(i, {})) for i in wanted}
    chunks = [c for c in mgr.chunks if any(t.slot.param_index in given for t in c.tensors)]
    for c in chunks:  # chunk-id order on every rank, the keys of the parameters asked for: the all-gathers pair up
        for key in parts.in_chunk(c, given):
            full = mgr.gather_shard(c, state_shard(mgr, c, parts, key))
            for t in c.tensors:
                i = t.slot.param_index
                if i in given and parts.has(i, key):  # [Note: state keys a parameter has] in consolidate.py
                    given[i][key] = full[t.offset : t.offset + t.numel].view(t.shape).clone()
    mgr.tiers.page_out()
    before = {i: {k: _mark(v) for k, v in st.items()} for i, st in given.items()}
    out = {mgr.params[i]: st for i, st in given.items()}
    ok = False
    try:
        yield out
        ok = True
    finally:
        if ok and writeback:  # after an exception the other ranks may not be here
            _write_back(mgr, binding, given, before)


def settled_state(engine: Any, what: str) -> None:
    """Before ``what`` reads the optimizer's state outside its step: not inside a backward nor, stepping in backward,
    between one and the step; every rank here (a collective follows); a resumed state read in."""
    if torch._C._current_graph_task_id() != -1:
        raise ChunkError(
            f"{what} cannot be called inside a backward (a hook or an autograd function): call it between "
            "steps (on_train_batch_end, on_before_optimizer_step without step_in_backward)."
        )
    early = engine.early
    if early is not None and early.stepped:  # the same on every rank: they step the same chunks in backward
        raise ChunkError(
            f"{what} between a backward and the optimizer step: with step_in_backward=True "
            f"{len(early.stepped)} chunks have stepped already, so their state is this step's where plain "
            "Lightning's is the last one's. Call it after the step (on_train_batch_end), or pass "
            "step_in_backward=False."
        )
    engine.manager.comm.roll_call(engine.hooks.where(), what=what, advice=_ALONE)
    engine.settle_state()


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _mark(v: Any) -> Any:
    """What tells a value changed: a tensor's identity, version counter and a copy of a small one (scalars are
    often replaced by an equal new tensor); anything else as it is."""
    if not torch.is_tensor(v):
        return ("value", v)
    return ("tensor", v, v._version, v.detach().clone() if v.numel() <= 64 else None)


def _changed(now: Any, mark: tuple[Any, ...]) -> bool:
    if mark[0] == "value":
        return bool(now != mark[1]) if not torch.is_tensor(now) else True
    _, was, version, small = mark
    if now is was:
        return bool(now._version != version)
    if small is not None and torch.is_tensor(now) and now.shape == small.shape:
        return not torch.equal(now.detach().to(small.device, small.dtype), small)
    return True


def _write_back(mgr: Any, binding: Any, given: dict[int, dict[str, Any]], before: dict[int, dict[str, Any]]) -> None:
    """Each rank's piece of every changed per-element value, and every changed scalar, into its own state."""
    views, state = binding.views(), binding.optimizer.state
    for i, st in given.items():
        name, was = mgr.names[i], before[i]
        if set(st) != set(was):
            added, gone = sorted(set(st) - set(was)), sorted(set(was) - set(st))
            raise ChunkError(
                f"full_optimizer_state(): the state of {name!r} "
                + (f"gained {added} " if added else "")
                + ("and " if added and gone else "")
                + (f"lost {gone} " if gone else "")
                + f"inside the block; it keeps the keys it had ({sorted(was)}). Change their values in place "
                "(zero_() the moments, fill_() the step) instead."
            )
        changed = [k for k in st if _changed(st[k], was[k])]
        if not changed:
            continue
        v = views.get(i)
        mine = state.get(v) if v is not None else None
        if not mine:  # no piece of it on this rank (or a state only other ranks keep: none is made here)
            continue
        chunk, t = mgr.lookup(mgr.params[i])
        a, b = piece_range(chunk, t.offset, t.numel)
        mgr.readers.before_change()  # a save running beside training has what it reads first
        with mgr.tiers.writing(chunk, (Role.OPTIM,)):
            for k in changed:
                _write(name, k, st[k], mine, t, a, b, v.numel(), binding.whole_keys)
    mgr.tiers.page_out()


def _write(name: str, key: str, new: Any, mine: dict[str, Any], t: Any, a: int, b: int, numel: int, whole: Any) -> None:
    """Key ``key`` of this rank's state of the parameter described by ``t`` (its piece ``[a, b)``), from ``new``."""
    old = mine.get(key)
    if torch.is_tensor(old) and _per_element(key, old, numel, whole):
        value = torch.as_tensor(new)
        if value.shape != t.shape:
            raise ChunkError(
                f"full_optimizer_state(): state {key!r} of {name!r} was given shape {tuple(value.shape)}; it has the "
                f"parameter's shape {tuple(t.shape)}."
            )
        old.copy_(value.reshape(-1)[a - t.offset : b - t.offset].reshape(old.shape))
    elif torch.is_tensor(old):
        value = torch.as_tensor(new)
        if value.shape != old.shape:
            raise ChunkError(
                f"full_optimizer_state(): state {key!r} of {name!r} was given shape {tuple(value.shape)}; it has "
                f"shape {tuple(old.shape)}."
            )
        old.copy_(value)  # in place: a kernel may hold it (the fused step's count on the device)
    else:
        mine[key] = new
