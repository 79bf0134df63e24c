"""Static-shape expert parallelism on one rank: slot maths, drops, equality with the grouped experts,
and no host synchronisation in the MoE forward + backward.

How "no host sync" is shown on CPU (torch.cuda.set_sync_debug_mode is CUDA-only):
1. guard: every Python-level way to read a tensor back to the host (Tensor.item, tolist, cpu, numpy,
   __bool__, __int__, __float__, __index__) is patched to raise while a LatentMoE with EP experts and
   the histogram router runs forward + backward in training mode;
2. meta device: the same forward + backward on meta tensors, where any op whose output shape depends
   on data (nonzero, bincount, masked_select, boolean indexing: the C++-level syncs the guard cannot
   see) raises. Together they cover Python-level reads and data-dependent shapes.
On a GPU machine, test_no_sync_cuda runs it under torch.cuda.set_sync_debug_mode("error").
"""

import contextlib

import pytest
import torch

import k3.parallel.expert_parallel as ep_mod
from k3.config import preset
from k3.model.moe import LatentMoE, RoutedExperts
from k3.ops.glu import glu_fn
from k3.ops.moe import experts_grouped
from k3.parallel.expert_parallel import (
    EPRoutedExperts,
    apply_expert_parallel,
    dispatch_slots,
    drop_stats,
    expert_capacity,
)
from k3.parallel.qb_dist import apply_histogram_qb

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads():
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def forbid(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} called")

        return raise_

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, forbid(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_capacity():
    assert expert_capacity(100, 2, 8, 1.25) == 32  # ceil(1.25 * 100 * 2 / 8) = ceil(31.25)
    assert expert_capacity(10, 2, 2, 4.0) == 10  # never more than T
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, 2, 8, 0.0)


def test_dispatch_slots_by_hand():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 1]])  # expert 0 gets tokens 0,1,2; C = 2
    slot = dispatch_slots(indices, num_experts=3, capacity=2)
    # token-slot order: (t0,e0) (t0,e1) (t1,e0) (t1,e2) (t2,e0) (t2,e1) (t3,e2) (t3,e1)
    assert slot.tolist() == [0, 2, 1, 4, 6, 3, 5, 6]  # (t2, e0) and (t3, e1) exceed C: trash row 6


def _experts(E=8, Dl=16, I=24):
    torch.manual_seed(0)
    return RoutedExperts(E, Dl, I, glu_fn("situ"))


def _routing(T, E, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return torch.rand(T, k, generator=g), idx


def test_matches_grouped_forward_backward(world1):
    dense = _experts()
    ep = EPRoutedExperts(dense, world1.ep, capacity_factor=4.0)
    w, idx = _routing(200, 8, 2)
    z = torch.randn(200, 16, requires_grad=True)
    u = ep(z, w, idx)
    ref = experts_grouped(z, w, idx, dense.w1, dense.w2, dense.w3, dense.act)
    torch.testing.assert_close(u, ref, rtol=0, atol=1e-6)
    g = torch.randn_like(u)
    gz, gw = torch.autograd.grad(u, (z, ep.w1), g)
    rz, rw = torch.autograd.grad(ref, (z, dense.w1), g)
    torch.testing.assert_close(gz, rz, rtol=0, atol=1e-6)
    torch.testing.assert_close(gw.to_local(), rw, rtol=0, atol=1e-6)
    assert drop_stats(torch.nn.ModuleList([ep]))["dropped"] == 0


def test_drops_counted_and_zeroed(world1):
    dense = _experts()
    ep = EPRoutedExperts(dense, world1.ep, capacity_factor=0.5)
    w, idx = _routing(64, 8, 2)
    z = torch.randn(64, 16)
    u = ep(z, w, idx)
    C = expert_capacity(64, 2, 8, 0.5)
    slot = dispatch_slots(idx, 8, C)
    kept = (slot < 8 * C).view(64, 2)
    ref = experts_grouped(z, w * kept, idx, dense.w1, dense.w2, dense.w3, dense.act)  # dropped -> weight 0
    torch.testing.assert_close(u, ref, rtol=0, atol=1e-6)
    stats = drop_stats(torch.nn.ModuleList([ep]))
    assert stats["dropped"] == int((~kept).sum()) > 0 and stats["routed"] == 128
    assert drop_stats(torch.nn.ModuleList([ep]))["dropped"] == 0  # reset


def _ep_moe(mesh):
    config = preset("k3-nano")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"moe": LatentMoE(config)})
    apply_expert_parallel(model, mesh.ep, capacity_factor=1.25)
    apply_histogram_qb(model, config)
    return model.train()


def test_no_host_sync_forward_backward(world1):
    model = _ep_moe(world1)
    h = torch.randn(2, 24, 64, requires_grad=True)
    with no_host_reads():
        y = model["moe"](h)
        y.square().mean().backward()
    assert h.grad is not None and model["moe"].experts.w1.grad is not None
    with pytest.raises(AssertionError, match="host sync"), no_host_reads():  # the guard does bite
        torch.ones(1).item()


def test_meta_device_forward_backward(world1, monkeypatch):
    model = _ep_moe(world1)
    monkeypatch.setattr(ep_mod, "all_to_all", lambda x, group: x)  # world of one: the identity
    moe = model["moe"].to_empty(device="meta")
    for name in ("w1", "w2", "w3"):  # plain meta parameters (a DTensor needs a real device mesh)
        setattr(moe.experts, name, torch.nn.Parameter(torch.empty(8, 32, 32, device="meta")))
    h = torch.randn(2, 24, 64, device="meta", requires_grad=True)
    y = moe(h)
    y.sum().backward()
    assert y.shape == (2, 24, 64) and h.grad.shape == h.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync debug mode needs a GPU")
def test_no_sync_cuda():
    import torch.distributed as dist

    from k3.parallel.mesh import ParallelDims, build_mesh

    if dist.is_initialized():
        pytest.skip("a CPU process group is already up in this process")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29591", rank=0, world_size=1)
    try:
        model = _ep_moe(build_mesh(ParallelDims(1, 1))).cuda()
        h = torch.randn(2, 256, 64, device="cuda", requires_grad=True)
        model["moe"](h).sum().backward()  # warm-up (lazy init may sync)
        torch.cuda.set_sync_debug_mode("error")
        try:
            model["moe"](h).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        dist.destroy_process_group()
