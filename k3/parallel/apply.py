"""parallelize(model, mesh): turn a single-device K3ForCausalLM into a dp x ep sharded one, in a fixed order.

    1. expert parallelism    LatentMoE.experts -> EPRoutedExperts over mesh.ep   (module swap)
    2. Quantile Balancing    Router -> HistogramRouter summing over every rank      (module swap)
    3. FSDP2                 fully_shard per decoder layer (+ experts on mesh.dp), then the root

The model code stays single-device (CONTRIBUTING.md#single-device-model-code); everything distributed is in
k3/parallel. Build the model and initialise it identically on every rank before calling this (fine up to a few
billion parameters; beyond that build on the meta device and initialise after sharding: future work).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.parallel.expert_parallel import apply_expert_parallel
from k3.parallel.fsdp import apply_fsdp
from k3.parallel.mesh import Meshes
from k3.parallel.qb_dist import DEFAULT_BINS, DEFAULT_RANGE, apply_histogram_qb


def parallelize(
    model: nn.Module,
    mesh: Meshes,
    *,
    capacity_factor: float = 1.25,
    qb_bins: int = DEFAULT_BINS,
    qb_range: tuple[float, float] = DEFAULT_RANGE,
    param_dtype: torch.dtype | None = None,
    fsdp: bool = True,
) -> nn.Module:
    """EP -> histogram QB -> FSDP2 on `model` (in place); returns it. `mesh` comes from build_mesh()."""
    config = model.config
    if config.num_experts % mesh.ep.size():
        raise ValueError(f"ep={mesh.ep.size()} must divide num_experts={config.num_experts}")
    apply_expert_parallel(model, mesh.ep, capacity_factor)
    apply_histogram_qb(model, config, group=None, bins=qb_bins, value_range=qb_range)
    if fsdp:
        apply_fsdp(model, mesh, param_dtype)
    return model
