"""Per-Head Muon: agreement with torch.optim.Muon, per-head block structure, RMS, experts, bad inputs."""

import math

import pytest
import torch

from k3.optim.muon import Muon, muon_update, newton_schulz, orthogonalize, update_scale


def _rms(x: torch.Tensor) -> float:
    return x.pow(2).mean().sqrt().item()


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt, params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_when_per_head_off(nesterov):
    shapes = [(64, 32), (32, 96), (48, 48)]
    ours, ref = _params(shapes), _params(shapes)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5)
    opt_ref = torch.optim.Muon(ref, adjust_lr_fn="match_rms_adamw", **kw)
    # head_split is set but per_head=False must ignore it; bf16 iteration as torch does it.
    opt = Muon([{"params": ours, "head_split": (0, 4)}], per_head=False, ns_dtype=torch.bfloat16, **kw)
    _run(opt, ours, 4)
    _run(opt_ref, ref, 4)
    for p, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], opt_ref.state[r]["momentum_buffer"])


def test_fp32_iteration_close_to_torch_bf16():
    G = torch.randn(96, 40, generator=torch.Generator().manual_seed(3))
    ours = newton_schulz(G)
    ref = newton_schulz(G, dtype=torch.bfloat16)
    assert ours.dtype == torch.float32
    assert not torch.equal(ours, ref)  # the dtype argument is real
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-2)


def test_newton_schulz_batched_equals_loop_and_is_near_orthogonal():
    G = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(G)
    for i in range(3):
        torch.testing.assert_close(out[i], newton_schulz(G[i]), rtol=1e-5, atol=1e-6)
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.25
    # Scale invariance (the reason the EMA and sum momentum forms are equivalent).
    torch.testing.assert_close(newton_schulz(7.0 * G), out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("axis", [0, 1])
def test_per_head_equals_blockwise_newton_schulz(axis):
    H, shape = 4, ((4 * 12, 20) if axis == 0 else (20, 4 * 12))
    M = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    blocks = M.chunk(H, dim=axis)
    expected = torch.cat([newton_schulz(b) for b in blocks], dim=axis)
    out = orthogonalize(M, (axis, H))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, newton_schulz(M), atol=1e-2)  # differs from whole-matrix Muon


def test_3d_experts_orthogonalised_per_expert():
    W = torch.randn(5, 16, 24, generator=torch.Generator().manual_seed(6))
    out = orthogonalize(W)
    for e in range(5):
        torch.testing.assert_close(out[e], newton_schulz(W[e]), rtol=1e-5, atol=1e-6)
    out_split = orthogonalize(W, (0, 2))
    torch.testing.assert_close(out_split[3], orthogonalize(W[3], (0, 2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1])
def test_each_block_update_rms_near_target(axis):
    H = 8
    shape = (H * 32, 64) if axis == 0 else (64, H * 16)
    p = _params([shape])[0]
    before = p.detach().clone()
    opt = Muon([{"params": [p], "head_split": (axis, H)}], lr=1.0, weight_decay=0.0)
    _run(opt, [p], 1)
    delta = p.detach() - before
    assert update_scale(p.shape, (axis, H)) == pytest.approx(0.2 * math.sqrt(64))
    for block in delta.chunk(H, dim=axis):
        assert 0.14 < _rms(block) < 0.24


def test_rms_scale_by_matrix_uses_full_shape():
    shape, split = torch.Size([8 * 32, 64]), (0, 8)
    assert update_scale(shape, split, "matrix") == pytest.approx(0.2 * math.sqrt(256))
    assert update_scale(shape, split, "block") == pytest.approx(0.2 * math.sqrt(64))
    assert update_scale(torch.Size([4, 16, 24]), None, "matrix") == pytest.approx(0.2 * math.sqrt(24))
    with pytest.raises(ValueError, match="rms_scale_by"):
        update_scale(shape, split, "head")


def test_expert_param_step_and_weight_decay():
    p = _params([(3, 16, 24)])[0]
    before = p.detach().clone()
    opt = Muon([p], lr=0.1, weight_decay=0.5, momentum=0.0, nesterov=False)
    g = torch.randn(p.shape, generator=torch.Generator().manual_seed(7))
    p.grad = g.clone()
    opt.step()
    expected = before * (1 - 0.1 * 0.5) - 0.1 * 0.2 * math.sqrt(24) * newton_schulz(g)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


def test_muon_update_nesterov_and_plain():
    g, buf = torch.ones(2, 2), torch.full((2, 2), 2.0)
    out = muon_update(g, buf, 0.5, nesterov=True)
    torch.testing.assert_close(buf, torch.full((2, 2), 1.5))  # 0.5 * 2 + 0.5 * 1
    torch.testing.assert_close(out, torch.full((2, 2), 1.25))  # 0.5 * 1 + 0.5 * 1.5
    assert muon_update(g, buf, 0.5, nesterov=False) is buf


def test_head_split_must_divide():
    with pytest.raises(ValueError, match="head_split"):
        Muon([{"params": _params([(30, 8)]), "head_split": (0, 4)}])
    with pytest.raises(ValueError, match="head_split"):
        orthogonalize(torch.randn(8, 30), (1, 4))
    with pytest.raises(ValueError, match="axis"):
        orthogonalize(torch.randn(8, 8), (2, 4))
    opt = Muon(_params([(8, 8)]))
    with pytest.raises(ValueError, match="head_split"):
        opt.add_param_group({"params": _params([(8, 6)]), "head_split": (1, 4)})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("shape", [(16,), (2, 3, 4, 5), ()])
def test_non_matrix_params_rejected(shape):
    with pytest.raises(ValueError, match="AdamW"):
        Muon([torch.nn.Parameter(torch.randn(shape))])


def test_state_dict_roundtrip_keeps_head_split():
    p = _params([(16, 8)])[0]
    opt = Muon([{"params": [p], "head_split": (0, 2)}], lr=0.01)
    _run(opt, [p], 1)
    opt2 = Muon([{"params": [p], "head_split": None}], lr=0.01)
    opt2.load_state_dict(opt.state_dict())
    assert tuple(opt2.param_groups[0]["head_split"]) == (0, 2)
    torch.testing.assert_close(opt2.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_batched_step_equals_per_parameter_steps():
    """Muon.step stacks every block of one shape across parameters into one Newton-Schulz call; a
    subclass that overrides `_orthogonalize` (the distributed optimizer) steps parameter by parameter.
    Both give the same parameters after a few steps, for whole matrices, row and column head splits,
    3-D experts and shapes shared across groups."""
    from k3.optim.muon import orthogonalize_many

    class PerParam(Muon):
        def _orthogonalize(self, p, update, head_split, ns_kwargs):
            return orthogonalize(update, head_split, **ns_kwargs)

    g = torch.Generator().manual_seed(0)
    shapes = [(32, 24), (24, 32), (32, 24), (4, 16, 24), (64, 24)]
    params = [torch.randn(s, generator=g) for s in shapes]
    heads = [torch.randn(64, 24, generator=g), torch.randn(24, 64, generator=g)]
    runs = []
    for cls in (Muon, PerParam):
        ps = [p.clone().requires_grad_() for p in params]
        hs = [h.clone().requires_grad_() for h in heads]
        opt = cls(
            [
                {"params": ps},
                {"params": hs[:1], "head_split": (0, 2)},
                {"params": hs[1:], "head_split": (1, 2)},
            ],
            lr=0.02,
        )
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in (*ps, *hs):
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append([p.detach() for p in (*ps, *hs)])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the helper alone: blocks go back where they came from
    u = torch.randn(24, 64, generator=g)
    (got,) = orthogonalize_many([(u, (1, 4), {})])
    torch.testing.assert_close(got, orthogonalize(u, (1, 4)))
