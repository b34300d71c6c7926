"""Deferred initialisation: a module built on the meta device, initialised module by module as packing
needs its tensors, so that no rank ever holds the whole model.

[Note: deferred initialisation] ``DeferredInit.capture(module)`` finds the parameters and buffers
left on the meta device (``configure_model`` under ``chunk_offload``, or
``Trainer.init_module(empty_init=True)``). A meta tensor cannot become a real one through
``param.data = ...`` (PyTorch refuses meta -> CPU), so each meta ``Parameter`` is replaced, once
and for every module that shares it, by a new ``Parameter`` whose data is a *placeholder*: a
one-element CPU tensor expanded to the shape. It has the right shape, dtype and device for
``configure_optimizers`` (fused AdamW checks the device) and costs nothing; writing into it
raises. Meta buffers become placeholders too, so that a set-up that fails half way leaves a
module Lightning can still move to the CPU. The first pack then asks for each parameter's value
in registration order, and ``value(param)`` walks the modules in ``module.modules()`` order,
initialising each module that directly owns a deferred tensor until that parameter has its value:

- the module's own deferred tensors get fresh memory filled with NaN on ``device``: where plain
  Lightning builds ``configure_model`` (its strategy's root device, a GPU's generator or the
  CPU's), with that device as the default for the tensors the init makes, as Lightning's
  ``tensor_init_context`` sets it. The values are bit for bit those of
  ``for m in model.modules(): m.reset_parameters()`` after an eager build there with the same
  seed, which is what constructing the modules in that order does. On a GPU that is also the
  fast way: a CPU generator is one core's (some 300M numbers a second, half a minute at 10B);
- its tensors that already have values (shared with a module initialised earlier, such as a tied
  head, or read from a weights file) are swapped for scratch copies during the call and put back
  after, so a later owner's init neither overwrites nor skips its random draws;
- ``init_fn(module)`` runs if given, else ``module.reset_parameters()``; a floating-point tensor
  still NaN afterwards was not initialised, which is an error naming module and tensor (found by
  ``amax``, which propagates NaN: no mask of the tensor's size, a tenth of ``isnan().any()``'s time);
- buffers stay on ``device`` (one an init assigns elsewhere moves there).

The pack copies each value into its chunk and points the parameter at the chunk, which frees its
memory, so at any time a rank holds its shards, the chunk being built, and the parameters of
the modules initialised ahead of it (at most one module's beyond that chunk, and the one chunk of
a group's biases and norms, built last). On a GPU those are on the device until packed: a
module's worth beside ``device_memory_limit``, during set-up only. A tied parameter
takes the value of its first owner in ``modules()`` order, as ``named_parameters`` reports it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

InitFn = Callable[[torch.nn.Module], None]
_CPU = torch.device("cpu")


class DeferredInitError(RuntimeError):
    """A tensor on the meta device that nothing can initialise, or an init that left one uninitialised."""


def is_meta(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "meta"


def placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` holding one element: no memory, and writing into it raises."""
    return torch.empty((), dtype=dtype).expand(shape)


def has_meta(module: torch.nn.Module) -> bool:
    return any(is_meta(t) for t in module.parameters()) or any(is_meta(b) for b in module.buffers())


class DeferredInit:
    """The modules of ``module`` that own tensors on the meta device, initialised as packing needs them."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        init_fn: InitFn | None = None,
        init_for: dict[int, InitFn] | None = None,
        device: torch.device = _CPU,
    ) -> None:
        self.module = module
        self.init_fn = init_fn
        self.init_for = init_for or {}  # id(module) -> its own init, before init_fn and reset_parameters()
        self.device = torch.device(device)  # where modules are initialised and buffers live
        self.names = {id(m): n or "<root>" for n, m in module.named_modules(remove_duplicate=False)}
        self.pending: set[int] = set()  # ids of deferred tensors (placeholders / meta buffers) without values yet
        self.provided: set[int] = set()  # ids of deferred tensors whose values come from elsewhere (a weights file)
        replaced: dict[int, torch.Tensor] = {}  # meta tensor id -> its placeholder (one for all owners)
        keep: list[torch.Tensor] = []  # the meta tensors, alive while mapped so that no id is reused
        for m in module.modules():
            for store, is_param in ((m._parameters, True), (m._buffers, False)):
                for name, t in store.items():
                    if not is_meta(t):
                        continue
                    assert t is not None
                    keep.append(t)
                    new = replaced.get(id(t))
                    if new is None:
                        new = placeholder(t.shape, t.dtype)
                        if is_param:
                            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                        replaced[id(t)] = new
                        self.pending.add(id(new))
                    store[name] = new  # type: ignore[assignment]
        self.deferred = set(self.pending)  # never shrinks: which modules are initialised does not change as values come
        self._walk: Iterator[torch.nn.Module] = iter(())

    @classmethod
    def capture(
        cls,
        module: torch.nn.Module,
        *,
        init_fn: InitFn | None = None,
        init_for: dict[int, InitFn] | None = None,
        device: torch.device = _CPU,
    ) -> DeferredInit | None:
        """``None`` when nothing in ``module`` is on the meta device; else replace its meta parameters by
        placeholders (before the optimizers are built) and return the object that will initialise them.
        ``init_for``: the init of particular modules (``id(module)`` -> ``fn(module)``), such as adapters."""
        if not has_meta(module):
            return None
        return cls(module, init_fn=init_fn, init_for=init_for, device=device)

    # ------------------------------------------------------------------ queries
    def is_deferred(self, t: torch.Tensor) -> bool:
        return id(t) in self.pending

    def _own(self, m: torch.nn.Module) -> list[tuple[str, bool, torch.Tensor]]:
        """(name, is_parameter, tensor) of the tensors ``m`` owns directly."""
        return [(n, True, p) for n, p in m._parameters.items() if p is not None] + [
            (n, False, b) for n, b in m._buffers.items() if b is not None
        ]

    def _needs_init(self, m: torch.nn.Module) -> bool:
        """``m`` owns a tensor built on the meta device that no file provides. Decided from what was deferred, not
        from what still is: a tied head whose only weight an earlier module already made still draws its init (on a
        scratch copy), so every module after it sees the random stream an eager build gives it."""
        return any(id(t) in self.deferred and id(t) not in self.provided for _, _, t in self._own(m))

    def start(self, provided: Iterable[torch.Tensor] = ()) -> None:
        """Before the first value: note the tensors that need no init, and check every other one can get one."""
        self.provided = {id(t) for t in provided if id(t) in self.pending}
        missing = []
        for m in self.module.modules():
            if (
                self._needs_init(m)
                and self.init_fn is None
                and id(m) not in self.init_for
                and not callable(getattr(m, "reset_parameters", None))
            ):
                names = [n for n, _, t in self._own(m) if id(t) in self.deferred and id(t) not in self.provided]
                missing.append(f"{self.names[id(m)]} ({type(m).__name__}): {', '.join(names)}")
        if missing:
            raise DeferredInitError(
                "these modules own tensors on the meta device and have no reset_parameters() to initialise them: "
                + "; ".join(missing)
                + ". Give them a reset_parameters() that initialises their own tensors, pass "
                "ChunkOffloadStrategy(param_init_fn=...) (called with each such module), or build them outside "
                "configure_model / the meta device."
            )
        self._walk = (m for m in self.module.modules() if self._needs_init(m))

    # ----------------------------------------------------------------- values
    def value(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s initialised value (on ``device``), initialising the modules before it in ``modules()`` order."""
        while id(p) in self.pending:
            m = next(self._walk, None)
            if m is None:
                raise DeferredInitError(
                    f"no module initialises the deferred tensor of shape {tuple(p.shape)}; "
                    "it is not owned by any module of the model."
                )
            self._init(m)
        return p.detach()

    def take(self, t: torch.Tensor) -> None:
        """``t`` got its value from elsewhere (a weights file): it is no longer pending."""
        self.pending.discard(id(t))

    def finish(self) -> None:
        """Initialise every module still pending (buffer-only modules, those after the last parameter)."""
        for m in self._walk:
            self._init(m)
        left = [
            f"{self.names[id(m)]}.{n}"
            for m in self.module.modules()
            for n, _, t in self._own(m)
            if id(t) in self.pending and id(t) not in self.provided
        ]
        if left:
            raise DeferredInitError(f"tensors left without a value after deferred initialisation: {', '.join(left)}.")

    def _init(self, m: torch.nn.Module) -> None:
        fresh: list[tuple[str, bool, torch.Tensor]] = []
        swapped: list[tuple[str, bool, torch.Tensor]] = []
        for name, is_param, t in self._own(m):
            if id(t) in self.pending and id(t) not in self.provided:
                real = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                if real.is_floating_point():
                    real.fill_(float("nan"))
                if is_param:
                    t.data = real
                else:
                    m._buffers[name] = real
                self.pending.discard(id(t))
                fresh.append((name, is_param, t if is_param else real))
            else:  # has its value already (or will from a file): the init writes a scratch copy instead
                scratch = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                if is_param:
                    m._parameters[name] = torch.nn.Parameter(scratch, requires_grad=t.requires_grad)
                else:
                    m._buffers[name] = scratch
                swapped.append((name, is_param, t))
        try:
            own = self.init_for.get(id(m), self.init_fn)
            with self.device:  # tensors the init makes, as under Lightning's tensor_init_context
                if own is not None:
                    own(m)
                else:
                    m.reset_parameters()  # type: ignore[operator]
        finally:
            for name, is_param, t in swapped:
                (m._parameters if is_param else m._buffers)[name] = t  # type: ignore[index,assignment]
        where = self.names[id(m)]
        bad, replaced = [], []
        for name, is_param, before in fresh:
            now = (m._parameters if is_param else m._buffers)[name]
            if is_param and now is not before:
                replaced.append(name)
            elif now is not None and now.is_floating_point() and now.numel() and bool(now.amax().isnan()):
                bad.append(name)
            elif now is not None and not is_param:
                m._buffers[name] = now.to(self.device)  # a new buffer the init assigned is fine
        how = "param_init_fn" if self.init_fn is not None else f"{type(m).__name__}.reset_parameters()"
        if replaced:
            raise DeferredInitError(
                f"{how} replaced {', '.join(f'{where}.{n}' for n in replaced)} with new Parameter objects; the "
                "optimizers hold the old ones. Initialise parameters in place (torch.nn.init.*_, tensor.copy_)."
            )
        if bad:
            raise DeferredInitError(
                f"{how} left {', '.join(f'{where}.{n}' for n in bad)} uninitialised (built on the meta device, "
                "still NaN after the init): initialise every tensor the module owns directly there."
            )


class _MetricsOnHost(TorchFunctionMode):
    """Tensors made inside a torchmetrics ``Metric``'s ``__init__`` go to the host, not the meta device.

    [Note: metrics under deferred init]
    A metric's states and their defaults (``add_state(default=torch.tensor(0.0))``) are plain attributes, not
    parameters or buffers: nothing initialises them again, and built on the meta device they had no values. The
    metric then failed when it was first moved ("Cannot copy out of meta tensor; no data!", at the end of ``fit``
    after training) and logged nothing meaningful before. They are a few scalars or class counts, so they are
    built for real, as plain Lightning builds them; the metric's parameters, if any, stay deferred with the rest."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _constructors() and kwargs.get("device") is None and _in_metric_init():
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _constructors() -> Any:
    from torch.utils._device import _device_constructors

    return _device_constructors()


def _in_metric_init() -> bool:
    metrics = sys.modules.get("torchmetrics")
    if metrics is None:
        return False
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), metrics.Metric):
            return True
        f = f.f_back  # type: ignore[assignment]
    return False


# an init deferred initialisation reproduces: reset_parameters(), and peft's LoRA init (hf.py's peft_adapters)
_INIT_FRAMES = ("reset_parameters", "_reset_parameters", "reset_lora_parameters")
_NOT_WRITES = ("detach_", "set_", "resize_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_")


class _MetaWrites(TorchDispatchMode):
    """Notes in-place writes to meta tensors made outside any ``reset_parameters`` (they do nothing there)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if (
            name.endswith("_")
            and name not in _NOT_WRITES
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].is_meta
            and not self._in_init()
        ):
            self.writes.append(f"{name} at {self._caller()}")
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _in_init() -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_name in _INIT_FRAMES:
                return True
            f = f.f_back  # type: ignore[assignment]
        return False

    @staticmethod
    def _caller() -> str:
        """The innermost frame outside torch: where the user's code asked for the write."""
        f = sys._getframe(2)
        while f is not None and ("/torch/" in f.f_code.co_filename or f.f_code.co_filename == __file__):
            f = f.f_back  # type: ignore[assignment]
        return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


@contextlib.contextmanager
def meta_init(*, check_writes: bool | Callable[[], bool] = True) -> Iterator[None]:
    """Build modules on the meta device. With ``check_writes``, values written in place outside a
    ``reset_parameters()`` (``self.apply(init_fn)``, ``nn.init.normal_(self.proj.weight)`` in ``__init__``) are
    an error when the block ends: on the meta device they do nothing, and deferred initialisation would
    silently give those tensors ``reset_parameters()``'s values instead. Pass ``param_init_fn`` to say how
    they are initialised. A callable ``check_writes`` is asked when the block ends, so code inside it (a
    ``configure_model`` that sets the strategy's ``param_init_fn``) can still say how."""
    with torch.device("meta"), _MetricsOnHost(), _MetaWrites() as mode:
        yield
    if callable(check_writes):
        check_writes = check_writes()
    if mode.writes and check_writes:
        shown = "; ".join(dict.fromkeys(mode.writes))
        raise DeferredInitError(
            "the model was built on the meta device (deferred initialisation) and wrote values into "
            f"{len(mode.writes)} "
            f"meta tensor(s) outside reset_parameters(), which does nothing there: {shown[:600]}. Deferred "
            "initialisation calls each module's reset_parameters(); to initialise differently (e.g. GPT-2's "
            "normal(0, 0.02)), pass ChunkOffloadStrategy(param_init_fn=fn), fn(module) initialising the tensors that "
            "module owns directly."
        )
