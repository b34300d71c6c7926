"""The one-pass host Adam step as a C++ loop of our own, built with inductor's C++ toolchain.

[Note: the compute copy stored past the caches]
The one pass (``host_adam.py``) reads a shard's master, gradient and both moments and writes the master, the
moments and the compute-dtype copy: 30 bytes an element. But a store to a cache line the loop never read first
reads that line from memory (the cache must own it before it can write part of it), so the compute copy, which
nothing in the step reads, costs 2 bytes of reading as well as its 2 of writing: 32 bytes moved, not 30, and a
sixth stream competing for bandwidth. A non-temporal store writes whole lines straight to memory, with no read and
without evicting the lines the loop still uses. Inductor never emits one, so this module is the same loop
written by hand: the arithmetic is inductor's for ``_adam_pass`` (the same ``at::vec`` operations in the same
order, built with the same flags, ``-ffp-contract=off`` among them), so its bits are the compiled kernel's and
torch's fused kernel's; only the compute copy's store changes. On the 2-core CI machine that took the step
under the 30-byte floor of the compiled kernel (docs/benchmarks.md, `benchmarks/optimizer_step.py`).

The copy's stores must be aligned to the vector's width, so each call steps the elements before the first
aligned one, and the last ``numel % width``, with the masked loads and stores inductor uses for its tail (the
same lane-wise arithmetic, so the same bits), and every thread fences its streaming stores before the parallel
region ends, so the copy is in memory when the call returns. Built on first use (a few seconds, cached on disk
by inductor); where it cannot be built, or the vector ISA inductor probes for is not available (its
``at::vec`` would be scalar code, slower than torch's own kernel), ``native_kernel`` returns ``None`` with the
reason and the one pass is the ``torch.compile`` kernel.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import vec_isa

PRELUDE = "#include <torch/csrc/inductor/cpp_prefix.h>"
SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cstdint>

namespace {
using at::vec::Vectorized;
constexpr int64_t W = Vectorized<float>::size();

// a gradient as float32: read as it is, or widened from bf16 as inductor loads one (exact either way)
template <typename G>
inline Vectorized<float> load_grad(const G* g, int64_t count) {
  if constexpr (std::is_same_v<G, float>) return Vectorized<float>::loadu(g, count);
  else return at::vec::convert<float>(Vectorized<G>::loadu(g, count));
}

// Torch's fused CPU Adam(W) vector loop, as _adam_pass in host_adam.py writes it: WD 0 none, 1 decoupled, 2 coupled
template <typename Low, int WD, bool MAXIMIZE, bool SMALL, typename G>
struct Step {
  const float* s;  // sign, decay, wd, w, beta2, c2, bc2_sqrt, eps, neg_step
  inline void operator()(float* p, const G* g, float* m, float* v, Low* low, int64_t i, int64_t count,
                         bool stream) const {
    auto pv = Vectorized<float>::loadu(p + i, count);
    auto gv = load_grad(g + i, count);
    auto mv = Vectorized<float>::loadu(m + i, count);
    auto vv = Vectorized<float>::loadu(v + i, count);
    if constexpr (MAXIMIZE) gv = gv * Vectorized<float>(s[0]);
    if constexpr (WD == 1) pv = pv * Vectorized<float>(s[1]);
    if constexpr (WD == 2) gv = at::vec::fmadd(pv, Vectorized<float>(s[2]), gv);
    auto d = gv - mv;
    Vectorized<float> m1;
    if constexpr (SMALL) m1 = at::vec::fmadd(Vectorized<float>(s[3]), d, mv);
    else m1 = at::vec::fmadd(Vectorized<float>(s[3] - 1.0f), d, gv);
    auto v1 = at::vec::fmadd(Vectorized<float>(s[5]) * gv, gv, vv * Vectorized<float>(s[4]));
    auto p1 = pv + (Vectorized<float>(s[8]) * m1) / (v1.sqrt() / Vectorized<float>(s[6]) + Vectorized<float>(s[7]));
    p1.store(p + i, count);
    m1.store(m + i, count);
    v1.store(v + i, count);
    auto c = at::vec::convert<Low>(p1);
#if defined(CPU_CAPABILITY_AVX512)
    if (stream) { _mm256_stream_si256(reinterpret_cast<__m256i*>(low + i), _mm512_castsi512_si256(c)); return; }
#elif defined(CPU_CAPABILITY_AVX2)
    if (stream) { _mm_stream_si128(reinterpret_cast<__m128i*>(low + i), _mm256_castsi256_si128(c)); return; }
#endif
    c.store(low + i, count);
  }
};

template <typename Low, int WD, bool MAXIMIZE, bool SMALL, typename G>
void run(float* p, const G* g, float* m, float* v, Low* low, int64_t n, const float* s) {
  const Step<Low, WD, MAXIMIZE, SMALL, G> step{s};
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr uintptr_t A = W * sizeof(Low);  // the streaming store's alignment: one vector of the copy
  int64_t head = static_cast<int64_t>(((A - reinterpret_cast<uintptr_t>(low) % A) % A) / sizeof(Low));
  const bool stream = true;
#else
  int64_t head = 0;
  const bool stream = false;
#endif
  head = head < n ? head : n;
  for (int64_t i = 0; i < head; i += W) step(p, g, m, v, low, i, head - i < W ? head - i : W, false);
  const int64_t blocks = (n - head) / W;
  #pragma omp parallel if (blocks >= 1024)
  {
    #pragma omp for schedule(static) nowait
    for (int64_t b = 0; b < blocks; ++b) step(p, g, m, v, low, head + b * W, W, stream);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    _mm_sfence();  // this thread's streaming stores are in memory before the region's closing barrier
#endif
  }
  for (int64_t i = head + blocks * W; i < n; i += W) step(p, g, m, v, low, i, n - i < W ? n - i : W, false);
}

template <typename Low, typename G>
void dispatch(float* p, const G* g, float* m, float* v, Low* low, int64_t n, const float* s, int wd,
              int maximize, int small) {
#define LC_CASE(WD, MAX, SMALL) \
  if (wd == WD && maximize == MAX && small == SMALL) return run<Low, WD, MAX, SMALL, G>(p, g, m, v, low, n, s);
  LC_CASE(0, 0, 0) LC_CASE(0, 0, 1) LC_CASE(0, 1, 0) LC_CASE(0, 1, 1)
  LC_CASE(1, 0, 0) LC_CASE(1, 0, 1) LC_CASE(1, 1, 0) LC_CASE(1, 1, 1)
  LC_CASE(2, 0, 0) LC_CASE(2, 0, 1) LC_CASE(2, 1, 0) LC_CASE(2, 1, 1)
#undef LC_CASE
}

template <typename G>
void by_copy(float* p, const G* g, float* m, float* v, void* low, int low_is_half, int64_t n, const float* s, int wd,
             int maximize, int small) {
  if (low_is_half) dispatch(p, g, m, v, static_cast<at::Half*>(low), n, s, wd, maximize, small);
  else dispatch(p, g, m, v, static_cast<at::BFloat16*>(low), n, s, wd, maximize, small);
}
}  // namespace

// returns the vector width it was built for; the gradient is float32, or bf16 with grad_is_bf16
extern "C" int lc_adam_one_pass(float* p, const void* g, int grad_is_bf16, float* m, float* v, void* low,
                                int low_is_half, int64_t n, const float* scalars, int wd, int maximize, int small) {
  if (grad_is_bf16) {
    by_copy(p, static_cast<const at::BFloat16*>(g), m, v, low, low_is_half, n, scalars, wd, maximize, small);
  } else {
    by_copy(p, static_cast<const float*>(g), m, v, low, low_is_half, n, scalars, wd, maximize, small);
  }
  return static_cast<int>(W);
}
"""

MODES = {"none": 0, "decoupled": 1, "coupled": 2}
LOW_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
GRAD_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_kernel: NativeKernel | None = None
_why_not: str | None = None  # why this process has no native kernel
_isa: bool | None = None  # whether inductor found a vector ISA (``vector_isa``)
_lock = threading.RLock()  # one build a process, whichever thread asks first (``build_in_background``)
_building = False


def vector_isa() -> bool:
    """Whether inductor builds C++ with a vector ISA here. It probes for one by building and loading a test library
    in a child process, once a process; where that fails (for any reason) its ``at::vec`` is scalar code, and so is
    every kernel it compiles, the one-pass kernels too: several times slower than torch's own fused kernel."""
    with _lock:
        return _vector_isa()


def _vector_isa() -> bool:
    global _isa
    if _isa is None:
        try:  # inductor's pick, its probe children spared importing torch ([Note: the vector ISA probe])
            _isa = bool(vec_isa.pick())
        except Exception:  # noqa: BLE001 - an inductor without this internal: assume it vectorizes, as it did
            _isa = True
    return _isa


def _prelude() -> str:
    """The include of inductor's C++ prelude: an installed header since torch 2.8; before, a copy inductor writes to its
    cache and includes by its path ([Note: torch versions] in ``system/torch_features.py``)."""
    from torch._inductor import codecache

    installed = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "inductor" / "cpp_prefix.h"
    written = getattr(codecache, "cpp_prefix", None)
    return PRELUDE if installed.exists() or written is None else written()


def _build() -> Callable[..., int]:
    from torch._inductor.codecache import CppCodeCache

    lib = CppCodeCache.load(SOURCE.replace(PRELUDE, _prelude(), 1))
    fn = lib.lc_adam_one_pass
    fn.argtypes = (
        [ctypes.c_void_p] * 2
        + [ctypes.c_int]
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
        + [ctypes.c_int] * 3
    )
    fn.restype = ctypes.c_int  # the vector width it was built for
    return fn


def native_kernel() -> NativeKernel | None:
    """The native one-pass step, or ``None`` when it cannot run in this process (the reason in ``why_not()``)."""
    global _kernel, _why_not
    with _lock:
        if _kernel is None and _why_not is None:
            try:
                if _vector_isa():
                    _kernel = NativeKernel(_build())
                else:
                    _why_not = "inductor found no vector ISA to build for (its at::vec would be scalar code)"
            except Exception as e:  # noqa: BLE001 - no compiler, or an inductor without these internals
                _why_not = f"building it failed: {type(e).__name__}: {e}"
        return _kernel


def build_in_background() -> None:
    """Start building the native kernel (or loading it from inductor's cache) on a thread of its own, once a
    process, so that the first host step finds it built.

    [Note: the kernel built beside set-up]
    The first host step built the kernel: inductor's import and its probe for a vector ISA take 4 s a process with
    its cache warm (2-core CPU), 22 s with it cold, as on a lent GPU's fresh machine, where the first step of the
    largest model, which a lease's time budget had already stopped once, would pay it too. A fit on a GPU
    starts it at set-up instead, which takes minutes there at that size and runs mostly outside the interpreter;
    the step that needs it waits for the same build, never starts a second."""
    global _building
    with _lock:
        if _building or _kernel is not None or _why_not is not None:
            return
        _building = True
    threading.Thread(target=native_kernel, name="lightning_chunk-native-adam", daemon=True).start()


def why_not() -> str | None:
    return _why_not


def supports(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, low: torch.Tensor) -> bool:
    """Whether the native loop steps these tensors: contiguous float32 on the host, a bf16 or fp16 copy, the
    gradient in float32 or bf16 ([Note: gradients in bf16 until the step] in ``memory/low_grads.py``)."""
    return (
        low.dtype in LOW_DTYPES
        and g.dtype in GRAD_DTYPES
        and all(t.dtype == torch.float32 for t in (p, m, v))
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (p, g, m, v, low))
        and p.numel() == g.numel() == m.numel() == v.numel() == low.numel()
    )


class NativeKernel:
    """``pack(adam_scalars(...))`` once a group and step, then ``kernel(p, g, m, v, low, *packed)`` a chunk: one
    Adam step of ``p`` (in place, with ``m`` and ``v``) that also writes ``low``. Packing reads the scalars before
    the first chunk's loop ([Note: the kernels back to back] in ``host_adam.py``)."""

    def __init__(self, fn: Callable[..., int]) -> None:
        self.fn = fn

    @staticmethod
    def pack(scalars: tuple[Any, ...]) -> tuple[Any, ...]:
        *values, mode, maximize, small = scalars
        array = (ctypes.c_float * len(values))(*(float(x) for x in values))  # float32 values: exact as floats
        return array, MODES[mode], int(maximize), int(small)

    def __call__(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        low: torch.Tensor,
        array: Any,
        mode: int,
        maximize: int,
        small: int,
    ) -> None:
        self.fn(
            p.data_ptr(),
            g.data_ptr(),
            GRAD_DTYPES[g.dtype],
            m.data_ptr(),
            v.data_ptr(),
            low.data_ptr(),
            LOW_DTYPES[low.dtype],
            p.numel(),
            array,
            mode,
            maximize,
            small,
        )
