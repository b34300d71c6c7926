"""What the installed torch offers that the engine uses where it can, asked in one place.

[Note: torch versions]
The package runs on torch 2.7 and later. A few things it uses came later; where one is missing the engine does
without it, with the same results:
- ``UntypedStorage._swap_data_ptr_`` (torch 2.12): moves memory between storages without changing their identity.
  Without it the host's payload pool keeps nothing ([Note: a pool of payload blocks] in ``tiers/pool.py``), a
  storage is emptied and filled with ``resize_`` (so it keeps its allocator: a pinned shard is refilled pinned), and
  a shard pinned to the byte, which cannot be resized, keeps its memory between steps ([Note: exact pinned memory]),
  as does a pageable gradient buffer, its pages advised free ([Note: gradient buffers the kernel may take] in
  ``host_heap.py``).
- ``torch.optim.Muon`` (torch 2.9): without it there is no Muon to step.
- the C++ prelude inductor's kernels include (``torch/csrc/inductor/cpp_prefix.h``, an installed header since torch
  2.8; before, a copy inductor writes to its cache): where to find it (``optim/adam_native.py``).
- inductor's vector-ISA probe children that load their library without importing torch (torch 2.13): before it,
  ``optim/vec_isa.py`` runs the probe that way ([Note: the vector ISA probe]).
Each is read when it is used, not copied at import, so that a test can take one away (``monkeypatch.setattr``) and
check the engine without it on a torch that has it. Beside torch: Lightning 2.5 reads checkpoint files without a
``weights_only`` (``checkpointing.py`` passes it only when given), and Python 3.10 has no exception notes (the message
carries ours: ``errors.add_note``). The fast tier passes on Python 3.10, torch 2.7.1 and Lightning 2.5.0 (the multi-rank
tests too, Muon's and Lightning's EMA's skipped), and on Python 3.12, torch 2.11 and Lightning 2.6.6, the GPU machine's
(2026-12-06: ``.ci/versions`` builds both; there the slow tier passes too); CI runs everything on torch 2.13.
"""

from __future__ import annotations

import torch

SWAP_STORAGES: bool = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
MUON: bool = hasattr(torch.optim, "Muon")


def swap_memory(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    """``storage`` takes ``other``'s memory and ``other`` takes its: each keeps its identity, and its views see the
    memory it now holds. The one call of ``_swap_data_ptr_``, so that a torch without it is never asked."""
    if not SWAP_STORAGES:
        raise RuntimeError("this torch cannot swap storages' memory (UntypedStorage._swap_data_ptr_, torch 2.12)")
    storage._swap_data_ptr_(other)  # type: ignore[attr-defined]
