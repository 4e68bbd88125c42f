"""Giving freed host memory back to the system after the phases that free much at once.

glibc's malloc serves a request below its mmap threshold from its heaps and keeps what is
freed there for reuse; the threshold rises (up to 32 MiB) with every large block freed, so
most of a model's tensors end up in the heaps. After a pipeline's construction (the initial
weights of each stage, the modules' own parameters) and after a checkpoint load (the
reader's buffers) those heaps hold freed memory the run will not ask for again in that
form, resident until trimmed: the process would keep more than it holds. `malloc_trim`
returns the free pages of every heap to the kernel. A no-op without glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_trim = getattr(_libc, "malloc_trim", None)


def return_free_memory() -> None:
    """Return the free pages malloc keeps to the kernel (glibc; elsewhere nothing)."""
    if _trim is not None:
        _trim(0)
