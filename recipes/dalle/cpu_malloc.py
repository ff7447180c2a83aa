"""``keep_freed_memory()``: let glibc's malloc reuse freed memory instead of page-faulting fresh pages.

glibc serves large allocations (above 128 KiB, a threshold that adapts up to 32 MiB) with new ``mmap`` pages
and returns freed memory to the OS, so every CPU training step pays again for its large temporaries (logits,
activations, gradients): on bench-small ~120k page faults and ~0.25 s of kernel time per fp32 step, ~20% of
the step on this machine (tests/benchmarks/bench_dalle_train.py, ``--malloc``). With mmap off for ordinary
allocations and no trimming, the freed blocks are reused from the heap: the process keeps its peak resident
memory, as PyTorch's CUDA caching allocator does on GPUs (jemalloc or tcmalloc via LD_PRELOAD do the same).

It changes the whole process's allocator, so it is meant for training entry points, not for import time.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Configure glibc malloc to keep and reuse freed memory; returns False (and changes nothing) elsewhere."""
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; 0 mmaps: large blocks come from the heap and are recycled
    return mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
