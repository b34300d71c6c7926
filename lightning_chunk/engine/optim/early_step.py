"""``step_in_backward=True``: each chunk steps as soon as its gradients are final, and gives its gradient shard back.

[Note: stepping in backward]
ZeRO-3 holds a rank's gradient shard (in fp32 on two ranks, 2 of the 8 bytes a parameter of training state)
from the reduce-scatter that fills it to the optimizer step that reads it, that is, across most of backward.
Here a chunk steps the moment its gradients are final: with several ranks when its reduce-scatter lands, with
one when its last parameter's gradient is copied in. Its gradient shard's memory is then given back
(``Chunk.release_grad``: the storage shrinks to nothing and every view of it stays valid) until the next
gradient, so a rank holds the gradients of a few chunks at a time instead of all of them.

The update is the plain step's, bit for bit: the optimizer is element-wise (``check_optimizer``), so stepping a
chunk's views alone computes what one ``step()`` over every view computes, with the same hyperparameters
(the LR scheduler steps after ``optimizer.step()``, so the learning rate is the step's), and what an optimizer keeps
in its param groups advances once a step ([Note: group state in partial steps] in ``partial_steps.py``). It is exact
only when nothing after backward may change the gradients or veto the step. Clipping by value changes each element alone
([Note: clipping by value in backward]); clipping by norm and fp16 loss scaling read every gradient before any
step (the norm, an overflow), so with them host chunks step on a guess that is checked after backward and undone
where wrong ([Note: speculating past the norm and the overflow] in ``speculation.py``). Refused up front: several
optimizers and manual optimization, which step at times of the user's choosing.

Which parameters got a gradient: the plain step skips a parameter that got none (no weight decay, no ``step``),
and with several ranks the ranks vote on that (one if it got one on any rank, DDP's rule): each chunk's vote
travels with its reduce-scatter where its shard is on the device under a limit ([Note: gradients some ranks
lack] in ``reduce.py``). A chunk steps early only where each of its trainable parameters got a gradient (by its vote on
some rank, else on this rank); a chunk with a
parameter that got none (a branch not taken this step) waits for the vote after backward and steps then, chunk by
chunk, also giving its gradient shard back. The agreement check ([Note: checking once a micro-batch] in
``agreement.py``) runs before the decision. The warm-up step, a micro-batch traced again and the micro-batches
of gradient accumulation that do not step (``ChunkEngine.accumulating``) step after backward as usual.

[Note: the same bytes on every rank after a step]
Ranks plan their evictions and prefetches from the bytes each holds on the device, so those bytes must be the
same on every rank, or the ranks gather and evict different chunks and pair different collectives (on NCCL:
silently mixed weights). After the vote a rank keeps a parameter's gradient flag only where its shard holds a piece
of it, so a chunk whose parameters all lie in another rank's half has no flag here: stepped after backward by that
rule alone, it kept its gradient shard on this rank while the rank holding the pieces gave its own back: the
warm-up step, and with speculation the device chunks of every step. A Llama of 8 layers in bf16-mixed on two ranks
under a 10 MiB limit then failed the collective check in its second step (one 128 KiB gradient shard apart). So
after backward a chunk reduced this step (``grad_written``, the same on every rank) gives its gradient shard back
on every rank, stepped or not.

One more condition is the model's: the chunk's parameters must not be read by backward after their gradients
are final. Autograd runs a parameter's last use before it accumulates its gradient, so that holds unless a
module saves a detached alias of a parameter for a later backward (an in-place step would then be reported by
autograd's version check on one rank; with several ranks the payload is a gathered copy and is not touched).

Costs: ``optimizer.step()`` runs once per chunk (its step hooks too, as on the disk tier: so ``step_in_backward=None``
keeps a fit whose optimizer has hooks stepping after backward), and after ``backward()`` the stepped parameters have
no gradient to read (``on_before_optimizer_step`` sees ``None``).

[Note: clipping by value in backward]
Lightning's ``gradient_clip_algorithm="value"`` clamps every gradient to ``[-v, v]`` after backward; a clamp reads
one element, so each chunk clamps its own gradients just before it steps (``EarlyStep._clip``, the same
``_foreach`` clamps as ``torch.nn.utils.clip_grad_value_``): in backward, after it, and for a disk chunk in the
staging buffer its step reads (``step_staged_chunk``) or in its file. With several ranks the clamp is applied to the
reduced shard, as DDP applies it to the all-reduced gradient; with accumulation, to the sum of the micro-batches.
The call Lightning then makes (``clip_grad_value_`` with the same value) finds nothing left to clip. Clipping by
norm cannot follow: the first chunk to step would need the norm of gradients not computed yet (``speculation.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ..chunks.chunk import Chunk, Role, Tier
from ..errors import UnsupportedOptimizerError
from ..memory.manager import ChunkManager
from .binding import OptimizerBinding
from .disk_in_backward import DiskSteps
from .scaler import DynamicLossScaler
from .speculation import Speculation, refusal
from .step_thread import HostStepThread


class EarlyStep:
    """Steps each chunk of the one optimizer when its gradients are final; the rest after backward, chunk by chunk."""

    def __init__(self, manager: ChunkManager, bindings: Sequence[OptimizerBinding]) -> None:
        if len(bindings) != 1:
            raise UnsupportedOptimizerError(
                f"step_in_backward=True needs exactly one optimizer; got {len(bindings)}. Each chunk steps during "
                "backward, before a second optimizer could step or read its gradients: use step_in_backward=False."
            )
        self.manager = manager
        self.binding = bindings[0]
        self.active = False  # this backward may step: set when it starts (not in a warm-up or a traced step)
        self.stepped: set[int] = set()  # chunk ids stepped since the last ``finish``
        self.early = 0  # chunks stepped during backward since set-up (the rest stepped after it)
        self.disk = DiskSteps(manager, self.binding, manager.tiers.disk)
        self.clip_value: float | None = None  # Lightning's gradient_clip_val with algorithm "value", else None
        self.speculation: Speculation | None = None  # with clipping by norm or fp16 loss scaling (``speculate``)
        # [Note: the host Adam beside backward] in step_thread.py
        self.thread = HostStepThread(manager.device) if manager.config.step_thread_on(manager.device.type) else None
        self._handed = 0  # chunks handed to the worker in this backward
        # device chunks handed to the worker, each with the hand-over count that gives its gradient shard back
        self._held: deque[tuple[int, Chunk]] = deque()  # [Note: the same device bytes on every rank in backward]
        manager.reducer.on_final = self.grads_final

    def speculate(self, *, clip_norm: bool, scaler: DynamicLossScaler | None) -> None:
        """This fit clips by norm or scales the loss (fp16): chunks step on a guess ([Note: speculating past the norm
        and the overflow] in ``speculation.py``)."""
        if not (clip_norm or scaler):
            self.speculation = None
            return
        limit = self.manager.config.host_memory_limit
        if limit is not None:
            raise ValueError(refusal("fp16 loss scaling" if scaler else "clipping by norm", limit))
        self.speculation = Speculation(self.binding, scaler)

    def begin(self) -> None:
        """A backward that may step starts ([Note: stepping disk chunks in backward] in ``disk_in_backward.py``)."""
        self.manager.reducer.vote = self.active and self.manager.comm.world_size > 1
        self.manager.reducer.voted.clear()
        self._held.clear()  # left only by a backward that raised: those chunks keep their shards
        self._handed = 0
        low = self.manager.grads.low  # [Note: gradients in bf16 until the step] in memory/low_grads.py
        one = self.active and self.manager.comm.world_size == 1  # nothing reads the gradients before the step:
        plain = one and self.speculation is None and self.clip_value is None  # no clip, no scaler
        ids = self.binding.host_adam.low_grad_chunks(self.binding.views()) if plain else set()
        low.takes = (lambda c: c.chunk_id in ids) if ids else None
        if self.active:
            self.disk.begin()
            if self.thread is not None and self.manager.chunks:
                self.binding.slots.of_chunk(self.manager.chunks[0])  # built here: the worker reads them too

    def backward_ended(self) -> None:
        """Every chunk handed to the worker has stepped and given its gradient shard back."""
        if self.thread is not None:
            self.thread.join(self._reaped)
            self._give_back_due(every=True)
        self._handed = 0

    def grads_final(self, chunk: Chunk) -> None:
        """The chunk's gradients of this backward are all in its shard (the reducer's and one rank's path)."""
        if not (self.active and self.manager.grads.sync) or chunk.chunk_id in self.stepped or not chunk.trainable:
            return
        # before anything is kept, and before this rank's own decision below ([Note: checking once a micro-batch])
        self.manager.comm.verify_issued()
        mgr = self.manager
        voted = mgr.reducer.voted.get(chunk.chunk_id)  # the vote of a device chunk, taken as it landed
        complete = all(t.has_grad for t in chunk.tensors if t.requires_grad) if voted is None else voted
        if not complete:
            return  # the vote after backward decides which of its parameters step: after it
        if self.speculation is not None and not self.speculation.takes(chunk):
            return  # device and disk chunks do not speculate: after backward
        self._step(chunk, {}, in_backward=True)
        self.early += self.speculation is None  # a guess counts once it stepped (``Speculation.guesses``)

    def step_rest(self, **kwargs: Any) -> Any:
        """``optimizer.step()`` after backward: the chunks not stepped yet, one at a time, each giving its gradient
        shard back as it goes (so the first step, which creates the optimizer state, never holds both)."""
        self.backward_ended()
        self.disk.end()
        out = None
        mgr = self.manager
        if self.speculation is not None:
            self._settle(self.speculation)
        for c in mgr.chunks:
            if c.chunk_id in self.stepped or not c.trainable or c.grad_released:
                continue
            if any(t.has_grad for t in c.tensors):
                out = self._step(c, kwargs, in_backward=False)
            elif mgr.comm.world_size > 1 and c.grad_written:  # [Note: the same bytes on every rank after a step]
                self._release(c, to_pool=False)
                self.stepped.add(c.chunk_id)
        return out

    def _step(self, chunk: Chunk, kwargs: dict[str, Any], *, in_backward: bool) -> Any | None:
        """Step the chunk and give its gradient shard back: during backward to the manager's pool, whose block the
        next chunk's gradients take (so the gradient shards stop going through malloc, whose holes the resident
        set keeps); after backward, when the shards of every chunk may be let go at once (the warm-up), to the
        allocator, so that the pool never keeps a whole model's gradients. A disk chunk steps in backward from
        its gradients in memory where it can ([Note: stepping disk chunks in backward] in ``disk_in_backward.py``)."""
        mgr = self.manager
        spec = self.speculation if in_backward else None
        if in_backward and self.thread is not None and chunk.shard_tier is not Tier.DISK:
            # CUDA: the worker lands the chunk's gradient copies, then steps ([Note: gradients landed beside
            # backward] in offload.py)
            land = mgr.reducer.offload.hand_over(chunk.chunk_id)
            self.stepped.add(chunk.chunk_id)

            def job() -> None:
                land()
                if spec is None:
                    self._host_step(chunk)
                else:
                    spec.step(chunk, self._clip)

            try:
                self._handed += 1
                self._give_back_due()
                if self._holds_back(chunk):
                    self._held.append((self._handed + self.thread.max_pending, chunk))
                self.thread.submit(chunk, job, self._reaped)
            except BaseException:
                land()  # perhaps never handed to the worker (an earlier chunk's error): the copies land all the same
                raise
            return None
        mgr.reducer.offload.drain()  # CUDA: a gradient copied to a host shard on the side stream must be in
        if spec is not None:  # kept with its gradients until ``optimizer.step()``
            self.backward_ended()
            with mgr.clock.measure("optimizer"):
                spec.step(chunk, self._clip)
            self.stepped.add(chunk.chunk_id)
            return None
        self.backward_ended()  # nothing else narrows the param groups while the worker steps
        out = None
        with mgr.clock.measure("optimizer"):
            if not (in_backward and chunk.shard_tier is Tier.DISK and self.disk.step(chunk, self._clip)):
                if chunk.shard_tier is Tier.DISK:
                    mgr.tiers.grads_done(chunk)  # the step below reads the gradients from the file
                if self.clip_value is not None:
                    with mgr.tiers.writing(chunk, (Role.GRAD,)):  # a disk shard's gradients paged in
                        self._clip([s.grad for s in self.binding.slots.of_chunk(chunk)])  # type: ignore[misc]
                out = self.binding.step_chunk(chunk, **kwargs)
        self._release(chunk, to_pool=in_backward)
        self.stepped.add(chunk.chunk_id)
        return out

    def _host_step(self, chunk: Chunk) -> None:
        """On the worker: a chunk's clip and step ([Note: the host Adam beside backward])."""
        self._clip([s.grad for s in self.binding.slots.of_chunk(chunk)])  # type: ignore[misc]
        self.binding.step_chunk(chunk)

    def _reaped(self, chunk: Chunk) -> None:
        """On the autograd thread, once the worker stepped ``chunk``: its gradient shard goes to the pool, unless
        the step was a guess, which keeps it until ``optimizer.step()``, or it is a device chunk of several ranks,
        whose shard goes when its count comes ([Note: the same device bytes on every rank in backward])."""
        if not (self.speculation is not None or self._holds_back(chunk)):
            self._release(chunk)

    def _holds_back(self, chunk: Chunk) -> bool:
        """[Note: the same device bytes on every rank in backward]
        The worker reports a chunk stepped whenever it is done, and the autograd thread takes the report at its next
        hand-over (or its next wait for the worker), so when a chunk's gradient shard is given back depends on how
        fast each rank's host steps went. A device shard's bytes are what every rank plans evictions and gradient
        payloads by ([Note: the same bytes on every rank after a step]): two gloo ranks given the same limit under
        ``placement="static"`` differed by one 3 KB gradient shard, one rank landed its reduce-scatters to make room
        where the other did not, and the check of the collectives failed (on NCCL the ranks would then evict, and
        gather, different chunks). So with several ranks a device chunk's shard is given back at a count every rank
        shares: the ``max_pending``-th hand-over after its own (waiting for the worker where it has not stepped it
        yet), or at the end of backward. That is the latest the shard went before, where the worker was the slower,
        so the device holds no more gradient shards than ``phases.py`` counts; a host chunk's shard, on the host
        tier, still goes at once."""
        return chunk.shard_tier is Tier.DEVICE and self.manager.comm.world_size > 1 and self.speculation is None

    def _give_back_due(self, *, every: bool = False) -> None:
        """The held device chunks whose count has come (all of them with ``every``) give their gradient shards
        back, in order."""
        assert self.thread is not None
        while self._held and (every or self._held[0][0] <= self._handed):
            _, chunk = self._held.popleft()
            self.thread.wait_for(chunk, self._reaped)  # at once where the worker has stepped it
            self._release(chunk)

    def _settle(self, spec: Speculation) -> None:
        """``optimizer.step()``: a speculated chunk whose guess held keeps its step and gives its gradient shard back;
        where the clip proved it wrong, it is put back and steps again after backward, with the clipped gradients."""
        if spec.wrong:
            self.stepped -= spec.undo.keys()  # stepped again below
            spec.roll_back_all(self.manager.chunks)
            return
        for c in self.manager.chunks:
            if c.chunk_id in spec.undo:
                spec.drop(c)
                self._release(c, to_pool=False)

    def roll_back(self) -> None:
        """fp16: some rank overflowed, the step is skipped: the chunks stepped on the guess are put back."""
        if self.speculation is not None:
            self.backward_ended()
            self.speculation.roll_back_all(self.manager.chunks)

    def _release(self, chunk: Chunk, *, to_pool: bool = True) -> None:
        """On the autograd thread, once ``chunk`` stepped: its gradient shard goes to the pool (in backward) or to
        the allocator (after it; a pinned one stays where a fit speculates, [Note: gradient shards pinned to the
        byte])."""
        self.manager.grads.release(chunk, to_pool=to_pool, keep_pinned=self.speculation is not None)

    def stats(self) -> dict[str, float]:
        low = self.manager.grads.low
        out: dict[str, float] = {"chunks_stepped_in_backward": self.early}
        if low.taken:  # [Note: gradients in bf16 until the step] in memory/low_grads.py
            out.update(chunks_stepped_from_bf16_grads=low.taken - low.widened, chunks_widened_to_fp32=low.widened)
        if self.speculation is not None:  # [Note: speculating past the norm and the overflow]
            out.update(
                chunks_stepped_in_backward=self.early + self.speculation.guesses,
                speculation_rollbacks=self.speculation.rollbacks,
                speculation_peak_bytes=self.speculation.peak_bytes,
            )
        if self.thread is not None:  # [Note: the host Adam beside backward]
            out.update(chunks_stepped_on_thread=self.thread.stepped, time_step_thread_s=self.thread.seconds)
        if self.manager.ledger[Tier.DISK]:  # [Note: stepping disk chunks in backward] in disk_in_backward.py
            out["disk_staged_ahead_missed"] = self.disk.missed
        return out

    def close(self) -> None:
        """The end of the run: the worker thread, if one was started, ends."""
        if self.thread is not None:
            self.thread.close()

    def _clip(self, grads: list[torch.Tensor]) -> None:
        """Clip by value, as Lightning's ``gradient_clip_algorithm="value"`` does after backward ([Note: clipping
        by value in backward]): element by element, so one chunk's gradients clip alone, bit for bit."""
        if self.clip_value is not None and grads:
            torch._foreach_clamp_min_(grads, -self.clip_value)
            torch._foreach_clamp_max_(grads, self.clip_value)

    def finish(self) -> None:
        """After the step: the released gradients are gone, as after ``zero_grad()``: the next backward writes
        fresh ones (the flags say overwrite, not add)."""
        self.backward_ended()
        mgr = self.manager
        if self.speculation is not None:  # a step not taken through ``step_rest`` (a skipped one) keeps nothing
            self.speculation.reset()
        for c in mgr.chunks:
            if c.grad_released:
                c.grad_written = False
                for t in c.tensors:
                    t.has_grad = False
        self.binding.slots.detach_released()
        self.disk.end()
        self.stepped = set()
        self.active = False
        mgr.reducer.vote = False
