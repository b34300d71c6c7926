"""Payload memory reused between gathers on the host, instead of returned to the allocator.

[Note: a pool of payload blocks]
A payload is released by taking the memory out of its storage and filled by putting memory back in, so
that the parameters' views and the tensors autograd saved keep pointing at one storage
([Note: hooks and autograd with freed storage] in hooks.py). With ``storage.resize_`` the memory goes back
to the allocator at every release and comes from it at every gather. On CUDA that is the caching
allocator, which keeps the blocks. On the host it is glibc's malloc, and every step asks it for each chunk's
payload twice (forward and backward) and its gradient payload once:
- blocks over the mmap threshold are mapped afresh, so each gather page-faults every page it writes
  (measured: filling a new 37.7 MB buffer takes 30 to 60 ms on the 2-core benchmark machine, a reused one
  about 5 ms);
- blocks under it are carved from a heap shared with activations and gloo's temporaries, whose holes
  grow the resident set past what is in use (docs/benchmarks.md, "Largest model under a memory limit").

So on the host the pool keeps released blocks and hands them to the next gather of the same size. A block
moves between a payload's storage and a holder storage with ``UntypedStorage._swap_data_ptr_`` (what
``torch.utils.swap_tensors`` uses): the payload storage keeps its identity, its views see the new memory,
and a released payload's storage holds no bytes, as it did with ``resize_(0)``. The pool never holds more
than the most payload bytes of one size that were alive at once, minus those alive now; it is emptied when
the layout changes and at the end of the run. Its blocks are device memory the ledger does not count, so
under a ``device_memory_limit`` the hooks trim it at every moment to what the limit leaves beside the chunks
and the traced activations ([Note: the pool under a limit] in placement.py). Where torch lacks
``_swap_data_ptr_`` ([Note: torch versions] in ``system/torch_features.py``), or on CUDA, the pool keeps nothing
and storages resize as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..chunks.chunk import give_back
from ..system import torch_features
from ..system.host_heap import lazily_free


class BlockPool:
    def __init__(
        self, device: torch.device, *, enabled: bool = True, per_size: int | None = None, lazy: bool = False
    ) -> None:
        """``per_size``: keep at most this many blocks of one size; one given back beyond goes to its allocator.
        ``lazy``: where the pool cannot keep blocks (no storage swaps), a pageable storage emptied keeps its bytes
        with its pages advised free instead ([Note: gradient buffers the kernel may take] in ``host_heap.py``)."""
        self.device = torch.device(device)
        self.enabled = enabled and torch_features.SWAP_STORAGES and self.device.type == "cpu"
        self.lazy = lazy and not self.enabled and self.device.type == "cpu"
        self.per_size = per_size
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self.pooled_bytes = 0  # held here, in no chunk
        self.pooled_peak = 0
        self.reused = 0  # fills served from the pool
        self.allocated = 0  # fills that asked the allocator
        self.trimmed = 0  # blocks given back to the allocator by ``trim``
        self.kept_lazily = 0  # storages emptied that kept their bytes, advised free (``lazy``)

    def fill(
        self, storage: torch.UntypedStorage, nbytes: int, make: Callable[[], torch.UntypedStorage] | None = None
    ) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory (contents undefined): a kept block, else ``make``'s new
        memory (of the kind its tier allocates: a swap moves the memory's allocator with it, so an emptied storage
        resized would get pageable memory where the tier pins: [Note: gradient shards pinned to the byte]), else
        memory from the storage's own allocator."""
        blocks = self._free.get(nbytes) if self.enabled else None
        if blocks:
            torch_features.swap_memory(storage, blocks.pop())
            self.pooled_bytes -= nbytes
            self.reused += 1
            return
        if make is not None and torch_features.SWAP_STORAGES:
            fresh = make()
            assert fresh.nbytes() == nbytes, (fresh.nbytes(), nbytes)
            torch_features.swap_memory(storage, fresh)
        else:  # without swapping, ``give_back`` emptied it with ``resize_``: it kept its allocator, and refills from it
            storage.resize_(nbytes)
        self.allocated += 1

    def empty(self, storage: torch.UntypedStorage) -> bool:
        """Take ``storage``'s memory (it then holds no bytes); keep it for the next ``fill`` of that size. With
        ``lazy`` and no swaps, a pageable one keeps its bytes, its pages advised free (``True``: no ``fill`` needed,
        and its owner counts it as given back)."""
        n = storage.nbytes()
        if self.lazy and n and storage.resizable() and lazily_free(storage):
            self.kept_lazily += 1
            return True
        if not self.enabled or n == 0 or (self.per_size is not None and len(self._free.get(n, ())) >= self.per_size):
            give_back(storage)
            return False
        holder = torch.UntypedStorage(0, device=self.device)
        torch_features.swap_memory(storage, holder)
        self._free.setdefault(n, []).append(holder)
        self.pooled_bytes += n
        self.pooled_peak = max(self.pooled_peak, self.pooled_bytes)
        return False

    def tensor(
        self, numel: int, dtype: torch.dtype, make: Callable[[], torch.UntypedStorage] | None = None
    ) -> torch.Tensor:
        """A new 1-d tensor of ``numel`` elements (contents undefined; memory as ``fill`` gives it); give it back
        with ``empty``."""
        t = torch.empty(0, dtype=dtype, device=self.device)
        self.fill(t.untyped_storage(), numel * dtype.itemsize, make)
        return t.set_(t.untyped_storage(), 0, (numel,))  # type: ignore[call-overload]

    def trim(self, max_bytes: int) -> None:
        """Give kept blocks back to the allocator, largest first, until the pool holds at most ``max_bytes``."""
        if self.pooled_bytes <= max_bytes:
            return
        for n in sorted(self._free, reverse=True):
            blocks = self._free[n]
            while blocks and self.pooled_bytes > max_bytes:
                blocks.pop()
                self.pooled_bytes -= n
                self.trimmed += 1
            if not blocks:
                del self._free[n]

    def clear(self) -> None:
        """Return every kept block to the allocator."""
        self._free.clear()
        self.pooled_bytes = 0

    def stats(self) -> dict[str, float]:
        return {
            "pool_bytes": self.pooled_bytes,
            "pool_bytes_peak": self.pooled_peak,
            "pool_reused": self.reused,
            "pool_allocated": self.allocated,
            "pool_trimmed": self.trimmed,
        }
