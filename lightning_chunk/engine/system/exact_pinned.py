"""Page-locked host tensors of exactly the bytes asked, for ``OffloadOptions(pin_memory="exact")``.

[Note: exact pinned memory]
``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every block up to a
power of two and keeps freed blocks cached ([Note: pinned blocks a repack leaves behind] in ``host_heap.py``). A
host shard of 2^k + 1 bytes takes 2^(k+1): for Llama 2 7B on 8 ranks the host shards took 2.5 GiB a rank more than
asked, for 70B on one node 63 GiB (``lightning-chunk plan`` counts it). Here each tensor is its own anonymous
private mapping (exact to the page), page-locked with ``cudaHostRegister`` (portable: pinned for every device's
context, whichever is current on the thread that allocates):

- the tensor views the mapping through ``torch.frombuffer``, whose storage holds the mapping object alive and
  lets it go when the storage is freed, whatever the path (the last view dropped, a repack, the end of the run);
- the mapping object unregisters its range in ``__del__``, which runs before its memory is unmapped, after a
  synchronisation of the rank's GPU (named: ``__del__`` may run on any thread, whose current device may be GPU 0): a
  copy still in flight from or into it finishes first (torch's allocator waits for
  recorded events; a storage freed here is rare: at a repack, after a background save has written a copy, at the
  end of the run);
- such a storage cannot be resized: ``free_storage`` leaves its bytes to the last view; a gradient shard given back
  moves its memory out of the storage instead ([Note: gradient shards pinned to the byte] in ``memory/grads.py``);
- a forked process (a data loader's worker) does not inherit the mapping (``MADV_DONTFORK``), as it does not
  inherit torch's pinned blocks: none of its pages is ever copied on write away from the device's view of it;
- its pages are touched before they are registered, by torch's threads (a zero fill split between them): left to
  ``cudaHostRegister`` they are faulted in on the calling thread, one 4 KiB page at a time. Page faults scale with
  threads where one thread does some 2-3 GB/s (this 2-core VM: 2.8 GB/s on one, 5.5 on two); the registration of
  pages already there only pins them. cudaHostAlloc, torch's pinned blocks, faults on one thread too (RMM measured
  it 3.3-4x slower than a parallel first touch and a registration on 16 threads): at 10B parameters a host holds
  some 60-100 GB of pinned shards, a set-up's half minute or more;
- ``is_pinned()`` is true for registered memory, so copies with ``non_blocking=True`` run asynchronously, and
  torch's host allocator, which records events only for its own blocks, ignores these.

A registration that fails raises, naming the bytes and the error: a run never goes on with pageable memory where it
asked for page-locked. ``register`` and ``unregister`` are parameters so that a CPU test follows the lifetime.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable

import torch

_PORTABLE = 1  # cudaHostRegisterPortable
Register = Callable[[int, int], None]
Unregister = Callable[[int], None]


class _Mapping(mmap.mmap):
    """The memory of one exact pinned tensor: unregistered before it is unmapped."""

    ptr = 0
    unregister: Unregister | None = None

    def __del__(self) -> None:
        if self.unregister is not None:
            self.unregister(self.ptr)
            self.unregister = None


class ExactPinned:
    """Allocates page-locked host tensors of exactly the bytes asked; ``live_bytes`` is what is registered now."""

    def __init__(
        self,
        register: Register | None = None,
        unregister: Unregister | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``device``: the GPU whose copies use these tensors, synchronised before one is unregistered (``None``:
        the current device of the thread that unregisters)."""
        self._register = register if register is not None else _cuda_register
        self._unregister = unregister if unregister is not None else functools.partial(_cuda_unregister, device=device)
        self.live_bytes = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        mapping = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_DONTFORK"):  # a forked worker gets none of it, as with torch's pinned blocks
            mapping.madvise(mmap.MADV_DONTFORK)
        t = torch.frombuffer(mapping, dtype=dtype, count=numel)
        t.zero_()  # the first touch, on torch's threads (the mapping reads zeros: the values do not change)
        ptr = t.data_ptr()
        self._register(ptr, nbytes)  # raises: the mapping goes with ``t``, never registered
        self.live_bytes += nbytes

        def unregister(p: int) -> None:
            self.live_bytes -= nbytes
            self._unregister(p)

        mapping.ptr, mapping.unregister = ptr, unregister
        return t


def _cuda_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE)
    if int(err) != 0:
        raise RuntimeError(
            f"pin_memory='exact': cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)} "
            f"({torch.cuda.cudart().cudaGetErrorString(err)}); use pin_memory=True (torch's pinned allocator) or "
            "False (pageable)."
        )


def _cuda_unregister(ptr: int, device: torch.device | None = None) -> None:
    try:  # a copy in flight finishes first; at interpreter exit CUDA may be gone already, and then so is the lock
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - a destructor must not raise
        pass
