"""Keep freed memory in the process heap instead of handing it back to the kernel (glibc ``mallopt``).

glibc serves an allocation above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with a fresh
``mmap`` and returns it with ``munmap`` when freed. A training step allocates and frees the same large
activations, gradients and logits every step, so each step touches fresh pages again. Every first touch of a
4 KiB page is a page fault plus zeroing, which is slow in a virtual machine. k2-mini's bf16 logits cast to
fp32, [8, 256, 8192], are 67 MB, about 16,000 faults, and took 87 ms a copy where a copy into reused memory
takes about 20 ms.

``keep_freed_memory()`` sets

    M_MMAP_MAX = 0                 every allocation comes from the heap (brk), never its own mmap
    M_TRIM_THRESHOLD = 2^31 − 1    free memory at the top of the heap is kept (up to 2 GiB) rather than trimmed

so the next step reuses pages that are already mapped. The arithmetic is the same and so are the results;
only where the bytes live changes. The cost is that memory a process freed stays counted in its RSS until it
exits. Peak RSS is the same, since a step's peak is reused each step. The setting is what PyTorch's CPU
tuning guides get by preloading jemalloc or tcmalloc, without a native dependency.

Measured on an AMD EPYC (Zen 4) KVM guest, 2 threads, ``benchmarks/bench_k3_step.py`` medians of 5, two
invocations each way:
- k2-mini forward + backward: 0.86 / 0.83 s → 0.64 / 0.61 s.
- k2-mini full MuonClip step: 1.39 / 1.49 s → 1.12 / 1.31 s.
- k3-mini full step: 2.45 / 2.89 s → 1.92 / 2.31 s.
- Max RSS: +3 %.

It applies to the ``k2lab`` command and to the benchmarks, where both sides of a comparison share the
process. ``K2LAB_MALLOC=default`` keeps glibc's behaviour. On a C library without ``mallopt`` (musl, macOS)
nothing changes.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["ENV", "keep_freed_memory"]

ENV = "K2LAB_MALLOC"  # "default": leave glibc's thresholds alone
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)
_KEEP = 2**31 - 1  # the largest int mallopt takes
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Make freed memory stay in the heap for reuse (module doc); True when the setting is in force.

    Idempotent; returns False (and changes nothing) under ``K2LAB_MALLOC=default`` or without glibc.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "").lower() == "default":
        return False
    try:  # the C library already loaded into this process (no find_library: it spawns ldconfig)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _KEEP) == 1
    return _applied
