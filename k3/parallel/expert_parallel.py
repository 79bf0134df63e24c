"""Expert parallelism with static shapes: a fixed-capacity all-to-all dispatch/combine of routed experts.

The E experts are split over the `ep` ranks of an expert-parallel group (rank r owns experts
r*E_local .. (r+1)*E_local - 1). Each rank routes its own T tokens, then

    C        = min(T, ceil(capacity_factor * T * k / E))     slots per (expert, source rank), a Python int
    pos      = rank of a token-slot among the slots sent to the same expert (stable sort + exclusive
               cumsum of the per-expert counts); pos >= C is dropped (kept slots: lower token index first)
    send     [E, C, Dl] = [ep, E_local, C, Dl]  scatter of z into the static buffer (zeros where empty)
    recv     = all_to_all_single(send)  equal splits  -> [ep (source), E_local, C, Dl]
    y        = experts(recv as [E_local, ep*C, Dl])     one GLU per local expert on its ep*C rows
    back     = all_to_all_single(y)     equal splits  -> [E, C, Dl] on the source rank
    u_t      = Σ_i p_ti · back[e_ti, pos_ti]            fp32 accumulate (dropped slots contribute 0)

Every shape depends only on T, k, E, ep and the capacity factor, so nothing is read back to the host:
no `.item()`, `.tolist()`, `.cpu()` or data-dependent shape in the forward or backward
(tests/parallel/test_expert_parallel.py runs them with those methods made to raise). The all-to-all
with equal splits is its own adjoint, so the backward is two more all-to-alls.

Gradient contract: every rank's loss is the mean over its own tokens and the global loss is the mean
over ranks, so the dense gradients are averaged over all ranks (FSDP does that). An expert's gradient
is the sum of what its ep source ranks send back; the local expert weights are therefore used through
a 1/ep gradient scale, and averaging them over the data-parallel axis (FSDP on the dp mesh) completes
the global mean.

The dropped and routed slot counts accumulate on the device (`dropped`, `routed` buffers, not in the
state_dict); `drop_stats(model)` reads and resets them outside the step. With Quantile Balancing and
capacity_factor >= 1.25 the drop rate is ~0 after the first few steps.

Applied as a module swap on `LatentMoE.experts` (`apply_expert_parallel`); the model code is untouched.
The swapped module keeps the parameter names `experts.w1/w2/w3`, as DTensors sharded on dim 0 over the
ep mesh, so DCP checkpoints see the global [E, I, Dl] tensors and reshard to any ep size.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from k3.model.moe import LatentMoE, RoutedExperts


# ---- pure dispatch maths (no communication) ---------------------------------------------------------
def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per (expert, source rank): min(T, ceil(cf * T * k / E)), at least 1. A token picks an
    expert at most once, so C = T never drops."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


def dispatch_slots(indices_Tk: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Static slot of every token-slot: indices_Tk [T, k] -> slot_S [T*k] int64 in [0, E*C].

    slot = e*C + pos for a kept token-slot, E*C (a trash row) for a dropped one. pos is the token-slot's
    rank among those routed to the same expert, in token order: a stable sort by expert, minus the
    exclusive cumsum of the per-expert counts (counted with scatter_add: bincount would sync on CUDA).
    """
    flat = indices_Tk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts  # exclusive cumsum: first sorted position of each expert
    pos_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    pos = torch.empty_like(flat).scatter_(0, order, pos_sorted)
    return torch.where(pos < capacity, flat * capacity + pos, num_experts * capacity)


def scatter_to_slots(z_TD: torch.Tensor, slot_S: torch.Tensor, top_k: int, num_slots: int) -> torch.Tensor:
    """z_TD [T, Dl] -> buffer [num_slots, Dl]: row slot_S[s] holds z of token s // k (zeros elsewhere).
    Dropped token-slots land in an extra trash row that is cut off."""
    rows = z_TD.repeat_interleave(top_k, dim=0)  # [T*k, Dl]
    buf = z_TD.new_zeros(num_slots + 1, z_TD.shape[1]).index_add(0, slot_S, rows)
    return buf[:num_slots]


def combine_from_slots(
    y_SD: torch.Tensor, slot_S: torch.Tensor, weights_Tk: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """u_t = Σ_i p_ti · y[slot_ti] (fp32; a dropped slot reads a zero row). y_SD [E*C, Dl] -> [T, Dl].

    Accumulated token by token in expert order, the order `experts_grouped` uses, so with nothing
    dropped the result is bitwise the single-process one on CPU.
    """
    T, k = weights_Tk.shape
    y = torch.cat([y_SD, y_SD.new_zeros(1, y_SD.shape[1])])[slot_S].float()  # [T*k, Dl]
    order = torch.argsort(slot_S, stable=True)  # by expert (slot = e*C + pos); dropped slots last
    contrib = y[order] * weights_Tk.reshape(-1)[order].float()[:, None]
    out = torch.zeros(T, y_SD.shape[1], dtype=torch.float32, device=y_SD.device)
    return out.index_add_(0, order // k, contrib).to(out_dtype)


def experts_batched(
    x_ENd: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, act
) -> torch.Tensor:
    """Each local expert on its own rows: x [E_l, N, Dl], w1/w3 [E_l, I, Dl], w2 [E_l, Dl, I] -> [E_l, N, Dl].
    One F.linear per expert (the same kernel `experts_grouped` calls, so rows agree bitwise)."""
    return torch.stack(
        [
            F.linear(act(F.linear(x, a), F.linear(x, c)), b)
            for x, a, b, c in zip(x_ENd, w1, w2, w3, strict=True)
        ]
    )


# ---- differentiable collectives ---------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits along dim 0; its adjoint is the same all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # a permuted grad would give a permuted empty_like
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, grad * scale backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable equal-split all-to-all over dim 0 (whose size the group size divides)."""
    return _AllToAll.apply(x, group)


# ---- the module swap --------------------------------------------------------------------------------
class EPRoutedExperts(RoutedExperts):
    """RoutedExperts whose E experts are sharded over an expert-parallel mesh (see the module docstring).

    w1/w2/w3 are DTensors [E, ...] sharded Shard(0) over `ep_mesh`; forward(z [T, Dl], weights [T, k],
    indices [T, k]) -> u [T, Dl], the same contract as RoutedExperts (the `impl` argument is ignored).
    """

    def __init__(self, dense: RoutedExperts, ep_mesh: DeviceMesh, capacity_factor: float = 1.25):
        nn.Module.__init__(self)  # no full-size allocation: the weights come from `dense`
        E = dense.w1.shape[0]
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        if E % ep:
            raise ValueError(f"ep={ep} must divide num_experts={E}")
        expert_capacity(1, 1, 1, capacity_factor)  # validates capacity_factor
        self.act, self.impl, self.init_std = dense.act, dense.impl, dense.init_std
        self.num_experts, self.ep_mesh, self.capacity_factor = E, ep_mesh, capacity_factor
        local = slice(rank * (E // ep), (rank + 1) * (E // ep))
        for name in ("w1", "w2", "w3"):
            w = getattr(dense, name).detach()[local].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(w, ep_mesh, [Shard(0)], run_check=False)))
        self.register_buffer("dropped", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("routed", torch.zeros((), dtype=torch.long), persistent=False)

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, 0.0, self.init_std)

    def compute(self, fn, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        T, k = indices.shape
        E, ep, group = self.num_experts, self.ep_mesh.size(), self.ep_mesh.get_group()
        C = expert_capacity(T, k, E, self.capacity_factor)
        slot = dispatch_slots(indices, E, C)
        with torch.no_grad():
            self.dropped += (slot == E * C).sum()
            self.routed += slot.numel()
        send = scatter_to_slots(z, slot, k, E * C).view(ep, E // ep, C, z.shape[1])
        recv = all_to_all(send, group)  # [ep (source), E_local, C, Dl]
        x = recv.transpose(0, 1).reshape(E // ep, ep * C, z.shape[1])
        w1, w2, w3 = (_ScaleGrad.apply(self._local(w), 1.0 / ep) for w in (self.w1, self.w2, self.w3))
        y = experts_batched(x, w1, w2, w3, self.act)
        back = all_to_all(y.view(E // ep, ep, C, -1).transpose(0, 1).contiguous(), group)  # [ep, E_l, C, Dl]
        return combine_from_slots(back.reshape(E * C, -1), slot, weights, z.dtype)

    @staticmethod
    def _local(w: torch.Tensor) -> torch.Tensor:
        return w.to_local() if isinstance(w, DTensor) else w

    def extra_repr(self) -> str:
        E, I, Dl = self.w1.shape
        return f"experts={E}, dim={Dl}, intermediate={I}, ep={self.ep_mesh.size()}, cf={self.capacity_factor}"


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, capacity_factor: float = 1.25) -> int:
    """Swap every LatentMoE's `experts` for an EPRoutedExperts over `ep_mesh`; returns how many."""
    n = 0
    for module in model.modules():
        if isinstance(module, LatentMoE) and not isinstance(module.experts, EPRoutedExperts):
            module.experts = EPRoutedExperts(module.experts, ep_mesh, capacity_factor)
            n += 1
    return n


@torch.no_grad()
def drop_stats(model: nn.Module, reset: bool = True) -> dict[str, float]:
    """{"dropped", "routed", "drop_rate"} summed over this rank's EP layers since the last reset
    (one host read; call it outside the forward/backward)."""
    layers = [m for m in model.modules() if isinstance(m, EPRoutedExperts)]
    if not layers:
        return {"dropped": 0, "routed": 0, "drop_rate": 0.0}
    dropped, routed = (int(sum(getattr(m, key) for m in layers)) for key in ("dropped", "routed"))
    if reset:
        for m in layers:
            m.dropped.zero_()
            m.routed.zero_()
    return {"dropped": dropped, "routed": routed, "drop_rate": dropped / max(routed, 1)}
