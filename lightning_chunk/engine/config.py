"""Typed, closed configuration of the chunk engine, validated once.

Every bad value is rejected with a ``ValueError`` that names the field, the
value and what is allowed. Configs are frozen: nothing downstream mutates the
caller's object; derive a new one with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.utils import parametrize

from .system.page_cache import IO_MODES, DiskIO

PlacementName = Literal["auto", "device", "host", "static"]
OptimizerKernel = Literal["auto", "one_pass", "fused", "foreach", "loop"]
PinMemory = bool | Literal["exact"]  # [Note: exact pinned memory] in system/exact_pinned.py

PLACEMENTS: tuple[str, ...] = ("auto", "device", "host", "static")
OPTIMIZER_KERNELS: tuple[str, ...] = ("auto", "one_pass", "fused", "foreach", "loop")

# [Note: memory sizes] One parser for every size a user writes (limits, the CLI's flags): an int of bytes, or a
# number with a unit, any case, a space allowed. K, M, G, T and KB, MB, GB, TB are powers of 1000 (as disks and
# Kubernetes count); Ki, Mi, Gi, Ti and KiB, MiB, GiB, TiB powers of 1024 (as memory is sold and torch reports it).
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
SIZE_FORMS = (
    "an int of bytes, or a number with a unit, any case: K, M, G, T, KB, MB, GB, TB (powers of 1000) or "
    "Ki, Mi, Gi, Ti, KiB, MiB, GiB, TiB (powers of 1024), for example '12GiB', '1.5 GB' or '512MiB'"
)


def parse_bytes(value: int | float | str | None, *, field: str) -> int | None:
    """Turn ``2_000_000``, ``"512MiB"``, ``"12G"`` or ``"1.5 GB"`` into a byte count; ``None`` stays ``None``
    ([Note: memory sizes])."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{field}={value!r} is not a memory size; give {SIZE_FORMS}.")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field}={value!r} is not a memory size; give {SIZE_FORMS}.")
        n: float = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        n = value
        if isinstance(value, float) and value == value and value > 0 and not value.is_integer():
            raise ValueError(f"{field}={value!r} is not a whole number of bytes; give {SIZE_FORMS}.")
    if not n >= 1:  # also NaN
        raise ValueError(f"{field}={value!r} must be a positive number of bytes (at least 1); give {SIZE_FORMS}.")
    return int(n)


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest of GiB, MiB and KiB that keeps it at least 1 (bytes below 1 KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} bytes"


def format_bytes(n: int) -> str:
    """``n`` as an error message shows a size: the bytes, then KiB, MiB or GiB beside them."""
    return f"{n} bytes ({human_bytes(n)})" if abs(n) >= 2**10 else f"{n} bytes"


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name}={value!r} is not allowed; it must be {allowed}.")


@dataclass(frozen=True)
class ChunkConfig:
    """How parameters are packed into chunks and placed between the device and host tiers.

    The strategy's arguments and its three groups, flattened; each field is documented once, in
    ``lightning_chunk/options.py`` (``docs/configuration.md`` is generated from it). ``check_invariants`` is the
    engine's alone."""

    placement: PlacementName = "auto"
    device_memory_limit: int | None = None
    host_memory_limit: int | None = None
    disk_dir: str | None = None
    disk_io: DiskIO = "auto"
    reshard_after_forward: bool | None = None
    offload_fraction: float = 0.5
    chunk_numel: int | None = None
    chunk_numel_min: int = 1 << 20
    chunk_numel_max: int = 1 << 26
    prefetch: bool = True
    pin_memory: PinMemory = True
    materialize_on_teardown: bool | None = None  # None: where the whole model fits ([Note: the model after fit])
    materialize_optimizer_state: bool | None = None  # None: on one rank ([Note: optimizer state after fit])
    optimizer_kernel: OptimizerKernel = "auto"
    assume_elementwise_optimizer: bool = False
    sharded_accumulation: bool = True
    shard_size: int | str | None = None  # [Note: replicas of the shard group] in comm/group.py
    collective_timeout_s: float = 300.0
    broadcast_buffers: bool = True
    verify_collectives: bool | str | None = None
    replan_when_inputs_grow: bool = True
    step_in_backward: bool | None = None
    step_thread: bool | None = None
    leaf_modules: tuple[type | str, ...] = ()
    activation_checkpointing: tuple[type | str, ...] = ()  # [Note: activation checkpointing by class]
    keep_freed_heap: bool = True
    frozen_in_compute_dtype: bool = False  # [Note: frozen weights in the compute dtype]

    check_invariants: bool = False
    """Re-derive the byte accounting from the chunks after every manager operation (slow; tests)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "device_memory_limit", parse_bytes(self.device_memory_limit, field="device_memory_limit")
        )
        object.__setattr__(self, "host_memory_limit", parse_bytes(self.host_memory_limit, field="host_memory_limit"))
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or not os.fspath(self.disk_dir):
                raise ValueError(f"disk_dir={self.disk_dir!r} is not allowed; it must be a directory path or None.")
            object.__setattr__(self, "disk_dir", os.fspath(self.disk_dir))
        for field in ("leaf_modules", "activation_checkpointing"):
            classes = getattr(self, field)
            if (
                isinstance(classes, (str, type))
                or not isinstance(classes, (tuple, list))
                or not all(
                    isinstance(m, str) and m or isinstance(m, type) and issubclass(m, torch.nn.Module) for m in classes
                )
            ):
                raise ValueError(
                    f"{field}={classes!r} is not allowed; it must be a list of torch.nn.Module subclasses or class "
                    "names (for example ['MyBlock'])."
                )
            object.__setattr__(self, field, tuple(classes))
        self._validate()

    def _validate(self) -> None:
        if self.disk_io not in IO_MODES:
            raise ValueError(f"disk_io={self.disk_io!r} is not allowed; choose one of {', '.join(IO_MODES)}.")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not allowed; choose one of {', '.join(PLACEMENTS)}.")
        if self.optimizer_kernel not in OPTIMIZER_KERNELS:
            raise ValueError(
                f"optimizer_kernel={self.optimizer_kernel!r} is not allowed; choose one of "
                f"{', '.join(OPTIMIZER_KERNELS)}."
            )
        if (
            isinstance(self.offload_fraction, bool)
            or not isinstance(self.offload_fraction, (int, float))
            or not (0.0 <= self.offload_fraction <= 1.0)
        ):
            raise ValueError(
                f"offload_fraction={self.offload_fraction!r} is not allowed; it must be a number in [0, 1]."
            )
        _positive_int("chunk_numel", self.chunk_numel, allow_none=True)
        _positive_int("chunk_numel_min", self.chunk_numel_min)
        _positive_int("chunk_numel_max", self.chunk_numel_max)
        if self.chunk_numel_min > self.chunk_numel_max:
            raise ValueError(
                f"chunk_numel_min={self.chunk_numel_min} is larger than chunk_numel_max={self.chunk_numel_max}; "
                "the minimum must not exceed the maximum."
            )
        if (
            isinstance(self.collective_timeout_s, bool)
            or not isinstance(self.collective_timeout_s, (int, float))
            or self.collective_timeout_s <= 0
        ):
            raise ValueError(
                f"collective_timeout_s={self.collective_timeout_s!r} is not allowed; it must be a positive "
                "number of seconds."
            )
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward={self.reshard_after_forward!r} is not allowed; it must be True, False or None."
            )
        if self.reshard_after_forward is True and self.placement != "host":
            raise ValueError(
                f"reshard_after_forward=True is not allowed with placement={self.placement!r}: only placement='host' "
                "releases payloads after use. The other placements keep them until the device budget needs the room "
                "(set device_memory_limit to bound it); use placement='host' to release every payload after use."
            )
        if (
            self.verify_collectives not in (None, True, False, "each", "batch")
            or isinstance(self.verify_collectives, (int, float))
            and not isinstance(self.verify_collectives, bool)
        ):
            raise ValueError(
                f"verify_collectives={self.verify_collectives!r} is not allowed; it must be None, True, "
                "False, 'each' or 'batch'."
            )
        if self.step_in_backward is not None and not isinstance(self.step_in_backward, bool):
            raise ValueError(
                f"step_in_backward={self.step_in_backward!r} is not allowed; it must be True, False or None."
            )
        if self.shard_size not in (None, "node") and (
            isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 2
        ):
            raise ValueError(
                f"shard_size={self.shard_size!r} is not allowed; it must be None (every rank), 'node' (the devices of "
                "a node) or a number of ranks of at least 2."
            )
        if self.step_thread is not None and not isinstance(self.step_thread, bool):
            raise ValueError(f"step_thread={self.step_thread!r} is not allowed; it must be True, False or None.")
        if not (isinstance(self.pin_memory, bool) or self.pin_memory == "exact"):
            raise ValueError(
                f"pin_memory={self.pin_memory!r} is not allowed; it must be True (torch's pinned allocator), "
                "'exact' (page-locked to the byte) or False (pageable)."
            )
        for name in ("materialize_on_teardown", "materialize_optimizer_state"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; it must be True, False or None.")
        for name in (
            "broadcast_buffers",
            "prefetch",
            "assume_elementwise_optimizer",
            "sharded_accumulation",
            "replan_when_inputs_grow",
            "keep_freed_heap",
            "frozen_in_compute_dtype",
            "check_invariants",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed; it must be True or False.")

    def replace(self, **changes: object) -> ChunkConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def step_thread_on(self, device_type: str) -> bool:
        """Stepping in backward, host chunks step on a worker ([Note: the host Adam beside backward]):
        ``step_thread``, where ``None`` means on a GPU."""
        return self.step_thread if self.step_thread is not None else device_type == "cuda"

    def steps_beside_backward(self, device_type: str) -> bool:
        """Host chunks step on a worker beside backward: stepping in backward (``None`` counted as not), on a
        thread (``step_thread_on``)."""
        return self.step_in_backward is True and self.step_thread_on(device_type)


def device_margin_bytes(total_bytes: int) -> int:
    """What ``device_memory_limit=None`` leaves free on a CUDA device: 10% of its memory, at least 1 GiB."""
    return max(1 << 30, total_bytes // 10)


def default_device_limit(device: torch.device) -> int | None:
    """``device_memory_limit=None`` made concrete: free memory now less ``device_margin_bytes``; ``None`` on CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    limit = free - device_margin_bytes(total)
    if limit <= 0:
        raise ValueError(
            f"device_memory_limit=None: {device} has {free} bytes free of {total}, less than the "
            f"{device_margin_bytes(total)}-byte margin; free device memory or set device_memory_limit."
        )
    return limit


def resolve_reshard_after_forward(config: ChunkConfig, device: torch.device) -> ChunkConfig:
    """``reshard_after_forward=None`` made concrete for ``device``: ``False`` (keep within the budget) on an
    accelerator, whose trace sees every byte its allocator holds; ``True`` (release after use) on a CPU device, whose
    payloads are host memory and whose trace sees only the saved activations ([Note: keeping payloads for backward]
    in ``placement.py``)."""
    if config.reshard_after_forward is not None or config.placement != "host":
        return config
    return config.replace(reshard_after_forward=device.type == "cpu")


# modules whose kernels need their parameters in their own dtype under mixed precision ([Note: normalisation in
# mixed precision]): BatchNorm 1d/2d/3d, SyncBatchNorm, InstanceNorm and their lazy forms
OWN_DTYPE_MODULES: tuple[type, ...] = (torch.nn.modules.batchnorm._NormBase,)


def autocast_fp32_layer(m: torch.nn.Module) -> bool:
    """An embedding, or a normalisation layer (a class named ``...Norm``: LayerNorm, RMSNorm, GroupNorm, and models'
    own, as transformers' ``LlamaRMSNorm``): what autocast leaves in fp32, feeding the residual stream, reading it."""
    return isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or type(m).__name__.lower().endswith("norm")


def packed_codes(p: torch.Tensor) -> bool:
    """[Note: quantized weights]
    A QLoRA base holds bitsandbytes' 4-bit weights (``Params4bit``): two codes a byte, packed into a ``quant_storage``
    tensor, their scales beside them in ``quant_state``, read only by bitsandbytes' kernels. Its values are not
    numbers: a cast rewrites the bytes. Under ``bf16-mixed`` a float32 container became a bf16 payload of half the
    bytes, and the kernel failed on its shape; ``16-mixed`` over a bf16 container (``fp32_embeddings_and_norms=False``)
    would have decoded other weights without a word. Such a parameter keeps its own dtype in every precision, as
    BatchNorm's do, and is packed, sharded, offloaded and gathered like any frozen one (FSDP and DeepSpeed ZeRO-3 ask
    the same container, ``quant_storage=torch.bfloat16``). A container that is not a float (bitsandbytes' default
    ``uint8``) is refused, naming that option. The strategy quantizes such weights where plain Lightning's
    ``model.to(device)`` does and puts their ``quant_state`` on the device (``quantized.py``)."""
    return hasattr(p, "quant_state")


def elementwise_shaped(p: torch.Tensor) -> bool:
    """A scalar or a vector (one dimension longer than 1 at most: a temperature, a bias, a class token)."""
    return sum(d > 1 for d in p.shape) <= 1


# the forward pre-hooks of torch.nn.utils.weight_norm and spectral_norm, which compute a weight as parametrizations
# do ([Note: reparametrized weights in mixed precision])
_NORM_HOOKS: tuple[type, ...] = (
    importlib.import_module("torch.nn.utils.weight_norm").WeightNorm,
    importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm,
)


def reparametrized_params(m: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``m``'s weight is computed from by a parametrization (``torch.nn.utils.parametrize``: weight
    norm, spectral norm, orthogonal, a LoRA of one's own) or by weight norm's and spectral norm's forward pre-hooks,
    with ``m``'s own others (its bias); ``[]`` where ``m`` has none.

    [Note: reparametrized weights in mixed precision]
    Lightning's mixed precision keeps the originals (``weight_v`` and ``weight_g``, ``weight_orig``, a LoRA's base,
    A and B) in fp32 and computes the weight from them in fp32, autocast lowering only the ops on its list (a
    LoRA's ``B @ A``); the layer's matmul runs in bf16. In payloads of the compute dtype the whole computation ran
    in bf16: spectral norm's power iteration (``torch.mv(..., out=u)`` into its fp32 buffers) failed ("addmv
    input tensors must have the same dtype"); weight norm's backward, which subtracts the gradient's radial part,
    lost most of its digits (0.026 off plain Lightning after four steps of a three-layer MLP whose plain form is
    0.0003 off); a LoRA parametrization over a frozen base (``W + B @ A``) trained 5.2% off plain Lightning's
    update where bf16-mixed itself is 0.55% off fp32. Their parameters keep their own dtype, as BatchNorm's do
    (0.57%): a parametrized layer's payload is fp32, twice bf16's bytes, and its matmul still runs in bf16."""
    hooked = any(isinstance(h, _NORM_HOOKS) for h in m._forward_pre_hooks.values())
    lists = list(m.parametrizations.values()) if parametrize.is_parametrized(m) else []  # type: ignore[operator]
    if not hooked and not lists:
        return []
    return [*m.parameters(recurse=False), *(p for pl in lists for p in pl.parameters())]


@dataclass(frozen=True)
class DtypePolicy:
    """The dtypes one precision setting implies for chunk buffers.

    [Note: normalisation in mixed precision]
    Under autocast a BatchNorm's kernel takes a bf16 (or fp16) input with fp32 weight, bias and running
    statistics, and not a low-precision weight beside fp32 statistics ("expected scalar type BFloat16 but found
    Float"). Lightning's mixed precision keeps every parameter in fp32 and so never meets it; payloads in the
    compute dtype do. As FSDP's ``MixedPrecision`` leaves ``_BatchNorm`` modules in full precision, the parameters
    of ``own_dtype_modules`` keep their own dtype in their payloads: the layout key (``ChunkKey.own_dtype``) puts
    them in chunks of their own, whose compute dtype is the master's. They are small (two vectors a layer) and
    packed together, in first-use order, so a CNN gets one or two such chunks.
    """

    compute_dtype: torch.dtype | None = None
    """dtype of payloads (what modules compute with). ``None``: each parameter's own dtype."""

    master_dtype: torch.dtype | None = None
    """dtype of master shards, gradient accumulators and optimizer state. ``None``: each
    parameter's own dtype."""

    own_dtype_modules: tuple[type, ...] = OWN_DTYPE_MODULES
    """modules whose parameters compute in their own dtype whatever ``compute_dtype`` says."""

    embeddings_and_norms_own_dtype: bool = False
    """embeddings and normalisation layers (``autocast_fp32_layer``), scalars and vectors (``elementwise_shaped``) too:
    Lightning's autocast computes them in fp32 ([Note: a weight used twice under mixed precision] in
    ``precision.py``)."""

    frozen_in_compute_dtype: bool = False
    """frozen chunks keep one copy, in the compute dtype ([Note: frozen weights in the compute dtype])."""

    autocast: bool = False
    """steps run under autocast to the compute dtype (Lightning's mixed precisions): a parameter an op reads where
    the user turned autocast off keeps its own dtype ([Note: parameters read outside autocast])."""

    reduce_dtype: torch.dtype | None = None
    """several ranks: the dtype fp32 gradients are summed across ranks in, the gradient payload's (FSDP's
    ``MixedPrecision.reduce_dtype``, DeepSpeed's ``communication_data_type``). ``None``: the master dtype."""

    def reduce_for(self, master: torch.dtype) -> torch.dtype:
        """The gradient payload's dtype of a chunk whose master is ``master``: only fp32 masters narrow."""
        return self.reduce_dtype if self.reduce_dtype is not None and master == torch.float32 else master

    def compute_for(self, param_dtype: torch.dtype, *, own_dtype: bool = False) -> torch.dtype:
        return param_dtype if own_dtype else self.compute_dtype or param_dtype

    def own_dtype_params(self, module: torch.nn.Module) -> frozenset[int]:
        """``id``s of the parameters that keep their own dtype when payloads are in another dtype than the
        parameters': those of ``own_dtype_modules``, of reparametrized weights (``reparametrized_params``), those
        wider than the master dtype (float64: ``_wider``), quantized ones (``packed_codes``) and those
        ``embeddings_and_norms_own_dtype`` names."""
        if self.compute_dtype is None:
            return frozenset()
        keep: set[int] = set()
        for m in module.modules():
            mine = isinstance(m, self.own_dtype_modules) or (
                self.embeddings_and_norms_own_dtype and autocast_fp32_layer(m)
            )
            own = m.parameters(recurse=False) if mine else ()
            keep.update(id(p) for p in [*own, *reparametrized_params(m)])
            if self.embeddings_and_norms_own_dtype:
                keep.update(id(p) for p in m.parameters(recurse=False) if elementwise_shaped(p))
            keep.update(id(p) for p in m.parameters(recurse=False) if self._wider(p.dtype) or packed_codes(p))
        return frozenset(keep)

    @property
    def mixed(self) -> bool:
        """Payloads in a lower precision than masters (``bf16-mixed``, ``16-mixed``)."""
        return (
            self.compute_dtype is not None and self.master_dtype is not None and self.compute_dtype != self.master_dtype
        )

    def _wider(self, param_dtype: torch.dtype) -> bool:
        """[Note: float64 parameters under mixed precision]
        Autocast leaves float64 tensors alone, and Lightning's mixed precision never changes a parameter's dtype:
        a float64 parameter (a physical constant fitted beside a network) computes and steps in float64. In bf16
        payloads over fp32 masters it computed in bf16 and was stepped and saved in fp32, silently: after six
        steps its values agreed with plain Lightning's to 2e-5, fp32's rounding. A parameter wider than the
        mixed precision's master dtype keeps its own dtype for both (``bf16-true`` rounds every parameter, as
        Lightning's does)."""
        return self.mixed and param_dtype.itemsize > self.master_dtype.itemsize  # type: ignore[union-attr]

    def master_for(self, param_dtype: torch.dtype, *, trainable: bool = True, own_dtype: bool = False) -> torch.dtype:
        """The dtype of a chunk's master shard.

        [Note: frozen weights in the compute dtype]
        A frozen parameter is never stepped: its fp32 master serves only what reads the weights outside a forward
        (checkpoints, the values after fit, a later unfreeze), since every forward reads the payload, in the
        compute dtype. So under ``bf16-mixed`` a frozen chunk held 6 bytes a parameter (fp32 master, bf16 copy)
        where its forward needs 2: a LoRA fine-tune's frozen base cost three times its compute copy (pytorch
        #91165, DeepSpeed #3948). With ``frozen_in_compute_dtype`` a frozen chunk's master is its compute copy,
        one buffer in the compute dtype, as a 32-true chunk's is: training is the same bit for bit (the payload
        is the same rounding of the same values), but what is saved, consolidated or given back after fit for a
        frozen parameter is that rounding, and a parameter unfrozen later starts from it. So it is the user's
        choice, off by default: a checkpoint of frozen fp32 weights keeps them whole unless asked."""
        if not trainable and self.frozen_in_compute_dtype:
            return self.compute_for(param_dtype, own_dtype=own_dtype)
        if self.master_dtype is None or self._wider(param_dtype):
            return param_dtype
        if not trainable and self._narrow_already(param_dtype):
            return param_dtype
        return self.master_dtype

    def _narrow_already(self, param_dtype: torch.dtype) -> bool:
        """[Note: low-precision parameters under mixed precision]
        A fine-tune often loads its frozen base already in bf16 (``torch_dtype=torch.bfloat16``) beside fp32
        adapters under ``bf16-mixed``. Lightning's mixed precision leaves the base so, 2 bytes a parameter; here
        it was given fp32 masters: 6 bytes a parameter for values its 2 hold exactly. Under a mixed precision a
        frozen parameter no wider than the compute dtype keeps its own dtype as its master. A *trainable* bf16
        parameter still gets an fp32 master, gradient and optimizer state, as DeepSpeed's bf16 mode gives it:
        plain Lightning steps it in bf16, where an update smaller than half a bf16 step of the weight is lost
        (training stalls silently); ``bf16-true`` is that pure-bf16 run, when it is wanted."""
        return self.mixed and param_dtype.itemsize <= self.compute_dtype.itemsize  # type: ignore[union-attr]
