"""lightning_chunk: chunk-based ZeRO-3 with CPU offload, as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``chunk_offload`` (placement
``auto``), ``chunk`` (``device``) and ``chunk_offload_cpu`` (``host``), and lets
``LightningModule.load_from_checkpoint`` read a sharded checkpoint directory.
"""

from lightning.pytorch.strategies import StrategyRegistry

from ._version import __version__
from .ema import ChunkEMA
from .engine import ChunkConfig, ChunkEngine, DeviceMemoryLimitError
from .module_loading import read_sharded_in_load_from_checkpoint
from .options import CheckOptions, MemoryOptions, OffloadOptions
from .precision import ChunkPrecision
from .strategy import ChunkOffloadStrategy
from .telemetry import ChunkTelemetry

ChunkOffloadStrategy.register_strategies(StrategyRegistry)
read_sharded_in_load_from_checkpoint()  # [Note: load_from_checkpoint on a directory]

__all__ = [
    "CheckOptions",
    "ChunkConfig",
    "ChunkEMA",
    "ChunkEngine",
    "ChunkOffloadStrategy",
    "ChunkPrecision",
    "ChunkTelemetry",
    "DeviceMemoryLimitError",
    "MemoryOptions",
    "OffloadOptions",
    "__version__",
]
