"""Marks for tests of what only newer torch offers ([Note: torch versions] in engine/system/torch_features.py)."""

import pytest

from lightning_chunk.engine.system import torch_features

needs_swap = pytest.mark.skipif(
    not torch_features.SWAP_STORAGES, reason="this torch has no UntypedStorage._swap_data_ptr_ (torch 2.12)"
)
needs_muon = pytest.mark.skipif(not torch_features.MUON, reason="this torch has no torch.optim.Muon (torch 2.9)")
