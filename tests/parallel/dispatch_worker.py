"""Run under torchrun (2 CPU processes, gloo) by test_multiprocess.py: EP dispatch+combine on 2 ranks vs
the single-process grouped experts on the whole batch. Writes the comparison to argv[1] (rank 0).

Two checks: (1) the real GLU experts, forward and backward, against `experts_grouped` (equal up to the
CPU GEMM's blocking, which depends on the row count); (2) the data movement alone, bitwise: with a
row-wise expert f_e(x) = (e + 1)·x + tanh(x) the 2-rank dispatch -> all-to-all -> combine must give
exactly Σ_i p_i f_{e_i}(z_t), accumulated in expert order like experts_grouped.
"""

import json
import sys

import torch
import torch.distributed as dist

import k3.parallel.expert_parallel as ep_mod
from k3.model.moe import RoutedExperts
from k3.ops.glu import glu_fn
from k3.ops.moe import experts_grouped
from k3.parallel.expert_parallel import EPRoutedExperts
from k3.parallel.mesh import ParallelDims, build_mesh, init_distributed


def main(out_path: str) -> None:
    rank, world = init_distributed()
    mesh = build_mesh(ParallelDims.from_world(world, world))
    torch.manual_seed(0)
    E, k, T, Dl, I = 8, 2, 512, 32, 48
    dense = RoutedExperts(E, Dl, I, glu_fn("situ"))
    z = torch.randn(T, Dl)
    weights = torch.rand(T, k)
    indices = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ep = EPRoutedExperts(dense, mesh.ep, capacity_factor=E / k)  # C = T_local: nothing can drop
    rows = slice(rank * T // world, (rank + 1) * T // world)
    z_local = z[rows].clone().requires_grad_(True)
    u_local = ep(z_local, weights[rows], indices[rows])
    u_local.sum().backward()  # the global loss is the sum over ranks of these
    gathered = [torch.empty_like(u_local) for _ in range(world)]
    dist.all_gather(gathered, u_local.detach())
    grads = [torch.empty_like(z_local) for _ in range(world)]
    dist.all_gather(grads, z_local.grad)
    w1_grad = ep.w1.grad.full_tensor() * world  # undo the 1/ep scale: grad of the sum, not the mean
    ep_mod.experts_batched = lambda x, w1, w2, w3, act: torch.stack(  # rank r owns experts r*E/world..
        [(rank * (E // world) + j + 1) * xj + torch.tanh(xj) for j, xj in enumerate(x)]
    )
    with torch.no_grad():
        u_rowwise = ep(z[rows], weights[rows], indices[rows])
    rowwise = [torch.empty_like(u_rowwise) for _ in range(world)]
    dist.all_gather(rowwise, u_rowwise)
    if rank == 0:
        exact = torch.zeros(T, Dl)
        for e in range(E):
            p = (weights * (indices == e)).sum(-1)  # [T]; at most one slot of a token per expert
            hit = (indices == e).any(-1)
            exact[hit] += p[hit, None] * ((e + 1) * z[hit] + torch.tanh(z[hit]))
        z_ref = z.clone().requires_grad_(True)
        ref = experts_grouped(z_ref, weights, indices, dense.w1, dense.w2, dense.w3, dense.act)
        ref.sum().backward()
        counts = torch.bincount(indices[: T // world].reshape(-1), minlength=E)
        result = {
            "rowwise_equal": torch.equal(torch.cat(rowwise), exact),
            "rowwise_max_diff": float((torch.cat(rowwise) - exact).abs().max()),
            "max_diff": float((torch.cat(gathered) - ref).abs().max()),
            "min_count": int(counts.min()),
            "dropped": int(ep.dropped),
            "z_grad_diff": float((torch.cat(grads) - z_ref.grad).abs().max()),
            "w1_grad_diff": float((w1_grad - dense.w1.grad).abs().max()),
            "w1_grad_scale": float(dense.w1.grad.abs().max()),
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
