"""KimiDeltaAttention.decode_step (the one-token fast path) against forward_chunked."""

import pytest
import torch
from torch import nn

from k3.config import preset
from k3.model.kda import KimiDeltaAttention
from k3.model.layers import Linear
from k3.model.state import KDAState

CFG = preset("k3-nano")


def build(dtype=torch.float32) -> KimiDeltaAttention:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(CFG, layer_idx=0)
    for m in layer.modules():  # unit-scale projections so every path matters numerically
        if isinstance(m, Linear):
            nn.init.normal_(m.weight, 0.0, m.in_features**-0.5)
    return layer.to(dtype)


def _decode(layer, x, fast: bool, monkeypatch):
    """Prefill 3 tokens, then decode the rest one by one -> (outputs [B, T, D], final state)."""
    monkeypatch.setattr(KimiDeltaAttention, "fast_decode", fast)
    st = KDAState.zeros(CFG, x.shape[0], dtype=x.dtype)
    with torch.no_grad():
        ys = [layer(x[:, :3], st)] + [layer(x[:, t : t + 1], st) for t in range(3, x.shape[1])]
    return torch.cat(ys, 1), st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_matches_reference(dtype, monkeypatch):
    layer = build(dtype)
    x = torch.randn(2, 9, CFG.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    calls = []
    real = KimiDeltaAttention.decode_step
    monkeypatch.setattr(KimiDeltaAttention, "decode_step", lambda s, *a: calls.append(1) or real(s, *a))
    y_fast, st_fast = _decode(layer, x, True, monkeypatch)
    assert len(calls) == 6  # every one-token step took the fast path
    y_ref, st_ref = _decode(layer, x, False, monkeypatch)
    assert len(calls) == 6
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y_fast.float(), y_ref.float(), **tol)
    for f in ("conv_q", "conv_k", "conv_v", "recurrent"):
        a, b = getattr(st_fast, f), getattr(st_ref, f)
        assert a.shape == b.shape and a.dtype == b.dtype, f
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=f)


def test_decode_step_not_taken_with_grad_or_empty_state(monkeypatch):
    layer = build()
    calls = []
    real = KimiDeltaAttention.decode_step
    monkeypatch.setattr(KimiDeltaAttention, "decode_step", lambda s, *a: calls.append(1) or real(s, *a))
    x = torch.randn(1, 1, CFG.hidden_size, requires_grad=True)
    st = KDAState.zeros(CFG, 1, dtype=torch.float32)
    layer(x, st).sum().backward()  # training-style call: the reference path, with gradients
    assert x.grad is not None and not calls
    with torch.no_grad():
        layer(x, KDAState())  # no history yet: the reference path fills the state
    assert not calls
