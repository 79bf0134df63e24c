"""MLA attention references agree (naive == absorbed == blockwise), masks, and RoPE properties."""

import pytest
import torch

from k3.ops.mla import (
    causal_mask,
    expand_pays,
    mla_attention_absorbed,
    mla_attention_blockwise,
    mla_attention_causal,
    mla_attention_latent,
    mla_attention_reference,
    ragged_causal_mask,
    split_kv_b,
)
from k3.ops.rope import apply_rope


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, rtol: float) -> None:
    """Max-abs error relative to the reference's max magnitude, reported with the tensor name."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    ref, got = ref.double(), got.double()
    err = (ref - got).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-12)
    assert rel <= rtol, (
        f"{name}: rel err {rel:.3e} > {rtol:.1e} (max abs {err:.3e}, mean {(ref - got).abs().mean():.3e})"
    )


H, DN, DR, DV, R = 3, 16, 8, 12, 20


def _inputs(B, T, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    q_nope, q_pe = r(B, T, H, DN), r(B, T, H, DR)
    c_kv, k_pe = r(B, S, R), r(B, S, DR)
    kv_b = r(H * (DN + DV), R) * 0.5
    return q_nope, q_pe, c_kv, k_pe, kv_b


def _naive_from_latent(q_nope, q_pe, c_kv, k_pe, kv_b, scale, mask):
    kv = (c_kv @ kv_b.T).view(*c_kv.shape[:2], H, DN + DV)
    return mla_attention_reference(q_nope, q_pe, kv[..., :DN], k_pe, kv[..., DN:], scale, mask)


@pytest.mark.parametrize("B,T,S", [(2, 5, 5), (2, 1, 9), (1, 4, 11)], ids=lambda v: f"{v}")
def test_absorbed_equals_naive(B, T, S):
    """T == S: prefill without a cache; T < S: queries are the last T of S keys (cache + new)."""
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, S)
    scale = (DN + DR) ** -0.5
    mask = causal_mask(T, S)
    ref = _naive_from_latent(q_nope, q_pe, c_kv, k_pe, kv_b, scale, mask)
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    got = mla_attention_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, mask)
    assert got.shape == (B, T, H, DV)
    assert_close("absorbed", ref, got, 1e-5)


@pytest.mark.parametrize("B,T,S", [(2, 5, 5), (2, 1, 9), (1, 4, 11)], ids=lambda v: f"{v}")
def test_latent_form_equals_naive(B, T, S):
    """mla_attention_latent takes the cached [c_kv | k_pe] rows whole; with a causal or ragged mask."""
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, S)
    scale = (DN + DR) ** -0.5
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    latent = torch.cat([c_kv, k_pe], -1)
    ragged = ragged_causal_mask(torch.tensor([S - T, S - T - 1][:B]).clamp(min=0), T, S)
    for mask in (causal_mask(T, S), ragged):
        ref = _naive_from_latent(q_nope, q_pe, c_kv, k_pe, kv_b, scale, mask)
        got = mla_attention_latent(q_nope, q_pe, latent, w_uk, w_uv, scale, mask)
        assert got.shape == (B, T, H, DV)
        assert_close("latent", ref, got, 1e-5)


@pytest.mark.parametrize("T,S,block", [(7, 7, 3), (3, 10, 4), (6, 6, 64), (1, 9, 2)], ids=lambda v: f"{v}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("expand", [False, True], ids=["absorbed", "expanded"])
def test_blockwise_equals_naive(T, S, block, causal, expand):
    B = 2
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, S, seed=1)
    scale = (DN + DR) ** -0.5
    mask = causal_mask(T, S) if causal else None
    ref = _naive_from_latent(q_nope, q_pe, c_kv, k_pe, kv_b, scale, mask)
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    got = mla_attention_blockwise(
        q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, causal=causal, block_size=block, expand=expand
    )
    assert_close("blockwise", ref, got, 1e-5)


@pytest.mark.parametrize("expand", [False, True], ids=["absorbed", "expanded"])
def test_blockwise_doc_ids_equals_naive_and_separate_docs(expand):
    B, T = 2, 9
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, T, seed=2)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2, 2]])
    scale = 0.3
    mask = causal_mask(T, T, None, docs, docs)
    ref = _naive_from_latent(q_nope, q_pe, c_kv, k_pe, kv_b, scale, mask)
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    got = mla_attention_blockwise(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, q_doc_ids=docs, k_doc_ids=docs,
                                  block_size=2, expand=expand)  # fmt: skip
    assert_close("blockwise docs", ref, got, 1e-5)
    for a, b in [(0, 3), (3, 5), (5, 9)]:  # row 0: each document alone gives the same output
        sl = slice(a, b)
        alone = _naive_from_latent(q_nope[:1, sl], q_pe[:1, sl], c_kv[:1, sl], k_pe[:1, sl], kv_b, scale,
                                   causal_mask(b - a, b - a))  # fmt: skip
        assert_close(f"doc {a}:{b}", alone, ref[:1, sl], 1e-6)


def test_expand_pays_where_the_multiply_adds_say():
    """Per key and row: expanded R*H*(Dn+Dv) + H*T*(Dn+Dr+Dv) vs absorbed H*T*(2R+Dr) multiply-adds."""
    R, Dn, Dr, Dv, H = 128, 64, 32, 64, 4

    def cheaper(T):
        return R * H * (Dn + Dv) + H * T * (Dn + Dr + Dv) < H * T * (2 * R + Dr)

    for T in (1, 64, 127, 128, 129, 600, 4096):
        assert expand_pays(T, R, Dn, Dv) == cheaper(T), T
    assert not expand_pays(10**6, 64, 64, 64)  # 2R <= Dn + Dv: the latent is never wider, absorbing wins


def test_causal_mask_layout():
    m = causal_mask(2, 4)[0]
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    d = torch.tensor([[0, 1, 1]])
    assert causal_mask(3, 3, None, d, d)[0].tolist() == [[True, False, False], [False, True, False],
                                                         [False, True, True]]  # fmt: skip
    with pytest.raises(ValueError):
        causal_mask(3, 2)


def test_naive_grads_finite():
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(1, 4, 4, seed=3)
    for t in (q_nope, q_pe, c_kv, k_pe, kv_b):
        t.requires_grad_(True)
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    out = mla_attention_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, 0.2, causal_mask(4, 4))
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q_nope, q_pe, c_kv, k_pe, kv_b))


# ---- RoPE ---------------------------------------------------------------------------------------------
def test_rope_relative_and_norm_preserving():
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    rot = lambda x, p: apply_rope(x[None], torch.tensor([p]), 10000.0)[0]
    d1 = rot(q, 5) @ rot(k, 2)
    d2 = rot(q, 103) @ rot(k, 100)
    assert abs(d1 - d2) < 1e-4 and abs(d1 - q @ k) > 1e-3  # depends on p - s only, and does rotate
    assert torch.allclose(rot(q, 0), q) and torch.allclose(rot(q, 77).norm(), q.norm(), atol=1e-5)
    x = torch.randn(2, 3, 4, 8)  # [B, H, T, Dr] with positions [B, 1, T]
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    y = apply_rope(x, pos[:, None], 10000.0)
    assert torch.allclose(y[1, 2, 0], rot(x[1, 2, 0], 5), atol=1e-6)
    with pytest.raises(ValueError):
        apply_rope(torch.randn(3, 5), torch.arange(3), 10000.0)


@pytest.mark.parametrize("T,S,block", [(7, 7, 3), (5, 12, 2), (64, 64, None), (9, 9, 64)], ids=str)
def test_causal_blocks_equal_naive_fwd_bwd(T, S, block):
    """Query blocks that skip the keys past their last query == the dense masked attention, with the
    causal mask, a ragged one and a document one; gradients too (the training path)."""
    B = 2
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, S)
    kv = (c_kv @ kv_b.T).view(B, S, H, DN + DV)
    k_nope, v = kv[..., :DN].contiguous(), kv[..., DN:].contiguous()
    ragged = ragged_causal_mask(torch.tensor([S - T, max(0, S - T - 2)]), T, S)
    docs = torch.tensor([[0] * (S // 2) + [1] * (S - S // 2)] * B)
    doc = causal_mask(T, S, None, docs[:, S - T :], docs)
    for mask in (causal_mask(T, S), ragged, doc):
        leaves = [t.clone().requires_grad_() for t in (q_nope, q_pe, k_nope, k_pe, v)]
        ref = mla_attention_reference(*leaves, 0.3, mask)
        lv = [t.clone().requires_grad_() for t in (q_nope, q_pe, k_nope, k_pe, v)]
        got = mla_attention_causal(*lv, 0.3, mask, block)
        assert_close("causal blocks", ref, got, 1e-5)
        do = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad(got, lv, do), torch.autograd.grad(ref, leaves, do), strict=True):
            assert_close("grad", b, a, 1e-5)
