"""CPU execution helpers for the chunk path: reusable scratch buffers and denormal flushing.

Groups of chunks are processed one after another with identical shapes, so their temporaries can live
in the same memory (fresh multi-MB allocations cost page faults on every call).
"""

from contextlib import contextmanager

import torch

from k3.ops import native


class Workspace:
    """Named scratch buffers reused across groups of chunks (a new shape allocates a new buffer)."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor, *shape: int) -> torch.Tensor:
        t = self._bufs.get(name)
        if t is None or t.shape != shape:
            t = self._bufs[name] = like.new_empty(shape)
        return t


@contextmanager
def denormals_flushed():
    """Flush denormals to zero for the duration, on this thread and its OpenMP pool (where torch's and
    MKL's batched products run), restoring the previous mode.

    Strong decays make many products fall below fp32's normal range (~1e-38); they are negligible, but
    each costs a microcode assist: LAPACK's triangular solve ran about twice as slow on denormal operands,
    and a worker thread left unflushed made k3-mini's chunk products ~20x slower than on normal ones.
    """
    was_on = float(torch.full((), 1e-40) * 1.0) == 0.0  # a denormal survives unless flushing is on
    if not was_on:
        torch.set_flush_denormal(True)
        native.flush_denormals_team(True)
    try:
        yield
    finally:
        if not was_on:
            torch.set_flush_denormal(False)
            native.flush_denormals_team(False)
