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
from typing import Any

from .engine.config import OptimizerKernel
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
            "elements per chunk; `None` chooses after the warm-up step: the least padding between the bounds and "
            "at most `2 × total / 32` elements (at least 16 chunks; the range is never narrower than `[lo, 2 "
            "lo]`, `lo` the larger of `chunk_numel_min` and the largest parameter; no such bound with one rank "
            'and `placement="device"`, where nothing moves), with two payloads plus the traced activations under '
            "the limit"
        ),
        when=("larger for fewer, bigger copies; smaller for finer placement"),
    )
    chunk_numel_min: int = knob(
        1 << 20,
        doc=("lower bound of the search (raised to the largest parameter)"),
        when="",
    )
    chunk_numel_max: int = knob(
        1 << 26,
        doc=("upper bound of the search (raised to the largest parameter, e.g. a 7B Llama's 131M-element embedding)"),
        when="",
    )
    offload_fraction: float = knob(
        0.5,
        doc=("`static` only: fraction of chunks whose shards live on the host"),
        when="",
    )
    reshard_after_forward: bool | None = knob(
        None,
        doc=(
            "`host` only: `False` keeps the payloads forward gathered until their last use in the step while "
            "`device_memory_limit` less the traced activations has room (one all-gather a chunk a step instead of"
            " two where the payloads fit, as DeepSpeed ZeRO-3's default); what does not fit is released after "
            "use, farthest next use first. `True` releases every payload after its forward use and gathers it "
            "again for backward (FSDP2's default). `None`: `False` on an accelerator (whose budget is its free "
            "memory at set-up less the margin, or the limit); `True` on a CPU device, where kept payloads are "
            "another copy of the model in host memory, and where, under a `device_memory_limit`, they fill a "
            "budget that does not count backward's gradients. The other placements keep payloads until the budget"
            " needs the room (`True` is refused with them)"
        ),
        when=(
            "`True` on an accelerator shared with something the limit does not know about; `False` on a CPU "
            "device whose memory has room for the model's payloads beside the sharded state (1.01× DDP's step "
            "instead of 1.08× on the CPU benchmark)"
        ),
    )
    sharded_accumulation: bool = knob(
        True,
        doc=(
            "several ranks, gradient accumulation: every micro-batch's gradients are reduce-scattered into the "
            "shards (ZeRO-3: a rank holds its share plus a few chunks in flight); `False` keeps non-stepping "
            "micro-batches' gradients unreduced in whole-chunk payloads and reduces once a step, like DDP's "
            "`no_sync`"
        ),
        when=(
            "`False` for fewer collectives when the whole fp32 gradient fits on every rank's device (bit-exact "
            "with DDP's summation order)"
        ),
    )
    materialize_on_teardown: bool | None = knob(
        None,
        doc=(
            "when `fit` ends, parameters get their full trained values on the host, gathered chunk by chunk (the "
            "peak is the model plus one chunk). `None`: where the whole model fits in a rank's share of the host "
            "memory available (a fifth kept free); elsewhere the parameters are left empty and rank 0 warns "
            "([Note: the model after fit])"
        ),
        when=("`True` to build them always; `False` never (the values are in the checkpoints)"),
    )
    materialize_optimizer_state: bool = knob(
        False,
        doc=(
            "when `fit` ends, also gather the whole optimizer state on every rank into the optimizer, in the "
            "plain per-parameter form; off: the optimizer is pointed back at the parameters with no state (the "
            "sharded state is in the checkpoints)"
        ),
        when=("on to inspect or reuse `trainer.optimizers[i].state` after `fit`"),
    )
    leaf_modules: Sequence[type | str] = knob(
        (),
        doc=(
            'module classes, or class names (`"MyBlock"`, `"pkg.mod.MyBlock"`), each of which gathers its whole '
            "subtree's parameters at its own forward; its descendants get no hooks (DeepSpeed's ZeRO-3 leaf "
            "modules). Any module, the LightningModule itself included (it then holds every parameter for the "
            "whole step). `torch.nn.MultiheadAttention`, `TransformerEncoderLayer`/`TransformerDecoderLayer` and "
            "any module with a `torch.nn.utils.parametrize` parametrization (weight norm, ...) are leaves always "
            "([Note: leaf modules] in `engine/runtime/leaves.py`)"
        ),
        when=(
            "rarely needed: a module that reads another module's parameter by attribute (`F.linear(x, "
            "self.child.weight)`, a tied head `h @ self.wte.weight.T` in your LightningModule's `forward`, "
            "`self.pos.weight[idx]`) adopts it by itself ([Note: parameters read outside their owner] in "
            "`engine/runtime/reads.py`); name a module here when it reaches a parameter through a reference kept "
            "elsewhere (a list or closure built before training): the warm-up checks every op for reads of "
            "released parameters and names such a read and this option"
        ),
    )
    replan_when_inputs_grow: bool = knob(
        True,
        doc=(
            "under a device limit: a training micro-batch with larger inputs than any the placement was traced "
            "with is traced again and placement re-planned (`docs/reliability.md`); several ranks agree on input "
            "sizes with one all-reduce a micro-batch"
        ),
        when=("off to keep the warm-up's plan whatever the inputs"),
    )
    keep_freed_heap: bool = knob(
        True,
        doc=(
            "on a CPU device with no `host_memory_limit`: glibc keeps the heap pages a step frees for the next "
            "step (trim threshold 1 GiB, mmap threshold 32 MiB, set once for the process with `mallopt`) instead "
            "of giving them back and page-faulting them in again at the next forward; skipped when "
            "`GLIBC_TUNABLES` or `MALLOC_*_` already set glibc's thresholds ([Note: the heap between steps] in "
            "`engine/system/host_heap.py`)"
        ),
        when=("off to leave glibc's settings alone, e.g. when another library in the process tunes malloc"),
    )


@dataclass(frozen=True)
class OffloadOptions:
    """How shards move between the tiers and how the host steps them: the disk tier, copies, the optimizer kernel."""

    disk_dir: str | None = knob(
        None,
        doc=(
            "the disk tier's directory: each process makes a scratch sub-directory there and removes it when "
            "training ends (a later run removes what a killed one left); the space is reserved before training"
        ),
        when=("with `host_memory_limit`, a fast local disk"),
    )
    disk_io: DiskIO = knob(
        "auto",
        doc=(
            "how the disk tier's files move: `buffered` through the page cache (`preadv`/`pwritev`), `direct` "
            "past it (`O_DIRECT` into page-aligned buffers, each transfer in 1 MiB pieces, 32 in flight); `auto` "
            "goes direct when the disk bytes of this host's ranks exceed what the page cache could hold beside "
            "their host limits (`MemAvailable`, bounded by the memory cgroups above the process), decided when a "
            'layout is placed; `memory_stats()["disk_direct_io"]` says which'
        ),
        when=(
            "`buffered` where memory is about to be freed for the run; `direct` where the memory `auto` sees now "
            "will be taken by something else"
        ),
    )
    prefetch: bool = knob(
        True,
        doc=(
            "gather the next traced moment's chunks, and the chunk used after them, ahead of use when they fit "
            "([Note: how far ahead to gather])"
        ),
        when=("off to save device memory at the cost of stalls"),
    )
    pin_memory: bool = knob(
        True,
        doc=("page-lock host shards when computing on CUDA"),
        when=("off when host memory is tight"),
    )
    optimizer_kernel: OptimizerKernel = knob(
        "auto",
        doc=(
            "`auto`: torch's fused kernels where the optimizer has them and you chose neither `fused` nor "
            "`foreach`, and for Adam/AdamW with a compute copy on host shards of at least 2^25 elements a rank, "
            "one pass that steps and writes the copy (`host_adam.py`: a C++ loop of our own built with inductor's"
            " toolchain, `adam_native.py`, else the `torch.compile` kernel; falls back with a warning where "
            "neither can be built, and keeps torch's kernel where inductor has no vector ISA to build for); "
            "`one_pass` uses that pass at any size (an error where it cannot be built); `fused`, `foreach`, "
            "`loop` force one of torch's kernels. The flags are set for the step alone: your optimizer's "
            "`param_groups`, its `state_dict()` and every checkpoint keep the `fused`/`foreach` you built it with"
            " ([Note: the kernel and the user's param groups] in `engine/optim/kernels.py`)"
        ),
        when=(
            "`loop` for bit-exact agreement with plain Lightning on CPU (torch's own default there); with `auto` "
            "the parameters agree to fp32 rounding, which Adam carries along over a run"
        ),
    )


@dataclass(frozen=True)
class CheckOptions:
    """What the ranks check and report: agreement on collectives, timeouts, buffers as DDP keeps them, statistics."""

    verify_collectives: bool | str | None = knob(
        None,
        doc=(
            'several ranks: check that all ranks issue the same chunk collectives. `"batch"`: compared once a '
            "micro-batch, before a gradient is stepped or an evaluation step's outputs are returned; `True` "
            '(`"each"`): before each collective\'s result is used; `False`: off. `None` = `"batch"` with gloo, off'
            " with NCCL"
        ),
        when=("`True` while finding where ranks disagree (a `CollectiveTimeoutError` after a data-dependent branch)"),
    )
    collective_timeout_s: float = knob(
        300.0,
        doc=(
            "several ranks: the longest any collective may wait before an error names its chunk and module (gloo;"
            " on NCCL the process group's `timeout` bounds waits)"
        ),
        when=("lower in tests and debugging"),
    )
    broadcast_buffers: bool = knob(
        True,
        doc=(
            "several ranks, while fitting: rank 0's buffers (BatchNorm's running statistics) before each forward "
            "DDP syncs them in, as `DDPStrategy(broadcast_buffers=True)`: every rank evaluates with the same "
            "statistics"
        ),
        when=("`False` when buffers are large and each rank's own are fine (as with DDP)"),
    )
    log_memory_stats: bool | str = knob(
        True,
        doc=(
            "on the steps Lightning logs: a few `memory_stats()` entries as `chunk/*` (device, host and disk "
            "chunk bytes, the device peak, evictions, gathers, the loss scale and gradient norm where they exist,"
            ' and the seconds by cause `chunk/time_*_s`); `"all"`: every entry; `False`: none'
        ),
        when=('`"all"` when tracking down a memory or speed question'),
    )
    assume_elementwise_optimizer: bool = knob(
        False,
        doc=(
            "accept an optimizer class the engine does not know (it must update each element from that element alone)"
        ),
        when=("third-party element-wise optimizers"),
    )


GROUPS: dict[str, type[Any]] = {"memory": MemoryOptions, "offload": OffloadOptions, "checks": CheckOptions}
GROUP_OF: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}

# the strategy's own arguments: what each does, and when to change it (the groups' fields document themselves)
ARGUMENTS: dict[str, tuple[str, str]] = {
    "placement": (
        (
            "`device`: every shard and payload on the device. `host`: every shard on the host, payloads fetched "
            "on use and released after use, or kept until their last use in the step while the device budget has "
            "room (see `reshard_after_forward`). `static`: the first `offload_fraction` of the chunks on the "
            "host. `auto`: from the warm-up trace, as many shards on the device as the limit minus activations "
            "allows"
        ),
        ("`device` when the model state fits; `host` for the smallest device footprint"),
    ),
    "device_memory_limit": (
        (
            "bytes on the device for the chunks (payloads, shards, gradients, optimizer state) **and** the "
            "activations the warm-up step traced: placement keeps chunk memory under the limit less each moment's"
            " traced activations, and a limit too small for both is refused with the smallest that works. An int "
            "of bytes, or a number with a unit, any case: `K`, `M`, `G`, `T`, `KB`, ..., `TB` are powers of 1000,"
            ' `Ki`, ..., `Ti` and `KiB`, ..., `TiB` powers of 1024 (`"12GiB"`, `"1.5 GB"`); fractions of a byte, '
            "zero and negatives are refused ([Note: memory sizes] in `engine/config.py`; `host_memory_limit` and "
            "the CLI's sizes take the same forms). `None`: on CUDA, the device's free memory when training starts"
            " less a margin of 10 % of its memory (at least 1 GiB) for the CUDA context, the caching allocator's "
            'slack and the collectives\' buffers (`memory_stats()["device_memory_limit"]` shows the value); '
            "unbounded on CPU"
        ),
        ("to share the device, or to leave more room than the margin; on CPU-only machines to make offload real"),
    ),
    "host_memory_limit": (
        (
            "bytes of chunk memory allowed in host memory: host-tier shards (device-tier ones too on a CPU "
            "device, whose tier is host memory), the compute-dtype copies of disk-tier shards and the two disk "
            "shards paged in at once; shards that do not fit keep their master, gradient and optimizer state in "
            'files under `disk_dir`. An int or a string such as `"64GiB"`. `None`: no limit, no disk tier. The '
            "automatic chunk size keeps two disk shards within half the limit"
        ),
        (
            "when the training state (16 bytes a parameter in fp32 with Adam, over the ranks) does not fit in "
            "host memory: `docs/disk-tier.md`"
        ),
    ),
    "step_in_backward": (
        (
            "step the optimizer on each chunk as soon as its gradients are final, during backward, and give its "
            "gradient shard back: 6 bytes a parameter of fp32 state a rank on two ranks instead of 8, "
            "bit-identical updates. With the disk tier, disk chunks step from their gradients in memory while "
            "backward goes on, their master and optimizer state read ahead: no gradient file is written or read "
            "([Note: stepping disk chunks in backward]). Refused with gradient clipping, fp16 loss scaling, "
            "several optimizers and manual optimization (they need the gradients after backward); "
            "`on_before_optimizer_step` sees no gradient on the chunks that stepped. `None` (the default): on "
            "where `host_memory_limit` is set and nothing in the fit reads the gradients after backward (none of "
            "the above, and no override of `on_after_backward`, `on_before_optimizer_step`, "
            "`configure_gradient_clipping` or `optimizer_step` on the module or a callback), off otherwise; rank "
            "0 logs which and why ([Note: stepping in backward by default with the disk tier] in "
            "`backward_step.py`)"
        ),
        (
            "the largest model a memory limit allows (`docs/faq.md`); the disk tier where memory cannot cache its"
            " files (0.62-0.92x the step, 15% less peak memory on `benchmarks/disk.py`'s GPT)"
        ),
    ),
    "state_dict_type": (
        (
            "`sharded`: checkpoints are directories every rank writes its shards into, in parallel; `full`: one "
            "plain file gathered chunk by chunk and written by rank 0"
        ),
        ("`full` for small models you want as one file (or use `lightning-chunk consolidate`)"),
    ),
    "weights": (
        (
            "a file or directory to start from, read tensor by tensor into each rank's shards at the first "
            "`setup`: a `state_dict` file, a Lightning or consolidated checkpoint, or a `save_pretrained` "
            "safetensors directory ([deferred-init.md](deferred-init.md))"
        ),
        ("fine-tuning from saved weights without building the model on every rank"),
    ),
    "param_init_fn": (
        (
            "`fn(module)`, called instead of `reset_parameters()` for each module built on the meta device "
            "(`configure_model`, `init_module(empty_init=True)`), to initialise the tensors it owns directly"
        ),
        ("models whose init lives outside `reset_parameters()`"),
    ),
}
ARGUMENTS.update(
    {
        "memory": ("a `MemoryOptions`: chunk sizes, what stays resident, what `fit` leaves behind (table below)", ""),
        "offload": (
            "an `OffloadOptions`: the disk tier's directory and I/O, prefetch, pinning, the optimizer kernel",
            "",
        ),
        "checks": ("a `CheckOptions`: agreement between ranks, timeouts, buffers, logged statistics", ""),
        "process_group_backend": ("several ranks: the backend; `None` picks NCCL on GPU, gloo on CPU", ""),
        "timeout": ("several ranks: the process group's timeout (NCCL's waits are bounded by it)", ""),
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
    raise ValueError(f"{name}={value!r} is not allowed; it must be a {cls.__name__}, a dict of its fields, or None.")


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


__all__ = ["ARGUMENTS", "CheckOptions", "MemoryOptions", "OffloadOptions"]
