"""lightning_chunk: chunk-based ZeRO-3 with CPU offload, as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``chunk_offload`` (placement
``auto``), ``chunk`` (``device``) and ``chunk_offload_cpu`` (``host``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from ._version import __version__
from .ema import ChunkEMA
from .engine import ChunkConfig, ChunkEngine, DeviceMemoryLimitError
from .options import CheckOptions, MemoryOptions, OffloadOptions
from .precision import ChunkPrecision
from .strategy import ChunkOffloadStrategy
from .telemetry import ChunkTelemetry

ChunkOffloadStrategy.register_strategies(StrategyRegistry)

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
