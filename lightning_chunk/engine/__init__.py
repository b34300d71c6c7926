"""The chunk engine: plain torch, no ``lightning`` import (tests assert it)."""

from .chunk import Chunk, Tier
from .collectives import Collectives
from .config import ChunkConfig, DtypePolicy, parse_bytes
from .errors import ChunkError, DeviceMemoryLimitError, IllegalTransitionError, LayoutError, UnsupportedOptimizerError
from .runtime import ChunkEngine
from .states import LEGAL_TRANSITIONS, TensorState

__all__ = [
    "Chunk",
    "ChunkConfig",
    "ChunkEngine",
    "ChunkError",
    "Collectives",
    "DeviceMemoryLimitError",
    "DtypePolicy",
    "IllegalTransitionError",
    "LEGAL_TRANSITIONS",
    "LayoutError",
    "TensorState",
    "Tier",
    "UnsupportedOptimizerError",
    "parse_bytes",
]
