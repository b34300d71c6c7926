"""``module.state_dict()`` and ``module.load_state_dict()`` between steps, through hooks on the modules.

[Note: a module's state dict between steps]
Between its uses a parameter is a view of its chunk's payload: a placeholder of NaN while released, else this
rank's compute-dtype copy, stale once the optimizer stepped ([Note: parameters outside a step] in
``full_params.py``). Each module that owns packed parameters gets three hooks (``state_dict_hooks``):

- *Saving.* ``state_dict()`` read those payloads: placeholders a user would save without a word
  (``torch.save(model.state_dict(), ...)`` in a callback), or a stale bf16 copy of an fp32 model. With one rank,
  whose master shards hold the whole model, each packed parameter's entry becomes its master value in its own dtype
  (a view when the dtypes agree and the shard is not on disk); with several ranks, where only a collective can
  assemble it, the call raises ``ChunkError`` saying to save through Lightning or inside ``full_parameters()``
  (every rank). ``keep_vars=True`` entries (the parameters themselves, which the engine's own callers ask for) are
  left alone.
- *Loading.* ``load_state_dict()`` after set-up (pretrained weights loaded in ``on_fit_start``, a callback that
  restores the best weights in ``on_train_end``) copied into the payload views: into a placeholder it failed ("more
  than one element of the written-to tensor refers to a single memory location"), into a compute-dtype copy it
  raised as a write that would be lost. Every entry a state dict holds is a whole value, so no collective is needed:
  the pre-hook gives each packed parameter with an entry of its shape a fresh tensor (the entry itself, in the
  parameter's own dtype) for torch's copy to land in, and the post-hook of the module that opened the first one
  (an ancestor of every module that opens one before its own post-hook runs) writes each rank's piece of every
  value into its master shard and compute copy (``load_values``, which lets a stale resident payload go), then
  points the parameters back at their payloads. Writing once, at the outermost post-hook, matters: two modules'
  parameters can share a chunk, and re-pointing a chunk while an ancestor's parameter still holds its fresh tensor
  would take that tensor for a ``.data`` the user assigned. As in plain PyTorch the optimizer's state is left as it
  is, missing and unexpected keys are reported as torch reports them, and every rank must load the same values (as
  under DDP). ``assign=True``, which would replace the packed parameters, is refused. A load inside a
  micro-batch (``training_step``, a forward) is left to torch: the step holds its parameters gathered, and a write
  into a copy is refused where it would be lost.

Calls inside ``full_parameters()``, where the parameters hold their whole values, are left to torch, as are modules
not packed yet (set-up) and deep copies of a module, which keep its hooks.

[Note: a deep copy between steps]
``copy.deepcopy`` of a module whose parameters are released copies their placeholders: a model of NaN, silently.
That is how torch's EMA recipe starts (``AveragedModel(pl_module)`` in a callback's ``on_fit_start``, then
``update_parameters`` after each step), and how a frozen teacher or a DPO reference model is made once training
has begun: on one rank under host placement every averaged weight was NaN after the first step. Each module that
owns packed parameters gets a ``__deepcopy__`` of its own (``_CopyGuard``, in its instance ``__dict__``, which
``copy.deepcopy`` looks up first): while one of those parameters is released and ``full_parameters()`` is not open,
it raises ``ChunkError`` naming the parameter, ``full_parameters()`` and ``ChunkEMA``; otherwise (resident values, a
copy inside the block) it copies as torch does, without itself. A pickled module carries no guard.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ..chunks.chunk import Role, Tier
from ..chunks.parked import show
from ..errors import ChunkError
from .consolidate import load_values
from .full_params import _IN_A_STEP


def state_dict_hooks(
    module: torch.nn.Module, mgr: Any, is_open: Callable[[], bool], in_a_step: Callable[[], bool]
) -> list[Any]:
    """Install the hooks of [Note: a module's state dict between steps]; returns their handles. ``is_open``:
    whether ``full_parameters()`` is open; ``in_a_step``: whether a micro-batch runs."""
    handles = []
    loading = _Loading(mgr)
    for mod in module.modules():
        mine = {n: mgr.index_of[id(p)] for n, p in mod._parameters.items() if p is not None and id(p) in mgr.index_of}
        if mine:
            handles.append(mod.register_state_dict_post_hook(_master_entries(mgr, mine, is_open)))
            handles.append(mod.register_load_state_dict_pre_hook(loading.opener(mine, is_open, in_a_step)))
            handles.append(mod.register_load_state_dict_post_hook(loading.closer()))
            handles.append(_CopyGuard(mod, mgr, mine, is_open))
    return handles


def _no_guard() -> None:
    """What a pickled ``_CopyGuard`` becomes: ``__deepcopy__ = None``, which ``copy.deepcopy`` skips."""
    return None


class _CopyGuard:
    """A module's ``__deepcopy__`` while its parameters are packed ([Note: a deep copy between steps])."""

    def __init__(self, module: torch.nn.Module, mgr: Any, mine: dict[str, int], is_open: Callable[[], bool]) -> None:
        self.module, self.mgr, self.mine, self.is_open = module, mgr, mine, is_open
        module.__dict__["__deepcopy__"] = self

    def __call__(self, memo: dict[int, Any]) -> torch.nn.Module:
        mgr, module = self.mgr, self.module
        if not self.is_open():
            for name, i in self.mine.items():
                if module._parameters.get(name) is mgr.params[i] and self._released(i):
                    raise ChunkError(
                        f"copy.deepcopy would copy parameter {mgr.specs[i].name!r} as NaN: chunk_offload released its "
                        "chunk after use, and a parameter shows a placeholder until the next gather. Copy inside "
                        "`with trainer.strategy.full_parameters():` (every rank), or before fit (__init__, setup, "
                        "configure_model); for an average of the weights use lightning_chunk.ChunkEMA, which keeps "
                        "each rank's share beside the shards, or make and update torch's AveragedModel inside that "
                        "block too (its update_parameters reads the parameters after each step, where they are "
                        "released)."
                    )
        del module.__dict__["__deepcopy__"]
        try:
            return copy.deepcopy(module, memo)
        finally:
            module.__dict__["__deepcopy__"] = self

    def _released(self, i: int) -> bool:
        try:
            return bool(self.mgr.lookup(self.mgr.params[i])[0].params_parked)
        except KeyError:  # not packed (set-up, a repack): the parameter holds its own value
            return False

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _no_guard, ()

    def remove(self) -> None:
        if self.module.__dict__.get("__deepcopy__") is self:
            del self.module.__dict__["__deepcopy__"]


def _master_entries(mgr: Any, mine: dict[str, int], is_open: Callable[[], bool]) -> Callable[..., None]:
    # a closure, not functools.partial: copy.deepcopy(module) copies a partial's arguments (the whole manager) but
    # shares a function
    def hook(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if not is_open():
            _fill_masters(mgr, module, mine, state_dict, prefix)

    return hook


def _fill_masters(
    mgr: Any, module: torch.nn.Module, mine: dict[str, int], state_dict: dict[str, Any], prefix: str
) -> None:
    for name, i in mine.items():
        key = prefix + name
        v = state_dict.get(key)
        if v is None or isinstance(v, torch.nn.Parameter):  # keep_vars=True: the parameter itself is asked for
            continue
        if module._parameters.get(name) is not mgr.params[i]:  # a deep copy of the module, which kept the hook
            continue
        try:
            chunk, info = mgr.lookup(mgr.params[i])
        except KeyError:  # not packed yet (set-up): the parameter holds its own value
            continue
        if mgr.comm.world_size > 1:
            raise ChunkError(
                f"state_dict() of a module trained by chunk_offload on {mgr.comm.world_size} ranks is not available "
                f"between steps ({key!r} is sharded across the ranks; its payload is released or a stale copy). Save "
                "through Lightning (trainer.save_checkpoint, ModelCheckpoint: every rank), or call state_dict() "
                "inside `with trainer.strategy.full_parameters():` on every rank; after fit the module is whole."
            )
        with mgr.tiers.reading(chunk, (Role.MASTER,)):  # a disk shard's file is paged in meanwhile
            value = chunk.master_tensor_for_read()[info.offset : info.offset + info.numel].view(info.shape)
            state_dict[key] = value.to(info.orig_dtype, copy=chunk.shard_tier is Tier.DISK).detach()


class _Loading:
    """One ``load_state_dict`` call's opened parameters (index -> the fresh tensor torch copies into), and the
    module that opened the first of them, whose post-hook writes them all."""

    def __init__(self, mgr: Any) -> None:
        self.mgr = mgr
        self.opened: dict[int, torch.Tensor] = {}
        self.first: torch.nn.Module | None = None

    def opener(self, mine: dict[str, int], is_open: Callable[[], bool], in_a_step: Callable[[], bool]) -> Any:
        mgr = self.mgr

        def hook(
            module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *_: Any
        ) -> None:
            if is_open() or in_a_step():
                return
            for name, i in mine.items():
                param: torch.nn.Parameter = mgr.params[i]
                value = state_dict.get(prefix + name)
                if module._parameters.get(name) is not param or not torch.is_tensor(value) or i in self.opened:
                    continue  # a deep copy; no entry, or one torch reports; a tied parameter opened already
                if value.shape != param.shape:
                    continue
                try:
                    _, info = mgr.lookup(param)
                except KeyError:  # not packed yet (set-up): torch copies into the parameter's own value
                    continue
                if info.state in _IN_A_STEP:
                    continue
                if local_metadata.get("assign_to_params_buffers"):
                    raise ChunkError(
                        f"load_state_dict(assign=True) would replace {prefix + name!r}, a parameter chunk_offload "
                        "packed into its chunks; call it without assign=True (the values are copied into the shards)."
                    )
                if self.first is None:  # not `or`: a module with __len__ (an empty ModuleList) is falsy
                    self.first = module
                self.opened[i] = value.detach().to(info.orig_dtype, copy=True)
                show(param, self.opened[i])

        return hook

    def closer(self) -> Callable[..., None]:
        def hook(module: torch.nn.Module, incompatible_keys: Any) -> None:
            if module is self.first:
                self.write()

        return hook

    def write(self) -> None:
        """Each rank's piece of every opened value into its shards; the parameters back at their payloads."""
        mgr, values = self.mgr, self.opened
        self.opened, self.first = {}, None
        chunks = {}
        for i in values:
            chunk, info = mgr.lookup(mgr.params[i])
            info.pointed()  # the fresh tensor is the engine's own, not a .data the user assigned
            chunks[chunk.chunk_id] = chunk
        try:
            load_values(mgr, values)
            mgr.tiers.page_out()
        finally:
            for chunk in chunks.values():
                chunk.point_params()
