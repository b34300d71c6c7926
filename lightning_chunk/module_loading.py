"""``MyModule.load_from_checkpoint(path)`` where ``path`` is a sharded checkpoint directory.

[Note: load_from_checkpoint on a directory]
Lightning's own way back from training to a model is ``MyModule.load_from_checkpoint(ckpt.best_model_path)``. A
sharded checkpoint (the default ``state_dict_type``) is a directory, and Lightning opens the path as one file:
``IsADirectoryError``, with no word of what to do (DeepSpeed's and FSDP's sharded checkpoints fail the same way, and
their users convert first); so did ``Trainer().test(model, ckpt_path=dir)`` under another strategy. Importing this
package wraps the loaders that ``load_from_checkpoint`` and Lightning's ``TorchCheckpointIO`` call
(``lightning.pytorch.core.saving.pl_load``, ``lightning.fabric.plugins.io.torch_io.pl_load``): a local directory is
read as a sharded checkpoint by ``consolidate.read_checkpoint`` (FSDP's and ModelParallel's too: [Note: resuming a
peer's sharded checkpoint]), which gives what ``torch.load`` gives for a plain checkpoint file; anything else goes to
Lightning's loader unchanged. The whole model is then in host memory once, as a plain checkpoint's would be; for a
model larger than that, evaluate with ``trainer.validate/test/predict(model, ckpt_path=dir)`` under
``chunk_offload``. The optimizers' states are read from the shards only when first looked into
(``StatesOnRead``): a fit resumed under DDP or ``"auto"`` reads them, whole on every rank as from a plain file, where
a test or ``load_from_checkpoint`` never does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io import torch_io
from lightning.pytorch.core import saving

from .consolidate import read_checkpoint


def _is_directory(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isdir(path)


def read_sharded_in_load_from_checkpoint() -> None:
    """Wrap ``saving.pl_load`` and ``torch_io.pl_load`` once ([Note: load_from_checkpoint on a directory]); a
    Lightning without them is left alone."""
    for module in (saving, torch_io):
        _wrap(module)


def _wrap(module: Any) -> None:
    original: Callable[..., Any] | None = getattr(module, "pl_load", None)
    if original is None or getattr(original, "reads_sharded", False):
        return

    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if _is_directory(path_or_url):  # one not a complete checkpoint: an error that says what is missing
            return read_checkpoint(path_or_url, map_location)
        return original(path_or_url, map_location, *args, **kwargs)

    pl_load.reads_sharded = True  # type: ignore[attr-defined]
    module.pl_load = pl_load
