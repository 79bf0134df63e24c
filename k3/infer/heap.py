"""The C heap kept for reuse: freed activations stay in the process instead of going back to the OS.

A prefill allocates and frees tensors of megabytes on every op (k3-small, 2,048 tokens: [2048, 1024]
fp32 is 8 MB). glibc serves large blocks with their own `mmap` (its threshold adapts up to 32 MB) and
gives a heap's free top back to the OS past a trim threshold, so most forwards fault their activations
in again, 4 KB at a time, each page zeroed by the kernel: ~40-100 K page faults per k3-small
[8, 256] prefill. `keep_freed_memory()` fixes both thresholds (`mallopt`): blocks under 32 MB come from
the heap and freed memory is kept, so after the first forward the activations reuse resident pages
(~0.2-20 K faults, the prefill ~6 % faster). The cost is resident memory held at its peak, which an
inference process reaches on every batch anyway. The engine calls it unless
`EngineConfig.keep_freed_memory` is off; elsewhere than glibc it does nothing.
"""

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: ~2 GB of free heap top before a trim, i.e. never
_state: list[bool] = []  # [result] once called


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for reuse (once per process); True where they were set."""
    if not _state:
        _state.append(_set())
    return _state[0]


def _set() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the OS now (glibc `malloc_trim(0)`): after a request that
    needed far more memory than serving does (a large body, decoded images). True where it ran."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
