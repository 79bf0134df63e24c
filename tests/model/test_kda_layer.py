"""KimiDeltaAttention layer: checkpoint names, state carrying (prefill/decode/chunks), packing, causality."""

import dataclasses

import pytest
import torch
from torch import nn

from k3.config import preset
from k3.model.kda import KimiDeltaAttention
from k3.model.layers import Linear
from k3.model.state import KDAState, ModelState


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, rtol: float) -> None:
    """Max-abs error relative to the reference's max magnitude, reported with the tensor name."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    ref, got = ref.double(), got.double()
    err = (ref - got).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-12)
    assert rel <= rtol, (
        f"{name}: rel err {rel:.3e} > {rtol:.1e} (max abs {err:.3e}, mean {(ref - got).abs().mean():.3e})"
    )


CFG = preset("k3-nano")  # D=64, KDA H=2, K=V=32, conv W=4, safe gate lb=-5


def build(config=CFG, seed=0, dtype=None) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(config, layer_idx=0, dtype=dtype)
    for m in layer.modules():  # unit-scale projections so every path matters numerically
        if isinstance(m, Linear):
            nn.init.normal_(m.weight, 0.0, m.in_features**-0.5)
    return layer


def inputs(B, T, seed=1, dtype=torch.float32):
    return torch.randn(B, T, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_parameter_names_shapes_dtypes():
    layer = build(dtype=torch.bfloat16)
    sd = {k: (tuple(v.shape), v.dtype) for k, v in layer.state_dict().items()}
    HK, D, K, H = 64, 64, 32, 2
    f32, bf = torch.float32, torch.bfloat16
    assert sd == {
        "q_proj.weight": ((HK, D), bf), "k_proj.weight": ((HK, D), bf), "v_proj.weight": ((HK, D), bf),
        "q_conv1d.weight": ((HK, 1, 4), f32), "k_conv1d.weight": ((HK, 1, 4), f32),
        "v_conv1d.weight": ((HK, 1, 4), f32),
        "f_a_proj.weight": ((K, D), bf), "f_b_proj.weight": ((HK, K), bf),
        "dt_bias": ((HK,), f32), "A_log": ((H,), f32), "b_proj.weight": ((H, D), bf),
        "g_proj.weight": ((HK, D), bf), "o_norm.weight": ((K,), f32), "o_proj.weight": ((D, HK), bf),
    }  # fmt: skip


def test_full_size_parameter_count_on_meta():
    layer = KimiDeltaAttention(preset("k3-full"), layer_idx=0, device="meta")
    assert sum(p.numel() for p in layer.parameters()) == 443_740_384  # docs/spec.md#parameter-counts


def test_reset_parameters_ranges():
    layer = build()
    assert bool(((layer.A_log.exp() >= 1) & (layer.A_log.exp() <= 16)).all())
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert bool(((dt >= 1e-4 * 0.999) & (dt <= 0.1 * 1.001)).all())
    assert bool((layer.q_conv1d.weight.abs() <= 0.5).all()) and torch.equal(
        layer.o_norm.weight, torch.ones(32)
    )


@pytest.mark.parametrize("T", [13, 70], ids=["T13-recurrent-prefill", "T70-chunk-prefill"])
def test_prefill_then_decode_equals_full_forward(T):
    layer = build()
    x = inputs(2, T + 2)
    with torch.no_grad():
        full = layer(x)
        state = KDAState()
        pre = layer(x[:, :T], state=state)
        assert state.recurrent.dtype == torch.float32 and state.recurrent.shape == (2, 2, 32, 32)
        assert state.conv_q.shape == (2, 64, 3)
        steps = [layer(x[:, t : t + 1], state=state) for t in (T, T + 1)]
    assert_close("prefill", full[:, :T], pre, 1e-5)
    assert_close("decode", full[:, T:], torch.cat(steps, 1), 1e-5)


def test_chunked_prefill_equals_one_pass():
    layer = build()
    x = inputs(1, 150)
    with torch.no_grad():
        full = layer(x)
        state = KDAState.zeros(CFG, 1, dtype=torch.float32)  # allocated zeros == the empty state
        parts = [layer(x[:, a:b], state=state) for a, b in [(0, 30), (30, 130), (130, 150)]]
    assert_close("chunked prefill", full, torch.cat(parts, 1), 1e-5)


@pytest.mark.parametrize(
    "capture, primed",
    [([70, -1, 140], True), ([2, 1, -1], True), ([1, -1, 2], False)],
    ids=["chunked-then-recurrent", "inside-the-conv-history", "no-history"],
)
def test_capture_gives_the_state_after_p_tokens_per_row(capture, primed):
    """capture_at [B]: each row's `captured` state equals a forward over its first p tokens alone, rows
    without one hold their final state there, and the outputs and final states match the call without
    a capture. Row 2 of the first case runs the chunked kernel, then the recurrence for its last 10
    tokens; captures before W-1 tokens take part of their conv state from the earlier history (or the
    zeros of a fresh state)."""
    fields = ("conv_q", "conv_k", "conv_v", "recurrent")
    layer = build()
    B, T = 3, 150
    x, hist = inputs(B, T), inputs(B, 7, seed=2)
    with torch.no_grad():
        start = KDAState()
        if primed:
            layer(hist, state=start)
        state, plain = dataclasses.replace(start, capture_at=capture), dataclasses.replace(start)
        assert_close("output", layer(x, state=plain), layer(x, state=state), 1e-5)
        assert state.capture_at is None  # one call only
        for f in fields:
            assert_close(f, getattr(plain, f), getattr(state, f), 1e-5)
            row = capture.index(-1)
            assert torch.equal(getattr(state.captured, f)[row], getattr(state, f)[row])  # no capture: final
        for b in (r for r in range(B) if capture[r] > 0):
            alone = KDAState(
                *(None if getattr(start, f) is None else getattr(start, f)[b : b + 1] for f in fields)
            )
            layer(x[b : b + 1, : capture[b]], state=alone)
            for f in fields:
                assert_close(f"row {b} {f}", getattr(alone, f)[0], getattr(state.captured, f)[b], 1e-6)
    with pytest.raises(ValueError, match="capture_at"):
        layer(x, state=dataclasses.replace(start, capture_at=[T, -1, -1]))


@pytest.mark.parametrize("keep", [0, 1, 20])
def test_keep_outputs_the_last_positions_and_the_same_state(keep):
    """keep (a model's last layer): y [B, keep, D] == the full call's last positions, and the state
    after it is bit-identical to the full call's (the recurrence still runs over every token)."""
    fields = ("conv_q", "conv_k", "conv_v", "recurrent")
    layer = build()
    x, hist = inputs(2, 90), inputs(2, 5, seed=2)
    with torch.no_grad():
        start = KDAState()
        layer(hist, state=start)
        full_state, kept_state = dataclasses.replace(start), dataclasses.replace(start)
        full = layer(x, state=full_state)
        kept = layer(x, state=kept_state, keep=keep)
        assert kept.shape == (2, keep, x.shape[2])
        for f in fields:
            assert torch.equal(getattr(full_state, f), getattr(kept_state, f)), f
        if keep:
            assert_close("kept outputs", full[:, 90 - keep :], kept, 1e-6)
            assert_close("no state", layer(x)[:, 90 - keep :], layer(x, keep=keep), 1e-6)
    with pytest.raises(ValueError, match="keep"):
        layer(x, keep=91)
    with pytest.raises(ValueError, match="keep"):
        layer(x.view(1, 180, -1), cu_seqlens=torch.tensor([0, 90, 180]), keep=1)


def test_varlen_equals_each_doc_alone():
    layer = build()
    B, T = 2, 40
    x = inputs(B, T)
    cu = torch.tensor([0, 7, 40, 41, 75, 80])  # row boundary at 40; docs of length 7, 33, 1, 34, 5
    with torch.no_grad():
        state = KDAState()
        packed = layer(x, state=state, cu_seqlens=cu)
        flat = x.reshape(1, B * T, -1)
        for n in range(len(cu) - 1):
            a, b = cu[n].item(), cu[n + 1].item()
            doc_state = KDAState()
            alone = layer(flat[:, a:b], state=doc_state)
            assert_close(f"doc {n}", alone, packed.reshape(1, B * T, -1)[:, a:b], 1e-5)
            assert_close(f"doc {n} recurrent", doc_state.recurrent[0], state.recurrent[n], 1e-5)
            assert_close(f"doc {n} conv_v", doc_state.conv_v[0], state.conv_v[n], 1e-6)
        no_state = layer(x, cu_seqlens=cu)  # chunked kernel, varlen
    assert_close("varlen chunk vs recurrent", packed, no_state, 1e-5)


def test_varlen_rejects_documents_across_rows():
    with pytest.raises(ValueError, match="row boundary"):
        build()(inputs(2, 8), cu_seqlens=torch.tensor([0, 5, 16]))


def test_causality():
    layer = build()
    x = inputs(1, 90)
    t = 70
    x2 = x.clone()
    x2[0, t] += 1.0
    with torch.no_grad():
        y, y2 = layer(x), layer(x2)
    # the chunked kernel's in-chunk reference points may depend on later tokens: equal up to rounding
    assert (y[:, :t] - y2[:, :t]).abs().max() <= 1e-6 * y.abs().max()
    assert (y[:, t:] - y2[:, t:]).abs().max() > 1e-2 * y.abs().max()


def test_backward_finite_grads():
    layer = build()
    x = inputs(2, 20).requires_grad_(True)
    layer(x).square().mean().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


def test_bf16_decode_keeps_state_dtypes():
    layer = build(dtype=torch.bfloat16)
    x = inputs(1, 6, dtype=torch.bfloat16)
    state = ModelState.empty(CFG)[0]
    with torch.no_grad():
        full = layer(x)
        layer(x[:, :5], state=state)
        last = layer(x[:, 5:], state=state)
    assert last.dtype == torch.bfloat16 and state.conv_k.dtype == torch.bfloat16
    assert state.recurrent.dtype == torch.float32
    assert_close("bf16 decode", full[:, 5:], last, 5e-2)


def test_low_rank_gate_variant():
    la = dataclasses.replace(CFG.linear_attn_config, use_full_rank_gate=False, gate_lower_bound=None)
    cfg = CFG.replace(linear_attn_config=la)
    layer = build(cfg)
    assert "g_a_proj.weight" in layer.state_dict() and "g_proj.weight" not in layer.state_dict()
    x = inputs(1, 9)
    with torch.no_grad():
        full, state = layer(x), KDAState()
        parts = [layer(x[:, :8], state=state), layer(x[:, 8:], state=state)]
    assert_close("softplus gate, low-rank output gate", full, torch.cat(parts, 1), 1e-5)
