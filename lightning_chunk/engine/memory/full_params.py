"""The parameters' whole values between steps, and what was written into them back into the shards.

[Note: parameters outside a step]
Between its uses a parameter is a view of its chunk's payload, which is this rank's compute-dtype copy (stale
until the next gather once the optimizer stepped the shards; released to a placeholder under host placement and
with several ranks, [Note: a released parameter] in ``chunks/parked.py``). So what a callback read between steps
depended on the placement and the world size, and what it wrote (an EMA copied in at the end of training, a weight
clamped after ``opt.step()``) was silently lost the next time the chunk was gathered from its shards.
``full_parameters`` is the one way in, like FSDP's ``summon_full_params`` and DeepSpeed's ``GatheredParameters``:

- each chunk holding one of the requested parameters is gathered from the master shards (a collective with several
  ranks: every rank enters with the same parameters), and each parameter's ``.data`` becomes a fresh tensor with
  its whole value in its own dtype, on the compute device (the host with ``offload_to_cpu``);
- on leaving, with ``writeback``, each rank writes its piece of every value (or of a ``.data`` assigned inside) back
  into its master shard and the compute-dtype copies, and a stale resident payload is released to be gathered
  again. An element the caller left as it was keeps its master value, so a bf16 model whose masters are fp32 loses
  no precision by being looked at;
- the parameters then point at their payload views (or placeholders) again. The optimizer's state is not touched.

A write outside the block into a resident payload that is a copy of the shard (mixed precision, or several ranks
between a gather and the next step) would be lost without a word when the payload is gathered or written back
again. Written through the parameter (``p.clamp_()``, ``p.copy_()``, ``load_state_dict``, ``reset_parameters()``
under ``no_grad``), it bumps the parameter's version counter: each micro-batch and evaluation step first compares
the counters with those taken when the parameters were last pointed at their payloads (``check_stray_writes``) and
raises ``ChunkError`` naming the parameter; so do a save and the end of ``fit``, which no micro-batch follows. A write
during a step (``nn.Embedding(max_norm=...)`` renormalises the rows its forward looks up) is caught when the payload is
released, before the counter is taken again (``Chunk.point_params``); in a resident copy, by the next check. An
assignment ``p.data = x`` is caught by its storage ([Note: a replaced .data] in ``chunk.py``), a write through
``p.data`` (``p.data.mul_()``) by its values ([Note: writes through .data]). A chunk whose payload *is* its shard
(one rank, the shard on the device, no mixed precision) keeps what is written into it, so it is not checked: the
write trains.

``module.state_dict()`` and ``module.load_state_dict()`` between steps go through hooks instead
([Note: a module's state dict between steps] in ``module_state.py``).

Inside, the engine is closed: a forward (whose hooks would gather into the payloads under the caller's feet) raises
``ChunkError``, as does entering during a forward or backward, where autograd holds the payloads' values.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..chunks.chunk import Role, lost_write, storage_of
from ..chunks.parked import engine_reads, show
from ..chunks.repack import piece_range
from ..chunks.states import TensorState
from ..errors import ChunkError
from .consolidate import chunk_values, load_values

S = TensorState
_IN_A_STEP = (S.COMPUTE, S.HOLD_AFTER_FWD, S.READY_FOR_REDUCE, S.READY_FOR_REDUCE_FREE)
_ALONE = (
    "The block gathers every rank's shards, as FSDP's summon_full_params does, so every rank enters it: one under "
    "`if trainer.is_global_zero:` waits for ranks that never come. Enter it on every rank; save or print on one."
)


@contextlib.contextmanager
def full_parameters(
    engine: Any,
    params: torch.nn.Module | torch.Tensor | Iterable[torch.Tensor] | None = None,
    *,
    writeback: bool = True,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Give ``params`` (a module's parameters, one parameter or several; every packed parameter when ``None``) their
    whole values while the block runs; with ``writeback``, what was written into them goes back into the shards.
    ``with_grads``: their ``.grad`` too ([Note: gradients in full_parameters]). A collective with several ranks."""
    mgr, hooks = engine.manager, engine.hooks
    if hooks.closed is not None:
        raise ChunkError("full_parameters() is already open: it cannot be nested.")
    if torch._C._current_graph_task_id() != -1:
        raise ChunkError(
            "full_parameters() cannot be entered inside a backward (a hook or an autograd function): "
            "enter it between steps, or in training_step before the forward or after the optimizer step."
        )
    busy = sorted({t.name for c in mgr.chunks for t in c.tensors if t.state in _IN_A_STEP})
    held = {mgr.names[i] for i in hooks.held()}
    if busy and set(busy) <= held:
        raise ChunkError(
            f"full_parameters() cannot be entered while {len(busy)} parameters read by iteration in this "
            f"training_step are in use ({', '.join(busy[:4])}{', ...' if len(busy) > 4 else ''}): a read of "
            "self.parameters() holds them to the end of the micro-batch's backward, and after it to the next "
            "micro-batch. Enter the block first and read them inside it."
        )
    if busy:
        raise ChunkError(
            f"full_parameters() cannot be entered between a forward and its backward: {len(busy)} "
            f"parameters are in use ({', '.join(busy[:4])}{', ...' if len(busy) > 4 else ''}). Enter it "
            "between steps, or in training_step before the forward or after the optimizer step."
        )
    # one rank alone would wait in the gathers below ([Note: a forward outside a step] in group.py)
    mgr.comm.roll_call(hooks.where(), what="full_parameters()", advice=_ALONE)
    if with_grads:  # before the chunks are listed: in the first step this is the warm-up's repack (new chunks)
        engine.grads_ready("full_parameters(with_grads=True)")
    wanted = param_indices(mgr, params)
    chunks = [c for c in mgr.chunks if any(t.slot.param_index in wanted for t in c.tensors)]
    with_grad = _with_gradients(engine, chunks, wanted) if with_grads else set()
    device = torch.device("cpu") if offload_to_cpu else mgr.device
    values: dict[int, torch.Tensor] = {}
    grads: dict[int, tuple[torch.Tensor, int]] = {}  # the gradient given and its version counter then
    assigned: list[tuple[Any, torch.Tensor]] = []  # parameters whose .data the block replaced, and the new value
    ok = False
    try:  # a gather that fails part-way still points every parameter back at its payload
        for c in chunks:  # chunk-id order on every rank: the all-gathers pair up
            whole = chunk_values(mgr, c, device=device)
            mine = [t for t in c.tensors if t.slot.param_index in wanted]
            whole_grads = (
                chunk_values(mgr, c, device=device, grads=True)
                if any(t.slot.param_index in with_grad for t in c.tensors)
                else {}
            )
            for t in mine:
                i = t.slot.param_index
                values[i] = whole[i]
                show(t.param, whole[i])
                if i in with_grad:
                    t.param.grad = whole_grads[i]
                    grads[i] = (whole_grads[i], whole_grads[i]._version)
        hooks.closed = (
            "a forward inside full_parameters(): leave the block first (the parameters hold their whole "
            "values there, not the chunks' payloads the hooks gather into)."
        )
        yield
        ok = True
    finally:
        hooks.closed = None
        for c in chunks:  # what was written inside goes back below (with writeback=False it is let go, as asked)
            for t in c.tensors:
                value = values.get(t.slot.param_index)
                if value is None:
                    t.version = t.param._version
                    continue
                if storage_of(t.param) != storage_of(value):
                    assigned.append((t, t.param.data))
                t.pointed()  # the block's value or one assigned to .data: not a stray write
        try:
            if ok and writeback:  # after an exception the other ranks may not be here: no collective, no write
                _take_assigned(assigned, values)
                if with_grads:
                    _write_grads(engine, chunks, wanted, grads)
                load_values(mgr, values, keep_unchanged=True)
                mgr.tiers.page_out()
        finally:
            for c in chunks:
                for t in c.tensors:
                    if with_grads and t.slot.param_index in wanted:
                        t.param.grad = None
                c.point_params()


def _with_gradients(engine: Any, chunks: list[Any], wanted: set[int]) -> set[int]:
    """[Note: gradients in full_parameters]
    Between a backward and the optimizer step (``on_before_optimizer_step``, where Lightning's ``grad_norm`` is
    meant to run) a parameter's ``.grad`` is ``None``: its gradient lives in the chunks' gradient shards, each rank
    holding a piece of the average over ranks. ``full_parameters(with_grads=True)`` (FSDP's ``summon_full_params``
    argument) gathers them as it gathers the values: each wanted parameter that got a gradient on any rank gets its
    whole gradient, the one the optimizer will read (after the ranks' vote, unscaled under fp16 once Lightning calls
    ``on_before_optimizer_step``), in the parameter's dtype. On leaving, with ``writeback``, a gradient changed in
    place or replaced goes back into this rank's piece of the shard (elements left as they were keep their fp32
    value), and one set to ``None`` is skipped by the step, as ``torch.optim`` skips a parameter without a gradient.
    A gradient cannot be given to a parameter that got none (it has no gradient to add to on the other ranks).
    Refused while a micro-batch's gradients still wait in the gradient payloads (``sharded_accumulation=False``
    inside accumulation) and with ``step_in_backward=True`` (gone after backward)."""
    mgr = engine.manager
    waiting = [c.chunk_id for c in chunks if c.grad_payload is not None]  # left there by no_sync()
    if waiting:
        raise ChunkError(
            f"full_parameters(with_grads=True): the gradients of chunks {waiting[:8]} still wait in their gradient "
            "payloads (sharded_accumulation=False, inside gradient accumulation), not in the shards this block "
            "reads. Read them at the step (on_before_optimizer_step) or set sharded_accumulation=True."
        )
    order = [t for c in chunks for t in c.tensors if t.slot.param_index in wanted]
    # after the vote a rank keeps the flag only where it holds a piece: the union over ranks is the parameter's
    flags = torch.tensor(
        [t.has_grad and t.requires_grad for t in order], dtype=torch.uint8, device=mgr.comm.tensor_device()
    )
    if mgr.comm.world_size > 1 and order:
        mgr.comm.all_reduce(flags, op="max", what="the vote on which parameters' gradients full_parameters gathers")
    return {t.slot.param_index for t, f in zip(order, flags.tolist(), strict=True) if f}


def _write_grads(engine: Any, chunks: list[Any], wanted: set[int], given: dict[int, tuple[torch.Tensor, int]]) -> None:
    """Each rank's piece of what the block left in the gradients ([Note: gradients in full_parameters])."""
    mgr = engine.manager
    for c in chunks:
        lo, _ = c.shard_range
        for t in c.tensors:
            i = t.slot.param_index
            if i not in wanted:
                continue
            now = t.param.grad
            if i not in given:
                if now is not None:
                    raise ChunkError(
                        f"full_parameters(with_grads=True): parameter {t.name!r} got no gradient in "
                        "this step, and a gradient cannot be given to it here; change or remove the "
                        "gradients that exist."
                    )
                continue
            a, b = piece_range(c, t.offset, t.numel)
            if now is None:
                t.has_grad = False  # skipped by the step, as in torch.optim; pieces elsewhere: other ranks did it
                continue
            g, version = given[i]
            if (now is g and now._version == version) or a >= b:
                continue
            with mgr.tiers.writing(c, (Role.GRAD,)):
                shard = c.grad[a - lo : b - lo]
                piece = now.reshape(-1)[a - t.offset : b - t.offset].to(shard.device)
                shard.copy_(torch.where(piece == shard.to(piece.dtype), shard, piece.to(shard.dtype)))
    for b in engine.bindings:
        b.slots.attach()


def _take_assigned(assigned: list[tuple[Any, torch.Tensor]], values: dict[int, torch.Tensor]) -> None:
    """``p.data = x`` inside the block (MoCo's momentum update): ``x`` is the value written back, as an in-place write
    would be ([Note: a replaced .data] in ``chunk.py``)."""
    for t, new in assigned:
        if new.shape != t.shape:
            raise ChunkError(
                f"full_parameters(): parameter {t.name!r} was given a .data of shape {tuple(new.shape)}; its shape "
                f"is {tuple(t.shape)}, and a packed parameter keeps its shape."
            )
        values[t.slot.param_index] = new


def param_indices(mgr: Any, params: torch.nn.Module | torch.Tensor | Iterable[torch.Tensor] | None) -> set[int]:
    """The indices of the packed parameters among ``params`` (a module's, one or several; all when ``None``)."""
    if params is None:
        return set(range(len(mgr.params)))
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    elif isinstance(params, torch.Tensor):
        params = [params]
    out = set()
    for p in params:
        i = mgr.index_of.get(id(p))
        if i is not None:  # not packed (a buffer-like parameter left on the module): it has its value already
            out.add(i)
    return out


def check_stray_writes(mgr: Any, when: str = "outside a step or in the last step's forward") -> None:
    """Raise ``stray_write``'s error, if any."""
    lost = stray_write(mgr, when)
    if lost is not None:
        raise lost


@engine_reads
def stray_write(mgr: Any, when: str) -> ChunkError | None:
    """The error for a parameter of a resident payload that is a copy of its shard written in place since it was last
    pointed at its payload, or one whose ``.data`` was replaced where that is not kept: the write would be lost
    ([Note: parameters outside a step], [Note: a replaced .data] in ``chunk.py``), or one written through ``.data``
    ([Note: writes through .data]). Checked before each micro-batch, a save and the end of ``fit``."""
    lost: ChunkError | None = None
    for c in mgr.chunks:
        for t in c.tensors:
            looked, t.looked = t.looked, None  # each note is compared once
            if lost is None and t.replaced():
                lost = c.keep_replaced(t, when)
            if lost is not None or c.params_parked or c.master_is_payload():
                continue  # a placeholder refuses writes; a payload that is the master keeps them
            if t.param._version != t.version:
                lost = lost_write(t, c.chunk_id, when)
            elif looked is not None and t.view is not None and not torch.equal(bits(t.view), looked):
                lost = lost_write(t, c.chunk_id, when, through_data=True)
    return lost


def bits(t: torch.Tensor) -> torch.Tensor:
    """A checksum of ``t``'s bit patterns: another value in any element changes it (a change that another exactly
    offsets aside). Its bytes are summed as 64-bit words where they lie whole (wrapping, as integers do), the bytes
    at either end one by one: summing 4-byte words widened to 64 bits took 19 times as long on a CPU (4.8 s of a 0.67B
    Llama's set-up, where Lightning's ``zero_grad`` reads every parameter before ``fit`` trains)."""
    t = t.detach()
    if not t.is_contiguous():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return torch.stack([t.view(ints).sum(dtype=torch.int64), t.new_zeros((), dtype=torch.int64)])
    raw = t.reshape(-1).view(torch.uint8)
    head = -raw.storage_offset() % 8  # bytes before the first whole 64-bit word of the storage
    whole = max(raw.numel() - head, 0) // 8 * 8
    words = raw[head : head + whole].view(torch.int64).sum() if whole else raw.new_zeros((), dtype=torch.int64)
    ends = torch.cat([raw[:head], raw[head + whole :]]).sum(dtype=torch.int64)
    return torch.stack([words, ends])


def looked_at(
    mgr: Any, is_open: Callable[[], bool], arm: Callable[[torch.Tensor, bool], None] = lambda p, released: None
) -> Callable[[torch.Tensor, bool], None]:
    """[Note: writes through .data]
    ``p.data.clamp_(-c, c)`` (WGAN's weight clipping as first published), ``pk.data.mul_(m).add_(pq.data, ...)``
    (momentum encoders) write through a tensor that ``.data`` makes afresh, with a version counter of its own: the
    parameter's never moves, and in bf16-mixed on one rank, where the payload is a bf16 copy the step rewrites from
    the fp32 master, the clamp was lost at the next step without a word (0.2 off plain Lightning after 4 steps).
    Between steps (while no step's reader is set, [Note: parameters read outside their owner] in ``reads.py``)
    reading a packed parameter by attribute or iteration notes the bits of its payload view (``bits``), once, where
    the payload is a copy of the shard and resident; the next check (``stray_write``: a micro-batch, a save, the end
    of ``fit``) compares, and a change the engine did not make raises as an in-place write does. The engine's own
    writes into payloads (``write_back``, ``load_values``, a gather's ``point_params``) drop the notes. Code that
    touches no parameter between steps pays nothing; one that does pays a read of what it touched, twice. Reads made
    by this package (a save's ``module.state_dict(keep_vars=True)``) are not noted: the first caller on the stack
    past torch's module code is looked at. Every such read also calls ``arm(param, released)`` ([Note: released
    parameters read between steps] in ``runtime/between_steps.py``). A read inside a backward is the step's, not one
    between steps, though no step's reader is set there (Lightning runs backward after ``training_step`` returns): a
    checkpointed block's recomputation reads its parameters again. Before, each such read noted its bits (a kernel a
    parameter, 96 a step for a 20-block GPT, every note dropped by the step's own write-back) and armed the
    between-steps mode, through which each op of the rest of backward then went in Python."""

    def reader(param: torch.Tensor, by_attribute: bool) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # in a backward: the step's (see above)
        where = mgr.find(param)
        if where is None or is_open():
            return
        chunk, t = where
        if _read_by_this_package():
            return
        arm(param, chunk.params_parked)
        if t.looked is None and t.view is not None and not chunk.params_parked and not chunk.master_is_payload():
            t.looked = bits(t.view)

    return reader


_THIS_PACKAGE = os.sep + "lightning_chunk" + os.sep
_MODULE_CODE = (os.path.join("torch", "nn", "modules", "module.py"), os.path.join("engine", "runtime", "reads.py"))


def released_read(mgr: Any, param: torch.Tensor) -> bool:
    """``param`` is a parameter of a released chunk, read by attribute or iteration by code outside this package
    ([Note: released parameters read between steps] in ``runtime/between_steps.py``); for a watch reader."""
    where = mgr.find(param)
    return where is not None and where[0].params_parked and not _read_by_this_package(depth=3)


def _read_by_this_package(depth: int = 2) -> bool:
    """The first caller past torch's module code and the watch, ``depth`` frames up from here, is this package's."""
    f: Any = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.endswith(_MODULE_CODE):
        f = f.f_back
    return f is not None and _THIS_PACKAGE in f.f_code.co_filename
