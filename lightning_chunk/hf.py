"""Hugging Face ``transformers`` models under ``chunk_offload``: their initialisation on the meta device, and the
export of a sharded checkpoint to a directory ``from_pretrained`` loads.

``transformers`` (and ``safetensors``, for reading) are the optional ``[hf]`` extra; nothing else in the package
imports them, and this module imports them only inside the functions that need them.

- ``HFInit(model)``: the ``param_init_fn`` for a ``PreTrainedModel`` built in ``configure_model`` (on the meta
  device under ``chunk_offload``). [Note: Hugging Face init, module by module]
- ``PeftAdapters``: LoRA adapters added by ``peft`` to a model built on the meta device.
  [Note: LoRA adapters on the meta device]
- ``keep_generation_in_step(module, on)``: ``generate()`` on several ranks keeps them in step.
  [Note: generation on several ranks]
- ``export_hf(checkpoint, out_dir)`` (``lightning-chunk consolidate --format hf``): ``safetensors`` shards, their
  index, ``config.json`` and ``generation_config.json``, streamed chunk by chunk.
  [Note: exporting to save_pretrained's layout]
"""

from __future__ import annotations

import functools
import math
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .consolidate import _progress, check_output
from .engine.config import parse_bytes
from .engine.files.safetensors_file import StreamingSafetensors
from .engine.files.weights import ModuleWeights, open_weights
from .engine.state.checkpoint import KEY, CheckpointError, iter_saved_chunks, read_meta, weights_key
from .engine.system.atomic import remove_dir, replace_dir
from .hf_weights import as_saved, converted, pretrained_class, saved_layout

HF_CONFIG_KEY = "hf_config"  # where a LightningModule keeps ``model.config.to_dict()`` in its checkpoints
DEFAULT_MAX_SHARD_SIZE = "5GB"  # as ``save_pretrained``


# ================================================================ generation
def keep_generation_in_step(module: torch.nn.Module, on: bool) -> None:
    """Mark (``on``) or unmark every ``PreTrainedModel`` in ``module`` as holding sharded weights.

    [Note: generation on several ranks]
    ``generate()`` on several ranks keeps them in step (``synced_gpus``: a rank that has finished runs forward
    passes with the others until every rank has) only where it believes the weights are sharded, under DeepSpeed
    ZeRO-3 or FSDP, which it asks ``is_fsdp_managed_module``: the attribute ``_is_fsdp_managed_module`` FSDP2's
    integration sets. Under ``chunk_offload`` the weights are sharded as under FSDP, and every forward all-gathers
    them, so the rank that stopped first left the others waiting in an all-gather of the next token: an error after
    ``collective_timeout_s`` on gloo, a hang on NCCL (DeepSpeed #5635, Lightning #18473 without ``synced_gpus``).
    So on several ranks the strategy sets that attribute on every ``PreTrainedModel`` while its engine runs. The
    attribute's other readers in ``transformers`` (layer drop in speech models) ask the same question: whether
    every rank must run the same forward passes. ``transformers`` is not imported for a model that does not use it.
    """
    pretrained = pretrained_class()
    if pretrained is None:
        return
    for m in module.modules():
        if isinstance(m, pretrained):
            if on:
                m.__dict__["_is_fsdp_managed_module"] = True
            else:
                m.__dict__.pop("_is_fsdp_managed_module", None)


# ================================================================ initialisation
class _LeaveAlone(TorchDispatchMode):
    """Drops in-place writes (and the random draws they make) to tensors whose storage is in ``storages``; writes to
    anything else (the module's own tensors, an init's temporaries) go through."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        target = args[0] if args else None
        if (
            name.endswith("_")
            and isinstance(target, torch.Tensor)
            and target.untyped_storage().data_ptr() in self.storages
        ):
            return target
        return func(*args, **(kwargs or {}))


class HFInit:
    """``param_init_fn`` for a ``transformers.PreTrainedModel`` built on the meta device.

    [Note: Hugging Face init, module by module] A ``PreTrainedModel`` initialises itself in ``post_init()``:
    ``model._init_weights(m)`` for every module ``m``, children before parents, so that a parent's rule wins
    (GPT-2 scales ``c_proj`` from its ``GPT2Attention``/``GPT2MLP``, which own no tensor themselves). On the meta
    device that does nothing, and deferred initialisation (``engine/chunks/materialize.py``) initialises one module at a
    time, as packing reaches its tensors. So for module ``m`` this runs ``_init_weights(m)`` and then
    ``_init_weights`` of each ancestor, nearest first, dropping the writes into the tensors of other modules
    (placeholders, or values already packed): each of ``m``'s tensors ends with the value of the last rule that
    writes it, as in ``post_init``. Writes into anything else (an init's temporaries) go through. The random stream
    differs from an eager ``from_config`` (whose constructors draw too), so the values are another draw of the same
    init; rotary frequency buffers, norms and zeroed biases come out equal. ``padding_idx`` rows are zeroed as
    ``_init_weights`` does.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        if not callable(getattr(model, "_init_weights", None)):
            raise TypeError(
                f"HFInit takes a transformers PreTrainedModel (with _init_weights); got {type(model).__name__}."
            )
        self.model = model
        self._parent = {id(c): m for m in model.modules() for c in m.children()}

    def __call__(self, module: torch.nn.Module) -> None:
        own = {
            t.untyped_storage().data_ptr()
            for t in (*module._parameters.values(), *module._buffers.values())
            if t is not None
        }
        others = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers())} - own
        chain = [module]
        while id(chain[-1]) in self._parent:
            chain.append(self._parent[id(chain[-1])])
        with torch.no_grad(), _LeaveAlone(others):
            for m in chain:
                self.model._init_weights(m)  # type: ignore[operator]


def module_weights(path: str, module: Any, adapters: PeftAdapters | None) -> ModuleWeights:
    """The strategy's ``weights=``, as transformers would load them ([Note: converted checkpoints] in
    ``hf_weights.py``), checked against ``module`` (a LoRA run's adapters may be missing from them)."""
    return ModuleWeights(
        converted(open_weights(path), module),
        module,
        strict=getattr(module, "strict_loading", True),
        optional=adapters.tensors() if adapters else (),
        wrapped=PeftAdapters.base_name if adapters else None,
    )


# ================================================================== peft adapters
class PeftAdapters:
    """The LoRA adapters ``peft`` added to a model: their init on the meta device, and where a pretrained file's
    weights went.

    [Note: LoRA adapters on the meta device] ``get_peft_model`` on a model built in ``configure_model`` (so that no
    rank holds the whole base) wraps each target layer: its weight moves to ``<layer>.base_layer.weight`` and
    ``lora_A``/``lora_B`` (``lora_embedding_A``/``_B`` for an embedding) are added and initialised by
    ``reset_lora_parameters``, which does nothing on the meta device. Deferred initialisation then initialises
    each adapter module as ``reset_lora_parameters`` does (``init_lora_weights=True``: A as ``nn.Linear``'s
    kaiming-uniform, B zero; ``"gaussian"``: A normal with std 1/r; an embedding's A zero and B normal), and the
    base's weights come from the file under their moved names. Another draw of the same init as an eager build,
    as for ``HFInit``. Inits that read the base weights (PiSSA, OLoRA, LoftQ, EVA, CorDA, DoRA's magnitude) cannot
    run before the weights are loaded and are refused, naming the option."""

    def __init__(self, module: torch.nn.Module) -> None:
        configs: dict[str, Any] = {}
        for m in module.modules():
            found = getattr(m, "peft_config", None)
            if isinstance(found, dict):
                configs.update(found)
        self.inits: dict[int, Any] = {}
        self.layers: list[Any] = [m for m in module.modules() if callable(getattr(m, "reset_lora_parameters", None))]
        for layer in self.layers:  # each init runs only where its module was built on the meta device
            for name in layer.lora_A:
                config = configs.get(name)
                init = functools.partial(_init_lora_a, name=name, config=config, r=layer.r[name])
                self.inits[id(layer.lora_A[name])] = init
                self.inits[id(layer.lora_B[name])] = _init_zero
            for name in getattr(layer, "lora_magnitude_vector", {}):
                self.inits[id(layer.lora_magnitude_vector[name])] = functools.partial(_refuse, name, "use_dora=True")
            self.inits[id(layer.lora_embedding_A)] = _init_zero
            self.inits[id(layer.lora_embedding_B)] = _init_normal

    @classmethod
    def of(cls, module: torch.nn.Module) -> PeftAdapters | None:
        found = cls(module)
        return found if found.layers else None

    def tensors(self) -> set[int]:
        """Ids of the adapters' tensors (now: after deferred initialisation replaced the meta ones)."""
        return {
            id(t)
            for layer in self.layers
            for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
            for t in getattr(layer, part).parameters()
        }

    @staticmethod
    def base_name(name: str) -> str | None:
        """Where a pretrained file's ``<layer>.weight`` is in a model peft wrapped: ``<layer>.base_layer.weight``."""
        layer, _, leaf = name.rpartition(".")
        return f"{layer}.base_layer.{leaf}" if layer else None


def _refuse(name: str, option: str, module: torch.nn.Module) -> None:
    raise ValueError(
        f"the LoRA adapter {name!r} has {option}, an init that reads the base weights; on a model built on the "
        "meta device (configure_model) only init_lora_weights=True or 'gaussian' can be initialised (the base "
        "weights are loaded later). Build the base model outside configure_model, or use one of those inits. "
        "[Note: LoRA adapters on the meta device]"
    )


def _init_lora_a(module: torch.nn.Module, *, name: str, config: Any, r: int) -> None:
    how = getattr(config, "init_lora_weights", True)
    if getattr(config, "use_dora", False) or how not in (True, "gaussian"):
        _refuse(name, "use_dora=True" if getattr(config, "use_dora", False) else f"init_lora_weights={how!r}", module)
    with torch.no_grad():
        if how is True:
            torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # type: ignore[arg-type]
        else:
            torch.nn.init.normal_(module.weight, std=1 / r)  # type: ignore[arg-type]
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)  # type: ignore[arg-type]


def _init_zero(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in module.parameters(recurse=False):
            t.zero_()


def _init_normal(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in module.parameters(recurse=False):
            torch.nn.init.normal_(t)


# ===================================================================== export
def _config(config: Any, meta: dict[str, Any], path: Path) -> Any:
    """A ``PretrainedConfig`` from ``config`` (an instance, a dict, or a path to ``config.json`` or its directory), or
    from the checkpoint's ``hf_config``."""
    from transformers import AutoConfig, PretrainedConfig

    if config is None:
        config = meta.get(HF_CONFIG_KEY)
        if config is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds no Hugging Face config (no '{HF_CONFIG_KEY}' saved with it): pass the "
                "model's config (--config DIR_OR_config.json), or save `checkpoint['hf_config'] = "
                "model.config.to_dict()` in the LightningModule's on_save_checkpoint, as examples/hf/main.py does."
            )
    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):
        d = dict(config)
        if "model_type" not in d:
            raise CheckpointError(f"the Hugging Face config {sorted(d)[:8]}... has no 'model_type'.")
        return AutoConfig.for_model(d.pop("model_type"), **d)
    p = Path(config)
    if not p.exists():
        raise CheckpointError(f"config {str(p)!r}: no such file or directory (a config.json or its directory).")
    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"config {str(p)!r} cannot be read as a Hugging Face config: {e}") from None


def _meta_model(config: Any) -> torch.nn.Module:
    """The model the config describes, on the meta device: names, shapes and tied weights, no memory."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def _kept_keys(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The names ``save_pretrained`` writes, with their shapes: the state dict less the tied copies."""
    sd = model.state_dict(keep_vars=True)
    targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[int, list[str]] = {}
    for k, v in sd.items():
        groups.setdefault(id(v), []).append(k)
    kept = {([n for n in names if n not in targets] or names)[0] for names in groups.values()}
    return {k: tuple(v.shape) for k, v in sd.items() if k in kept}


def _prefix(saved: Iterable[str], wanted: Iterable[str]) -> str:
    """What the checkpoint's names have in front of the model's (``model.`` for a LightningModule's ``self.model``,
    ``model._orig_mod.`` once compiled): the prefix under which most of the wanted names are found."""
    wanted = set(wanted)
    counts: dict[str, int] = {}
    for key in saved:
        cut = 0
        while True:
            if key[cut:] in wanted:
                counts[key[:cut]] = counts.get(key[:cut], 0) + 1
            cut = key.find(".", cut) + 1
            if cut == 0:
                break
    return max(counts, key=lambda p: (counts[p], -len(p)), default="")


def _listing(items: list[str], limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _match(
    ck: dict[str, Any], keep: dict[str, tuple[int, ...]], known: set[str], path: Path, config: Any
) -> tuple[str, dict[str, list[str]], dict[str, str]]:
    """(prefix, param name -> the exported names it fills, buffer key -> exported name), or an error listing every
    name the config's model and the checkpoint disagree on."""
    saved = list(ck["state_dict_keys"])
    prefix = _prefix(saved, keep)
    aliases, buffers, shapes = ck["aliases"], ck["buffers"], ck["params"]
    fills: dict[str, list[str]] = {}
    from_buffers: dict[str, str] = {}
    missing, other_shape = [], []
    for k, shape in keep.items():
        key = prefix + k
        if key in aliases:
            have = tuple(shapes[aliases[key]])
            fills.setdefault(aliases[key], []).append(k)
        elif key in buffers:
            have = tuple(buffers[key].shape)
            from_buffers[key] = k
        else:
            missing.append(k)
            continue
        if have != tuple(shape):
            other_shape.append(f"{k}: {have} in the checkpoint, {tuple(shape)} in the config's model")
    extra = [k[len(prefix) :] for k in saved if k.startswith(prefix) and k[len(prefix) :] not in known]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {_listing(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in the config's model ({len(extra)}): {_listing(extra)}")
    if other_shape:
        problems.append(f"of another shape ({len(other_shape)}): {_listing(other_shape, 4)}")
    if problems:
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise CheckpointError(
            f"the config ({arch}, model_type={getattr(config, 'model_type', '?')!r}) does not match checkpoint "
            f"{str(path)!r} (checkpoint names = '{prefix}' + model names); nothing was written. Tensors "
            + "; ".join(problems)
            + "."
        )
    return prefix, fills, from_buffers


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    config: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
    ema: bool = False,
    force: bool = False,
) -> Path:
    """Write ``out_dir`` as ``save_pretrained`` would, from a sharded ``lightning-chunk`` checkpoint. An existing
    non-empty ``out_dir`` is refused unless ``force``, and then replaced only once the new one is complete.

    [Note: exporting to save_pretrained's layout] The config (``config``, or the checkpoint's ``hf_config``) is
    built into its model on the meta device, which gives the names ``save_pretrained`` writes: the state dict
    without the tied copies (``lm_head.weight`` when it is the input embedding; ``from_pretrained`` ties it
    again). The checkpoint's names carry the prefix of the submodule that holds the model (``model.``), found by
    matching; every name and shape is checked before anything is written. The fp32 masters stream out one saved
    chunk at a time into ``safetensors`` files laid out up front ([Note: streaming safetensors]), each tensor in the
    layout ``save_pretrained`` writes (a mixture of experts' 3D tensors expert by expert, [Note: converted
    checkpoints] in ``hf_weights.py``), in ``dtype``
    (default: the parameters' own), so memory stays near one chunk whatever the model's size. Everything is
    written into ``.NAME.partial`` beside ``out_dir`` and renamed into place once complete; an existing non-empty
    ``out_dir`` is refused.
    """
    path = Path(checkpoint)
    meta = read_meta(path)
    ck = meta[KEY]
    out = check_output(path, out_dir, force=force)
    max_shard_bytes = parse_bytes(max_shard_size, field="max_shard_size")
    assert max_shard_bytes is not None
    cfg = _config(config, meta, path)
    model = _meta_model(cfg)
    keep = _kept_keys(model)
    known = set(model.state_dict()) | {n for n, _ in model.named_buffers()}  # non-persistent ones too
    prefix, fills, from_buffers = _match(ck, keep, known, path, cfg)
    param_dtypes = {n: getattr(torch, d) for n, d in ck["param_dtypes"].items()}
    if dtype is not None:
        out_dtype = getattr(torch, dtype.replace("torch.", ""), None) if isinstance(dtype, str) else dtype
        if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
            raise CheckpointError(f"dtype={dtype!r} is not a floating-point torch dtype (float32, bfloat16, float16).")
    else:
        out_dtype = next(iter(param_dtypes.values()), torch.float32)

    def dtype_of(saved: torch.dtype) -> torch.dtype:
        return out_dtype if saved.is_floating_point else saved

    tmp = out.parent / f".{out.name}.partial"
    remove_dir(tmp)
    tmp.mkdir()
    try:
        writer = StreamingSafetensors(tmp, max_shard_bytes=max_shard_bytes)
        saved = saved_layout(model, keep)  # experts one by one, as save_pretrained writes them ([Note: converted ...])

        def add(k: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
            for n, s in saved[k].items() if saved else [(k, shape)]:
                writer.add(n, tuple(s), dtype)

        def write(k: str, value: torch.Tensor) -> None:
            for n, v in as_saved(model, k, value).items() if saved else [(k, value)]:
                writer.write(n, v)
            bar.update(1)

        for key, k in from_buffers.items():
            add(k, keep[k], dtype_of(ck["buffers"][key].dtype))
        for spec in ck["chunks"]:  # in the order the saved chunks will stream in
            for name, _, _, shape in spec["slots"]:
                for k in fills.get(name, ()):
                    add(k, tuple(shape), dtype_of(param_dtypes[name]))
        writer.open()
        bar = _progress(sum(map(len, fills.values())) + len(from_buffers), progress, f"exporting {path.name}")
        for key, k in from_buffers.items():
            write(k, ck["buffers"][key])
        for _, spec, full in iter_saved_chunks(path, meta, weights_key(meta, path, ema=ema)):  # ema: ChunkEMA's
            for name, off, numel, shape in spec["slots"]:
                for k in fills.get(name, ()):
                    write(k, full[off : off + numel].view(shape))
            del full
        writer.close()
        bar.close()
        _write_configs(cfg, model, tmp, out_dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out)  # an empty directory, or (force) whatever was there, replaced once the new one is complete
    return out


def _write_configs(cfg: Any, model: torch.nn.Module, where: Path, dtype: torch.dtype) -> None:
    cfg.architectures = [type(model).__name__]
    if hasattr(cfg, "dtype"):
        cfg.dtype = dtype
    else:  # transformers < 5
        cfg.torch_dtype = dtype
    cfg.save_pretrained(str(where))
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if gen is not None and can_generate():
        gen.save_pretrained(str(where))
