"""KDA gate, short conv (fast paths vs the loop reference, forward and backward), RMSNorm, gated RMSNorm."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3.ops.conv import causal_conv1d, causal_conv1d_reference, causal_conv1d_train, causal_conv1d_update
from k3.ops.gate import kda_gate
from k3.ops.gated_norm import gated_rms_norm, gated_rms_norm_reference
from k3.ops.norm import rms_norm, rms_norm_reference, rms_norm_train


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, rtol: float) -> None:
    """Max-abs error relative to the reference's max magnitude, reported with the tensor name."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    ref, got = ref.double(), got.double()
    err = (ref - got).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-12)
    assert rel <= rtol, (
        f"{name}: rel err {rel:.3e} > {rtol:.1e} (max abs {err:.3e}, mean {(ref - got).abs().mean():.3e})"
    )


# ---- gate ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, None], ids=lambda lb: f"lb{lb}")
def test_gate_matches_per_element_formula(lower_bound):
    torch.manual_seed(0)
    B, T, H, K = 2, 3, 2, 4
    z, A_log, dt_bias = torch.randn(B, T, H, K) * 3, torch.randn(H), torch.randn(H * K)
    g = kda_gate(z, A_log, dt_bias, lower_bound)
    assert g.dtype == torch.float32 and g.shape == (B, T, H, K)
    for b, t, h, c in [(0, 0, 0, 0), (1, 2, 1, 3), (0, 1, 1, 2), (1, 0, 0, 1)]:
        x = z[b, t, h, c].item() + dt_bias[h * K + c].item()
        a = math.exp(A_log[h].item())
        if lower_bound is not None:
            want = lower_bound / (1 + math.exp(-a * x))
        else:
            want = -a * (x if x > 20 else math.log1p(math.exp(x)))
        assert abs(g[b, t, h, c].item() - want) <= 1e-5 * max(1.0, abs(want))


def test_gate_lower_bound_respected_and_bf16_input():
    torch.manual_seed(0)
    z = (torch.randn(2, 16, 3, 8) * 2).bfloat16()
    g = kda_gate(z, torch.rand(3) * 0.5, torch.randn(24), -5.0)
    assert g.dtype == torch.float32
    assert bool((g > -5.0).all() and (g < 0).all()) and g.min() < -2.5 and g.max() > -2.5
    g_sat = kda_gate(
        z * 100, torch.randn(3), torch.randn(24), -5.0
    )  # fp32 saturates onto the bounds at worst
    assert bool((g_sat >= -5.0).all() and (g_sat <= 0).all())
    g_kimi = kda_gate(z, torch.zeros(3), torch.zeros(24), None)
    assert bool((g_kimi <= 0).all()) and g_kimi.min() < -5.0  # the unbounded form can go below -5


def test_gate_bad_shapes():
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(torch.zeros(1, 1, 2, 4), torch.zeros(128), torch.zeros(8), -5.0)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(torch.zeros(1, 1, 2, 4), torch.zeros(2), torch.zeros(4), -5.0)


# ---- conv ---------------------------------------------------------------------------------------------
def _conv_inputs(B, T, C, W, with_state, dtype=torch.float32):
    u = torch.randn(B, T, C, dtype=dtype, requires_grad=True)
    w = torch.randn(C, 1, W, requires_grad=True)
    s = torch.randn(B, C, W - 1, dtype=dtype, requires_grad=True) if with_state else None
    return u, w, s


@pytest.mark.parametrize("B,T,C,W,with_state", [(2, 7, 6, 4, False), (1, 2, 5, 4, True), (3, 9, 4, 3, True),
                                                (2, 5, 4, 1, False)],
                         ids=lambda v: str(v))  # fmt: skip
def test_conv_fast_equals_ref_fwd_bwd(B, T, C, W, with_state):
    torch.manual_seed(0)
    u, w, s = _conv_inputs(B, T, C, W, with_state)
    y, fin = causal_conv1d(u, w, s)
    y_r, fin_r = causal_conv1d_reference(u, w, s)
    assert y.shape == (B, T, C) and fin.shape == (B, C, W - 1)
    assert_close("y", y_r, y, 1e-6)
    assert_close("final_state", fin_r, fin, 0)
    dy = torch.randn_like(y)
    grads = [torch.autograd.grad((out * dy).sum(), [t for t in (u, w, s) if t is not None])
             for out in (y, y_r)]  # fmt: skip
    for name, g, g_r in zip(("du", "dw", "ds"), grads[0], grads[1], strict=False):
        assert_close(name, g_r, g, 1e-5)


def test_conv_matches_definition():
    """y[t, c] = SiLU(sum_j w[c, 0, j] u[t-W+1+j, c]), zeros before the start; W-1 is the current token."""
    torch.manual_seed(0)
    u, w = torch.randn(1, 5, 3), torch.randn(3, 1, 4)
    y, fin = causal_conv1d(u, w)
    t, c = 4, 2
    want = F.silu(sum(w[c, 0, j] * u[0, t - 3 + j, c] for j in range(4)))
    assert torch.allclose(y[0, t, c], want, atol=1e-6)
    assert torch.allclose(y[0, 0, c], F.silu(w[c, 0, 3] * u[0, 0, c]), atol=1e-6)
    assert torch.equal(fin[0], u[0, 2:].T)
    _, fin_short = causal_conv1d(u[:, :2], w)  # shorter than W-1: zero-padded on the left
    assert torch.equal(fin_short[0, :, 0], torch.zeros(3)) and torch.equal(fin_short[0, :, 1:], u[0, :2].T)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-hist", "init-state"])
def test_conv_varlen_equals_per_doc(with_state):
    torch.manual_seed(0)
    lens, C, W = [3, 1, 6, 2], 5, 4
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    u = torch.randn(1, sum(lens), C, requires_grad=True)
    w = torch.randn(C, 1, W, requires_grad=True)
    s = torch.randn(len(lens), C, W - 1, requires_grad=True) if with_state else None
    y, fin = causal_conv1d(u, w, s, cu_seqlens=cu)
    y_r, fin_r = causal_conv1d_reference(u, w, s, cu_seqlens=cu)
    assert fin.shape == (len(lens), C, W - 1)
    assert_close("y vs ref", y_r, y, 1e-6)
    assert_close("final vs ref", fin_r, fin, 0)
    for n in range(len(lens)):
        a, b = cu[n].item(), cu[n + 1].item()
        y_n, fin_n = causal_conv1d(u[:, a:b], w, None if s is None else s[n : n + 1])
        assert_close(f"doc {n} y", y_n, y[:, a:b], 1e-6)
        assert_close(f"doc {n} final", fin_n[0], fin[n], 0)
    dy = torch.randn_like(y)
    params = [t for t in (u, w, s) if t is not None]
    g = torch.autograd.grad((y * dy).sum(), params)
    g_r = torch.autograd.grad((y_r * dy).sum(), params)
    for name, a, b in zip(("du", "dw", "ds"), g_r, g, strict=False):
        assert_close(name, a, b, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_update_steps_equal_full_conv(dtype):
    torch.manual_seed(0)
    B, T, C, W = 2, 6, 4, 4
    u, w = torch.randn(B, T, C, dtype=dtype), torch.randn(C, 1, W)
    y_full, fin_full = causal_conv1d(u, w)
    y_pre, state = causal_conv1d(u[:, :2], w)  # prefill 2, then step token by token
    steps = [y_pre]
    for t in range(2, T):
        y_t, state = causal_conv1d_update(u[:, t : t + 1], w, state)
        assert y_t.shape == (B, 1, C) and state.dtype == dtype
        steps.append(y_t)
    y_2d, _ = causal_conv1d_update(u[:, T - 1], w, _prev_state(u, w, T - 1))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close("steps", y_full, torch.cat(steps, 1), tol)
    assert_close("2-d step", y_full[:, -1], y_2d, tol)
    assert torch.equal(state, fin_full)


def _prev_state(u, w, t):
    return causal_conv1d(u[:, :t], w)[1]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("packed", [True, False], ids=["docs", "rows"])
def test_conv_train_path_equals_reference_fwd_bwd(packed, threads):
    """The training path (native forward and backward over packed documents) against the per-token
    reference: y, the final states and du, dw (the weight's gradient summed over a thread team), with
    enough tokens to split over the team."""
    torch.manual_seed(1)
    C, W = 24, 4
    lens = [1, 3, 70, 2, 130, 50] if packed else [128, 128]
    u = torch.randn(1 if packed else 2, sum(lens) if packed else 128, C, requires_grad=True)
    w = torch.randn(C, 1, W, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if packed else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = causal_conv1d_train(u, w, cu)
        assert got is not None, "the native training path did not take fp32 inputs with a gradient"
        ref = causal_conv1d_reference(u, w, None, cu)
        dy, df = torch.randn_like(ref[0]), torch.randn_like(ref[1])
        grads = [torch.autograd.grad((y * dy).sum() + (f * df).sum(), (u, w)) for y, f in (got, ref)]
    finally:
        torch.set_num_threads(before)
    assert_close("y", ref[0], got[0], 1e-6)
    assert_close("final", ref[1], got[1], 0)
    for name, g, g_r in zip(("du", "dw"), *grads, strict=True):
        assert_close(name, g_r, g, 1e-5)
    with torch.no_grad():
        assert causal_conv1d_train(u, w, cu) is None  # no gradient: the inference kernels' job


def test_conv_bad_inputs():
    u, w = torch.zeros(2, 4, 3), torch.zeros(3, 1, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(u, w, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(u, w, torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(u, torch.zeros(4, 1, 4))


# ---- gated norm ---------------------------------------------------------------------------------------
def test_gated_rms_norm_normalize_then_gate():
    torch.manual_seed(0)
    o, gate, w = torch.randn(2, 3, 2, 8) * 4, torch.randn(2, 3, 2, 8), torch.rand(8) + 0.5
    y = gated_rms_norm(o, gate, w, 1e-5)
    rms = o.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    assert_close("gated norm", o / rms * w * torch.sigmoid(gate), y, 1e-6)
    # gating happens after the norm: scaling the gate changes y, scaling o does not
    assert_close("scale invariance", y, gated_rms_norm(o * 7.0, gate, w, 1e-5), 1e-5)
    yb = gated_rms_norm(o.bfloat16(), gate.bfloat16(), w, 1e-5)
    assert yb.dtype == torch.bfloat16
    assert_close("bf16", y, yb, 1e-2)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(o, gate, torch.ones(4), 1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shape", [(3, 5, 20), (70, 3, 300), (2, 4, 2, 128)], ids=lambda v: str(v))
def test_native_norms_equal_the_references(shape, threads):
    """Without autograd on fp32 both norms run as one native pass per row (k3/ops/csrc/rms_norm.c): each
    equals its torch reference to fp32 rounding, for rows not a multiple of 8, calls large enough to split
    their rows over a team (the same bits on 1 and 3 threads), no weight, a strided input, and large or
    tiny magnitudes; with autograd (the native training path) gradients match the reference's."""
    from k3.ops import native

    if native.library("rms_norm") is None:
        pytest.skip("no C compiler: the native kernels cannot be built")
    g = torch.Generator().manual_seed(0)
    D = shape[-1]
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[0]).view(-1, *[1] * (len(shape) - 1))
    gate, w = torch.randn(*shape, generator=g) * 6, torch.rand(D, generator=g) + 0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = [rms_norm(x, w, 1e-5), rms_norm(x, None, 1e-6), gated_rms_norm(x, gate, w, 1e-5)]
            want = [rms_norm_reference(x, w, 1e-5), rms_norm_reference(x, None, 1e-6)]
            want.append(gated_rms_norm_reference(x, gate, w, 1e-5))
            strided = rms_norm(x.transpose(0, 1), w, 1e-5)
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("rms", "rms, no weight", "gated"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6 * b.abs().max().item(), msg=name)
    torch.testing.assert_close(strided, rms_norm_reference(x.transpose(0, 1), w, 1e-5), rtol=2e-6, atol=1e-5)
    if threads == 3:  # the rows are independent: a team gives the one-thread bits
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                assert torch.equal(rms_norm(x, w, 1e-5), got[0])
                assert torch.equal(gated_rms_norm(x, gate, w, 1e-5), got[2])
        finally:
            torch.set_num_threads(before)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    for fast, ref in ((lambda a, b: rms_norm(a, b, 1e-5), lambda a, b: rms_norm_reference(a, b, 1e-5)),
                      (lambda a, b: gated_rms_norm(a, gate, b, 1e-5),
                       lambda a, b: gated_rms_norm_reference(a, gate, b, 1e-5))):  # fmt: skip
        ga = torch.autograd.grad(fast(xg, wg).square().sum(), [xg, wg])
        gb = torch.autograd.grad(ref(xg, wg).square().sum(), [xg, wg])
        for a, b in zip(ga, gb, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


# ---- native passes (k3/ops/csrc/kda_pointwise.c) --------------------------------------------------------
@pytest.mark.parametrize(
    "B,T,C,W,with_state",
    [(2, 40, 20, 4, True), (1, 2, 13, 4, True), (2, 9, 16, 4, False), (1, 6, 8, 1, False)],
    ids=lambda v: str(v),
)
def test_native_pointwise_equal_the_torch_paths(monkeypatch, B, T, C, W, with_state):
    """Without autograd on fp32 the conv + SiLU and the safe gate run as native passes: each equals its
    torch path (native.kernel_may_run patched off), incl. T < W-1 with a history, C not a multiple of 8,
    W = 1; the final conv state is the same tensor values."""
    from k3.ops import native

    if native.library("kda_pointwise") is None:
        pytest.skip("no C compiler: the native kernels cannot be built")
    g = torch.Generator().manual_seed(0)
    u, w = torch.randn(B, T, C, generator=g) * 3, torch.randn(C, 1, W, generator=g)
    s = torch.randn(B, C, W - 1, generator=g) if with_state else None
    H, K = 2, C // 2
    z, A_log, dt_bias = (
        torch.randn(B, T, H, K, generator=g) * 4,
        torch.randn(H, generator=g),
        torch.randn(H * K),
    )
    with torch.no_grad():
        fast = (*causal_conv1d(u, w, s), kda_gate(z, A_log, dt_bias, -5.0))
        monkeypatch.setattr(native, "kernel_may_run", lambda *t: False)
        ref = (*causal_conv1d(u, w, s), kda_gate(z, A_log, dt_bias, -5.0))
    for name, a, b in zip(("conv y", "conv final state", "gate"), fast, ref, strict=True):
        assert_close(name, b, a, 0 if name == "conv final state" else 1e-6)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kind", ["weight", "no-weight", "gated"])
def test_norm_train_path_matches_float64_reference_fwd_bwd(kind, threads):
    """The training path of both norms (native forward and backward, fp32 with a gradient) against the
    references in float64: values and the gradients of x, the gate and the weight (summed over rows by a
    thread team), on rows of very different scales and D not a multiple of 8."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 3, 300, generator=g) * torch.logspace(-2, 2, 70)[:, None, None]
    gate = torch.randn(x.shape, generator=g) * 4 if kind == "gated" else None
    w = None if kind == "no-weight" else torch.randn(300, generator=g)
    leaves = [t.requires_grad_() for t in (x, gate, w) if t is not None]
    dy = torch.randn(x.shape, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = rms_norm_train(x, gate, w, 1e-5)
        if got is None:
            pytest.skip("no C compiler: the native kernel cannot be built")
        fast = gated_rms_norm(x, gate, w, 1e-5) if kind == "gated" else rms_norm(x, w, 1e-5)
        assert torch.equal(fast, got)  # what the fast paths take with a gradient
        got_g = torch.autograd.grad(got, leaves, dy)
    finally:
        torch.set_num_threads(before)
    d = [t.detach().double().requires_grad_() for t in leaves]
    ref = (
        gated_rms_norm_reference(*d, 1e-5)
        if kind == "gated"
        else rms_norm_reference(d[0], d[1] if w is not None else None, 1e-5)
    )
    ref_g = torch.autograd.grad(ref, d, dy.double())
    assert_close("y", ref, got, 1e-6)
    for name, r, a in zip(("dx", "dgate" if kind == "gated" else "dw", "dw"), ref_g, got_g, strict=False):
        assert_close(name, r, a, 1e-5)
