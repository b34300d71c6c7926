"""Adam on host shards with a compute-dtype copy: one pass that steps the master and writes the copy.

[Note: one pass over a host shard]
With mixed precision a host shard's step is two passes over memory: torch's fused AdamW reads
param, gradient and both moments and writes param and moments (28 bytes an element), then the
write-back reads the master again to write the compute copy that gathers read (6 bytes more, where
one loop would need 2). ``one_pass`` does both in one loop compiled by ``torch.compile`` (inductor's
C++ backend, which compiles with ``-ffp-contract=off``), over a chunk's whole run of views at once:
the views are contiguous in the shard and the moments are flat regions, so one call steps a chunk.
Its arithmetic is the vector loop of torch's fused CPU kernel, operation for operation (``lerp`` as
the fma of the formula its weight picks, the second moment as ``fma(c*g, g, v*beta2)``, the
hyperparameters rounded to float32 from the same double expressions), so it is bit-identical to
``fused=True`` except in the last ``numel % 16`` elements of each parameter, which torch's kernel
steps in a scalar loop of its own. It needs a C++ compiler the first time (a few seconds, cached on
disk by inductor after); when compiling fails the step falls back to torch's kernel and the two-pass
write-back, with a warning.

Two kernels do this pass. First the loop of ``adam_native.py``: the compiled kernel's arithmetic written
by hand, built with the same toolchain and flags, which stores the compute copy past the caches and so
moves 30 bytes an element where the compiled kernel moves 32 ([Note: the compute copy stored past the
caches]); then, where that cannot be built or does not take the dtypes, the ``torch.compile`` kernel
below. Both are tested bit for bit against torch's fused kernel. ``"auto"`` takes neither where
inductor found no vector ISA to build for: both would be scalar code there.

[Note: Adam's moments in flat regions]
One call a chunk needs the moments laid out like the master shard. So for the chunks the one pass
steps, ``exp_avg`` and ``exp_avg_sq`` are two flat regions and each view's state holds slices of
them: the optimizer sees exactly the state it would have made (same keys, dtypes, zeros, ``step``
tensor), so its ``state_dict``, the checkpoint formats and the repack are unchanged. They are made
zero before the first step, as torch would make them; state that arrives in pieces (a checkpoint
loaded, a repack) is copied into regions at the next step, one chunk at a time. Nothing here holds a
region but the views' state, so a repack that takes the state frees it. Other chunks keep torch's
per-parameter state: regions for every host chunk (tried for the heap's sake, issue 11) left the
fp32 peak no lower and with larger outliers (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..chunks.chunk import Chunk, Tier
from ..memory.manager import ChunkManager
from . import adam_native

MOMENTS = ("exp_avg", "exp_avg_sq")
# "auto" uses the one-pass step when this rank's host shards with a compute copy hold at least this many
# elements: below it the saving (8 bytes an element a step, about 0.2 ms per million elements on the 2-core CI
# machine) does not soon repay a cold build (seconds, once a machine) and inductor's vector-ISA check (1.4 s a process)
ONE_PASS_MIN_NUMEL = 1 << 25


def one_pass_ok(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """A group whose step the one-pass kernel reproduces: torch's own Adam or AdamW (not a subclass: it may step
    or keep state otherwise) with its fused kernel, without ``amsgrad``, ``capturable`` or ``differentiable``."""
    return (
        type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        and bool(group.get("fused"))
        and not group.get("amsgrad")
        and not group.get("differentiable")
        and not group.get("capturable")
    )


def _adam_pass(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    sign: torch.Tensor,
    decay: torch.Tensor,
    wd: torch.Tensor,
    w: torch.Tensor,
    beta2: torch.Tensor,
    c2: torch.Tensor,
    bc2_sqrt: torch.Tensor,
    eps: torch.Tensor,
    neg_step: torch.Tensor,
    weight_decay: str,
    maximize: bool,
    small: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch's fused CPU Adam(W) vector loop, as tensor operations: (param, exp_avg, exp_avg_sq).

    ``sign`` is -1 (torch multiplies by -1 with ``maximize``); ``weight_decay`` is ``"none"``, ``"decoupled"``
    (AdamW) or ``"coupled"`` (Adam). The kernel specializes on these three Python values and the dtype: the
    choices torch's loop makes once for the whole tensor are made at compile time here, not per element.
    ``small``: ``|w| < 0.5`` for the lerp's weight ``w = 1 - beta1``, which picks torch's formula (torch blends
    the two per vector). As a tensor condition it cost a blend and a broadcast a vector, and multiplying by a
    ``sign`` of 1 a multiply: 2-3% of the step out of cache, 14% in it, for the same bits."""
    fma = torch.ops.prims.fma  # registered by torch._inductor.inductor_prims (``one_pass_kernel``)
    if maximize:
        g = g * sign
    if weight_decay == "decoupled":
        p = p * decay
    elif weight_decay == "coupled":
        g = fma(p, wd, g)  # torch's build contracts g + p * wd
    m1 = fma(w, g - m, m) if small else fma(w - 1, g - m, g)  # torch's lerp
    v1 = fma(c2 * g, g, v * beta2)
    p1 = p + neg_step * m1 / (v1.sqrt() / bc2_sqrt + eps)
    return p1, m1, v1


def _step_and_copy(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, low: torch.Tensor, *scalars: Any
) -> None:
    p1, m1, v1 = _adam_pass(p, g, m, v, *scalars)
    m.copy_(m1)
    v.copy_(v1)
    p.copy_(p1)
    low.copy_(p1)


NATIVE = True  # the one pass is the hand-written loop of adam_native.py where it builds; False: torch.compile's only
_compiled: Callable[..., None] | None = None
_broken: str | None = None  # why the torch.compile kernel cannot run in this process
_warned = False


def one_pass_kernel() -> Callable[..., None] | None:
    """The compiled one-pass kernel, or ``None`` when it cannot be compiled here (the reason is in ``_broken``)."""
    global _compiled, _broken
    if _compiled is None and _broken is None:
        import torch._dynamo  # noqa: F401 - its config says whether torch.compile is switched off
        from torch._inductor import inductor_prims  # noqa: F401 - registers prims.fma for the kernel

        if torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
            # torch.compile would hand back the function itself: several passes, and prims.fma's eager form
            # rounds the product, so neither the speed nor the bits would be the kernel's
            _broken = "torch.compile is disabled in this process (TORCH_COMPILE_DISABLE or TORCHDYNAMO_DISABLE)"
            return None
        adam_native.vector_isa()  # inductor's pick, made without its slow probe ([Note: the vector ISA probe])
        _compiled = torch.compile(_step_and_copy, dynamic=True, fullgraph=True)
    return _compiled if _broken is None else None


def _unavailable(reason: str, forced: bool, cause: BaseException | None = None) -> None:
    """The one pass cannot run here: an error when the user asked for it, else a warning (once) and torch's kernel."""
    global _broken, _warned
    if forced:
        raise RuntimeError(
            f"optimizer_kernel='one_pass' but the one-pass Adam kernel cannot run here ({reason}); "
            "use optimizer_kernel='auto' or 'fused'"
        ) from cause
    _broken = reason
    if not _warned:
        _warned = True
        warnings.warn(
            f"chunk_offload: the one-pass host Adam kernel is not available ({reason}); stepping with "
            "torch's fused kernel and a separate write-back instead.",
            stacklevel=2,
        )


def run_key(run: tuple[Chunk, int, list[tuple[int, torch.Tensor, int, int]]]) -> tuple[int, int]:
    """A run of a chunk's views by its chunk and first element ([Note: a chunk's views in several runs])."""
    return run[0].chunk_id, run[2][0][2]


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64).to(torch.float32)


def adam_scalars(group: dict[str, Any], step: float, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """The kernel's scalar arguments for ``group`` at ``step`` (already incremented), computed as torch's
    fused CPU kernel computes them: in double, then rounded to float32."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    wd, eps = float(group["weight_decay"]), float(group["eps"])
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
    mode = "none" if wd == 0 else "decoupled" if decoupled else "coupled"
    w = _f32(1 - beta1)
    return (
        _f32(-1.0),
        _f32(1 - lr * wd),
        _f32(wd),
        w,
        _f32(beta2),
        _f32(1 - beta2),
        _f32(bc2**0.5),
        _f32(eps),
        _f32(-(lr / bc1)),
        mode,
        bool(group.get("maximize")),
        bool(w.abs() < 0.5),
    )


class HostAdam:
    """One optimizer's one-pass steps of host chunks with a compute copy, and those chunks' flat moments.

    ``one_pass``: ``True`` to step eligible chunks with the one-pass kernel, ``False`` never, ``"auto"``
    when they are large enough to repay compiling it (``ONE_PASS_MIN_NUMEL``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        manager: ChunkManager,
        one_pass: Any,
        flags: list[dict[str, Any]],
    ) -> None:
        """``flags``: each group's kernel flags (``kernel_flags``), which its steps run with."""
        self.optimizer = optimizer
        self.manager = manager
        self.one_pass = one_pass
        self.reset()
        mixed = manager.dtypes.compute_for(torch.float32) != torch.float32  # host chunks have a compute copy
        groups = optimizer.param_groups
        steps_one_pass = any(one_pass_ok(optimizer, {**g, **f}) for g, f in zip(groups, flags, strict=True))
        if one_pass is not False and NATIVE and mixed and steps_one_pass and manager.device.type == "cuda":
            adam_native.build_in_background()  # [Note: the kernel built beside set-up]

    def reset(self) -> None:
        """Forget the layout (the views and their state were rebuilt: bind, load, unbind). Nothing here holds
        a region: the views' state does, so a repack that takes the state frees it."""
        self._runs: list[tuple[Chunk, int, list[tuple[int, torch.Tensor, int, int]]]] | None = None
        # per run (``run_key``): weak references to each view's moment slices as ``ensure_regions`` made them
        self._made: dict[tuple[int, int], list[weakref.ref]] = {}
        self._ready: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # this step's regions, by run

    # ----------------------------------------------------------------- layout
    def _host_runs(
        self, views: dict[int, torch.Tensor]
    ) -> list[tuple[Chunk, int, list[tuple[int, torch.Tensor, int, int]]]]:
        """Per run of contiguous views of a host-tier chunk with a compute copy in a group the one pass can step:
        (chunk, group index, [(param, view, start, end)]) with the views' ranges in shard coordinates, in order.

        [Note: a chunk's views in several runs]
        A chunk's views tile one run of its shard where its parameters lie back to back. Where they do not (a
        chunk that kept its buffers through a repack has the parameters that came placed where others left room,
        [Note: a chunk's parameters in their old places] in ``packing.py``; a parameter whose size is not a
        multiple of ``ALIGN_NUMEL`` leaves padding), each stretch of contiguous views is a run of its own, with
        its own moment regions and kernel call: the padding between holds no parameter and is never stepped. A
        chunk counts as stepped by the one pass (its compute copy fresh, its gradients taken in bf16) only where
        every run of it is."""
        if self._runs is None:
            mgr = self.manager
            group_of = {id(v): k for k, g in enumerate(self.optimizer.param_groups) for v in g["params"]}
            by_chunk: dict[int, tuple[Chunk, int, list[tuple[int, torch.Tensor, int, int]]]] = {}
            for i, v in views.items():
                c, info = mgr.lookup(mgr.params[i])
                k = group_of.get(id(v))
                if (
                    c.shard_tier is not Tier.HOST
                    or c.low is None
                    or k is None
                    or not one_pass_ok(self.optimizer, self.optimizer.param_groups[k])
                ):
                    continue
                lo, _ = c.shard_range
                a = max(info.offset, lo) - lo
                by_chunk.setdefault(c.chunk_id, (c, k, []))[2].append((i, v, a, a + v.numel()))
            runs = []
            for c, k, pieces in by_chunk.values():
                pieces.sort(key=lambda x: x[2])
                run = [pieces[0]]
                for x in pieces[1:]:
                    if x[2] != run[-1][3]:  # a gap: [Note: a chunk's views in several runs]
                        runs.append((c, k, run))
                        run = []
                    run.append(x)
                runs.append((c, k, run))
            self._runs = sorted(runs, key=run_key)
        return self._runs

    def ensure_regions(self, runs: list[tuple[Chunk, int, list[tuple[int, torch.Tensor, int, int]]]]) -> None:
        """Give the views of ``runs``' chunks their moments as slices of flat regions: zeros before the first
        step (as torch would create them), copies of state that arrived in pieces otherwise."""
        state = self.optimizer.state
        self._ready = {}
        for c, k, pieces in runs:
            ready = self.regions(c, k, pieces)
            if ready is not None:
                self._ready[run_key((c, k, pieces))] = ready
                continue
            keys = MOMENTS
            have = [state.get(v) for _, v, _, _ in pieces]
            if not all(st and all(key in st for key in keys) for st in have) and (
                any(have) or any(v.grad is None for _, v, _, _ in pieces)
            ):
                continue  # torch creates state only with a gradient: a chunk with a view that has neither is left to it
            start, end = pieces[0][2], pieces[-1][3]
            dtype = pieces[0][1].dtype
            regions = {key: torch.zeros(end - start, dtype=dtype) for key in keys}
            made: list[weakref.ref[torch.Tensor]] = []
            for (_, v, a, b), st in zip(pieces, have, strict=True):
                slices = {key: regions[key][a - start : b - start] for key in keys}
                if st:
                    for key in keys:
                        slices[key].copy_(st[key].reshape(-1))
                        st[key] = slices[key]
                else:
                    # torch's fused Adam: ``step`` a float32 scalar on the parameter's device (the host)
                    state[v] = {"step": torch.zeros((), dtype=torch.float32), **slices}
                made.extend(weakref.ref(slices[key]) for key in keys)
            self._made[run_key((c, k, pieces))] = made
            self._ready[run_key((c, k, pieces))] = regions

    def regions(
        self, c: Chunk, k: int, pieces: list[tuple[int, torch.Tensor, int, int]]
    ) -> dict[str, torch.Tensor] | None:
        """The flat regions of the moments of chunk ``c``'s run ``pieces`` by key, or ``None`` when the views' state
        is not (or no longer) the slices ``ensure_regions`` made."""
        made = self._made.get(run_key((c, k, pieces)))
        if made is None:
            return None
        state = self.optimizer.state
        keys = MOMENTS
        it = iter(made)
        for _, v, _, _ in pieces:
            st = state.get(v)
            for name in keys:
                x = st.get(name) if st else None
                if x is None or next(it)() is not x:
                    return None
        first = state[pieces[0][1]]
        return {name: first[name]._base for name in keys}

    def low_grad_chunks(self, views: dict[int, torch.Tensor]) -> set[int]:
        """Ids of the chunks the native one-pass kernel would step from bf16 gradients now: host chunks of a
        bf16 compute copy over fp32 masters, whose views have their moments in the regions and one step count
        ([Note: gradients in bf16 until the step] in ``memory/low_grads.py``)."""
        runs = self._host_runs(views)
        if not (NATIVE and self._wants_one_pass(runs) and adam_native.native_kernel()):
            return set()
        state = self.optimizer.state
        steps: dict[int, set[float] | None] = {}  # per chunk, its views' step counts; None: a run that cannot
        for c, k, pieces in runs:  # every run of the chunk must ([Note: a chunk's views in several runs])
            seen = steps.setdefault(c.chunk_id, set())
            if seen is None:
                continue
            bf16 = c.compute_dtype == torch.bfloat16 and c.master_dtype == torch.float32
            if not bf16 or self.regions(c, k, pieces) is None:
                steps[c.chunk_id] = None
                continue
            seen.update(state[v]["step"].item() for _, v, _, _ in pieces)
        return {cid for cid, seen in steps.items() if seen is not None and len(seen) == 1}

    # --------------------------------------------------------------- one pass
    def _wants_one_pass(self, runs: list[tuple[Chunk, int, list[Any]]]) -> bool:
        if self.one_pass is False or (_broken is not None and not (NATIVE and adam_native.native_kernel())):
            return False
        numel = sum(r[2][-1][3] - r[2][0][2] for r in runs)
        if numel == 0:
            return False
        # "auto" without a vector ISA: either kernel would be scalar code, slower than torch's own
        return self.one_pass is True or (numel >= ONE_PASS_MIN_NUMEL and adam_native.vector_isa())

    def step_one_pass(self, views: dict[int, torch.Tensor], only: set[int] | None = None) -> tuple[set[int], set[int]]:
        """Step the eligible host chunks in one pass each; returns (ids of the views stepped, ids of the chunks
        whose compute copy is now fresh). ``views``: the binding's views, the whole layout (``"auto"`` weighs every
        host chunk, and the runs are cached for it); ``only``: ids of the views to step now (one chunk's, stepped
        in backward), else all of them.

        [Note: the kernels back to back] Everything a chunk's call needs (its step count, read and checked, its
        hyperparameters, the slices) is read for every chunk before the first kernel runs, and the bookkeeping
        waits until the last one is done. Each kernel streams its chunk through the caches, so the first
        operations after it run cold: with 16 chunks of 12.5M elements, reading the step counts with ``torch.stack``
        between kernels took 4 ms a step (3% of it), and the step's time outside the kernels fell from 8 ms to 2."""
        runs = self._host_runs(views)
        if not self._wants_one_pass(runs):
            return set(), set()
        if only is not None:
            runs = [r for r in runs if all(id(v) in only for _, v, _, _ in r[2])]
        native = adam_native.native_kernel() if NATIVE else None
        compiled = one_pass_kernel() if native is None else None
        if native is None and compiled is None:
            _unavailable(_broken or "unknown", self.one_pass is True)
            return set(), set()
        self.ensure_regions(runs)  # only where the kernel can run: otherwise torch's own state is as good
        state = self.optimizer.state
        scalars: dict[tuple[int, float], tuple[Any, ...]] = {}
        packed: dict[tuple[int, float], tuple[Any, ...]] = {}
        calls: list[
            tuple[
                Chunk,
                list[tuple[int, torch.Tensor, int, int]],
                list[torch.Tensor],
                Callable[..., None],
                tuple[Any, ...],
            ]
        ] = []
        for c, k, pieces in runs:
            regions = self._ready.get(run_key((c, k, pieces)))
            # a chunk whose gradients are in bf16 has them for every view, and none attached to the views
            if regions is None or (not c.grads_in_low and any(v.grad is None for _, v, _, _ in pieces)):
                continue
            steps = [state[v]["step"] for _, v, _, _ in pieces]
            step = steps[0].item()
            if any(s.item() != step for s in steps[1:]):  # views stepped apart (a user's own optimizer surgery)
                continue
            if (k, step) not in scalars:
                scalars[(k, step)] = adam_scalars(self.optimizer.param_groups[k], step + 1, self.optimizer)
            start, end = pieces[0][2], pieces[-1][3]
            grad = c.grad_low if c.grads_in_low else c.grad  # [Note: gradients in bf16 until the step]
            assert c.master is not None and grad is not None and c.low is not None
            tensors = (
                c.master[start:end],
                grad[start:end],
                regions["exp_avg"],
                regions["exp_avg_sq"],
                c.low[start:end],
            )
            if native is not None and adam_native.supports(*tensors):
                if (k, step) not in packed:
                    packed[(k, step)] = native.pack(scalars[(k, step)])
                calls.append((c, pieces, steps, native, (*tensors, *packed[(k, step)])))
                continue
            if c.grads_in_low:  # bf16 gradients are the native loop's alone: widened for torch's kernel
                continue
            compiled = compiled or one_pass_kernel()  # dtypes the native loop does not take
            if compiled is None:
                _unavailable(_broken or "unknown", self.one_pass is True)
                continue  # torch's kernel steps this chunk
            calls.append((c, pieces, steps, compiled, (*tensors, *scalars[(k, step)])))
        done = 0
        for *_, kernel, args in calls:
            try:
                kernel(*args)
            except Exception as e:  # noqa: BLE001 - no compiler here: torch's kernel steps these chunks
                _unavailable(f"compiling it failed: {type(e).__name__}: {e}", self.one_pass is True, e)
                break
            done += 1
        stepped: set[int] = set()
        counters: list[torch.Tensor] = []
        for _, pieces, steps, *_ in calls[:done]:
            counters.extend(steps)
            stepped.update(id(v) for _, v, _, _ in pieces)
        if counters:
            torch._foreach_add_(counters, 1)
        # a chunk's compute copy is fresh where every run of it stepped ([Note: a chunk's views in several runs])
        left = {c.chunk_id for c, _, pieces in runs if any(id(v) not in stepped for _, v, _, _ in pieces)}
        return stepped, {c.chunk_id for c, *_ in calls[:done]} - left
