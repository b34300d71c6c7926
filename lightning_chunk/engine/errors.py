"""Errors raised by the chunk engine. Each one says what went wrong and where."""

from __future__ import annotations

import re
import sys

import torch


class ChunkError(RuntimeError):
    """Base class of every error raised by the engine."""


class IllegalTransitionError(ChunkError):
    """A tensor moved between two states that the legal table does not connect."""


class DeviceMemoryLimitError(ChunkError, torch.OutOfMemoryError):
    """Chunk memory on the device tier would exceed ``device_memory_limit``: an out-of-memory, so that
    ``except torch.OutOfMemoryError`` (a loop that skips a batch too long) catches it as it catches the allocator's.
    On a CUDA device the message begins as the allocator's does: Lightning's ``BatchSizeFinder`` and
    ``Tuner.scale_batch_size`` recognise an out-of-memory by those words, and halve the batch rather than stop."""

    PREFIX = "CUDA out of memory under device_memory_limit: "

    def __init__(self, message: str, device: torch.device | None = None) -> None:
        cuda = device is not None and device.type == "cuda"
        super().__init__(self.PREFIX + message if cuda and not message.startswith(self.PREFIX) else message)


# a limit refused before the warm-up traced the activations names a lower bound: each retry costs a model's set-up
PLUS_ACTIVATIONS = (
    " plus the activations, which the warm-up step measures (`lightning-chunk plan` measures both in one dry run, "
    "naming the smallest limit that fits)"
)


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


# what a checkpoint's param groups that outnumber the optimizer's mean ([Note: param groups added while training])
GROUPS_ADDED_HINT = (
    "a group added while training (optimizer.add_param_group) must be built again before the checkpoint loads, in "
    "configure_optimizers, as plain PyTorch's load_state_dict asks"
)

_PLACEHOLDER_WRITE = "more than one element of the written-to tensor refers to a single memory location"


def add_note(exception: BaseException, text: str) -> None:
    """A note shown under the traceback (Python 3.11 on); before, the message carries it, where it is one string."""
    add = getattr(exception, "add_note", None)
    if add is not None:
        add(text)
    elif len(exception.args) == 1 and isinstance(exception.args[0], str):
        exception.args = (f"{exception.args[0]}\n{text}",)


def explain_user_error(exception: BaseException) -> None:
    """Add what an error of torch's or pickle's means here (a note: ``add_note``):
    a write into a released parameter's placeholder ([Note: a released parameter] in ``chunks/parked.py``), whose
    error advises a ``clone()`` that would lose the write; ``torch.save(module)`` during ``fit``, which cannot pickle
    the engine's hooks on the module."""
    said = str(exception)
    if isinstance(exception, RuntimeError) and _PLACEHOLDER_WRITE in said:
        add_note(
            exception,
            "chunk_offload: if this was a write into a parameter between its uses (weights clamped in a callback, a "
            "momentum encoder updated), the parameter's chunk was released and its .data is a placeholder, one NaN "
            "expanded to its shape, that refuses writes; a clone would lose the write. Write inside `with "
            "trainer.strategy.full_parameters():` on every rank (docs/faq.md, 'Reading or writing parameters "
            "between steps').",
        )
    local = _LOCAL_OBJECT.search(said)
    if local is not None and _ours(local.group(1)):
        add_note(
            exception,
            "chunk_offload: while fit runs, the modules carry the engine's hooks, which cannot be pickled, and "
            "their parameters hold chunk views or placeholders rather than whole values, so torch.save(module) or "
            "pickle cannot save the model then. Save the weights: torch.save(module.state_dict(), path) (one rank), "
            "inside `with trainer.strategy.full_parameters():` (every rank), or trainer.save_checkpoint(path); or "
            "save the module after fit returns, when it is plain again.",
        )


_LOCAL_OBJECT = re.compile(r"(?:pickle|get) local object '(\w+)\.")


def _ours(name: str) -> bool:
    """A class or function of that name is defined in this package (a hook's closure's owner)."""
    package = __name__.split(".")[0]
    return any(
        getattr(getattr(m, name, None), "__module__", "") == k
        for k, m in list(sys.modules.items())
        if k.split(".")[0] == package
    )


_LOW_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Half"}


def dtype_mismatch(exception: BaseException, low: torch.dtype) -> bool:
    """Whether ``exception`` is torch's error for an op given tensors of ``low`` beside wider ones."""
    said, name = str(exception), _LOW_NAMES.get(low, "?")
    if not isinstance(exception, RuntimeError):
        return False
    return (name in said and any(w in said for w in ("dtype", "scalar type", "same type"))) or "mixed dtype" in said


def explain_dtype_mismatch(exception: BaseException, precision: str, low: torch.dtype | None) -> None:
    """torch's error for an op that met a payload of ``low`` (the compute dtype of a mixed ``precision``, else
    ``None``) beside float32 tensors names neither the parameter's dtype policy nor the way out ([Note: parameters
    read outside autocast] in ``runtime/outside_autocast.py``)."""
    if low is not None and dtype_mismatch(exception, low):
        low_name = _LOW_NAMES[low]
        add_note(
            exception,
            f"chunk_offload: under {precision} parameters compute in {low_name} payloads, where plain Lightning keeps "
            "float32 parameters and autocast casts per op. Parameters read with autocast off in the warm-up or the "
            "first evaluation step keep float32 by themselves; if this op reads one elsewhere (a branch those steps "
            "did not take, or an op autocast does not cast), keep its module's parameters in float32: "
            f"plugins=[ChunkPrecision({precision!r}, full_precision_modules=[ThatModule])].",
        )
