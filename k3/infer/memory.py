"""The engine's memory outside torch's allocator: glibc's heap kept for the next forward
(`keep_freed_memory`, `release_free_memory`), and a model's CPU weights moved into transparent huge pages
for decode (`rehome`). Neither changes any value; both are measured in docs/engine.md and
docs/benchmarks.md.
"""

import ctypes
import ctypes.util
import mmap
import sys
import weakref

import torch

# ---- the heap ----------------------------------------------------------------------------------------
# A prefill allocates and frees tensors of megabytes on every op (k3-small, 2,048 tokens: [2048, 1024] fp32
# is 8 MB). glibc serves large blocks with their own `mmap` (its threshold adapts up to 32 MB) and gives a
# heap's free top back to the OS past a trim threshold, so most forwards fault their activations in again, 4
# KB at a time, each page zeroed by the kernel: ~40-100 K page faults per k3-small [8, 256] prefill.
# `keep_freed_memory()` fixes both thresholds (`mallopt`): blocks under 32 MB come from the heap and freed
# memory is kept, so after the first forward the activations reuse resident pages (~0.2-20 K faults, the
# prefill ~6 % faster). The cost is resident memory held at its peak, which an inference process reaches on
# every batch anyway. The engine calls it unless `EngineConfig.keep_freed_memory` is off; elsewhere than
# glibc it does nothing.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: ~2 GB of free heap top before a trim, i.e. never
_state: list[bool] = []  # [result] once called


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for reuse (once per process); True where they were set."""
    if not _state:
        _state.append(_set_thresholds())
    return _state[0]


def _set_thresholds() -> bool:
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


# ---- huge pages --------------------------------------------------------------------------------------
# Decode streams every active weight once per token, and at batch 1 its speed is the memory system's: on the
# 2-core Sapphire Rapids machine the benches run on, a 256 MB gemv reads 23 GB/s from 4 KB pages and 29 GB/s
# from 2 MB pages (the hardware prefetchers stop at page boundaries, and every 4 KB page costs a TLB walk).
# Linux gives anonymous memory huge pages where it is advised (`MADV_HUGEPAGE`; the common
# `transparent_hugepage=madvise` setting), but torch's allocations are never advised. `rehome(model)` copies
# every CPU parameter and buffer into one anonymous mapping, 2 MB-aligned and advised before its first
# touch, and points the tensors at it (`param.data`, the module's buffer slot): the same values, dtypes and
# shapes, tied tensors still tied, no extra memory once the old storage is freed. The model's math does not
# change; the engine calls this for the native decode step.
HUGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # every tensor starts on a cache line (the kernels' 64-byte loads)
_done: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def huge_pages_available() -> bool:
    """Whether this OS takes the huge-page advice (Linux with MADV_HUGEPAGE)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def rehome(model: torch.nn.Module) -> int:
    """Move `model`'s contiguous CPU parameters and buffers into one huge-page-advised mapping (once per
    model); returns the bytes moved (0 where `huge_pages_available()` is False or nothing qualifies)."""
    if not huge_pages_available() or model in _done:
        return 0
    # normal tensors even when the engine's step calls this under inference_mode (the model may train
    # afterwards)
    with torch.inference_mode(False), torch.no_grad():
        return _rehome(model)


def _rehome(model: torch.nn.Module) -> int:
    slots = [
        (m, name, t, True) for m in model.modules() for name, t in m._parameters.items() if t is not None
    ]
    slots += [(m, name, t, False) for m in model.modules() for name, t in m._buffers.items() if t is not None]
    slots = [s for s in slots if s[2].device.type == "cpu" and s[2].is_contiguous() and s[2].numel() > 0]
    keyed = [(m, n, t, is_param, _storage_key(t)) for m, n, t, is_param in slots]  # before any tensor moves
    offsets: dict[tuple, int] = {}  # one copy per storage view (tied tensors share theirs)
    total = 0
    for _, _, t, _, key in keyed:
        if key not in offsets:
            offsets[key] = total
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if total == 0:
        return 0
    arena = _advised_bytes(total)
    views: dict[tuple, torch.Tensor] = {}
    for m, name, t, is_param, key in keyed:
        if key not in views:
            n = t.numel() * t.element_size()
            views[key] = arena[offsets[key] : offsets[key] + n].view(t.dtype).view(t.shape)
            views[key].copy_(t.detach())
        if is_param:
            m._parameters[name].data = views[key]
        else:
            m._buffers[name] = views[key]
    _done.add(model)
    return total


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape))


def _advised_bytes(n: int) -> torch.Tensor:
    """n bytes [n] uint8 of a fresh anonymous mapping, starting on a 2 MB boundary, advised for huge pages
    before anything touches them (so the first touch faults in 2 MB pages)."""
    mm = mmap.mmap(
        -1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )  # private: shared memory is shmem, which THP skips
    mm.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    start = -address % HUGE
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds `mm` alive as long as any view lives
    return whole[start : start + n]
