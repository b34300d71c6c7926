"""glibc's heap: the process-wide settings the engine asks of it, and giving freed pages back.

Each function is a no-op where glibc is not the allocator (or ``libc.so.6`` cannot be loaded).

- ``keep_freed_heap``: a CPU run with no host memory limit keeps the pages a step frees for the next step
  ([Note: the heap between steps]); ``switch_in_backward``: and, for a wide model, autograd's blocks in backward.
- ``map_large_blocks``: under ``host_memory_limit``, every block of 4 MiB or more is its own mapping
  ([Note: a fixed mmap threshold]).
- ``release_freed_memory``: after a known transient (the warm-up, a repack, a checkpoint), give freed heap
  pages back to the OS.
- ``lazily_free``: pages a storage keeps that the kernel may take when it needs memory ([Note: gradient buffers
  the kernel may take]).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Iterable, Mapping

import torch

from .libc import libc

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's, before its adaptive raising
_DEFAULT_MMAP_MAX = 65536  # glibc's: how many blocks it may map at once

# [Note: the heap between steps]
# A CPU step allocates its activations on glibc's heap in the forward and frees them in the backward. glibc gives
# the top of its heap back to the OS whenever more than its trim threshold lies free there, and that threshold
# follows the largest mapped block freed so far (twice it, 64 MiB at most). In plain PyTorch, autograd's
# per-parameter gradients are allocated during backward and kept until the next ``zero_grad``, and they mostly
# keep the heap's top in use. Under the engine they are copied into the chunks' flat gradients and freed at once,
# and the chunks' buffers live outside the heap (mapped, or in the payload pool), so the heap holds little but
# activations. Each backward then freed the heap's top and each forward grew it again, page-faulting every page
# it wrote: several times plain Lightning's minor faults a step on ``benchmarks/step_overhead.py``'s GPT, and a
# few percent of its one-rank step (`e92b0d8`).
#
# So on a CPU compute device with no ``host_memory_limit`` the engine raises the trim threshold to 1 GiB: the pages
# a step frees stay with the process for the next step, as a caching allocator keeps device memory. Setting any
# glibc threshold turns its adaptive thresholds off and freezes the mmap threshold where it stands (128 KiB in a
# process that never freed a large mapped block: every activation is then mapped afresh, measured 20 to 30%
# slower), so the mmap threshold is set with it, to 32 MiB, where the adaptive one ends. The resident set stays
# at the step's own peak instead of dipping between steps; explicit trims after known transients
# (``release_freed_memory``) still give pages back. Not done under ``host_memory_limit`` (``map_large_blocks``
# bounds memory there), on CUDA (activations are device memory), when the environment already sets one of glibc's
# malloc thresholds (the user's choice stands), or with ``keep_freed_heap=False``; a later engine of the same
# process with ``host_memory_limit`` takes the trim threshold back to glibc's 128 KiB.
#
# 32 MiB is as high as glibc lets the mmap threshold go, and a wide model's weight gradients are larger (64 and 172
# MiB for a 7B Llama's attention and MLP projections): autograd mapped each afresh in every backward, and the engine,
# copying it into its chunk and dropping it, unmapped it at once. A 0.67B Llama (two 7B layers, fp32, one rank)
# faulted its 2.7 GB of gradients in again every step, 2.35 s a step. So while backward runs (``heap_in_backward``,
# from its first gradient to its end) glibc maps no block: those gradients come from the heap and its freed pages
# serve the next backward's, with nothing faulted in a steady step (1.45 s a step, the same peak resident set).
# Between backwards, and in the engine's own code in backward (its hooks: ``ENGINE_BLOCKS``), blocks are mapped as
# before, so the chunks' buffers and optimizer state stay off the heap: 43 layers of ``benchmarks/scale.py``'s GPT fit
# its 3 GiB a rank stepping in backward, where mapping no block while backward ran fitted 39 (42 before, the same
# day). Each switch is a ``mallopt``, which consolidates the heap's small free blocks: 8-12% of a step of a 48-layer
# GPT of width 64 (no gradient near 32 MiB), so an engine whose largest gradient is under the threshold switches
# nothing (``switch_in_backward``), nor one that did not keep the heap, though an earlier engine of its process did.
KEEP_TRIM_THRESHOLD = 1 << 30
KEEP_MMAP_THRESHOLD = 32 << 20

_USER_TUNABLES = (
    "glibc.malloc.trim_threshold",
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.top_pad",
    "glibc.malloc.mmap_max",
)
_USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_kept = False
_backward = False  # a backward runs: autograd's blocks come from the heap (``heap_in_backward``)


def _glibc(name: str, *args: int) -> int | None:
    """``name(*args)`` from glibc; ``None`` where there is no such library or function."""
    fn = getattr(libc(), name, None)
    return None if fn is None else fn(*(ctypes.c_int(a) for a in args))


def _mallopt(param: int, value: int) -> bool:
    return bool(_glibc("mallopt", param, value))


def user_set_thresholds(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment sets one of glibc's malloc thresholds (``GLIBC_TUNABLES`` or ``MALLOC_*_``)."""
    env = os.environ if environ is None else environ
    tunables = env.get("GLIBC_TUNABLES", "")
    return any(t in tunables for t in _USER_TUNABLES) or any(v in env for v in _USER_VARIABLES)


def keep_freed_heap() -> bool:
    """Keep the heap pages a step frees for the next step ([Note: the heap between steps]). Once a process;
    ``False`` where the environment sets glibc's thresholds itself or glibc is not the allocator."""
    global _kept
    if _kept:
        return True
    if user_set_thresholds():
        return False
    # the mmap threshold first: the trim threshold's mallopt alone would freeze it wherever it stands
    _kept = _mallopt(_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD) and _mallopt(_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)
    return _kept


def no_switch(running: bool) -> None:
    """What an engine calls as its backward starts and ends where autograd's blocks stay as glibc places them."""


def switch_in_backward(params: Iterable[torch.Tensor]) -> Callable[[bool], None]:
    """``heap_in_backward`` for an engine that kept the heap (``keep_freed_heap``) and has a parameter whose gradient
    is past the mmap threshold; else ``no_switch``: an engine of smaller ones, or one that did not ask
    (``keep_freed_heap=False``, a host limit, CUDA) switches nothing, each switch costing a ``mallopt``."""
    largest = max((p.numel() * p.element_size() for p in params), default=0)
    return heap_in_backward if _kept and largest > KEEP_MMAP_THRESHOLD else no_switch


def heap_in_backward(running: bool) -> None:
    """Serve autograd's blocks from the heap while a backward runs, where this process keeps its heap
    (``keep_freed_heap``), and map large blocks again after ([Note: the heap between steps])."""
    global _backward
    if _kept and running != _backward:
        _backward = running
        if not ENGINE_BLOCKS.depth:  # inside the engine's code blocks are mapped, and its end says so for autograd
            _mallopt(_M_MMAP_MAX, 0 if running else _DEFAULT_MMAP_MAX)


class _EngineBlocks:
    """``with ENGINE_BLOCKS:`` around the engine's own code in backward (its hooks): the buffers it makes there (a
    gradient payload, optimizer state at a first step) are mapped as between backwards, not left among autograd's
    blocks on the heap."""

    def __init__(self) -> None:
        self.depth = 0  # engine code running inside a backward, nested

    def __enter__(self) -> None:
        self.depth += 1
        if self.depth == 1 and _backward:
            _mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if self.depth == 0 and _backward:
            _mallopt(_M_MMAP_MAX, 0)


ENGINE_BLOCKS = _EngineBlocks()


def map_large_blocks(threshold: int = 4 << 20) -> bool:
    """Have glibc serve every allocation of ``threshold`` bytes or more with its own mapping, returned to the OS
    when freed (``mallopt(M_MMAP_THRESHOLD)``, which also turns off glibc's raising of that threshold).

    [Note: a fixed mmap threshold] By default glibc raises its mmap threshold to the size of each
    mapped block freed, up to 32 MiB, so chunk-sized buffers (payloads, gradient buffers) soon come
    from the heap, whose freed blocks the process keeps and fragments. Under CPU contention that
    left a whole model's payloads in the resident set during a warm-up step with the disk tier (in
    4 of 15 runs of an 85M GPT; none of 6 with a fixed 4 MiB threshold). It has a price: every
    chunk-sized buffer is a fresh mapping whose pages fault in, so the engine asks for it only where
    the user bounded host memory (``host_memory_limit``), whose bound it makes hold; it is
    process-wide. Blocks under the threshold (activations, small gradients) still come from the
    heap, so the engine also gives the heap's free pages back once a step, after backward
    (``release_freed_memory`` in ``prepare_step``).
    A no-op where glibc is not the allocator."""
    global _kept
    if _kept:  # an earlier engine of this process kept the heap: its trim threshold must not outlive it here
        heap_in_backward(False)
        _kept = not _mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
    return _mallopt(_M_MMAP_THRESHOLD, threshold)


def release_freed_memory() -> None:
    """Return freed heap pages to the OS (glibc). Streaming allocates and frees many multi-MiB buffers; glibc's
    adaptive mmap threshold then serves them from the heap, whose freed pages it keeps: RSS would creep up to
    many chunks without this. A no-op where glibc is not the allocator."""
    _glibc("malloc_trim", 0)


def release_pinned_cache() -> None:
    """Give the pinned host blocks torch's caching host allocator keeps for reuse back to the OS.

    [Note: pinned blocks a repack leaves behind]
    On CUDA every host-tier shard is pinned (``HostStorage``), and torch's caching host allocator keeps a freed
    pinned block for the next allocation of its power-of-two size class, never handing it back by itself. The
    warm-up places every shard on the host (``auto`` under a limit, always the case on a GPU); the repack at its end
    moves most of them to the device, and their pinned blocks stayed cached and page-locked for the whole run:
    about 8 GiB a rank for 7B on 8 ranks, from the layout chooser's sizes. A save written in the background copies
    the device shards it writes into pinned blocks (11.8 GiB a rank for 7B on 8 ranks of 80 GiB, ``plan
    --async-save``), which stayed cached after the save. So after every repack, at the first step after a
    background save is over, and at teardown the cache is emptied. Blocks still in use keep their power-of-two
    rounding (up to +32% a rank for 7B, +69% for 13B); ``pin_memory="exact"`` is the remedy for that ([Note: exact
    pinned memory] in ``exact_pinned.py``: nothing cached, nothing rounded). A no-op without CUDA."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()


_MADV_FREE = 8  # Linux 4.5+; older kernels answer EINVAL


def lazily_free(storage: torch.UntypedStorage) -> bool:
    """Let the kernel take the whole pages of ``storage``'s pageable host memory when it needs memory, while the
    storage keeps its bytes (``MADV_FREE``): written before the kernel took them, they cost no page fault; taken,
    they come back zeroed at the next write. Its values are undefined from here. ``False``, and nothing changed,
    where it is not pageable host memory, has no whole page, or the kernel or C library refuses.

    [Note: gradient buffers the kernel may take]
    Stepping in backward, a host chunk's gradient buffers (its fp32 shard, or the bf16 one it steps from: [Note:
    gradients in bf16 until the step]) are given back once the chunk stepped, so a step holds a few at a time.
    From torch 2.12 their memory moves into a pool of its own and back ([Note: gradient shards pinned to the byte]
    in ``memory/grads.py``). A torch without storage swaps ([Note: torch versions] in ``torch_features.py``) could only
    return it to the allocator (``resize_(0)``), which for blocks this size is glibc unmapping them, and the next
    gradient faulted every page in again, every step: an 800 MiB block refilled at 2.6-5.4 GB/s on the 2-core CPU
    machine where a kept one fills at 18-25, and on the H200 host, whose first touch ran at 6.2 GB/s, some 3 s a
    step for the bf16 buffers of a 10B model (6 s for fp32 shards) beside a host Adam of 3.5 s. Pinned buffers do
    not pay this (torch's caching host allocator keeps them; one pinned to the byte keeps its bytes).
    So there a pageable one keeps its bytes and its pages are advised free: nothing is faulted while the host has
    memory to spare, and under pressure the kernel takes them as it takes clean page cache, without swap, where a
    buffer given back would simply be gone. Their bytes count in the resident set until taken, so this is not done
    under ``host_memory_limit``, whose bound is the resident set's (as [Note: the heap between steps]). The ledger
    counts them given back (``Chunk.grad_lazy``, ``grad_low_lazy``), as ``plan`` does: the kernel's to take. On
    torch 2.11 on the CPU machine a 57M GPT's steps then faulted 330 MB each where they faulted 424 (the rest the
    CPU device's payloads; 2026-12-06)."""
    c = libc()
    if c is None or storage.device.type != "cpu" or storage.is_pinned():
        return False
    page = mmap.PAGESIZE
    start = -(-storage.data_ptr() // page) * page  # whole pages only: a heap block's neighbours share its ends
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end <= start:
        return False
    return c.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_FREE)) == 0
