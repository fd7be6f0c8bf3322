"""Keep freed memory in the process (glibc malloc), set once by each model service at start.

A forward's logits and every vocabulary-wide row after it (warp, the float64 CDF of a draw: 0.6 and
1.2 MB a row at the default pair's 151,936 tokens) are allocated and freed per step. glibc serves
such sizes with fresh mmaps, or trims its heap back to the system when they are freed, so each
step paid the page faults of touching new memory: a CDF of one row took 1.5 ms instead of 0.17,
of five rows 7-10 ms instead of 1 (this machine, `torch.cumsum` with and without the settings
below). Raising the mmap threshold to glibc's maximum (32 MB on 64-bit) and the trim threshold
above it keeps those pages in the heap, reused by the next step. The cost is memory the process
keeps at its peak instead of returning it. No-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: larger values are refused
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (above); False where there is no glibc mallopt or it refused."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(mmap) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
