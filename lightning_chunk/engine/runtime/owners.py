"""Which module owns which parameters: the modules the hooks go on, and the chunks each one's moments ask for."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from ..memory.manager import ChunkManager
from ..schedule.tracer import ROOT
from .leaves import LeafModules
from .reads import __file__ as reads_file

_log = logging.getLogger(__name__)
_DYNAMO = f"{os.sep}torch{os.sep}_dynamo{os.sep}"
# frames that hold a module as ``self`` without being its code: attribute look-ups, iteration, the read itself
_NOT_READERS = frozenset({torch.nn.modules.module.__file__, __file__, reads_file})


class ModuleOwners:
    """Module key -> the parameters it owns directly (a leaf module: its whole subtree's, [Note: leaf modules]), and
    per layout the chunks that hold them. Known from construction on, not from the hooks' ``install``: the first
    layout's chunk size is chosen before the hooks go in, and it sizes each module's chunks from this (with it
    empty, the automatic chunk size saw no module's chunks and took a size whose first step failed)."""

    def __init__(self, module: torch.nn.Module, manager: ChunkManager, leaf_modules: tuple[type | str, ...]) -> None:
        self.module = module
        self.manager = manager
        self.owned: dict[str, tuple[int, ...]] = {}  # module key -> indices of the parameters it owns directly
        self.index: dict[str, int] = {}  # module key -> its number, for collective tags
        self.modules: dict[str, torch.nn.Module] = {}  # module key -> module (not those inside a leaf)
        self._key_of: dict[int, str] = {}  # id(module) -> its key; inside a leaf, the leaf's
        self._chunks_of: dict[str, tuple[int, ...]] = {}
        self._layout_seen: object = None
        is_leaf = LeafModules(leaf_modules)
        inside_leaf: set[int] = set()
        index_of = manager.index_of
        for name, mod in module.named_modules():
            if id(mod) in inside_leaf:
                continue  # a leaf above gathers its parameters
            key = name or ROOT
            self.modules[key] = mod
            self._key_of[id(mod)] = key
            leaf = is_leaf(mod)  # the root too: it then owns every parameter, gathered for the whole step
            if leaf:
                inside_leaf.update(id(m) for m in mod.modules() if m is not mod)
                self._key_of.update((id(m), key) for m in mod.modules())
            own = tuple(dict.fromkeys(index_of[id(p)] for p in mod.parameters(recurse=leaf) if id(p) in index_of))
            if own:
                self.owned[key] = own
                self.index[key] = len(self.index)
        is_leaf.refuse_unmatched("leaf_modules", module)

    def chunks_of(self, key: str) -> tuple[int, ...]:
        """The chunks that hold the parameters ``key`` owns, in the current layout."""
        if self._layout_seen is not self.manager.layout:  # a (re)pack changed the chunk ids
            self._layout_seen = self.manager.layout
            params = self.manager.params
            self._chunks_of = {k: self.manager.chunk_ids_of([params[i] for i in own]) for k, own in self.owned.items()}
        return self._chunks_of.get(key, ())

    def holders_of(self, chunk: int) -> list[str]:
        """The modules whose parameters ``chunk`` holds."""
        self.chunks_of(ROOT)  # current layout
        return [k for k, ids in self._chunks_of.items() if chunk in ids]

    def adopt(self, key: str, index: int) -> bool:
        """``key``'s module owns parameter ``index`` from now on, beside the module that holds it; whether the module
        owned none before (its hooks are then to be installed)."""
        mgr = self.manager
        new = key not in self.owned
        if new:
            self.index[key] = len(self.index)
        own = self.owned[key] = (*self.owned.get(key, ()), index)
        self.chunks_of(key)
        self._chunks_of[key] = mgr.chunk_ids_of([mgr.params[j] for j in own])
        _log.info(
            "parameter %r is read by %s outside the module that holds it: gathered with it from now on",
            mgr.lookup(mgr.params[index])[1].name,
            "the root module" if key == ROOT else f"module {key!r}",
        )
        return new

    def reader(self, not_readers: frozenset[str]) -> str | None:
        """The key of the innermost module of the model whose code runs now (the root outside every other), looking
        up from the caller's caller past the frames of ``not_readers``' files (those that hold a module as ``self``
        without being its code); ``None`` while dynamo traces the code (it reads every parameter to make them graph
        inputs)."""
        f: Any = sys._getframe(2)
        skip = not_readers | _NOT_READERS
        while f is not None:
            if _DYNAMO in f.f_code.co_filename:
                return None
            if f.f_code.co_filename not in skip:
                key = self._key_of.get(id(f.f_locals.get("self")))
                if key is not None:
                    return key
            f = f.f_back
        return ROOT

    def param_name(self, t: torch.Tensor) -> str | None:
        """The name of the parameter ``t`` is, or is a view of (``w.T``)."""
        for candidate in (t, t._base):
            if candidate is not None and id(candidate) in self.manager.index_of:
                return self.manager.lookup(candidate)[1].name
        return None


def leaf_hint(root: torch.nn.Module, keys: list[str]) -> str:
    """For ranks that ran different modules ``keys``: the module nearest above all of them that runs code of its
    own (a mixture of experts choosing its experts from the data), offered as a leaf, which gathers its whole
    subtree at its forward whichever children then run; "" where that is the root."""
    parts = [k.split(".") for k in keys if k != ROOT]
    common: list[str] = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    while common:  # a ModuleList or ModuleDict has no forward: the module that holds it chooses
        mod = root.get_submodule(".".join(common))
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            break
        common.pop()
    if len(parts) < 2 or not common:
        return ""
    name = type(root.get_submodule(".".join(common))).__name__
    return (
        f" If {'.'.join(common)!r} ({name}) chooses from the data which of its children run (a mixture of "
        "experts), run every child, on no rows where none was chosen (each then gets a zero gradient, as a fused "
        "experts tensor does), or make it a leaf, gathered whole at its forward whichever children run: "
        f'MemoryOptions(leaf_modules=["{name}"]).'
    )
