"""The C library, loaded once through ctypes, for the few calls Python does not wrap.

``host_heap`` tunes glibc's malloc (``mallopt``, ``malloc_trim``), ``disk`` advises the kernel on mapped
files (``madvise`` without holding the GIL) and ``atomic`` swaps two names in one step (``renameat2``). Each
used to load the library on its own; they share this one handle. ``None`` where no C library can be loaded
(every caller then falls back to what Python offers, or skips the tuning).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library with ``errno`` kept for ``ctypes.get_errno``; ``None`` where there is none."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)  # glibc's name first: find_library may spawn a helper process
    except OSError:
        pass
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
