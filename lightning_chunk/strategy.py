"""``ChunkOffloadStrategy``: chunk-based ZeRO-3 with CPU offload as a Lightning strategy.

The Lightning glue only: it builds a ``ChunkEngine`` over the LightningModule and the optimizers from
``configure_optimizers``, wraps each step in the engine's micro-batch scope, and converts checkpoints to and from the
plain format. Everything that moves bytes lives in ``lightning_chunk.engine``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_deprecation, rank_zero_warn
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from .backward_step import after_failure, check_step_in_backward, clip_value, clips_by_norm, config_for_fit
from .ema import ChunkEMA
from .engine import ChunkConfig, ChunkEngine, Collectives
from .engine.chunks.materialize import DeferredInit, meta_init
from .engine.comm.group import shard_ranks
from .engine.config import PlacementName
from .engine.errors import explain_dtype_mismatch, explain_user_error
from .engine.memory import master_writes
from .engine.optim.binding import refuse_detached_views
from .engine.runtime.batches import input_bytes
from .engine.runtime.description import agree_on_limits
from .finetuning import follow_finetuning, unfollow_finetuning
from .hf import PeftAdapters, keep_generation_in_step, module_weights
from .options import CheckOptions, MemoryOptions, OffloadOptions, check_arguments, flatten, group, moved
from .precision import ChunkPrecision
from .quantized import quantize_for
from .same_batches import check_same_batches, repeat_while_others_run
from .signals import SignalsAtSteps
from .telemetry import log_memory_stats
from .toggles import follow_toggles
from .unsupported import check_callbacks, check_device
from .whole_values import WholeValues

# the arguments of Lightning's strategies that its connector may pass (it sets them as attributes otherwise)
LIGHTNING_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")

# name -> (placement, description)
PRESETS = {
    "chunk_offload": ("auto", "Chunk-based ZeRO-3; placement from a warm-up trace under the device memory limit"),
    "chunk": ("device", "Chunk-based ZeRO-3 with every shard on the device (no offload)"),
    "chunk_offload_cpu": ("host", "Chunk-based ZeRO-3 with every shard on the host, payloads fetched on use"),
}


_LIGHTNING_PRECISIONS = frozenset({"Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision"})


class ChunkOffloadStrategy(WholeValues):
    """Train any LightningModule with its parameters packed into chunks placed between device and host.

    Every argument and group field is documented once, in ``lightning_chunk/options.py``, and in the tables of
    ``docs/configuration.md`` generated from it ([Note: twelve arguments and three groups]).

    Args:
        placement: ``"auto"``, ``"device"``, ``"host"`` or ``"static"``.
        device_memory_limit: bytes of chunk memory and traced activations allowed on the device (``"12GiB"``).
        host_memory_limit: bytes of chunk memory allowed in host memory; shards beyond it go to the disk tier.
        step_in_backward: step each chunk as its gradients become final, during backward.
        state_dict_type: ``"sharded"`` (a directory every rank writes) or ``"full"`` (one plain file).
        weights: a file or directory of weights read into each rank's shards at the first ``setup``.
        param_init_fn: ``fn(module)`` for each module built on the meta device, instead of ``reset_parameters()``.
        memory: a ``MemoryOptions`` (or a dict of its fields): chunk sizes, what stays resident, the end of fit.
        offload: an ``OffloadOptions``: the disk tier's directory and I/O, prefetch, pinning, the optimizer kernel.
        checks: a ``CheckOptions``: agreement between ranks, timeouts, buffers, logged statistics.
        process_group_backend: several ranks: ``None`` picks NCCL on GPU, gloo on CPU.
        timeout: several ranks: the process group's timeout.
        **kwargs: Lightning's own (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin``), and, deprecated, a group's field by its name.
    """

    strategy_name = "chunk_offload"

    def __init__(
        self,
        placement: PlacementName = "auto",
        device_memory_limit: int | str | None = None,
        host_memory_limit: int | str | None = None,
        step_in_backward: bool | None = None,
        state_dict_type: str = "sharded",
        weights: str | os.PathLike[str] | None = None,
        param_init_fn: Callable[[torch.nn.Module], None] | None = None,
        memory: MemoryOptions | None = None,
        offload: OffloadOptions | None = None,
        checks: CheckOptions | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            **{k: kwargs.pop(k) for k in LIGHTNING_ARGS if k in kwargs},
        )
        given = {"memory": memory, "offload": offload, "checks": checks}
        groups, deprecated = moved(kwargs, {name: group(name, value) for name, value in given.items()})
        for message in deprecated:
            rank_zero_deprecation(message)
        self.memory, self.offload, self.checks = groups["memory"], groups["offload"], groups["checks"]
        top = dict(
            placement=placement,
            device_memory_limit=device_memory_limit,
            host_memory_limit=host_memory_limit,
            step_in_backward=step_in_backward,
        )
        self.config = ChunkConfig(**flatten(top, self.memory, self.offload, self.checks))
        if self.config.disk_dir is not None and self.config.host_memory_limit is None:
            rank_zero_warn(
                f"disk_dir={self.config.disk_dir!r} does nothing without host_memory_limit: the disk tier "
                "holds what does not fit under that limit. Set host_memory_limit (for example '64GiB'), or "
                "drop disk_dir."
            )
        check_arguments(timeout=timeout, state_dict_type=state_dict_type, param_init_fn=param_init_fn)
        self.state_dict_type, self.param_init_fn = state_dict_type, param_init_fn
        self.weights = None if weights is None else os.fspath(weights)
        self._weights_loaded = False  # the weights seed the first setup only: a later test() keeps trained values
        self.log_memory_stats = self.checks.log_memory_stats
        self.engine: ChunkEngine | None = None
        self._final_stats: dict[str, float] = {}
        self._kept_optimizer_states: dict[int, Any] = {}  # [Note: optimizer state after fit] in optim/kept_state.py
        self._deferred_saves = []  # [Note: a save inside a step] in checkpointing.py
        self._signals = SignalsAtSteps()  # [Note: signals on several ranks] in signals.py
        self._failed = False
        self._deferred: DeferredInit | None = None

    # ============================================================ registration
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (placement, description) in PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, placement=placement)

    # ======================================================== precision plugin
    @property
    def precision_plugin(self) -> ChunkPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = ChunkPrecision("32-true")
        assert isinstance(plugin, ChunkPrecision)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ChunkPrecision):
            precision = getattr(plugin, "precision", None)
            if precision is None or type(plugin).__name__ not in _LIGHTNING_PRECISIONS:
                raise TypeError(
                    f"chunk_offload cannot use the precision plugin {type(plugin).__name__}; pass precision='32-true', "
                    "'bf16-mixed', 'bf16-true' or '16-mixed', or a lightning_chunk.ChunkPrecision instance."
                )
            plugin = ChunkPrecision(precision)
        self._precision_plugin = plugin

    # ================================================================= setup
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module()``: tensors on the host (the engine places them); ``empty_init=True``: on the
        meta device, initialised chunk by chunk at ``setup`` ([Note: deferred initialisation])."""
        if not empty_init:
            with torch.device("cpu"), self.precision_plugin.tensor_init_context():
                yield
            return
        with meta_init(check_writes=lambda: self.param_init_fn is None), self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device, as DeepSpeed ZeRO-3's ``zero.Init`` builds partitioned:
        nothing is allocated until ``setup`` initialises each chunk and keeps this rank's shard. Values written in
        place outside ``reset_parameters()`` are an error unless ``param_init_fn`` is given (they would be lost)."""
        with meta_init(check_writes=lambda: self.param_init_fn is None):
            yield

    def model_to_device(self) -> None:
        """Buffers go to the device; parameters are placed by the engine (meta buffers when initialised)."""
        assert self.lightning_module is not None
        device = self.root_device
        for m in self.lightning_module.modules():
            for k, b in m._buffers.items():
                if b is not None and not (self._deferred is not None and self._deferred.is_deferred(b)):
                    m._buffers[k] = b.to(device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        check_device(self.root_device)
        self.accelerator.setup(trainer)
        self._failed = False
        module = self.lightning_module
        assert module is not None
        # as Lightning's Strategy.setup: the precision plugin converts the module first (bf16-true: its buffers)
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            # Trainer(sync_batchnorm=True), before the parameters are packed, as DDP and FSDP apply it (it was ignored)
            self.model = self._layer_sync.apply(self.model)
        # before configure_optimizers: meta tensors become placeholders the optimizers can hold
        adapters = PeftAdapters.of(module)  # [Note: LoRA adapters on the meta device] in hf.py
        deferred = DeferredInit.capture(
            module,
            init_fn=self.param_init_fn,
            init_for=adapters.inits if adapters else None,
            device=self.root_device,  # where plain Lightning builds configure_model: the same values
        )
        self._deferred = deferred
        self.model_to_device()
        quantize_for(module, self.root_device)  # [Note: quantizing where Lightning does] in quantized.py
        ranks = shard_ranks(self.config.shard_size, self.world_size, self.num_processes)
        timeout, verify = self.config.collective_timeout_s, self.config.verify_collectives
        comm = Collectives.over(ranks, timeout_s=timeout, verify=verify) if self.world_size > 1 else Collectives.local()
        weights, path = None, self.weights
        if path is not None and not self._weights_loaded:  # every rank reads its shards' part
            weights = comm.on_every_rank(
                lambda: module_weights(path, module, adapters), what=f"opening weights {path!r}"
            )
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # refused on every rank or on none: under the host limit every rank agrees on
            host_limit = agree_on_limits(self.config, comm).host_memory_limit  # [Note: one limit for every rank]
            check_callbacks(trainer, host_limit, self.config.disk_dir)
            if self.config.step_in_backward:
                check_step_in_backward(trainer, module, self.precision_plugin.precision, host_limit)
            self._kept_optimizer_states = {}  # the last fit's optimizers are gone
            self.setup_optimizers(trainer)
        # configure_optimizers() returned None: Lightning's placeholder steps nothing, and nothing is bound to it
        optimizers = [o for o in self.optimizers if not isinstance(o, _MockOptimizer)] if fitting else []
        precision = self.precision_plugin.precision
        config = config_for_fit(self.config, trainer, module, precision, optimizers) if fitting else self.config
        self.setup_precision_plugin()
        self.engine = ChunkEngine(
            module,
            optimizers,
            config=config,
            dtypes=self.precision_plugin.dtype_policy(),
            device=self.root_device,
            collectives=comm,
            deferred=deferred,
            weights=weights,
        )
        self.engine.buffers.enabled = fitting and self.config.broadcast_buffers  # DDP wraps the model to fit only
        if self.world_size > 1:  # [Note: generation on several ranks] in hf.py
            keep_generation_in_step(module, True)
            self.engine.hooks.where = lambda: module._current_fx_name  # [Note: a forward outside a step]
        self._weights_loaded = self._weights_loaded or weights is not None
        self._deferred = None
        emas = [cb for cb in trainer.callbacks if isinstance(cb, ChunkEMA)]  # type: ignore[attr-defined]
        if fitting and emas:  # before a checkpoint loads into it
            self.engine.ema = emas[0].average(self.engine, module)
        self.precision_plugin.attach(self.engine, self.root_device)
        if fitting and self.engine.early is not None:
            self.engine.early.clip_value = clip_value(trainer)
            self.engine.early.speculate(clip_norm=clips_by_norm(trainer), scaler=self.engine.scaler)
        if fitting and len(self.engine.bindings) > 1:
            follow_toggles(module, self)
        if fitting:
            follow_finetuning(trainer, self.engine)  # [Note: finetuning callbacks]
        self.engine.hooks.between.guard()  # [Note: released parameters read between steps]

    def memory_stats(self) -> dict[str, float]:
        """Chunk memory and traffic of this rank: bytes per tier, peak, copies, evictions, loss scale.

        After ``fit`` ends, the figures of the run that just ended."""
        if self.engine is None:
            return dict(self._final_stats)
        return self.engine.memory_stats()

    def offload_states(self) -> None:
        """Move this rank's training state off the device between steps: every shard on the device (weights,
        gradients, optimizer state) goes to host memory and no parameter stays gathered, so the device holds no
        chunk memory (DeepSpeed's ``offload_states``). For a generation engine, or another model, between training
        phases. Every rank must call it at the same point, between optimizer steps. ``reload_states()`` brings the
        state back; the next training or evaluation step does too if you do not ([Note: offloading states between
        phases] in ``engine/runtime/state_offload.py``). Before and after ``fit`` it does nothing."""
        if self.engine is not None:
            self.engine.offload.offload()

    def reload_states(self) -> None:
        """Put what ``offload_states()`` moved back where placement keeps it; training goes on bit for bit as if it
        had never moved. Every rank must call it at the same point."""
        if self.engine is not None:
            self.engine.offload.reload()

    # ================================================================= steps
    def _step(self, method: str, training: bool, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None
        self.engine.hooks.between.disarm()  # what runs up to the step's own check reads no placeholder
        # every rank runs as many batches as the others; in predict, one whose batches end repeats (same_batches.py)
        trainer, engine = self.lightning_module and self.lightning_module._trainer, self.engine
        if training:  # [Note: an optimizer's parameter given another tensor] in engine/optim/binding.py
            refuse_detached_views(engine.bindings)
        repeat, written, signalled = check_same_batches(
            trainer, engine.comm, master_writes.written(engine.manager), self._signals.mask()
        )
        if signalled:  # [Note: signals on several ranks] in signals.py
            self._signals.run(signalled)
        if written:  # [Note: the optimizer's views written outside its step]
            master_writes.refresh(engine.manager)
        nbytes, step = input_bytes(*args, **kwargs) if training else None, getattr(super(), method)

        def run() -> Any:
            with engine.micro_batch(training=training, input_bytes=nbytes) as outputs:
                out = step(*args, **kwargs)
                outputs(out)
            return out

        out = run()
        if repeat:
            repeat_while_others_run(engine.comm, run)
        if not training or not getattr(self.lightning_module, "automatic_optimization", True):  # else: after backward
            engine.hooks.between.guard()  # [Note: released parameters read between steps]
        return out

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._step("training_step", True, *args, **kwargs)
        if self.log_memory_stats and self.lightning_module is not None:
            log_memory_stats(self.lightning_module, self.memory_stats, every=self.log_memory_stats == "all")
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", False, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", False, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", False, *args, **kwargs)

    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return super().backward(closure_loss, *args, **kwargs)
        except Exception as raised:  # an interrupt ends the fit, whose teardown says what a step half taken left
            if self.engine is not None:  # before the user's code can zero_grad(): [Note: a backward that raised]
                try:
                    self.engine.after_backward()
                except Exception as ending:  # the error to show is where backward stopped, not the clean-up's
                    again = type(ending) is type(raised) and str(ending) == str(raised)
                    note = "chunk_offload: ending this backward (to free what it held and keep the ranks' collectives "
                    note += "paired) raised the same error again" if again else f"paired) also raised {ending!r}"
                    if hasattr(raised, "add_note"):  # Python 3.11
                        raised.add_note(note)
                    else:
                        warnings.warn(note, stacklevel=2)
            raise

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.after_backward()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for micro-batches that do not step. By default their gradients are still
        reduce-scattered into the shards (accumulation stays sharded); with ``sharded_accumulation=False``
        they stay local and unreduced until the stepping micro-batch."""
        if self.engine is None:
            yield
            return
        with self.engine.accumulating() if self.config.sharded_accumulation else self.engine.no_sync():
            yield

    def on_exception(self, exception: BaseException) -> None:
        self._signals.remove()  # Lightning's handlers again: no step follows ([Note: signals on several ranks])
        self._deferred_saves_on_exception(exception)  # [Note: a save inside a step] in checkpointing.py
        explain_user_error(exception)
        policy = self.precision_plugin.dtype_policy()
        low = policy.compute_dtype if policy.mixed else None  # the payloads' dtype under a mixed precision
        explain_dtype_mismatch(exception, self.precision_plugin.precision, low)
        # another rank may be stuck in a collective: teardown must not start new ones
        self._failed = True

    # ============================================================= teardown
    def teardown(self) -> None:
        failed: BaseException | None = None  # raised once the rest is torn down (a save in the background failed)
        if self.engine is not None:
            self._final_stats = self.engine.memory_stats()
            # after a failure: one rank gathers nothing from others; on several one may be stuck in a collective
            alone = self.engine.comm.world_size == 1
            materialize = self.config.materialize_on_teardown if alone or not self._failed else False
            said = after_failure(self.engine, alone) if self._failed else None
            if said is not None:
                warnings.warn(said, stacklevel=2)
            try:
                self.engine.teardown(materialize=materialize, device=torch.device("cpu"))
            except BaseException as e:  # noqa: BLE001
                failed = e
            self._kept_optimizer_states.update(self.engine.kept_optimizer_states)
            self.precision_plugin.attach(None, self.root_device)
            self.engine = None
        if self.lightning_module is not None:
            keep_generation_in_step(self.lightning_module, False)
            for name in ("toggle_optimizer", "untoggle_optimizer"):  # [Note: toggled optimizers]: the class's again
                self.lightning_module.__dict__.pop(name, None)
            # configure_model or setup failed while tensors were on the meta device: Lightning's teardown moves the
            # module to the CPU, which meta tensors refuse; placeholders hold no memory and can be moved
            DeferredInit.capture(self.lightning_module)
            trainer = self.lightning_module._trainer
            if trainer is not None:
                unfollow_finetuning(trainer)
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
                assert self.model is not None
                self.model = self._layer_sync.revert(self.model)  # plain BatchNorm again, as DDP's teardown does
        super().teardown()
        if failed is not None and self._failed:  # the error that stopped the run is the one to see
            warnings.warn(f"while tearing down after an error: {type(failed).__name__}: {failed}", stacklevel=2)
        elif failed is not None:
            raise failed
