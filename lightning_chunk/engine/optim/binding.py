"""The hybrid optimizer: the user's own optimizer, stepping master shards where they live.

[Note: per-parameter views of the master shards]
The optimizer keeps its class, hyperparameters, param groups and object identity
(LR schedulers stay bound to it): only the tensors in ``param_groups`` change.
Each parameter is replaced by a flat *view* of its piece of this rank's master
shard, not by the whole shard. That costs nothing (fused and foreach kernels take
lists of tensors) and keeps plain-PyTorch semantics exact where a flat
chunk-wide step would not: a parameter that got no gradient this step has
``grad is None`` and is skipped, with its own ``step`` count, exactly as in
``torch.optim``; frozen parameters never decay; optimizer state stays keyed by
parameter, so checkpoints map one to one onto the plain format.

Adam-family steps run torch's fused kernels (``fused=True``), which group the
tensors by device: host shards go through the fused CPU kernel and device
shards through the fused device kernel in the same ``step()``: that is the
hybrid Adam. Optimizers whose update needs parameter shapes (LBFGS, Adafactor,
Muon, ...) cannot step flat views and are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..chunks.chunk import Chunk, Role, TensorInfo, Tier
from ..config import ChunkConfig
from ..errors import UnsupportedOptimizerError
from ..memory.consolidate import gather_optimizer_state, local_optimizer_state, optimizer_state_parts, state_shard
from ..memory.manager import ChunkManager
from ..system.host_heap import release_freed_memory
from .host_adam import HostAdam


class GradSlot(NamedTuple):
    """A view the optimizer steps and where its gradient is."""

    param: int  # the parameter's index in the manager
    view: torch.Tensor  # the optimizer's view of the parameter's piece of the master shard
    chunk: Chunk
    info: TensorInfo  # the parameter's state in its chunk (whether it got a gradient this step)
    grad: torch.Tensor | None  # its slice of the chunk's gradient shard


ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop", "Adadelta"}
)
SHAPE_DEPENDENT = frozenset({"LBFGS", "SparseAdam", "Adafactor", "Muon"})


def check_optimizer(optimizer: torch.optim.Optimizer, config: ChunkConfig) -> None:
    name = type(optimizer).__name__
    is_torch = type(optimizer).__module__.startswith("torch.optim")
    if name in SHAPE_DEPENDENT:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__qualname__} needs parameter shapes (or a closure over whole tensors), but "
            f"chunk_offload steps flat shards of parameters; use one of {', '.join(sorted(ELEMENTWISE))}."
        )
    if not (is_torch and name in ELEMENTWISE) and not config.assume_elementwise_optimizer:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not known to update each element on its "
            "own; chunk_offload steps flat shards of parameters. Known element-wise optimizers: "
            f"{', '.join(sorted(ELEMENTWISE))}. "
            "If yours is element-wise, pass assume_elementwise_optimizer=True to the strategy."
        )


def state_bytes_per_element(optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of optimizer state per parameter element, found by stepping a 4-element copy once."""
    kwargs = {k: v for k, v in group.items() if k in optimizer.defaults and k not in ("params", "fused", "foreach")}
    probe = torch.zeros(4, dtype=dtype)
    probe.grad = torch.zeros(4, dtype=dtype)
    try:
        twin = type(optimizer)([probe], **kwargs)
        twin.step()
    except Exception:  # an unusual constructor: assume Adam's two moments
        return 2 * probe.element_size()
    return (
        sum(v.numel() * v.element_size() for v in twin.state[probe].values() if torch.is_tensor(v) and v.numel() == 4)
        // 4
    )


def _split_at_cache_lines(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group is stepped by torch's fused CPU Adam(W), which splits its work between threads at
    cache-line boundaries: its bits do not depend on the thread count (``DiskStorage.beside_io``). Other kernels
    split element-wise loops anywhere, and a scalar tail may round differently from the vector body."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(
        g.get("fused") for g in optimizer.param_groups
    )


class OptimizerBinding:
    """Rebinds one optimizer's param groups to master-shard views and feeds them gradients."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, manager: ChunkManager, group_offset: int, config: ChunkConfig
    ) -> None:
        check_optimizer(optimizer, config)
        self.optimizer = optimizer
        self.manager = manager
        self.config = config
        self.group_offset = group_offset
        self.group_params: list[list[int]] = [
            [manager.index_of[id(p)] for p in g["params"]] for g in optimizer.param_groups
        ]
        self._views: dict[int, torch.Tensor] = {}
        self._attached: set[int] = set()  # views whose gradient attach_grads set (see sync_zero_grad)
        # per view: where its gradient is (GradSlot), built on first attach
        self._grad_slots: list[GradSlot] | None = None
        self._by_chunk: dict[int, list[GradSlot]] | None = None
        self._choose_kernel()
        one_pass = {"auto": "auto", "one_pass": True}.get(config.optimizer_kernel, False)
        self.host_adam = HostAdam(optimizer, manager, one_pass)
        self.fresh_low: set[int] = set()  # chunks whose compute copy the last step wrote ([Note: one pass ...])

    def _choose_kernel(self) -> None:
        """The kernel flags each group steps with ([Note: the kernel and the user's param groups])."""
        kernel = self.config.optimizer_kernel
        self.kernel_flags: list[dict[str, Any]] = []
        for g in self.optimizer.param_groups:
            has_fused = "fused" in g
            flags: dict[str, Any] = {}
            if kernel == "auto":
                if has_fused and g.get("fused") is None and g.get("foreach") is None and not g.get("differentiable"):
                    flags["fused"] = True
            elif kernel in ("fused", "one_pass"):  # one_pass: torch's fused kernel wherever the one pass does not run
                if not has_fused:
                    raise UnsupportedOptimizerError(
                        f"optimizer_kernel={kernel!r} but {type(self.optimizer).__name__} has no fused kernel; "
                        "use optimizer_kernel='auto' or 'foreach'."
                    )
                flags.update(fused=True, foreach=False)
            elif kernel == "foreach":
                flags["foreach"] = True
                if has_fused:
                    flags["fused"] = False
            else:  # loop
                flags["foreach"] = False
                if has_fused:
                    flags["fused"] = False
            self.kernel_flags.append(flags)

    @contextlib.contextmanager
    def kernel(self) -> Iterator[None]:
        """The groups carry the chosen kernel's flags inside this block, the user's own outside it.

        [Note: the kernel and the user's param groups]
        ``optimizer_kernel="auto"`` steps Adam(W) with torch's fused kernel where the user chose none (torch's own
        default on CPU tensors is the single-tensor loop, which rounds otherwise in the last bit). The flags that
        select it are set for the step alone: ``optimizer.param_groups``, ``optimizer.state_dict()`` and every
        checkpoint keep what the user built the optimizer with, so a checkpoint resumed under another strategy
        steps with that strategy's default, and a user who reads the groups sees their own settings."""
        groups = self.optimizer.param_groups
        saved = [{k: g[k] for k in flags if k in g} for g, flags in zip(groups, self.kernel_flags, strict=True)]
        for g, flags in zip(groups, self.kernel_flags, strict=True):
            g.update(flags)
        try:
            yield
        finally:
            for g, flags, old in zip(groups, self.kernel_flags, saved, strict=True):
                for k in flags:
                    if k in old:
                        g[k] = old[k]
                    else:
                        g.pop(k, None)

    def state_bytes(self) -> dict[int, int]:
        """Global group index -> optimizer-state bytes per element of the master shards."""
        out = {}
        for k, g in enumerate(self.optimizer.param_groups):
            idx = self.group_params[k]
            dtype = self.manager.dtypes.master_for(self.manager.params[idx[0]].dtype) if idx else torch.float32
            out[self.group_offset + k] = state_bytes_per_element(self.optimizer, g, dtype)
        return out

    def bind(self, carried: dict[int, dict[str, Any]] | None = None) -> None:
        """Point every group at the current master views and give each view its optimizer state.

        ``carried``: this rank's pieces of the state, keyed by parameter index, as a repack carried them
        ([Note: optimizer state through a repack] in ``repack.py``). ``None`` at the first bind: state the
        optimizer already holds for the module parameters (Adagrad creates its ``sum`` in the constructor;
        a user may have stepped before) is whole, and each rank keeps its own piece of it."""
        new: dict[int, torch.Tensor] = {}
        for k, g in enumerate(self.optimizer.param_groups):
            views = []
            for i in self.group_params[k]:
                v = self.manager.master_view(i)
                if v is None:
                    continue
                new[i] = v
                views.append(v)
            g["params"] = views
        state = self.optimizer.state
        if carried is None:
            whole = {
                i: state.pop(self.manager.params[i])
                for g in self.group_params
                for i in g
                if self.manager.params[i] in state
            }
            carried = local_optimizer_state(self.manager, new, whole)
        for k, g in enumerate(self.optimizer.param_groups):
            step_on_device = bool({**g, **self.kernel_flags[k]}.get("fused") or g.get("capturable"))
            for i in self.group_params[k]:
                v = new.get(i)
                if v is not None and i in carried:
                    state[v] = {key: self._move(val, v, step_on_device) for key, val in carried[i].items()}
        self._views = new
        self._attached = set()
        self._grad_slots = None
        self._by_chunk = None
        self.host_adam.reset()
        self.keep_state()

    # ------------------------------------------------------- disk-tier shards
    def _disk_chunks(self) -> dict[int, Chunk]:
        """Chunks on the disk tier with a view in ``param_groups`` (as narrowed now: ``step_chunk`` steps one
        chunk's) that holds a gradient, in id order."""
        mgr = self.manager
        stepping = {id(v) for g in self.optimizer.param_groups for v in g["params"]}
        found = {}
        for i, v in self._views.items():
            if id(v) not in stepping or v.grad is None:  # a chunk with nothing to step is not read
                continue
            c = mgr.lookup(mgr.params[i])[0]
            if c.shard_tier is Tier.DISK:
                found[c.chunk_id] = c
        return dict(sorted(found.items()))

    def keep_state(self, chunks: Sequence[Chunk] | None = None) -> bool:
        """Move the per-element state of views into disk shards (``chunks``, all when ``None``) into their files;
        True when some state moved (it had been created in memory)."""
        mgr = self.manager
        moved = False
        wanted = None if chunks is None else {c.chunk_id for c in chunks}
        for i, v in self._views.items():
            c = mgr.lookup(mgr.params[i])[0]
            if c.shard_tier is not Tier.DISK or (wanted is not None and c.chunk_id not in wanted):
                continue
            st = self.optimizer.state.get(v)
            if st:
                storage = mgr.storage_of(c)
                for key in list(st):
                    kept = storage.keep_state(c, v, key, st[key])
                    moved = moved or kept is not st[key]
                    st[key] = kept
        return moved

    def _state_in_files(self, c: Chunk) -> bool:
        """Every view of ``c`` that will step has its per-element state in the chunk's file already."""
        mgr, state = self.manager, self.optimizer.state
        storage = mgr.disk
        for t in c.tensors:
            v = self._views.get(t.slot.param_index)
            if v is None or v.grad is None:
                continue
            st = state.get(v)
            if not st or not all(storage.keeps(c, val) for val in st.values() if torch.is_tensor(val) and val.dim()):
                return False
        return True

    def _step_staged(self, staged: Any, **kwargs: Any) -> Any:
        """Step the narrowed param groups on the staged twins of their views ([Note: staged optimizer steps] in
        ``disk_storage.py``): twin parameters, gradients and per-element state; scalar state (``step``) is shared."""
        state = self.optimizer.state
        twins = {}
        for g in self.optimizer.param_groups:
            new = []
            for v in g["params"]:
                tw = staged.like(v, Role.MASTER)
                if v.grad is not None:
                    tw.grad = staged.like(v.grad, Role.GRAD)
                st = state.get(v)
                if st:
                    state[tw] = {
                        k: (staged.like(x, Role.OPTIM) if torch.is_tensor(x) and staged.holds(x, Role.OPTIM) else x)
                        for k, x in st.items()
                    }
                twins[id(tw)] = (v, tw)
                new.append(tw)
            g["params"] = new
        try:
            return self.optimizer.step(**kwargs)
        finally:
            for v, tw in twins.values():
                st = state.pop(tw, None)
                if st is not None:  # scalars the step replaced rather than updated in place
                    for k, x in st.items():
                        if not (torch.is_tensor(x) and x.dim()):
                            state[v][k] = x
                tw.grad = None

    def step(self, **kwargs: Any) -> Any:
        """The optimizer's own ``step(**kwargs)``: large host chunks with a compute copy in one pass ([Note: one
        pass over a host shard] in ``host_adam.py``), disk chunks one at a time, the rest in one call."""
        with self.kernel():
            stepped, self.fresh_low = self.host_adam.step_one_pass(self._views)
            if not stepped:
                return self._step_rest(**kwargs)
            with self._only(lambda v: id(v) not in stepped):  # the optimizer still steps (its hooks, an LR
                return self._step_rest(**kwargs)  # scheduler's count), over the other views only

    @contextlib.contextmanager
    def _only(self, keep: Callable[[torch.Tensor], bool]) -> Iterator[None]:
        """Narrow every param group to the views ``keep`` accepts, and restore them after (also on an error):
        hyperparameters, LR schedulers and per-view state stay as they are."""
        groups = self.optimizer.param_groups
        full = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, full, strict=True):
                g["params"] = [v for v in params if keep(v)]
            yield
        finally:
            for g, params in zip(groups, full, strict=True):
                g["params"] = params

    def _step_rest(self, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)`` over the views in ``param_groups``, disk chunks one at a time.

        [Note: stepping disk shards] With shards on the disk tier one ``step()`` over every view
        would page the whole tier in at once. Here the views of memory-resident shards step
        first, in one call, and then each disk chunk's views in a call of their own: its
        master and optimizer state are paged in (the next chunk's are being read ahead meanwhile),
        stepped, and written back while the next one steps. ``param_groups`` are narrowed to
        the chunk's views for the call and restored after, so hyperparameters, LR schedulers
        and per-parameter ``step`` counts are untouched; an element-wise optimizer computes the
        same bits whichever call a view is stepped in. Optimizer state the step creates (the
        first step) moves into the chunk's file at once. Step hooks run once per call."""
        disk = self._disk_chunks()
        if not disk:
            return self.optimizer.step(**kwargs)
        mgr = self.manager
        chunk_of = {id(v): mgr.lookup(mgr.params[i])[0].chunk_id for i, v in self._views.items()}
        out = None
        storage = mgr.disk
        with self._only(lambda v: chunk_of.get(id(v)) not in disk):
            if any(g["params"] for g in self.optimizer.param_groups):
                out = self.optimizer.step(**kwargs)
        order = list(disk.values())
        staged = {c.chunk_id: self._state_in_files(c) for c in order}  # else through the mapping (a first step)
        # the I/O thread copies while this one steps: leave it a core, where the kernel's bits do not depend on it
        with storage.beside_io() if _split_at_cache_lines(self.optimizer) else contextlib.nullcontext():
            pending = storage.stage_in(order[0]) if staged[order[0].chunk_id] else None
            for k, c in enumerate(order):
                current, nxt = pending, (order[k + 1] if k + 1 < len(order) else None)
                pending = None
                if nxt is not None:  # read while this chunk steps
                    if staged[nxt.chunk_id]:
                        pending = storage.stage_in(nxt)
                    else:
                        storage.prefetch(nxt, (Role.MASTER, Role.OPTIM), write=True)
                        storage.prefetch(nxt, (Role.GRAD,))
                with self._only(functools.partial(_in_chunk, chunk_of, c.chunk_id)):
                    if current is not None:
                        storage.wait(current)
                        out = self._step_staged(current, **kwargs)
                        storage.stage_out(current, (Role.MASTER, Role.OPTIM))
                        continue
                    with storage.writing(c, (Role.MASTER, Role.OPTIM)), storage.reading(c, (Role.GRAD,)):
                        out = self.optimizer.step(**kwargs)
                        moved = self.keep_state([c])
                if moved:  # the state this step created in memory went to the file: give its pages back
                    release_freed_memory()
        storage.flush()  # what comes next reads the files through the mapping
        return out

    @staticmethod
    def _move(val: Any, like: torch.Tensor, step_on_device: bool) -> Any:
        """Per-element state follows the view (flat, on its device); scalar ``step`` where the kernel wants it."""
        if not torch.is_tensor(val):
            return val
        if val.dim() > 0:
            if val.numel() != like.numel():
                raise ValueError(
                    f"optimizer state of {val.numel()} elements for a shard piece of {like.numel()}: "
                    "state must be carried by piece, not by parameter"
                )
            return val.reshape(like.shape).to(device=like.device)
        return val.to(like.device if step_on_device else "cpu")

    # ----------------------------------------------------- plain state format
    def _positions(self) -> list[int]:
        """Param index of each position in this rank's ``optimizer.state_dict()`` numbering."""
        return [i for k in range(len(self.group_params)) for i in self.group_params[k] if i in self._views]

    def plain_state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` as the unchunked optimizer would write it (whole state, parameter shapes).

        A collective with several ranks: every rank calls it and gets the whole state."""
        plain_pos = self.plain_positions()
        whole = gather_optimizer_state(self.manager, self._views, self.optimizer.state, plain_pos)
        return {
            "state": {plain_pos[i]: st for i, st in sorted(whole.items(), key=lambda kv: plain_pos[kv[0]])},
            "param_groups": self.plain_param_groups(plain_pos),
        }

    def plain_positions(self) -> dict[int, int]:
        """Parameter index -> its position in the unchunked optimizer's ``state_dict``."""
        return {i: n for n, i in enumerate(i for g in self.group_params for i in g)}

    def plain_param_groups(self, plain_pos: dict[int, int]) -> list[dict[str, Any]]:
        """The param groups as the unchunked optimizer's ``state_dict`` writes them (the user's kernel flags)."""
        return [
            {
                **{key: v for key, v in g.items() if key != "params"},
                "params": [plain_pos[i] for i in self.group_params[k]],
            }
            for k, g in enumerate(self.optimizer.param_groups)
        ]

    def load_plain_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a state dict written by the unchunked optimizer (or by ``plain_state_dict``); each rank keeps its
        piece."""
        order = [i for g in self.group_params for i in g]
        whole: dict[int, dict[str, Any]] = {}
        for k, st in sd["state"].items():
            k = int(k)
            if k >= len(order):
                raise ValueError(
                    f"optimizer state names parameter position {k}, but the optimizer has {len(order)} "
                    "parameters: the checkpoint was written for another model or optimizer"
                )
            whole[order[k]] = st
        if len(sd["param_groups"]) != len(self.group_params):
            raise ValueError(
                f"the optimizer state has {len(sd['param_groups'])} param groups, the optimizer has "
                f"{len(self.group_params)}: the checkpoint was written for another optimizer"
            )
        mine = local_optimizer_state(self.manager, self._views, whole)
        self.load_local_state(mine, [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]])

    def load_local_state(self, mine: dict[int, dict[str, Any]], hypers: list[dict[str, Any]]) -> None:
        """Load this rank's pieces of per-parameter state (flat, like the views) and the groups' hyperparameters."""
        pos = self._positions()
        local_groups = []
        n = 0
        for k, g in enumerate(hypers):
            count = sum(1 for i in self.group_params[k] if i in self._views)
            local_groups.append({**g, "params": list(range(n, n + count))})
            n += count
        self.optimizer.load_state_dict(
            {"state": {p: mine[i] for p, i in enumerate(pos) if i in mine}, "param_groups": local_groups}
        )
        self._choose_kernel()  # the loaded groups carry the saver's kernel flags
        for g in self.optimizer.param_groups:
            on_device = bool(g.get("fused") or g.get("capturable"))
            for v in g["params"]:
                st = self.optimizer.state.get(v)
                if st and torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(v.device if on_device else "cpu")
        self.host_adam.reset()
        self.keep_state()

    def unbind(self, *, whole_state: bool = True) -> None:
        """Point the optimizer back at the module parameters, with whole state in their shapes (e.g. when ``fit``
        ends). Without ``whole_state`` (after a failure on another rank) the state is dropped: no collectives."""
        mgr = self.manager
        whole = (
            gather_optimizer_state(mgr, self._views, self.optimizer.state, range(len(mgr.params)))
            if whole_state
            else {}
        )
        for k, g in enumerate(self.optimizer.param_groups):
            g["params"] = [mgr.params[i] for i in self.group_params[k]]
        self.optimizer.state.clear()
        for i, st in whole.items():
            self.optimizer.state[mgr.params[i]] = st
        self._views = {}
        self.host_adam.reset()

    def views(self) -> dict[int, torch.Tensor]:
        return self._views

    def chunk_groups(self) -> range:
        """The global param-group indices of this optimizer (a chunk belongs to exactly one group)."""
        return range(self.group_offset, self.group_offset + len(self.group_params))

    # ------------------------------------------------------------ gradients
    def attach_grads(self) -> None:
        """Give each view its gradient (``None`` where the parameter got none), for ``step()`` and clipping.

        [Note: zero_grad on a rebound optimizer] As ``param.grad`` in plain PyTorch, the gradients are
        attached at the end of every backward and stay attached after the step. ``optimizer.zero_grad()``
        then sets them to ``None`` (or zeroes them in place, with ``set_to_none=False``) through the
        views, and ``sync_zero_grad`` reads that back before the flags are used again (the next backward,
        the next step): a gradient the user cleared is overwritten, one that was not is accumulated into,
        exactly as in ``torch.optim`` (a GAN's ``opt_g.zero_grad()`` drops the generator gradients of the
        discriminator's backward, also before ``opt_g`` first stepped). Reading the views rather than
        wrapping ``zero_grad`` also works through Lightning's ``LightningOptimizer``, which calls the
        optimizer class's method on itself."""
        attached = set()
        for i, v, chunk, info, g in self._slots():
            if info.has_grad and g is not None and not chunk.grad_released:  # released: stepped in backward
                if v.grad is not g:
                    v.grad = g
                attached.add(i)
            elif v.grad is not None:
                v.grad = None
        self._attached = attached

    def _slots(self) -> list[GradSlot]:
        """The ``GradSlot`` of every view. Gradient buffers persist until the next repack (a released one keeps its
        storage object): the slices can be kept."""
        if self._grad_slots is None:
            mgr = self.manager
            self._grad_slots = [
                GradSlot(i, v, *mgr.lookup(mgr.params[i]), mgr.grad_slice(i)) for i, v in self._views.items()
            ]
        return self._grad_slots

    def _chunk_slots(self, chunk: Chunk, *, with_grad: bool = True) -> list[GradSlot]:
        """The slots (``_slots``) of ``chunk``'s views (``with_grad``: those that got a gradient this step)."""
        if self._by_chunk is None:
            self._by_chunk = {}
            for slot in self._slots():
                self._by_chunk.setdefault(slot.chunk.chunk_id, []).append(slot)
        slots = self._by_chunk.get(chunk.chunk_id, ())
        return [s for s in slots if not with_grad or (s.info.has_grad and s.grad is not None)]

    def steps_on_this_rank(self, chunk: Chunk) -> bool:
        """This rank's shard of ``chunk`` holds a piece of a parameter this optimizer steps (not padding alone)."""
        return bool(self._chunk_slots(chunk, with_grad=False))

    def step_chunk(self, chunk: Chunk, **kwargs: Any) -> Any:
        """``step(**kwargs)`` over the views of ``chunk`` alone, with their gradients attached for the call
        ([Note: stepping in backward] in ``early_step.py``); other param groups' views are left out as well."""
        mine = self._chunk_slots(chunk)
        if not mine:
            return None
        ids = {id(s.view) for s in mine}
        with self._grads_for_the_call(mine), self.kernel():
            stepped, fresh = self.host_adam.step_one_pass(self._views, only=ids)
            self.fresh_low |= fresh
            rest = ids - stepped
            if not rest:
                return None
            with self._only(lambda v: id(v) in rest):
                return self._step_rest(**kwargs)

    def step_staged_chunk(self, chunk: Chunk, staged: Any, grads: torch.Tensor, **kwargs: Any) -> bool:
        """``step(**kwargs)`` over the views of disk chunk ``chunk`` alone, on ``staged`` (its master and optimizer
        state, being read by ``DiskStorage.stage_in``) with ``grads`` (the uint8 buffer its gradients gathered in)
        as the gradient file's twin, then the master and state written back on the I/O thread
        ([Note: stepping disk chunks in backward] in ``early_step.py``). False, with nothing stepped, when a view
        would step for the first time (its state would be created in the staging buffer): step it otherwise."""
        mine = self._chunk_slots(chunk)
        if not mine:
            return True
        storage = self.manager.disk
        ids = {id(s.view) for s in mine}
        with self._grads_for_the_call(mine):
            if not self._state_in_files(chunk):
                return False
            storage.wait(staged)  # its read iterates ``staged.files``: the twin below is a new object
            with_grads = dataclasses.replace(
                staged,
                files={**staged.files, Role.GRAD: storage.file(chunk, Role.GRAD)},
                bufs={**staged.bufs, Role.GRAD: grads},
            )
            with self._only(lambda v: id(v) in ids), self.kernel():
                with storage.beside_io() if _split_at_cache_lines(self.optimizer) else contextlib.nullcontext():
                    self._step_staged(with_grads, **kwargs)
            storage.stage_out(staged, (Role.MASTER, Role.OPTIM))
            return True

    @contextlib.contextmanager
    def _grads_for_the_call(self, mine: list[GradSlot]) -> Iterator[None]:
        """The slots' views hold their gradients for the block, and none after it (also on an error)."""
        for _i, v, _c, _info, g in mine:  # GradSlot
            v.grad = g
        try:
            yield
        finally:
            for _i, v, _c, _info, _g in mine:
                v.grad = None
            self._attached.difference_update(s.param for s in mine)

    def detach_released(self) -> None:
        """Views whose chunk gave its gradient shard back hold no gradient (as after ``zero_grad()``)."""
        for i, v, c, _info, _g in self._slots():
            if c.grad_released:
                v.grad = None
                self._attached.discard(i)

    def sync_zero_grad(self) -> None:
        """Forget the gradients ``zero_grad()`` set to ``None`` since they were attached: those parameters', and
        (as the optimizer's ``zero_grad`` ran) those of this optimizer's parameters this rank holds no piece of."""
        if not self._attached:
            return
        cleared = [i for i in self._attached if self._views[i].grad is None]
        self._attached.difference_update(cleared)
        if cleared:
            elsewhere = [i for g in self.group_params for i in g if i not in self._views]
            self.manager.clear_grads(cleared + elsewhere)

    def detach_grads(self) -> None:
        for v in self._views.values():
            v.grad = None
        self._attached = set()

    def grads(self) -> list[torch.Tensor]:
        return [v.grad for v in self._views.values() if v.grad is not None]

    def grad_chunks(self) -> list[tuple[Chunk, torch.Tensor]]:
        """``grads()`` with the chunk each gradient lives in (to page disk shards around a pass over them)."""
        mgr = self.manager
        return [(mgr.lookup(mgr.params[i])[0], v.grad) for i, v in self._views.items() if v.grad is not None]


class OptimizerStateCarrier:
    """Carries every bound optimizer's per-element state through a repack, piece by piece
    ([Note: optimizer state through a repack] in ``repack.py``). Building it is a collective."""

    def __init__(self, manager: ChunkManager, bindings: Sequence[OptimizerBinding]) -> None:
        self.manager = manager
        self.bindings = list(bindings)
        # every rank agrees on the state keys and on each parameter's scalar state (``step``)
        self.parts = [optimizer_state_parts(manager, b.views(), b.optimizer.state) for b in self.bindings]
        self.owner = {g: k for k, b in enumerate(self.bindings) for g in b.chunk_groups()}
        self.pieces: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in self.bindings]

    def take(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        k = self.owner.get(chunk.spec.key.group)
        if k is None or not self.parts[k].keys:
            return {}
        parts, b = self.parts[k], self.bindings[k]
        out = {key: state_shard(self.manager, chunk, parts, key) for key in sorted(parts.keys)}
        for t in chunk.tensors:  # the old state goes now: a repack never holds two copies of it
            i = t.slot.param_index
            parts.local.pop(i, None)
            v = b.views().get(i)
            if v is not None:
                b.optimizer.state.pop(v, None)
        return out

    def give(self, param_index: int, pieces: dict[str, torch.Tensor], chunk: Chunk, offset: int) -> None:
        k = self.owner.get(self.manager.specs[param_index].key.group)
        if k is not None and param_index in self.parts[k].scalars:  # a parameter with no state gets none
            storage = self.manager.storage_of(chunk)  # a disk shard takes its pieces into its file now
            self.pieces[k][param_index] = {key: storage.keep_piece(chunk, offset, key, v) for key, v in pieces.items()}

    def state_for(self, k: int) -> dict[int, dict[str, Any]]:
        """Binding ``k``'s state on this rank after the repack: scalars merged across ranks, per-element pieces."""
        parts = self.parts[k]
        out = {i: dict(st) for i, st in parts.scalars.items()}
        for i, pieces in self.pieces[k].items():
            out.setdefault(i, {}).update(pieces)
        return out


def _in_chunk(chunk_of: dict[int, int], cid: int, v: torch.Tensor) -> bool:
    return chunk_of.get(id(v)) == cid
