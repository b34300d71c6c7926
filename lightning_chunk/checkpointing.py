"""``ChunkCheckpoints``: what a Lightning checkpoint is under chunk_offload. A sharded directory every rank writes its
own shards into (``state_dict_type="sharded"``, the default), or one plain file with the whole model and optimizer
state (``"full"``); either loads straight into the chunks, on any world size ([Note: the checkpoint layout] in
``engine/state/checkpoint.py``).

[Note: a save inside a step]
With ``step_in_backward`` a chunk steps as soon as its gradients are final: from the first such step until the
optimizer step ends, the chunks hold the next step's weights and optimizer state while Lightning's counters still
say the last step. Lightning saves there when a signal lands (``SLURMEnvironment``'s auto-requeue saves in its
SIGUSR1 handler, which on a GPU runs as soon as ``backward()`` returns), or when a hook inside the step saves. Such
a checkpoint held a step its counters did not count: a resume took that step again, silently (16 of 16 parameters
away from plain Lightning's resume after 10 steps), and one asked for half-way through backward held some chunks of
each step. Plain Lightning has no such window: its weights change only in ``optimizer.step()``. So a save asked
for in the window is written when the step is whole: at the next batch's start, at the end of training, or, when
the run stops by SIGTERM (Lightning stops at the end of the batch), in ``on_exception``; it is then the checkpoint
a save at that point writes. A run that fails inside the step writes none of them and says so: the step is half
taken, and the checkpoints written before are the ones to resume from. The module after a failed fit holds what
the chunks hold, as plain Lightning's holds its last values (on one rank: Ctrl-C in a notebook left it empty
before), and a failure inside the step says which chunks took it (``backward_step.after_failure``); on several
ranks nothing is gathered, since one may be stuck in a collective.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

from ._version import __version__
from .engine import ChunkEngine
from .engine.errors import CheckpointError
from .engine.memory.full_params import check_stray_writes
from .engine.state.checkpoint import KEY as CHECKPOINT_KEY
from .engine.state.checkpoint import (
    is_sharded_checkpoint,
    load_sharded,
    offered_state_dict,
    placeholder_state_dict,
    save_sharded,
    when_saved,
)
from .engine.state.peer_checkpoint import as_plain, read_peer_checkpoint
from .engine.system.atomic import remove_dir
from .finetuning import restore_finetuning_groups
from .parallel import OneProcessPerDevice
from .signals import SignalsAtSteps

_SAVE_ADVICE = (
    "A save gathers or writes every rank's shards, so every rank calls it, as Lightning asks of strategies that "
    "checkpoint in a distributed way: `trainer.save_checkpoint` under `if trainer.is_global_zero:` waits for ranks "
    "that never come. Call it on every rank; Lightning writes the files where they belong."
)


class ChunkCheckpoints(OneProcessPerDevice):
    """Lightning's checkpoint hooks over the engine's chunks; ``ChunkOffloadStrategy`` sets the attributes below."""

    engine: ChunkEngine | None
    state_dict_type: str
    _kept_optimizer_states: dict[int, Any]  # [Note: optimizer state after fit] in engine/optim/kept_state.py
    _deferred_saves: list[tuple[Any, bool, Any]]  # (path, weights_only, storage_options): [Note: a save inside a step]
    _signals: SignalsAtSteps  # [Note: signals on several ranks] in signals.py

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load into the engine's chunks, which exist only after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself, shard by shard

    @property
    def _sharded(self) -> bool:
        return self.engine is not None and self.state_dict_type == "sharded"

    def _stepped_ahead(self) -> bool:
        """Chunks of this step stepped in backward, ahead of Lightning's step ([Note: a save inside a step])."""
        early = self.engine.early if self.engine is not None else None
        return early is not None and bool(early.stepped)

    def _write_deferred_saves(self) -> None:
        """The saves asked for inside the last step, now that it is whole ([Note: a save inside a step])."""
        saves, self._deferred_saves = self._deferred_saves, []
        for filepath, weights_only, storage_options in saves:
            self.lightning_module.trainer.save_checkpoint(filepath, weights_only, storage_options)  # type: ignore[union-attr]

    def _hold_signals(self, evaluating: bool = False) -> None:
        """From training's start, or an evaluation's outside training (alone, or a fit's sanity check) ([Note: signals
        on several ranks] in signals.py)."""
        if evaluating and self._fit_holds_signals():
            return
        if self.engine is not None and self.engine.comm.all_size > 1:
            self._signals.install(self.cluster_environment)

    def _release_signals(self, evaluating: bool = False) -> None:
        if evaluating and self._fit_holds_signals():
            return
        if self.engine is not None:
            self._signals.at_end(self.engine.comm)
        self._signals.remove()

    def _fit_holds_signals(self) -> bool:
        """An evaluation inside a fit, where the fit holds them (its sanity check, before training starts, does not)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is None or trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking

    def on_train_start(self) -> None:
        super().on_train_start()
        self._hold_signals()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._hold_signals(evaluating=True)

    def on_test_start(self) -> None:
        super().on_test_start()
        self._hold_signals(evaluating=True)

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._hold_signals(evaluating=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._write_deferred_saves()

    def on_train_end(self) -> None:
        super().on_train_end()
        self._write_deferred_saves()
        self._release_signals()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._release_signals(evaluating=True)

    def on_test_end(self) -> None:
        super().on_test_end()
        self._release_signals(evaluating=True)

    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._release_signals(evaluating=True)

    def _deferred_saves_on_exception(self, exception: BaseException) -> None:
        """The run stops: by SIGTERM every rank stops at the end of a batch, where the saves can be written; a
        failure inside the step leaves it half taken, and they are not ([Note: a save inside a step])."""
        saves = self._deferred_saves
        if not saves:
            return
        if isinstance(exception, SIGTERMException) and not self._stepped_ahead():
            self._write_deferred_saves()
            return
        self._deferred_saves = []
        rank_zero_warn(
            f"chunk_offload: not written: {', '.join(repr(str(s[0])) for s in saves)}, asked for while the chunks "
            f"were stepping in backward, to be written when the step was whole; the run failed inside it "
            f"({type(exception).__name__}). The checkpoints written before are the ones to resume from."
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return super().lightning_module_state_dict()
        if self._stepped_ahead():  # written when the step is whole: nothing is gathered now
            return placeholder_state_dict(self.engine)
        # a save's first step on every rank: one on some ranks only waits in a roll call, not in a collective
        self.engine.comm.roll_call(self.engine.hooks.where(), what="a checkpoint save", advice=_SAVE_ADVICE)
        check_stray_writes(self.engine.manager, "before a checkpoint save")  # it would not be in the checkpoint
        if self._sharded:  # save_checkpoint writes the shards; nothing is gathered
            return placeholder_state_dict(self.engine)  # [Note: the state_dict of a sharded save]
        return self.engine.full_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        binding = self._binding_of(optimizer)
        if binding is None:
            kept = self._kept_optimizer_states.get(id(getattr(optimizer, "_optimizer", optimizer)))
            return kept.plain_state_dict() if kept is not None else super().optimizer_state(optimizer)
        if self._sharded or self._stepped_ahead():
            return {}
        self.engine.settle_state()  # type: ignore[union-attr]  # [Note: optimizer state read after the warm-up]
        return binding.plain_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._stepped_ahead():  # [Note: a save inside a step]
            self._deferred_saves.append((filepath, "optimizer_states" not in checkpoint, storage_options))
            rank_zero_info(
                f"chunk_offload: {str(filepath)!r} was asked for while the chunks were stepping in backward, ahead of "
                "Lightning's step: it is written when the step is whole, before the next batch."
            )
            return
        if self.engine is None and isinstance(self.launcher, _MultiProcessingLauncher):  # [Note: the launcher]
            rank_zero_warn(
                f"chunk_offload: {str(filepath)!r} is saved by the notebook's process, which did not train: the fit "
                "ran in processes forked for its devices, which sent back the weights and metrics only. It holds no "
                "optimizer state and no progress to resume from; a ModelCheckpoint callback saves those during fit."
            )
        if not self._sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        assert self.engine is not None
        if storage_options is not None:
            raise TypeError(
                "chunk_offload's sharded checkpoints take no storage_options "
                f"(got {storage_options!r}); use state_dict_type='full' with a custom CheckpointIO."
            )
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_sharded(
            self.engine,
            filepath,
            extra,
            with_optimizer="optimizer_states" in checkpoint,
            version=__version__,
            state_dict=checkpoint.get("state_dict", {}),
            # Lightning's plugin for saves that do not hold training up: written beside it ([Note: training
            # beside a save] in engine/state/background_save.py)
            background=isinstance(self.checkpoint_io, AsyncCheckpointIO),
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        """A sharded checkpoint is renamed to a hidden name before it is deleted: a kill midway through the
        deletion (ModelCheckpoint dropping an older top-k) never leaves a half-deleted directory that looks like a
        checkpoint; see [Note: replacing a checkpoint directory]. While a save is written in the background the
        deletion waits for it to be complete, and is dropped if it fails.

        Every rank calls this. A checkpoint restored before the warm-up still holds the optimizer state the first
        step reads ([Note: optimizer state read after the warm-up]); Lightning's tuners (``BatchSizeFinder``,
        ``LearningRateFinder``) restore their checkpoint and remove it at once, so it is read first, on every rank,
        before rank 0 deletes it."""
        if not is_sharded_checkpoint(filepath):
            return super().remove_checkpoint(filepath)
        pending = self.engine.pending_state if self.engine is not None else None
        if pending is not None and pending.path.resolve() == Path(filepath).resolve():
            self.engine.settle_state()  # type: ignore[union-attr]
            self.barrier("remove_checkpoint")  # every rank has read its pieces before they go
        if self.is_global_zero:
            remove = functools.partial(remove_dir, Path(filepath))
            if self.engine is not None:
                when_saved(self.engine, remove)
            else:
                remove()

    def _read_file(self, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's read of a checkpoint file, memory-mapped where its own reader would read the whole file into
        every rank's memory.

        [Note: a plain checkpoint mapped]
        Lightning's ``TorchCheckpointIO`` reads a file through ``fsspec`` into memory: each rank holds the whole model
        and optimizer state (84 GB for a 7B Adam run, on each of 8 ranks) though it keeps only its pieces. A local
        file read with the default checkpoint IO is mapped instead (``torch.load(mmap=True)``), with Lightning's
        ``map_location`` and ``weights_only``: a rank touches the pages of the pieces it copies into its shards (the
        loaders read only those: [Note: resuming a peer's sharded checkpoint] in ``state/peer_checkpoint.py``), and
        ranks on one host share them in the page cache. The loaders copy what they keep (``local_optimizer_state``
        copies even a ``step``), so nothing holds the mapping past the restore; Lightning's saves replace a file (a
        new inode) rather than write into it. A file ``torch.save`` wrote in its legacy format, a remote path, a
        file that cannot be mapped, or a user's own ``CheckpointIO`` go through Lightning's reader as before (its
        ``weights_only`` came in Lightning 2.6, passed only when given)."""
        path, io = Path(str(checkpoint_path)), cast("CheckpointIO | None", self.checkpoint_io)
        if type(io) is AsyncCheckpointIO:  # its saves run beside training; its reads are its inner IO's
            io = io.checkpoint_io
        if type(io) is TorchCheckpointIO and _is_local(checkpoint_path) and path.is_file():
            try:
                return torch.load(path, map_location=lambda storage, loc: storage, mmap=True, weights_only=weights_only)
            except Exception:  # noqa: BLE001 - Lightning's reader reads it, or raises its own error
                pass
        kw = {} if weights_only is None else {"weights_only": weights_only}
        return super().load_checkpoint(checkpoint_path, **kw)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded directory or a plain Lightning file straight into the chunks (any world size)."""
        if self.engine is None:
            return self._read_file(checkpoint_path, weights_only)
        _seen_by_every_rank(self.engine, checkpoint_path)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        with_optimizer = bool(self.engine.bindings) and trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # evaluating a checkpoint (validate, test, predict) uses the average ChunkEMA kept, as Lightning's
        # EMAWeightAveraging checkpoints hold the average as their state_dict
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING

        def regroup(meta: dict[str, Any]) -> None:  # [Note: finetuning callbacks]
            if trainer is not None:
                restore_finetuning_groups(trainer, meta.get("callbacks") or {})

        peer = read_peer_checkpoint(checkpoint_path) if is_sharded_checkpoint(checkpoint_path) else None
        if is_sharded_checkpoint(checkpoint_path) and peer is None:
            meta = load_sharded(
                self.engine,
                checkpoint_path,
                with_optimizer=with_optimizer,
                averaged=not fitting,
                defer=not self.engine.warmed_up,  # [Note: optimizer state read after the warm-up]
                before_optimizer=regroup,
            )
            # loaded into the model after on_load_checkpoint, as Lightning does (load_model_state_dict)
            meta["state_dict"] = offered_state_dict(meta[CHECKPOINT_KEY], averaged=not fitting)
            meta = {k: v for k, v in meta.items() if k != CHECKPOINT_KEY}
            meta["_chunk_loaded"] = "shards"  # the model's values given by state_dict are still to load
            return meta
        else:
            # a plain file, or FSDP's or ModelParallel's directory ([Note: resuming a peer's sharded checkpoint])
            meta = as_plain(peer if peer is not None else self._read_file(checkpoint_path, weights_only))
            module = self.lightning_module
            self.engine.load_full_state_dict(meta["state_dict"], strict=getattr(module, "strict_loading", True))
            if with_optimizer and "optimizer_states" not in meta:  # as Lightning's own resume refuses it
                raise CheckpointError(
                    f"{str(checkpoint_path)!r} holds no optimizer state (saved with save_weights_only=True?): "
                    "resuming fit needs it. To start a new fit from its weights, load them (load_state_dict, or "
                    "ChunkOffloadStrategy(weights=...)) and call fit without ckpt_path."
                )
            if with_optimizer and meta["optimizer_states"]:
                regroup(meta)
                for binding, state in zip(
                    self.engine.bindings, _one_each(meta["optimizer_states"], len(self.engine.bindings)), strict=True
                ):
                    binding.load_plain_state_dict(state)
        meta["_chunk_loaded"] = True
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if checkpoint.get("_chunk_loaded") is True:
            return  # load_checkpoint put the values into the chunks already
        if self.engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self.engine.load_full_state_dict(dict(checkpoint["state_dict"]), strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if checkpoint.get("_chunk_loaded"):
            return
        for optimizer, state in zip(
            self.optimizers, _one_each(checkpoint["optimizer_states"], len(self.optimizers)), strict=True
        ):
            binding = self._binding_of(optimizer)
            if binding is None:
                optimizer.load_state_dict(state)
            else:
                binding.load_plain_state_dict(state)

    def _binding_of(self, optimizer: Optimizer) -> Any:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self.engine is None:
            return None
        return next((b for b in self.engine.bindings if b.optimizer is optimizer), None)


def _is_local(path: Any) -> bool:
    protocol = get_filesystem(path).protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def _one_each(states: Any, optimizers: int) -> Any:
    """A checkpoint's optimizer states, when it holds one for each optimizer the run configured."""
    if len(states) != optimizers:
        raise CheckpointError(
            f"the checkpoint holds {len(states)} optimizer state(s) but configure_optimizers "
            f"returned {optimizers} optimizer(s): a resume needs the optimizers it was saved with "
            "(or load the weights alone: ckpt_path=None and load_state_dict)."
        )
    return states


def _seen_by_every_rank(engine: ChunkEngine, path: Any) -> None:
    """Every rank reads the checkpoint (its own shards, or the whole file): one that does not find it raised alone and
    left the others in the load's first collective, a hang on NCCL. Refused on every rank, naming the ranks that do
    not see it ([Note: one directory every rank sees]); a path no rank finds gets Lightning's own error."""
    comm = engine.comm
    missing = comm.failed_ranks(get_filesystem(path).exists(str(path)), what=f"looking for checkpoint {str(path)!r}")
    if missing and len(missing) < comm.all_size:
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is not found on rank(s) {missing}, and is on the others: every rank reads it, "
            "so it must be on storage every node shares (NFS, Lustre, GPFS, a shared volume), not a disk local to "
            "one node"
        )
