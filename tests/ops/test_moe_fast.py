"""MoE inference fast paths (experts_active, experts_native, experts_padded, experts_gathered,
experts_auto) against experts_reference."""

import pytest
import torch

from k3.ops import moe, native
from k3.ops.glu import glu_fn, situ_glu, swiglu
from k3.ops.moe import (
    experts_active,
    experts_auto,
    experts_gathered,
    experts_grouped,
    experts_native,
    experts_padded,
    experts_reference,
)


def _case(T, k, E=8, I=16, Dl=12, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(*s, generator=g) * 0.5 for s in ((E, I, Dl), (E, Dl, I), (E, I, Dl))]
    z = torch.randn(T, Dl, generator=g)
    weights = torch.rand(T, k, generator=g)
    if skew:  # every token picks expert 0 first: a very uneven load
        idx = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(E - 1, generator=g)[: k - 1] + 1])
                           for _ in range(T)])  # fmt: skip
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return z, weights, idx, w


@pytest.mark.parametrize("fn", [experts_active, experts_padded, experts_gathered, experts_auto])
@pytest.mark.parametrize(
    ("T", "k", "skew"), [(1, 2, False), (1, 8, False), (5, 3, False), (64, 2, False), (33, 2, True)]
)
def test_fast_experts_match_naive_forward_backward(fn, T, k, skew):
    z, weights, idx, w = _case(T, k, skew=skew)
    leaves = [t.requires_grad_() for t in (z, weights, *w)]
    ref = experts_reference(z, weights, idx, *w, situ_glu)
    got = fn(z, weights, idx, *w, situ_glu)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(ref)
    want = torch.autograd.grad(ref, leaves, gy)
    have = torch.autograd.grad(got, leaves, gy)
    for name, a, b in zip(("z", "weights", "w1", "w2", "w3"), have, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_fast_experts_bf16_and_repeated_experts():
    z, weights, idx, w = _case(4, 3)
    idx[:, 1] = idx[:, 0]  # a token may name an expert twice: both slots count
    ref = experts_reference(z, weights, idx, *w, swiglu)
    for fn in (experts_active, experts_padded):
        torch.testing.assert_close(fn(z, weights, idx, *w, swiglu), ref, rtol=1e-5, atol=1e-5)
        zb, wb = z.bfloat16(), [t.bfloat16() for t in w]
        out = fn(zb, weights, idx, *wb, swiglu)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), experts_reference(zb, weights, idx, *wb, swiglu).float(),
                                   rtol=2e-2, atol=2e-2)  # fmt: skip


def test_auto_dispatch(monkeypatch):
    """Without the native kernel (its own test below): grouped with autograd or many slots, else active."""
    monkeypatch.setattr(moe, "experts_native", lambda *a: None)
    calls = []
    for name in ("experts_grouped", "experts_active"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    monkeypatch.setattr(moe, "ACTIVE_MAX_ELEMENTS", 64 * 2 * 16 - 1)  # just below T·k·I of a 64-token case
    z, weights, idx, w = _case(64, 2)
    with torch.no_grad():
        moe.experts_auto(z, weights, idx, *w, situ_glu)  # too many slots for one GLU call
        moe.experts_auto(z[:63], weights[:63], idx[:63], *w, situ_glu)  # a short prefill chunk
        moe.experts_auto(*_case(1, 2)[:3], *w, situ_glu)  # decode
    moe.experts_auto(*_case(1, 2)[:3], *[t.requires_grad_() for t in w], situ_glu)  # training
    assert calls == ["experts_grouped", "experts_active", "experts_active", "experts_grouped"]


def test_fast_experts_validate_shapes():
    z, weights, idx, w = _case(3, 2)
    for fn in (experts_active, experts_padded, experts_auto):
        with pytest.raises(ValueError, match="weights"):
            fn(z, weights, idx[:-1], *w, situ_glu)
        with pytest.raises(ValueError, match="w1"):
            fn(z, weights, idx, w[1], w[1], w[2], situ_glu)
    # two different matmul groupings: equal up to fp32 rounding, not bit for bit (the kernel blocking
    # depends on the row count and on how many threads are free)
    torch.testing.assert_close(
        experts_grouped(z, weights, idx, *w, situ_glu),
        experts_active(z, weights, idx, *w, situ_glu),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("T", [1, 7])
def test_latent_moe_inference_matches_training_path(T):
    from k3.config import preset
    from k3.model.moe import LatentMoE

    torch.manual_seed(3)
    layer = LatentMoE(preset("k3-nano")).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    h = torch.randn(1, T, layer.gate.weight.shape[1])
    ref = layer(h)  # grad enabled: grouped experts and the plain RMSNorm
    layer.experts.impl = "reference"
    with torch.no_grad():
        naive = layer(h)
    layer.experts.impl = "auto"
    with torch.no_grad():
        fast = layer(h)  # experts_active and the fused norm
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-5)


def test_auto_takes_the_gathered_path_while_compiling(monkeypatch):
    """Under torch.compile tracing, experts_auto must not read the indices on the host."""
    z, weights, idx, w = _case(1, 2)
    calls = []
    monkeypatch.setattr(moe.torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(moe, "experts_active", lambda *a: calls.append("active"))
    got = experts_auto(z, weights, idx, *w, situ_glu)
    assert not calls
    torch.testing.assert_close(got, experts_reference(z, weights, idx, *w, situ_glu), rtol=1e-5, atol=1e-5)


def _native_or_skip():
    if native.library("moe_experts") is None or native.blas_sgemm() is None:
        pytest.skip("no C compiler or no BLAS sgemm_ exported by torch: experts_native cannot run")


@pytest.mark.parametrize("act", ["situ", "situ-b8", "silu"])
@pytest.mark.parametrize(
    ("T", "k", "skew"), [(1, 2, False), (5, 3, False), (64, 2, False), (33, 4, True), (160, 2, False)]
)
@pytest.mark.parametrize(("Dl", "I"), [(20, 24), (32, 48)])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_experts_match_naive(act, T, k, skew, Dl, I, threads):
    """One C call per layer (gather, products, GLU, weighted scatter-add) == the reference, for SiTU with
    the release betas and others, SwiGLU, decode, uneven loads and experts without tokens, dims that are
    and are not multiples of 16; on one thread and on a team of three, each with its share of the
    experts and its own partial sums."""
    _native_or_skip()
    fn = {"situ": situ_glu, "situ-b8": glu_fn("situ", 8.0, 10.0), "silu": swiglu}[act]
    z, weights, idx, w = _case(T, k, E=8, I=I, Dl=Dl, skew=skew)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = experts_native(z, weights, idx, *w, fn)
    finally:
        torch.set_num_threads(before)
    with torch.no_grad():
        ref = experts_reference(z.double(), weights.double(), idx, *[t.double() for t in w], fn)
    assert got is not None and got.dtype == torch.float32 and got.shape == z.shape
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5)


def test_native_experts_decline_what_they_cannot_run():
    """None (the caller's torch path) for autograd, other dtypes, strided weights, unknown activations."""
    _native_or_skip()
    z, weights, idx, w = _case(6, 2)
    assert experts_native(z, weights, idx, *w, lambda g, u: g * u) is None
    assert experts_native(z.double(), weights, idx, *[t.double() for t in w], situ_glu) is None
    assert experts_native(z, weights, idx, w[0].mT.contiguous().mT, w[1], w[2], situ_glu) is None
    assert experts_native(z, weights, idx, w[0].clone().requires_grad_(), w[1], w[2], situ_glu) is None
    assert experts_native(z, weights.requires_grad_(), idx, *w, situ_glu) is None
    with pytest.raises(ValueError, match="w1"):
        experts_native(z, weights, idx, w[1], w[1], w[2], situ_glu)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 8\)"):
        experts_native(z, weights.detach(), idx + 7, *w, situ_glu)


def test_auto_takes_the_native_path_without_autograd(monkeypatch):
    _native_or_skip()
    calls = []
    real = moe.experts_native
    monkeypatch.setattr(moe, "experts_native", lambda *a: calls.append("native") or real(*a))
    z, weights, idx, w = _case(64, 2)
    with torch.no_grad():
        got = experts_auto(z, weights, idx, *w, situ_glu)
    assert calls == ["native"]
    torch.testing.assert_close(got, experts_reference(z, weights, idx, *w, situ_glu), rtol=1e-5, atol=1e-5)
