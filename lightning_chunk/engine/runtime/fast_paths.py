"""torch's transformer fast paths in the steps checked op by op.

[Note: torch's fast paths in checked steps]
Out of training mode, torch's ``MultiheadAttention`` runs one native attention op, and ``TransformerEncoder`` turns a
padded batch into a nested tensor (its outputs at padded positions are then zeros), only where
``torch.overrides.has_torch_function`` is false for their tensors; any torch-function mode on the stack makes it
true. The steps checked op by op for released parameters ([Note: parameters read outside their owner] in
``reads.py``: the warm-up's micro-batches and the first evaluation step) run under such a mode, so there these modules
took their slow paths where plain Lightning took the fast ones. In a probe (2026-12-06, 32-true, CPU) the first
validation batch of an encoder given a padding mask came out 3e-7 from plain Lightning's at the tokens and 1.86 at
the padded positions (computed instead of zero), every later batch equal; and an encoder frozen in eval mode, run
under ``no_grad`` in ``training_step``, changed the warm-up steps' losses, so training left plain Lightning's bits.

So the forward of each such module out of training mode runs with the checking modes that carry no marks taken off
the stack, and put back as it returns or raises. Nothing is lost: ``MultiheadAttention`` and the encoder's layers are
leaves whose whole subtree is gathered at their forward ([Note: leaf modules] in ``leaves.py``), and the encoder
reads its first layer's tensors by attribute, which the watch sees (and adopts), and computes nothing with them
itself. A mode with marks (mixed precision: [Note: parameters read outside autocast]) stays; autocast keeps the fast
paths off there in plain Lightning too. Another mode on the stack (a user's) stays where it was.

``TransformerEncoderLayer``'s own fused op stays off: torch refuses it to a layer whose modules have forward hooks,
and the engine's gather hooks are on the layer (as FSDP's and DeepSpeed's would be). Its slow path then calls the
attention's fast path, which gave the same bits as the fused op in the same probe.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch._C import _len_torch_function_stack, _pop_torch_function_stack, _push_on_torch_function_stack

from .reads import ReleasedReads

FAST_PATH_MODULES: tuple[type, ...] = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoder)
_eager = torch.compiler.disable  # as the engine's other hooks ([Note: hooks under torch.compile] in hooks.py)


def _stack() -> list[Any]:
    """The thread's torch-function modes, bottom first, taken off."""
    return [_pop_torch_function_stack() for _ in range(_len_torch_function_stack())][::-1]


def _checking(mode: Any) -> bool:
    return isinstance(mode, ReleasedReads) and mode.marks is None


_taken = threading.local()  # per thread: (module id, the modes taken off or None) of each hooked forward


def install(module: torch.nn.Module) -> list[Any]:
    """Hooks on every instance of ``FAST_PATH_MODULES`` in ``module`` that take the checking modes off the stack around
    its forward; their handles. Plain functions: a deep copy or a pickle of the module takes them by reference."""
    handles = []
    for mod in module.modules():
        if isinstance(mod, FAST_PATH_MODULES):
            handles.append(mod.register_forward_pre_hook(_before))
            handles.append(mod.register_forward_hook(_after, always_call=True))
    return handles


def _calls() -> list[tuple[int, list[Any] | None]]:
    calls = getattr(_taken, "calls", None)
    if calls is None:
        calls = _taken.calls = []
    return calls


@_eager
def _before(mod: torch.nn.Module, args: Any) -> None:
    whole = None
    if not mod.training and _len_torch_function_stack():
        whole = _stack()
        kept = [m for m in whole if not _checking(m)]
        for m in kept:
            _push_on_torch_function_stack(m)
        if len(kept) == len(whole):
            whole = None
    _calls().append((id(mod), whole))


@_eager
def _after(mod: torch.nn.Module, args: Any, output: Any) -> None:
    calls = _calls()
    if not calls or calls[-1][0] != id(mod):  # a hook before ours raised: ours never ran for this call
        return
    whole = calls.pop()[1]
    if whole is None:
        return
    above = _stack()[sum(not _checking(m) for m in whole) :]  # modes the forward left pushed, if any
    for m in whole + above:
        _push_on_torch_function_stack(m)
