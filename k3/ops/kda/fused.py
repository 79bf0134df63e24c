"""Chunked KDA's forward as one native pass per (sequence, head): the prefill path when nothing needs
gradients.

`chunk.py`'s torch path batches the chunk-local maps over groups of chunks and then walks the state
chunk by chunk with two small batched matmuls per step: at a 512-token prefill (4 heads of 64) that is
~100 torch calls whose 64 x 64 products run from L3 at a fraction of the matmul peak. Here
`k3/ops/csrc/kda_fused.c` takes each (sequence, head) from its first chunk to its last with every block
in L2 (prep, the two-half A products, the UT solve, the state pass; register-blocked products from
`small_gemm.h`), reading the padded [B, T, H, *] inputs in place and writing o in place.

It applies where the two-half forward does (`halves.halves_fit`) and the kernel's tiling does (chunk 32,
64 or 128; K, V multiples of 16), on fp32 CPU tensors without autograd and outside torch.compile; the
caller takes its torch path (`_ChunkKDA`) otherwise, and the tests compare the two. With several torch
threads the (sequence, head) pairs are split across as many Python threads (ctypes releases the GIL).
"""

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from k3.ops import native
from k3.ops.kda.prep import L2NORM_EPS

CHUNKS = (32, 64, 128)  # h = C / 2 must be a multiple of the kernel's 16-column tiles


class _Strides(ctypes.Structure):
    """(batch, token, head) strides of a [B, T, H, *] tensor, in elements (the kernel's `strides_bth`)."""

    _fields_ = [("b", ctypes.c_int64), ("t", ctypes.c_int64), ("h", ctypes.c_int64)]


def fused_fits(q, k, v, g, beta, chunk_size: int) -> bool:
    """Whether the native pass can run these padded [B, T, H, *] inputs (beta [B, T, H]): fp32 CPU, no
    gradient, not tracing, unit channel strides, a supported chunk size and K, V multiples of 16."""
    K, V = q.shape[-1], v.shape[-1]
    if chunk_size not in CHUNKS or K % 16 or V % 16 or not native.kernel_may_run(q, k, v, g, beta):
        return False
    return all(t.stride(-1) == 1 for t in (q, k, v, g))


def fused_forward(q, k, v, g, beta, h0, rows, chunk_size: int, scale: float):
    """Raw fp32 q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] (T a multiple of chunk_size; q, k
    L2-normalised inside, q scaled by `scale`), h0 [N, H, K, V] or None, rows: N tuples (batch row, first
    token, chunks) of the independent sequences -> (o [B, T, H, V], final states [N, H, K, V]); None when
    the kernel is not built (the caller takes its torch path). Padding rows of o (tokens no sequence
    covers) are left unwritten."""
    fn = native.function("kda_fused", "k3_kda_fused_forward", _ARGS)
    if fn is None:
        return None
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = v.new_empty(B, T, H, V)
    finals = q.new_empty(len(rows), H, K, V)
    h0 = None if h0 is None else h0.contiguous()
    seg = torch.tensor(rows, dtype=torch.int64).reshape(-1)
    args = [arg for t in (q, k, v, g) for arg in (t.data_ptr(), _Strides(*t.stride()[:3]))]
    args += [beta.data_ptr(), _Strides(*beta.stride())]
    head = (H, chunk_size, K, V, float(scale), L2NORM_EPS, seg.data_ptr())
    tail = (0 if h0 is None else h0.data_ptr(), o.data_ptr(), _Strides(*o.stride()[:3]), finals.data_ptr())
    tasks, workers = len(rows) * H, min(torch.get_num_threads(), len(rows) * H)
    work = torch.empty(workers, _scratch_floats(chunk_size, K, V) + 16)  # + 16: room to align each to 64 B
    spans = [(i * tasks // workers, (i + 1) * tasks // workers) for i in range(workers)]
    calls = [(*args, *head, a, b, *tail, _aligned(work[i])) for i, (a, b) in enumerate(spans)]
    if workers == 1:
        fn(*calls[0])
    else:
        list(_pool(workers).map(lambda call: fn(*call), calls))
    return o, finals


def _aligned(buf: torch.Tensor) -> int:
    """The first 64-byte aligned address in buf (fp32, >= 16 spare elements)."""
    return buf.data_ptr() + (-buf.data_ptr()) % 64


def _scratch_floats(C: int, K: int, V: int) -> int:
    n = ctypes.c_int64()
    native.function("kda_fused", "k3_kda_fused_scratch", _SCRATCH_ARGS)(C, K, V, ctypes.byref(n))
    return n.value


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a forked child (e.g. a DataLoader worker) starts its own


def _pool(workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="k3-kda")
        return _pools[workers]


_ARGS = [native.PTR, _Strides] * 5 + [native.I64] * 4 + [native.F32] * 2 + [native.PTR] + [native.I64] * 2
_ARGS += [native.PTR, native.PTR, _Strides, native.PTR, native.PTR]
_SCRATCH_ARGS = [native.I64] * 3 + [native.PTR]
