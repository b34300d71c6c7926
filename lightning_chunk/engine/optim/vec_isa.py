"""The vector ISA inductor builds the native host Adam for, picked as torch 2.13 picks it on Linux, on the torches
before it too.

[Note: the vector ISA probe]
Before inductor builds a C++ kernel it picks the widest vector ISA that the CPU reports and the compiler can build
for (``cpu_vec_isa.pick_vec_isa``). Each candidate's probe builds a small library and loads it in a child Python, so
that an illegal instruction kills the child, not the caller. Before torch 2.13 that child imports torch, 1.5 to 2 s
each on the 2-core CPU machine. A CPU with AMX has four candidates, and inductor launched ten children. That was 17 s
of each process's first host step on torch 2.11, the GPU machine's torch (2026-12-06): in every fit, in each
campaign child, in each child a test launches. Torch 2.13's child loads the library alone: torch's libraries are found
through ``LD_LIBRARY_PATH``, and the pick takes 1.4 to 2.3 s (1.9 s on torch 2.11 patched as below).

Where the installed inductor's child still imports torch (on x86-64 Linux), ``pick`` runs its probe that way: the
child's code and environment are patched for the call only, under a lock. The answer is kept only where every
candidate the CPU's flags allow passed. Otherwise inductor's caches are cleared and it probes its own way, so the
answer, which stays cached for the process (``torch.compile`` reads it too), is always the one inductor gives. Any
part of this that the installed inductor lacks leaves the pick to inductor as it is.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

_LOAD_ALONE = '\nfrom ctypes import cdll\ncdll.LoadLibrary("__lib_path__")\n'  # torch 2.13's child, on Linux
_lock = threading.Lock()


def pick() -> Any:
    """``cpu_vec_isa.pick_vec_isa()``'s answer, its probe children spared importing torch where they still do."""
    from torch._inductor import cpu_vec_isa as isa

    with _lock:
        if not _slow_probe(isa):
            return isa.pick_vec_isa()
        with _children_load_alone(isa):
            picked = isa.pick_vec_isa()
        if [str(i) for i in isa.valid_vec_isa_list()] == _candidates(isa):
            return picked
        _forget(isa)  # a candidate failed in the child that loads alone: inductor decides, its own way
        return isa.pick_vec_isa()


def _slow_probe(isa: Any) -> bool:
    """Whether the probe's child imports torch and the parts patched here are as expected (x86-64 Linux only)."""
    try:
        return (
            sys.platform == "linux"
            and platform.machine() == "x86_64"
            and "import torch" in isa.VecISA._avx_py_load
            and not hasattr(isa.VecISA, "_build_probe_env")  # torch 2.13's child, which loads alone
            and isa.config.cpp.vec_isa_ok is None  # None: probe (True or False: no child runs)
            and callable(isa.python_subprocess_env)
            and callable(isa.x86_isa_checker)
            and isinstance(isa.supported_vec_isa_list, list)  # what _candidates reads
            and isa.valid_vec_isa_list.cache_info().currsize == 0  # not picked yet in this process
            and callable(isa.VecISA._VecISA__bool__impl.cache_clear)  # what _forget clears
            and not isa.config.is_fbcode()
        )
    except AttributeError:
        return False


def _candidates(isa: Any) -> list[str]:
    """The ISAs inductor probes, in its order: those whose every flag the CPU reports."""
    flags = isa.x86_isa_checker()
    return [str(i) for i in isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]


@contextlib.contextmanager
def _children_load_alone(isa: Any) -> Iterator[None]:
    code, env = isa.VecISA._avx_py_load, isa.python_subprocess_env

    def with_torch_libs() -> dict[str, str]:
        out = dict(env())
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        out["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, out.get("LD_LIBRARY_PATH", "")) if p)
        return out

    isa.VecISA._avx_py_load, isa.python_subprocess_env = _LOAD_ALONE, with_torch_libs
    try:
        yield
    finally:
        isa.VecISA._avx_py_load, isa.python_subprocess_env = code, env


def _forget(isa: Any) -> None:
    isa.valid_vec_isa_list.cache_clear()
    isa.VecISA._VecISA__bool__impl.cache_clear()
