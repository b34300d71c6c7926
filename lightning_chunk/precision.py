"""``ChunkPrecision``: the precision plugin of ``ChunkOffloadStrategy``.

===========  ==============  =============  ==========================================
precision    payload dtype   master dtype   notes
===========  ==============  =============  ==========================================
32-true      param dtype     param dtype    bit-for-bit the plain-PyTorch update rule
bf16-mixed   bfloat16        float32        autocast to bf16 around forward
bf16-true    bfloat16        bfloat16       no fp32 copy anywhere (like Lightning's)
16-mixed     float16 [1]     float32        autocast to fp16, dynamic loss scaling
===========  ==============  =============  ==========================================

[1] embeddings, norms, scalars and vectors: float32 (``fp32_embeddings_and_norms``).

Unlike Lightning's own mixed-precision plugins, the payloads (the weights that
modules compute with) are in the low-precision dtype, as in DeepSpeed and
Colossal-AI: that halves the bytes moved between tiers. fp32 masters keep small
updates from being lost.

[Note: a weight used twice under mixed precision]
Lightning's ``MixedPrecision`` keeps fp32 parameters and runs autocast with its cast cache off: every op that reads
a weight casts it anew, so each use's gradient comes back through its own cast in fp32 and autograd sums the uses in
fp32. Here a module computes with the bf16 payload itself, one tensor for all its uses, whose gradients autograd
sums in bf16 before the chunk widens the sum into the fp32 gradient shard: what Lightning's plugin computes with
autocast's cache on, and what FSDP's and DeepSpeed's bf16 parameters compute. A weight one op reads a step (a
Linear) gets Lightning's bits; one read by several (a block run twice, a tied head, a discriminator
on real and fake samples) differs by bf16's rounding of the sum (0.2% of the update over 12 steps of the tests'
``LinearsOnly("twice")``). Lightning's sum would need an autograd node a use that widens its gradient, that is the
module's parameters swapped at every call: not done. ``tests/integration/test_mixed_precision_layers.py`` pins both;
the two-rank case ``bf16_one_read`` holds DDP's bits under limits that differ by rank, accumulation and a resume.
Autocast also leaves an embedding and a LayerNorm in fp32, so under Lightning's plugin the residual stream they feed is
fp32; with low-precision payloads it is bf16 or fp16. In 16-mixed the difference is range, not rounding: a tied GPT's
final norm's weight gradient overflowed fp16 at the first step where Lightning's fp32 one did not (one more skipped
step, the loss scale halved). A scalar or a vector read in the model's own arithmetic (SigLIP's ``logit_bias``, whose
gradient sums every logit's) overflowed the same way: SigLIP skipped the first step that Lightning's AMP took.
``fp32_embeddings_and_norms=True`` computes them in fp32: embeddings, norms, and every parameter with one dimension
longer than 1 at most (``elementwise_shaped`` in ``engine/config.py``; a bias an op casts reads as a cast fp32
parameter would, the same bits); the classes in ``full_precision_modules`` name the layers only. Lightning's bits in
16-mixed and bf16-mixed where no matrix is read uncast (a state space's ``A_log``, ViT's position embeddings), a tied
head included, for 2 more payload bytes an embedding parameter (``tests/integration/test_precision_parity.py``; on two
ranks ``sweep.py --full-precision``; transformers' models: ``architectures.py --fp32-layers``). It is 16-mixed's
default, where fp16's range costs whole steps; ``False`` gives DeepSpeed's and FSDP's all-fp16 payloads. bf16-mixed
keeps bf16 payloads unless asked (a rounding apart, and bf16 embeddings halve the residual stream's activations).

The step order follows Lightning's AMP plugin: closure (forward + backward) ->
gradients onto the master views -> unscale and agree on overflow (fp16) ->
``on_before_optimizer_step`` and clipping -> step, or skip on overflow ->
update the scale -> write the low-precision copies back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from .engine import ChunkEngine, DtypePolicy
from .engine.config import OWN_DTYPE_MODULES
from .engine.memory.full_params import released_read
from .engine.optim import shard_norms
from .engine.optim.scaler import DynamicLossScaler
from .engine.runtime.between_steps import Window
from .engine.runtime.reads import reading, refuse_clipping_without_gradients

SUPPORTED = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
_ALIASES = {"32": "32-true", 32: "32-true", "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}
_REFUSED = {
    "16-true": "fp16 weights with no fp32 master lose every update smaller than fp16's resolution and cannot be "
    "loss-scaled safely; use '16-mixed' (fp16 compute, fp32 masters, dynamic loss scaling) or 'bf16-true'",
    "64-true": "chunks are built for fp32 and lower; use '32-true'",
    "transformer-engine": "use 'bf16-mixed'",
}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def normalize_precision(precision: str | int) -> str:
    p = _ALIASES.get(precision, precision)
    if p in _REFUSED:
        raise ValueError(f"precision={precision!r} is not supported by chunk_offload: {_REFUSED[p]}.")
    if p not in SUPPORTED:
        raise ValueError(
            f"precision={precision!r} is not supported by chunk_offload; choose one of {', '.join(SUPPORTED)}."
        )
    return str(p)


class ChunkPrecision(Precision):
    def __init__(
        self,
        precision: str | int = "32-true",
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        full_precision_modules: Sequence[type] = (),
        fp32_embeddings_and_norms: bool | None = None,
        reduce_dtype: torch.dtype | str | None = None,
    ) -> None:
        """``full_precision_modules``: module classes whose parameters compute in their own dtype under mixed precision,
        beside BatchNorm and InstanceNorm, which always do ([Note: normalisation in mixed precision] in
        ``engine/config.py``; FSDP's ``MixedPrecision._module_classes_to_ignore``). ``fp32_embeddings_and_norms``:
        embeddings and normalisation layers (``nn.Embedding``, a class named ``...Norm``), scalars and vectors too, as
        autocast computes them under Lightning's mixed precision: its bits where no matrix is read uncast, for 2 more
        payload bytes an embedding parameter; ``None``: ``True`` under 16-mixed, else ``False`` ([Note: a weight used
        twice under mixed precision]). ``reduce_dtype``: with several ranks, the dtype gradients of fp32 masters are
        summed across ranks in (``torch.bfloat16``: half the reduce-scatter bytes and gradient payload memory, FSDP's
        ``MixedPrecision(reduce_dtype=...)``); ``None``: fp32, as DDP sums."""
        self.precision = normalize_precision(precision)  # type: ignore[assignment]
        self.reduce_dtype = _reduce_dtype(reduce_dtype)
        bad = [m for m in full_precision_modules if not (isinstance(m, type) and issubclass(m, torch.nn.Module))]
        if bad or isinstance(full_precision_modules, (str, type)):
            raise ValueError(
                f"full_precision_modules={full_precision_modules!r} is not allowed; it must be a list of "
                "torch.nn.Module subclasses."
            )
        self.full_precision_modules = tuple(full_precision_modules)
        if fp32_embeddings_and_norms is None:  # 16-mixed: Lightning's AMP, whose range the payloads must not lose
            fp32_embeddings_and_norms = self.precision == "16-mixed"
        if not isinstance(fp32_embeddings_and_norms, bool) or (
            fp32_embeddings_and_norms and "mixed" not in self.precision
        ):
            raise ValueError(
                f"fp32_embeddings_and_norms={fp32_embeddings_and_norms!r} is not allowed with precision "
                f"{self.precision!r}: it is True or False, and True only under 'bf16-mixed' or '16-mixed', where "
                "autocast computes those layers in fp32."
            )
        self.fp32_embeddings_and_norms = bool(fp32_embeddings_and_norms)
        self.scaler: DynamicLossScaler | None = (
            DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval)
            if self.precision == "16-mixed"
            else None
        )
        self._engine: ChunkEngine | None = None
        self._device_type = "cpu"
        self._warned_grad_reads = False
        self._manual_norms = shard_norms.ManualWindow()  # [Note: a norm over the optimizer's gradient shards]

    # --------------------------------------------------------------- wiring
    def dtype_policy(self) -> DtypePolicy:
        compute, master = {
            "32-true": (None, None),
            "bf16-mixed": (torch.bfloat16, torch.float32),
            "16-mixed": (torch.float16, torch.float32),
            "bf16-true": (torch.bfloat16, torch.bfloat16),
        }[self.precision]
        own = OWN_DTYPE_MODULES + self.full_precision_modules
        autocast = self.precision.endswith("-mixed")
        return DtypePolicy(
            compute,
            master,
            own_dtype_modules=own,
            embeddings_and_norms_own_dtype=self.fp32_embeddings_and_norms,
            autocast=autocast,
            reduce_dtype=self.reduce_dtype,
        )

    def attach(self, engine: ChunkEngine | None, device: torch.device) -> None:
        self._engine = engine
        self._device_type = device.type
        if engine is not None:
            engine.scaler = self.scaler

    @property
    def engine(self) -> ChunkEngine:
        if self._engine is None:
            raise RuntimeError(
                "ChunkPrecision is used outside ChunkOffloadStrategy's setup (no chunk engine attached)."
            )
        return self._engine

    # --------------------------------------------------------------- module
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``bf16-true``: parameters and floating-point buffers in bfloat16, as Lightning's ``HalfPrecision`` does
        (a float buffer left in fp32 meets bf16 activations: ``mat1 and mat2 must have the same dtype``)."""
        if self.precision == "bf16-true":
            return module.to(dtype=torch.bfloat16)
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(torch.bfloat16) if self.precision == "bf16-true" else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    # -------------------------------------------------------------- forward
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision in ("bf16-mixed", "16-mixed"):
            dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
            with torch.autocast(self._device_type, dtype=dtype):
                yield
        elif self.precision == "bf16-true":  # tensors made during forward are bf16 too, as with HalfPrecision
            with _default_dtype(torch.bfloat16):
                yield
        else:
            yield

    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(data, Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
        return data

    # ------------------------------------------------------------- backward
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with super().train_step_context(), self._manual_norms.closed_after():
            yield

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        self._manual_norms.close()
        if self.scaler is not None:
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        with self._grad_window():  # on_after_backward
            out = super().post_backward(tensor, module)
        self.engine.hooks.between.guard()  # [Note: released parameters read between steps]
        if not module.automatic_optimization:  # the user's code up to opt.step()
            self._manual_norms.open(self._view_grads, self.engine.comm.world_size, self._missing())
        return out

    def _shard_norms(self) -> contextlib.AbstractContextManager[Any]:
        """[Note: a norm over the optimizer's gradient shards] in ``engine/optim/shard_norms.py``."""
        return shard_norms.watched(self._view_grads, self.engine.comm.world_size, self._missing())

    def _missing(self) -> shard_norms.Missing:
        return shard_norms.Missing(self.engine.manager.index_of, self._missing_grad)

    def _view_grads(self) -> list[Tensor]:
        return [g for b in self.engine.bindings for g in b.slots.grads()]

    def _watch_grad_reads(self, param: Tensor, by_attribute: bool) -> None:
        """[Note: gradients read where they are not]
        Between backward and the step the gradients are in the shards, and ``param.grad`` is ``None``: Lightning's
        ``grad_norm(self)`` in ``on_before_optimizer_step`` then returned nothing to log, a user's own sum of
        ``p.grad.norm()`` over ``self.parameters()`` skipped every parameter (or failed on an empty list), and
        torch's ``clip_grad_norm_(self.parameters(), ...)`` there clipped nothing and returned a norm of 0, silently.
        While ``on_after_backward``, ``on_before_optimizer_step`` and clipping run, a ``None`` read of a trainable
        parameter's ``.grad`` says so once (``shard_norms.Missing``, in the torch function mode over those hooks),
        naming the parameter; torch's ``clip_grad_*`` raises instead, since the step would differ. Inside
        ``strategy.full_parameters(with_grads=True)`` the gradients are there (a parameter without one there got none
        this step: nothing is said); ``strategy.grad_norm(p)`` gives their norms without gathering ([Note: gradient
        norms from the shards] in ``engine/optim/gradients.py``)."""
        if self.engine.hooks.closed is None:  # outside full_parameters(): the gradients are in the shards
            refuse_clipping_without_gradients(param, self.engine.manager.params)
            if released_read(self.engine.manager, param):  # its value: [Note: released parameters read between steps]
                self.engine.hooks.between.arm(param, where=Window.BEFORE_THE_STEP)

    def _missing_grad(self, param: Tensor) -> None:
        engine = self.engine
        if self._warned_grad_reads or engine.hooks.closed is not None:
            return
        self._warned_grad_reads = True
        name = engine.manager.names[engine.manager.index_of[id(param)]]
        rank_zero_warn(
            f"param.grad of {name!r} was read between backward and the optimizer step, and is None: under "
            "chunk_offload the gradients are in the chunks' shards there (grad_norm(self) reads no gradients "
            "either). For their norms call self.trainer.strategy.grad_norm(2) (no gather); read them whole inside "
            "`with self.trainer.strategy.full_parameters(with_grads=True):` (every rank); clip with "
            "Trainer(gradient_clip_val=...).",
            category=UserWarning,
        )

    @contextlib.contextmanager
    def _grad_window(self) -> Generator[None, None, None]:
        """Between backward and the step: reads of parameters and of their ``.grad`` watched, norms over the
        optimizer's shards refused ([Note: gradients read where they are not]; [Note: a norm over the optimizer's
        gradient shards] in ``engine/optim/shard_norms.py``)."""
        self.engine.hooks.between.guard(Window.BEFORE_THE_STEP)
        try:
            with reading(self._watch_grad_reads), self._shard_norms():
                yield
        finally:
            self.engine.hooks.between.disarm()

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        engine = self.engine
        self._manual_norms.close()  # a manual step: its own window below
        closure_result = closure()
        if isinstance(optimizer, _MockOptimizer):  # configure_optimizers() returned None: a backward, no step
            with self._grad_window():
                self._after_closure(model, optimizer)
            engine.hooks.between.guard()
            return closure_result
        engine.hooks.between.disarm()  # the step reads no placeholder ([Note: released parameters read between steps])
        # ``training_step`` returned None: no backward. As Lightning's precisions do, step with what the earlier
        # micro-batches of an accumulation left (nothing, without one); skip the step only under a loss scaler
        skipped_backward = closure_result is None and model.automatic_optimization
        skip_step = skipped_backward and self.scaler is not None
        # everything below concerns this optimizer alone: with several (manual optimization) each steps its own
        engine.prepare_step()
        found_inf = False
        if self.scaler is not None and not skipped_backward:
            found_inf = engine.unscale_and_check(optimizer)
        with self._grad_window():  # on_before_optimizer_step, the clipping
            self._after_closure(model, optimizer)
        stepped = not skip_step and not found_inf
        if stepped:
            engine.step(optimizer, **kwargs)
        if self.scaler is not None and not skipped_backward:
            self.scaler.update(found_inf)
        engine.finish_step(stepped=stepped, optimizer=optimizer)
        engine.hooks.between.guard()
        return closure_result

    # ------------------------------------------------------------- clipping
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if not isinstance(optimizer, _MockOptimizer):  # no optimizer: no parameters to clip, as in plain Lightning
            self.engine.clip_grad_norm_(clip_val, optimizer=optimizer)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if not isinstance(optimizer, _MockOptimizer):
            self.engine.clip_grad_value_(clip_val, optimizer=optimizer)

    def main_params(self, optimizer: Optimizer) -> Any:
        return [p for g in optimizer.param_groups for p in g["params"]]

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _reduce_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if value is not None and dtype not in _REDUCE_DTYPES:
        raise ValueError(
            f"reduce_dtype={value!r} is not allowed; it must be None (the master dtype, fp32 as DDP sums), "
            "torch.bfloat16, torch.float16 or torch.float32, or one of their names ('bfloat16')."
        )
    return dtype
