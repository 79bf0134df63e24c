"""SiTU-GLU and SwiGLU (docs/spec.md#situ-glu): bound, β → ∞ limit, dtype handling, finite gradients; the
fused (exp-based, compiled) and native (C) SiTU against float64 and the reference."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops import glu, native
from k3.ops.glu import (
    fused_activations,
    glu_fn,
    situ_glu,
    situ_glu_fused,
    situ_glu_inplace,
    situ_glu_native,
    situ_glu_reference,
    swiglu,
)


@pytest.fixture
def no_native(monkeypatch):
    """The torch dispatch of a machine without a C compiler."""
    monkeypatch.setattr(native, "library", lambda name: None)


def _inputs(n=4096, scale=10.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype), (torch.randn(n, generator=g) * scale).to(dtype)


def test_situ_bounded():
    gate, up = _inputs(scale=10.0)
    assert situ_glu(gate, up).abs().max() < 4.0 * 25.0
    # far into saturation fp32 rounding can reach the bound itself, never pass it
    gate, up = _inputs(scale=1e4)
    out = situ_glu(gate, up)
    assert out.abs().max() <= 100.0 and out.abs().max() > 99.0
    assert situ_glu(gate, up, beta1=2.0, beta2=3.0).abs().max() <= 6.0


def test_situ_formula_and_unclipped_sigmoid():
    gate, up = _inputs(scale=6.0)
    want = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    torch.testing.assert_close(situ_glu(gate, up), want)
    # σ takes the un-clipped g: at g = 8, σ(8) differs from σ(4·tanh(2)) by ~1.6e-2
    g, u = torch.tensor([8.0]), torch.tensor([1.0])
    wrong = 4 * torch.tanh(g / 4) * torch.sigmoid(4 * torch.tanh(g / 4)) * 25 * torch.tanh(u / 25)
    assert (situ_glu(g, u) - wrong).abs().item() > 1e-2


def test_situ_tends_to_swiglu():
    gate, up = _inputs(scale=3.0)
    ref = F.silu(gate) * up
    errs = [(situ_glu(gate, up, beta, beta) - ref).abs().max().item() for beta in (10.0, 100.0, 1e4)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-4
    torch.testing.assert_close(swiglu(gate, up), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_situ_dtype_and_grad(dtype):
    gate, up = _inputs(scale=50.0, dtype=dtype)
    gate.requires_grad_(True)
    up.requires_grad_(True)
    out = situ_glu(gate, up)
    assert out.dtype == dtype
    ref = situ_glu_reference(gate.detach().float(), up.detach().float()).to(dtype)
    if dtype == torch.bfloat16:
        assert torch.equal(out.detach(), ref)  # computed in fp32, then one rounding
    else:  # fp32 with a gradient: the native training path, to fp32 rounding
        torch.testing.assert_close(out.detach(), ref, rtol=2e-6, atol=1e-30)
    out.float().pow(2).sum().backward()
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()
    assert gate.grad.abs().sum() > 0 and up.grad.abs().sum() > 0


def test_glu_fn():
    gate, up = _inputs(scale=3.0)
    torch.testing.assert_close(glu_fn("situ", 2.0, 5.0)(gate, up), situ_glu(gate, up, 2.0, 5.0))
    torch.testing.assert_close(glu_fn("silu")(gate, up), swiglu(gate, up))
    with pytest.raises(ValueError, match="hidden_act"):
        glu_fn("gelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_situ_inplace_equals_reference(dtype):
    gate, up = _inputs(scale=30.0, dtype=dtype, seed=1)
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), -float("inf")], dtype=dtype)
    gate, up = torch.cat([gate, edge, edge.flip(0)]), torch.cat([up, edge.flip(0), edge])
    g0, u0 = gate.clone(), up.clone()
    for betas in ((4.0, 25.0), (2.0, 3.0)):
        fast = situ_glu_inplace(gate, up, *betas)
        assert fast.dtype == dtype
        assert torch.equal(fast, situ_glu_reference(gate, up, *betas))  # same ops, same order
    assert torch.equal(gate, g0) and torch.equal(up, u0)  # the inputs are never written


def test_situ_dispatch_keeps_autograd(no_native):
    gate, up = _inputs(scale=5.0, seed=2)
    with torch.no_grad():
        assert torch.equal(situ_glu(gate, up), situ_glu_reference(gate, up))
    gate.requires_grad_(True)
    out = situ_glu(gate, up)  # the in-place chain would break autograd: the reference must be taken
    assert out.grad_fn is not None
    out.sum().backward()
    want = torch.autograd.grad(situ_glu_reference(gate, up).sum(), gate)[0]
    assert torch.equal(gate.grad, want)


def _situ_f64(gate, up, beta1=4.0, beta2=25.0):
    g, u = gate.double(), up.double()
    return beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * beta2 * torch.tanh(u / beta2)


EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-8, 0.29, 0.31, 1.2, 1.21, -1.2, 88.0, -88.0, 200.0, -200.0, 1e30, -1e30]


@pytest.mark.parametrize("betas", [(4.0, 25.0), (2.0, 3.0)], ids=["release", "other"])
def test_situ_fused_matches_float64_like_the_reference(betas):
    """situ_glu_fused (exp-based, series near 0) is as close to the float64 truth as the reference."""
    gate, up = _inputs(n=1 << 16, scale=6.0)
    truth = _situ_f64(gate, up, *betas)
    err = lambda out: ((out.double() - truth).abs() / truth.abs().clamp(min=1e-3)).max().item()  # noqa: E731
    assert err(situ_glu_fused(gate, up, *betas)) < max(2e-6, 2 * err(situ_glu_reference(gate, up, *betas)))
    edge = torch.tensor(EDGES + [float("inf"), float("-inf")])
    g, u = edge.repeat_interleave(len(edge)), edge.repeat(len(edge))  # every pair of edge values
    ref, got = situ_glu_reference(g, u, *betas), situ_glu_fused(g, u, *betas)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-30)


def test_fused_activations_compile_large_inputs_only(no_native):
    gate, up = _inputs(n=1 << 16, scale=6.0)
    small_g, small_u = gate[:100], up[:100]
    with torch.no_grad(), fused_activations():
        big = situ_glu(gate, up)  # compiled (first use builds it)
        small = situ_glu(small_g, small_u)
    assert glu._COMPILED and glu._COMPILED[0] is not None
    torch.testing.assert_close(big, situ_glu_reference(gate, up), rtol=2e-6, atol=1e-6)
    assert torch.equal(small, situ_glu_inplace(small_g, small_u))  # below FUSED_MIN_ELEMENTS: eager
    with torch.no_grad():
        assert torch.equal(situ_glu(gate, up), situ_glu_inplace(gate, up))  # outside the block: eager


def test_fused_activations_fall_back_when_compiling_fails(monkeypatch, no_native):
    def broken(*a):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(glu, "_COMPILED", [broken])
    gate, up = _inputs(n=1 << 16)
    with torch.no_grad(), fused_activations():
        with pytest.warns(UserWarning, match="fused SiTU disabled"):
            out = situ_glu(gate, up)
        assert not glu.fused_activations_enabled()
    assert torch.equal(out, situ_glu_inplace(gate, up))


@pytest.mark.parametrize("betas", [(4.0, 25.0), (2.0, 3.0)], ids=["release", "other"])
def test_situ_native_matches_float64_like_the_reference(betas):
    """The C kernel (exp polynomial, series near 0) is as close to the float64 truth as the reference,
    exact at the saturated limits, and what the no-grad dispatch takes when it is built."""
    gate, up = _inputs(n=1 << 16, scale=6.0)
    got = situ_glu_native(gate, up, *betas)
    if got is None:
        pytest.skip("no C compiler on this machine: the native kernel cannot be built")
    truth = _situ_f64(gate, up, *betas)
    err = lambda out: ((out.double() - truth).abs() / truth.abs().clamp(min=1e-3)).max().item()  # noqa: E731
    assert err(got) < max(2e-6, 2 * err(situ_glu_reference(gate, up, *betas)))
    edge = torch.tensor(EDGES + [float("inf"), float("-inf")])
    g, u = edge.repeat_interleave(len(edge)), edge.repeat(len(edge))
    ref, got = situ_glu_reference(g, u, *betas), situ_glu_native(g, u, *betas)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-30)
    with torch.no_grad():
        assert torch.equal(situ_glu(gate, up, *betas), situ_glu_native(gate, up, *betas))


@pytest.mark.parametrize("betas", [(4.0, 25.0), (2.0, 3.0)], ids=["release", "other"])
def test_situ_native_relative_accuracy_where_factors_are_small(betas):
    """Relative error against float64 with no floor, where each factor is tiny: σ(g) for g in [-80, -5]
    (exp(-|g|) must not come from 1 + expm1, which cancels there), tanh near 0 for |g|, |u| down to 1e-30
    (expm1, not 1 - exp), and both at once."""
    g = torch.Generator().manual_seed(5)
    n = 1 << 14
    neg = -torch.empty(n).uniform_(5.0, 80.0, generator=g)
    tiny = torch.logspace(-30, -1, n) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    mid = torch.randn(n, generator=g) * 3
    gate, up = torch.cat([neg, tiny, neg, mid]), torch.cat([mid, mid, tiny, tiny])
    got = situ_glu_native(gate, up, *betas)
    if got is None:
        pytest.skip("no C compiler on this machine: the native kernel cannot be built")
    truth = _situ_f64(gate, up, *betas)
    ok = truth.abs() > 1e-36  # keep float32-normal results (fp32 cannot hold the rest relatively)
    rel = ((got.double() - truth).abs() / truth.abs())[ok]
    assert ok.sum() > 3 * n and rel.max().item() < 1e-6


def test_situ_native_declines_what_it_cannot_take():
    gate, up = _inputs(n=64)
    assert situ_glu_native(gate.bfloat16(), up.bfloat16()) is None
    assert situ_glu_native(gate.view(8, 8).t(), up.view(8, 8).t()) is None  # not contiguous
    assert situ_glu_native(gate, up[:32]) is None
    with torch.no_grad():  # the dispatch then takes the torch path
        assert torch.equal(
            situ_glu(gate.bfloat16(), up.bfloat16()), situ_glu_inplace(gate.bfloat16(), up.bfloat16())
        )


def _grads(fn, gate, up, dout):
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    out = fn(g, u)
    return (out, *torch.autograd.grad(out, (g, u), dout.to(out.dtype)))


@pytest.mark.parametrize("betas", [(4.0, 25.0), (2.0, 3.0)], ids=["release", "other"])
def test_situ_train_forward_and_backward_match_float64_like_the_reference(betas):
    """The training path (native forward and backward) against float64 autograd: values and both
    gradients as close to the truth as the fp32 reference's, finite at the edges, and what `situ_glu`
    takes when a gradient is needed."""
    gate, up = _inputs(n=1 << 16, scale=6.0, seed=3)
    dout = torch.randn(gate.shape, generator=torch.Generator().manual_seed(4))
    if glu.situ_glu_train(gate.clone().requires_grad_(True), up, *betas) is None:
        pytest.skip("no C compiler on this machine: the native kernel cannot be built")
    truth = _grads(lambda g, u: _situ_f64(g, u, *betas), gate.double(), up.double(), dout)
    ref = _grads(lambda g, u: situ_glu_reference(g, u, *betas), gate, up, dout)
    got = _grads(lambda g, u: glu.situ_glu_train(g, u, *betas), gate, up, dout)
    for name, a, r, t in zip(("out", "dgate", "dup"), got, ref, truth, strict=True):
        err = lambda x, t=t: ((x.double() - t).abs().max() / t.abs().max()).item()  # noqa: E731
        assert err(a) < max(1e-6, 2 * err(r)), name
    edge = torch.tensor(EDGES)
    g, u = edge.repeat_interleave(len(edge)), edge.repeat(len(edge))
    d = torch.ones_like(g)
    for a, r in zip(_grads(lambda x, y: glu.situ_glu_train(x, y, *betas), g, u, d),
                    _grads(lambda x, y: situ_glu_reference(x, y, *betas), g, u, d), strict=True):  # fmt: skip
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, rtol=2e-6, atol=1e-6)
    g1 = gate.clone().requires_grad_(True)
    out = situ_glu(g1, up, *betas)
    assert out.grad_fn is not None and "SituGLU" in type(out.grad_fn).__name__


def test_situ_train_declines_what_it_cannot_take():
    gate, up = _inputs(n=64)
    gate.requires_grad_(True)
    assert glu.situ_glu_train(gate.bfloat16(), up.bfloat16()) is None
    assert glu.situ_glu_train(gate, up[:32]) is None
    assert glu.situ_glu_train(gate.view(8, 8).t(), up.view(8, 8).t()) is None
