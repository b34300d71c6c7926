"""The strategy's knobs, each documented once, here: twelve arguments of ``ChunkOffloadStrategy`` and three groups.

[Note: twelve arguments and three groups]
The knobs most runs set are arguments of the strategy (``placement``, the two memory limits, ``step_in_backward``,
how checkpoints and weights are read and written, the process group's); the rest are fields of three frozen groups,
``memory=MemoryOptions(...)``, ``offload=OffloadOptions(...)`` and ``checks=CheckOptions(...)``, as FSDP2's
``fully_shard`` takes policy objects. A group is a dataclass, so LightningCLI configures it as a nested mapping
(``strategy.init_args.memory.chunk_numel``), and a plain ``dict`` of its fields is accepted too. The engine keeps one
flat ``ChunkConfig``: ``flatten`` makes it. The names the strategy took before the groups (``chunk_numel=``,
``verify_collectives=``, ...) still work for one release, with a ``DeprecationWarning`` naming the group to use.
``docs/configuration.md``'s tables are generated from this module (``python -m lightning_chunk.config_docs``), and
a test fails when they differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .engine.config import OptimizerKernel, PinMemory
from .engine.system.page_cache import DiskIO


def knob(default: Any, *, doc: str, when: str) -> Any:
    """A group's field: its default, what it does (``doc``) and when to change it (``when``), for the docs."""
    return dataclasses.field(default=default, metadata={"doc": doc, "when": when})


@dataclass(frozen=True)
class MemoryOptions:
    """How parameters are packed into chunks and how much of the device and host memory they take."""

    chunk_numel: int | None = knob(
        None,
        doc=(
            "elements per chunk; `None` chooses after the warm-up: the least padding with at least 16 chunks, two "
            "payloads plus the traced activations under the limit ([Note: chunk granularity])"
        ),
        when="larger for fewer, bigger copies; about one transformer block with `host` on several ranks",
    )
    chunk_numel_min: int = knob(1 << 20, doc="lower bound of the search (raised to the largest parameter)", when="")
    chunk_numel_max: int = knob(1 << 26, doc="upper bound of the search (raised to the largest parameter)", when="")
    offload_fraction: float = knob(
        0.5, doc="`static` only: the fraction of chunks whose shards live on the host", when=""
    )
    reshard_after_forward: bool | None = knob(
        None,
        doc=(
            "`host` only: `False` keeps forward's payloads until their last use in the step while the device budget "
            "has room (one all-gather a chunk a step, DeepSpeed ZeRO-3's default); `True` releases each after its "
            "forward use (FSDP2's default). `None`: `False` on an accelerator, `True` on a CPU device"
        ),
        when="`False` on a CPU device with memory to spare; `True` on an accelerator shared with something else",
    )
    sharded_accumulation: bool = knob(
        True,
        doc=(
            "several ranks: every micro-batch's gradients are reduce-scattered into the shards; `False` keeps "
            "non-stepping micro-batches' gradients whole and reduces once a step, as DDP's `no_sync`"
        ),
        when="`False` for fewer collectives when the whole fp32 gradient fits on every rank's device",
    )
    shard_size: int | str | None = knob(
        None,
        doc=(
            "several ranks: chunks are sharded over groups of this many consecutive ranks and replicated across the "
            "groups (FSDP's `HYBRID_SHARD`); `'node'`: a node's devices. `None`: over every rank"
        ),
        when=(
            "`'node'` on several nodes whose host memory holds a node's share: only one all-reduce a chunk a step "
            "crosses nodes"
        ),
    )
    materialize_on_teardown: bool | None = knob(
        None,
        doc=(
            "when `fit` ends, give parameters their trained values on the host, chunk by chunk. `None`: where the "
            "whole model fits in a rank's share of host memory; elsewhere they are left empty and rank 0 warns"
        ),
        when="`True` always; `False` never (the values are in the checkpoints)",
    )
    materialize_optimizer_state: bool | None = knob(
        None,
        doc="when `fit` ends, give the optimizer its whole state too. `None`: on one rank (no copy)",
        when="`True` to use `trainer.optimizers[i]` after `fit` on several ranks",
    )
    leaf_modules: Sequence[type | str] = knob(
        (),
        doc=(
            'module classes or names (`"MyBlock"`) that gather their whole subtree at their own forward, '
            "DeepSpeed's leaf modules. `MultiheadAttention`, `Transformer*Layer` and parametrized modules always "
            "are ([Note: leaf modules])"
        ),
        when=(
            "a module that reaches its children's parameters through a reference kept elsewhere; the warm-up names "
            "it. Reads by attribute (a tied head) need nothing"
        ),
    )
    activation_checkpointing: Sequence[type | str] = knob(
        (),
        doc=(
            "module classes (or names) whose activations are recomputed in backward (torch's composable "
            "`checkpoint`, FSDP's `activation_checkpointing_policy`)"
        ),
        when="activations fill the device: name the transformer block",
    )
    replan_when_inputs_grow: bool = knob(
        True,
        doc=(
            "under a device limit, a training micro-batch with larger inputs than the warm-up's is traced again "
            "and placement re-planned ([reliability.md](reliability.md))"
        ),
        when="off to keep the warm-up's plan whatever the inputs",
    )
    frozen_in_compute_dtype: bool = knob(
        False,
        doc=(
            "frozen parameters keep one copy, in the compute dtype, and no fp32 master: 2 bytes a parameter under "
            "`bf16-mixed` instead of 6. Training is the same; saved and final values of frozen parameters are "
            "rounded to the compute dtype ([Note: frozen weights in the compute dtype])"
        ),
        when="LoRA and other fine-tunes of a large frozen base under mixed precision",
    )
    keep_freed_heap: bool = knob(
        True,
        doc=(
            "on a CPU device with no `host_memory_limit`, glibc keeps the heap pages a step frees for the next step "
            "(`mallopt`; skipped when `GLIBC_TUNABLES` sets glibc's thresholds) ([Note: the heap between steps])"
        ),
        when="off when another library in the process tunes malloc",
    )


@dataclass(frozen=True)
class OffloadOptions:
    """How shards move between the tiers and how the host steps them: the disk tier, copies, the optimizer kernel."""

    disk_dir: str | None = knob(
        None,
        doc=(
            "the disk tier's directory: each process makes a scratch directory there, reserves its space before "
            "training and removes it at the end"
        ),
        when="with `host_memory_limit`, on a fast local disk",
    )
    disk_io: DiskIO = knob(
        "auto",
        doc=(
            "`buffered` through the page cache, `direct` past it (`O_DIRECT`); `auto` goes direct when this host's "
            'disk bytes exceed what the page cache could hold (`memory_stats()["disk_direct_io"]` says which)'
        ),
        when="`direct` where the memory `auto` sees now will be taken by something else",
    )
    prefetch: bool = knob(
        True,
        doc="gather the next moments' chunks ahead of use when they fit ([Note: how far ahead to gather])",
        when="off to save device memory at the cost of stalls",
    )
    pin_memory: PinMemory = knob(
        True,
        doc="page-lock host shards on CUDA: `True` in torch's power-of-two blocks, `exact` to the byte",
        when="`exact` where `plan` shows the rounding binding; off where host memory is tighter still",
    )
    optimizer_kernel: OptimizerKernel = knob(
        "auto",
        doc=(
            "`auto`: torch's fused kernels (SGD, Adagrad: fp32 only); Adam(W) host shards of 2^25+ elements a rank "
            "with a compute copy step and write it in one pass (`host_adam.py`); `one_pass` at any size; "
            "`fused`, `foreach`, `loop` force torch's ([Note: the kernel and the user's param groups])"
        ),
        when=(
            "`loop` for bit-exact agreement with plain Lightning on CPU; `auto` agrees to fp32 rounding (`bf16-true`: "
            "equals torch's `fused=True`, which computes in fp32 where its default rounds each op to bf16)"
        ),
    )
    step_thread: bool | None = knob(
        None,
        doc="stepping in backward, chunks step on a thread beside it ([Note: the host Adam beside backward])",
        when="`None`: on a GPU",
    )


@dataclass(frozen=True)
class CheckOptions:
    """What the ranks check and report: agreement on collectives, timeouts, buffers as DDP keeps them, statistics."""

    verify_collectives: bool | str | None = knob(
        None,
        doc=(
            'several ranks: check that all ranks issue the same chunk collectives, `"batch"` once a micro-batch, '
            '`True` (`"each"`) before each result is used, `False` never. `None`: `"batch"` on gloo, off on NCCL'
        ),
        when="`True` while finding where ranks disagree",
    )
    collective_timeout_s: float = knob(
        300.0,
        doc="several ranks on gloo: the longest a collective waits before an error names its chunk and module",
        when="lower in tests and debugging",
    )
    broadcast_buffers: bool = knob(
        True,
        doc="several ranks: rank 0's buffers (BatchNorm's statistics) before each training forward, as DDP",
        when="`False` when buffers are large and each rank's own are fine",
    )
    log_memory_stats: bool | str = knob(
        True,
        doc='log a few `memory_stats()` entries as `chunk/*` on the steps Lightning logs; `"all"`: every entry',
        when='`"all"` when tracking down a memory or speed question',
    )
    assume_elementwise_optimizer: bool = knob(
        False,
        doc="accept an optimizer class the engine does not know; it must update each element from that element alone",
        when="third-party element-wise optimizers",
    )

    def __post_init__(self) -> None:
        if not (isinstance(self.log_memory_stats, bool) or self.log_memory_stats == "all"):
            raise ValueError(
                f"log_memory_stats={self.log_memory_stats!r} is not allowed; it must be True (a few "
                "chunk/* metrics), 'all' (every memory_stats() entry) or False."
            )


GROUPS: dict[str, type[Any]] = {"memory": MemoryOptions, "offload": OffloadOptions, "checks": CheckOptions}
GROUP_OF: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}

# the strategy's own arguments: what each does, and when to change it (the groups' fields document themselves)
ARGUMENTS: dict[str, tuple[str, str]] = {
    "placement": (
        (
            "`device`: every shard on the device. `host`: every shard on the host, payloads fetched on use. "
            "`static`: the first `offload_fraction` of the chunks on the host. `auto`: from the warm-up trace, as "
            "many shards on the device as the limit less activations allows"
        ),
        "`device` when the model state fits; `host` for the smallest device footprint",
    ),
    "device_memory_limit": (
        (
            "bytes on the device for the chunks **and** the activations the warm-up traced; a limit too small is "
            'refused with the smallest that works. An int or a size (`"12GiB"`, `"1.5 GB"`, [Note: memory '
            "sizes]). `None`: on CUDA the free memory at set-up less 10 % of the device; unbounded on CPU"
        ),
        "to share the device; on CPU-only machines to make offload real",
    ),
    "host_memory_limit": (
        (
            "bytes of chunk memory in host memory; shards that do not fit keep their master, gradient and "
            "optimizer state in files under `disk_dir`. `None`: no limit, no disk tier"
        ),
        "when the training state (16 bytes a parameter with Adam) does not fit: [disk-tier.md](disk-tier.md)",
    ),
    "step_in_backward": (
        (
            "step each chunk as soon as its gradients are final and give its gradient shard back (6 bytes a "
            "parameter instead of 8, bit-identical; on a GPU the host Adam runs beside backward). With norm clipping "
            "or fp16, host chunks step on a guess undone where wrong, which costs memory. Refused with several "
            "optimizers and manual optimization. `None`: on where nothing in the fit reads gradients after "
            "backward; rank 0 says why"
        ),
        "`False` to read gradients after backward",
    ),
    "state_dict_type": (
        "`sharded`: checkpoints are directories every rank writes into; `full`: one plain file written by rank 0",
        "`full` for small models you want as one file",
    ),
    "weights": (
        (
            "a `state_dict` file, a checkpoint or a `save_pretrained` directory, read tensor by tensor into each "
            "rank's shards at set-up ([deferred-init.md](deferred-init.md))"
        ),
        "fine-tuning without building the model on every rank",
    ),
    "param_init_fn": (
        "`fn(module)`, called instead of `reset_parameters()` for each module built on the meta device",
        "models whose init lives outside `reset_parameters()`",
    ),
}
ARGUMENTS.update(
    {
        "memory": ("a `MemoryOptions` (below)", ""),
        "offload": ("an `OffloadOptions` (below)", ""),
        "checks": ("a `CheckOptions` (below)", ""),
        "process_group_backend": ("several ranks: the backend; `None` picks NCCL on GPU, gloo on CPU", ""),
        "timeout": ("several ranks: the process group's timeout", ""),
    }
)


def group(name: str, value: Any) -> Any:
    """``value`` as the group ``name``'s dataclass: ``None`` is the defaults, a mapping names its fields."""
    cls = GROUPS[name]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"{name}={dict(value)!r} names {', '.join(unknown)}, which {cls.__name__} does not have; its fields "
                f"are {', '.join(f.name for f in dataclasses.fields(cls))}."
            )
        return cls(**value)
    article = "an" if cls.__name__[0] in "AEIOU" else "a"
    raise ValueError(
        f"{name}={value!r} is not allowed; it must be {article} {cls.__name__}, a dict of its fields, or None."
    )


def moved(kwargs: Mapping[str, Any], groups: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The groups with the flat names of ``kwargs`` (the strategy's arguments before the groups) moved into them,
    and a deprecation message for each; a name that is no knob is a ``TypeError`` that lists the arguments."""
    out = dict(groups)
    notes = []
    for key, value in kwargs.items():
        g = GROUP_OF.get(key)
        if g is None:
            raise TypeError(
                f"ChunkOffloadStrategy got an unexpected keyword argument {key!r}; its arguments are "
                f"{', '.join(ARGUMENTS)}, and the groups' fields are {', '.join(sorted(GROUP_OF))}."
            )
        out[g] = dataclasses.replace(out[g], **{key: value})
        notes.append(
            f"ChunkOffloadStrategy({key}=...) is deprecated and will be removed in the next release; pass "
            f"{g}={GROUPS[g].__name__}({key}=...) instead (docs/configuration.md)."
        )
    return out, notes


def grouped(args: Mapping[str, Any]) -> dict[str, Any]:
    """Strategy arguments with any group field named flat (``{"chunk_numel": 4096}``, as ``plan``'s overrides and
    older configs write them) moved into its group (``{"memory": {"chunk_numel": 4096}}``); groups given as
    dataclasses or dicts are merged field by field, a flat name winning."""
    out: dict[str, Any] = {k: v for k, v in args.items() if k not in GROUP_OF}
    for key, value in args.items():
        g = GROUP_OF.get(key)
        if g is None:
            continue
        current: Any = out.get(g)
        if isinstance(current, GROUPS[g]):
            out[g] = dataclasses.replace(current, **{key: value})
        else:
            out[g] = {**dict(current or {}), key: value}
    return out


def flatten(top: Mapping[str, Any], memory: MemoryOptions, offload: OffloadOptions, checks: CheckOptions) -> dict:
    """The engine's ``ChunkConfig`` fields out of the strategy's arguments and groups (``log_memory_stats`` is the
    strategy's alone)."""
    flat = dict(top)
    for g in (memory, offload, checks):
        flat.update({f.name: getattr(g, f.name) for f in dataclasses.fields(g)})
    flat.pop("log_memory_stats")
    return flat


def check_arguments(*, timeout: Any, state_dict_type: Any, param_init_fn: Any) -> None:
    """The strategy's own arguments outside the groups: a clear error naming the value and what is allowed."""
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(
            f"timeout={timeout!r} is not allowed; it must be a positive datetime.timedelta (the process group's "
            "timeout, for example timedelta(minutes=30)) or None."
        )
    if state_dict_type not in ("sharded", "full"):
        raise ValueError(f"state_dict_type={state_dict_type!r} is not allowed; choose 'sharded' or 'full'.")
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"param_init_fn={param_init_fn!r} is not allowed; it must be a callable taking a module.")


__all__ = ["ARGUMENTS", "CheckOptions", "MemoryOptions", "OffloadOptions"]
