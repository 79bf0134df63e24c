"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for K3, applied after expert parallelism.

    for each decoder layer:
        fully_shard(layer.block_sparse_moe.experts, mesh=mesh.dp)  expert DTensors (Shard(0) on "ep")
                                                                   gain an FSDP shard on "dp"
        fully_shard(layer.self_attn, mesh=mesh.dp_ep)              the KDA / MLA mixer
        fully_shard(layer.block_sparse_moe | layer.mlp, ...)       router, shared expert, latent projs
    fully_shard(model, mesh=mesh.dp_ep)                            embedding, lm_head, every norm and
                                                                   AttnRes vector of the layers

Gradients: FSDP averages each unit's gradient over its mesh (all ranks for dense weights, dp for
experts; the EP module already scaled expert grads by 1/ep), which is the gradient of the global mean
loss when every rank's loss is the mean over its own, equally sized, token set.

A DecoderLayer takes and returns no tensor (it advances the AttnRes block stream in place), so FSDP
can hook neither its backward nor its inputs' gradients, and a layer-level unit silently loses
gradients (tried: the last layer's unit never reduce-scatters). The units are therefore one level
down (mixer, FFN, experts: tensor in, tensor out, resharded after forward as usual); the layers' own
[D]-sized norm and AttnRes vectors stay with the root unit (unsharded from forward to backward).

`clip_grad_norm_` is a DTensor-aware global-norm clip: the gradients' squared norms are reduced over
their own meshes (dense and expert grads live on different meshes, which torch's clip cannot stack),
one all-reduce per mesh dim rather than per parameter.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from k3.parallel.mesh import Meshes


def apply_fsdp(model: nn.Module, mesh: Meshes, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard `model` (a K3ForCausalLM, EP already applied) as in the module docstring; returns it."""
    # K3 adds every unit's output to the block stream out of place (k3.model.attnres.BlockStream.add),
    # so FSDP's warning about view outputs (LatentMoE returns y.reshape(h.shape)) does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    dense, experts = mesh.dp_ep, mesh.dp
    for layer in model.model.layers:
        ffn = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
        if hasattr(layer, "block_sparse_moe"):
            fully_shard(ffn.experts, mesh=experts, mp_policy=mp)
        fully_shard(layer.self_attn, mesh=dense, mp_policy=mp)
        fully_shard(ffn, mesh=dense, mp_policy=mp)
    fully_shard(model, mesh=dense, mp_policy=mp)
    return model


def _sharded(t: DTensor) -> bool:
    """Every placement splits the elements (Shard, FSDP2's _StridedShard): the local squared sums of
    the mesh's ranks add up to the global one."""
    return all(isinstance(p, Shard) or type(p).__name__ == "_StridedShard" for p in t.placements)


@torch.no_grad()
def grad_norm(params) -> torch.Tensor:
    """Global L2 norm of the gradients (DTensor or plain), as a plain fp32 scalar tensor on the CPU.

    Sharded DTensor grads: local squared sums added per mesh, then one all-reduce per mesh dim (here
    dp_ep: 1, (dp, ep): 2), not one per parameter; anything else (a Replicate / Partial placement) is
    reduced on its own through DTensor."""
    per_mesh: dict = {}
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, DTensor) and _sharded(g):
            sq = torch.linalg.vector_norm(g.to_local().float()) ** 2
            per_mesh[g.device_mesh] = per_mesh.get(g.device_mesh, 0.0) + sq
        else:
            n = torch.linalg.vector_norm(g.float())
            n = n.full_tensor() if isinstance(n, DTensor) else n
            total = total + n.cpu() ** 2
    for mesh, sq in per_mesh.items():
        for dim in range(mesh.ndim):
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq.cpu()
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ semantics (coef = max_norm / (norm + 1e-6), capped at 1) for
    gradients on several meshes; returns the pre-clip norm."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params)
    if max_norm > 0 and math.isfinite(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.item())
    return norm
