"""Per-Head Muon under FSDP2: orthogonalise whole matrices / head blocks of sharded parameters.

FSDP2 shards a matrix's rows (dim 0) over ranks, so a head block (or the whole matrix Newton-Schulz
needs) can straddle ranks. `DistMuon` keeps the momentum buffer sharded like the parameter (elementwise
maths on the local shard), then for the orthogonalisation redistributes the update so every *matrix*
dim is whole on each rank:

    placement Shard(d), d one of the last two dims   -> Replicate (all-gather over that mesh axis)
    Shard(0) of a 3-D [E, out, in] expert stack       -> kept: each expert is its own matrix, and a rank
                                                         holding a slice of experts holds them whole

runs `orthogonalize` (head_split as in the single-process Muon) on the local, now whole matrices, and
redistributes the result back to the parameter's placements (a local slice, no communication). Every
rank of a replicated axis does the same Newton-Schulz on the same input, so the update equals the
single-process one up to the all-gather (which is exact). Cost: one all-gather of each dense matrix's
update per step (the FSDP all-gather volume again), and NS on the full matrix on every rank.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from k3.optim.muon import Muon, orthogonalize


def whole_matrix_placements(t: DTensor) -> list:
    """t's placements with every shard of a matrix dim replaced by Replicate (see module docstring)."""
    keep_dims = {0} if t.ndim == 3 else set()
    out = []
    for p in t.placements:
        if isinstance(p, Shard) and type(p) is Shard and p.dim in keep_dims:
            out.append(p)
        elif p.is_shard():
            out.append(Replicate())
        else:
            out.append(p)
    return out


def orthogonalize_dist(update: Tensor, head_split=None, **ns_kwargs) -> Tensor:
    """orthogonalize() for a plain tensor or a DTensor (gather matrix dims -> NS -> redistribute back)."""
    if not isinstance(update, DTensor):
        return orthogonalize(update, head_split, **ns_kwargs)
    placements = whole_matrix_placements(update)
    whole = update.redistribute(update.device_mesh, placements)
    local = orthogonalize(whole.to_local(), head_split, **ns_kwargs)
    out = DTensor.from_local(
        local, update.device_mesh, placements, shape=update.shape, stride=update.stride()
    )
    return out.redistribute(update.device_mesh, update.placements)


class DistMuon(Muon):
    """Muon for FSDP2 / EP DTensor parameters; identical to Muon on plain tensors."""

    def _orthogonalize(self, p: Tensor, update: Tensor, head_split, ns_kwargs: dict) -> Tensor:
        # whole matrices / head blocks are gathered, orthogonalized and re-sharded (see orthogonalize_dist)
        return orthogonalize_dist(update, head_split, **ns_kwargs).to(p.dtype)
