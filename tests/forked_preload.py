"""What the fork server of ``tests/forked.py`` imports once, for every rank it forks ([Note: forked ranks])."""

import lightning  # noqa: F401
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401

import lightning_chunk  # noqa: F401
import lightning_chunk.engine.runtime.engine  # noqa: F401
