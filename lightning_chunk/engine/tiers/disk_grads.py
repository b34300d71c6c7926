"""A disk chunk's gradients in backward: gathered in a host buffer, written to the gradient file on the I/O thread
once they are all in ([Note: gradient write-backs off the step]); the two largest buffers are kept for the next
chunks."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..chunks.chunk import Chunk, Role
from .disk import aligned_empty
from .disk_chunk import DiskChunk
from .disk_io import DiskIO


class GradBuffers:
    """The host buffers a disk chunk's gradients gather in, and their write-backs.

    [Note: gradient write-backs off the step] Written on the main thread, each disk chunk's gradient
    file held backward up for as long as the write took: 0.23 s a step on the 85M GPT of
    ``benchmarks/disk.py`` where memory could not cache the files. The I/O thread is idle in
    backward, so it writes them while backward goes on. The buffer is one of the two kept for the
    next chunks, so at most two are written at once, and taking one back waits for its write.
    What reads the file after it is ordered after the write: the optimizer's staged reads run on
    the same thread, in order; a use through the mapping (``DiskStorage.reading``, ``prefetch``) and
    a read of the gradients being accumulated (``target``, after a flush) wait for it first; the
    end of backward waits for all of them (``DiskIO.settle``), before anything outside the engine
    can look at a gradient. A write that failed raises there, or at the latest in ``flush``.
    """

    def __init__(self, io: DiskIO, flush: Callable[[], None], record: Callable[[Chunk], DiskChunk | None]) -> None:
        self.io = io
        self._flush = flush
        self._record = record
        self._spare: list[tuple[torch.Tensor, Future]] = []  # kept buffers, each with the write that may read it

    def target(self, chunk: Chunk) -> torch.Tensor:
        """A host buffer the gradients gather in (zeros, or the file's gradients when some are being accumulated);
        ``done`` writes it to the file with ``pwritev``: no page of the mapping is touched."""
        rec = self._record(chunk)
        assert rec is not None
        f = rec.files[Role.GRAD]
        buf = rec.grads
        if buf is None:
            spare = [s for s in self._spare if s[0].numel() >= f.nbytes]
            if spare:  # reused: no page faults anew, once its write-back has read it
                self._spare.remove(spare[0])
                buf, writing = spare[0]
                self.io.wait_for(writing)
            else:
                buf = aligned_empty(f.nbytes)
            buf = buf[: f.nbytes]
            # accumulating: keep what is there. One rank: a parameter of the chunk got a gradient in an earlier
            # micro-batch. Several: this rank's shard was written by an earlier reduce-scatter (its parameters'
            # flags are already set by this backward's gradients, which are still in the gradient payload)
            accumulating = chunk.grad_written if chunk.world_size > 1 else any(t.has_grad for t in chunk.tensors)
            if accumulating:
                self._flush()
                self.io.read_now(f, buf)
            else:
                buf.zero_()
            rec.grads = buf
        assert chunk.grad is not None
        return buf.view(chunk.grad.dtype)[: chunk.shard_numel]

    def done(self, chunk: Chunk) -> None:
        """The chunk's gradients are all in its buffer: write it to the file on the I/O thread."""
        rec = self._record(chunk)
        if rec is None:
            return
        buf, rec.grads = rec.grads, None
        if buf is not None:
            writing = self.io.write_grads(rec.files[Role.GRAD], buf)
            self._keep(buf, writing)

    def in_memory(self, chunk: Chunk) -> torch.Tensor | None:
        """The uint8 buffer this backward's gradients gathered in, before ``done`` writes it; else None."""
        rec = self._record(chunk)
        f = None if rec is None else rec.files.get(Role.GRAD)
        return None if rec is None or f is None or rec.grads is None else rec.grads[: f.nbytes]

    def drop(self, chunk: Chunk) -> None:
        """The gradients were used from memory and are gone ([Note: stepping disk chunks in backward] in
        ``optim/disk_in_backward.py``): keep the buffer for the next chunks without writing it to the file."""
        rec = self._record(chunk)
        buf = None
        if rec is not None:
            buf, rec.grads = rec.grads, None
        if buf is not None:
            done: Future = Future()
            done.set_result(None)
            self._keep(buf, done, wait=False)

    def _keep(self, buf: torch.Tensor, writing: Future, *, wait: bool = True) -> None:
        kept = sorted([*self._spare, (buf, writing)], key=lambda s: -s[0].numel())
        self._spare = kept[:2]  # the largest two are kept
        for _, dropped in kept[2:] if wait else ():
            self.io.wait_for(dropped)  # no more than two buffers a step may be writing

    def clear(self) -> None:
        self._spare.clear()
