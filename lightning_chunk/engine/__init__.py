"""The chunk engine: plain torch, no ``lightning`` import (tests assert it)."""

from .chunks.chunk import Chunk, Tier
from .chunks.states import LEGAL_TRANSITIONS, TensorState
from .comm.collectives import Collectives
from .config import ChunkConfig, DtypePolicy, parse_bytes
from .errors import ChunkError, DeviceMemoryLimitError, IllegalTransitionError, LayoutError, UnsupportedOptimizerError
from .runtime.engine import ChunkEngine

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
