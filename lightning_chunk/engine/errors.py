"""Errors raised by the chunk engine. Each one says what went wrong and where."""

from __future__ import annotations


class ChunkError(RuntimeError):
    """Base class of every error raised by the engine."""


class IllegalTransitionError(ChunkError):
    """A tensor moved between two states that the legal table does not connect."""


class DeviceMemoryLimitError(ChunkError):
    """Chunk memory on the device tier would exceed ``device_memory_limit``."""


class UnsupportedOptimizerError(ChunkError, TypeError):
    """The optimizer cannot step flat shards (it needs parameter shapes)."""


class LayoutError(ChunkError, ValueError):
    """Parameters cannot be packed as asked (a parameter larger than a chunk, ...)."""


class HostMemoryLimitError(ChunkError):
    """Host-tier chunk memory would exceed ``host_memory_limit`` even with every shard it can move on disk."""


class DiskTierError(ChunkError):
    """The disk tier's directory cannot hold what must go there (missing, unwritable, full, too small)."""


class CheckpointError(ChunkError, ValueError):
    """A path that is not a usable checkpoint, or one written for another model."""
