"""MoonViT pieces: 2-D RoPE invariants, varlen attention vs its reference, pos-emb, merger order, tower."""

import pytest
import torch

from k3.model.vision import (
    MoonViT,
    PatchMergerProjector,
    PosEmb,
    apply_rope_2d,
    apply_rope_2d_reference,
    cu_seqlens_from_grid,
    init_vision_weights,
    merge_patches,
    rope_2d_angles,
    varlen_attention,
    varlen_attention_reference,
)
from k3.vision.config import vision_preset

K = 16


def _angles(x, y):
    return rope_2d_angles(torch.tensor([float(x)]), torch.tensor([float(y)]), K)


def test_rope_identity_at_origin_and_matches_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, K, generator=g)
    assert torch.equal(apply_rope_2d(q, _angles(0, 0)), q)
    x, y = (torch.randint(0, 50, (7,), generator=g).float() for _ in range(2))
    qs = torch.randn(7, 3, K, dtype=torch.float64, generator=g)
    ang = rope_2d_angles(x, y, K)
    # the fast path rotates in fp32 by design (the reference in fp64): fp32 tolerances, not fp64's 1e-7
    torch.testing.assert_close(apply_rope_2d(qs, ang), apply_rope_2d_reference(qs, ang), rtol=1e-6, atol=1e-6)


def test_rope_pairing_x_on_even_pairs_y_on_odd_pairs():
    ang = _angles(3, 5)[0]  # [K/2]
    theta = 10000.0 ** (-4.0 * torch.arange(K // 4) / K)
    torch.testing.assert_close(ang[0::2], 3 * theta)
    torch.testing.assert_close(ang[1::2], 5 * theta)
    # moving along y leaves the x pairs (dims 4f, 4f+1) untouched
    q = torch.randn(1, 1, K)
    moved = apply_rope_2d(q, _angles(0, 7))
    x_dims = torch.tensor([d for d in range(K) if d % 4 < 2])
    torch.testing.assert_close(moved[..., x_dims], q[..., x_dims])


def test_rope_scores_depend_only_on_the_offset():
    q, k = torch.randn(1, 1, K, dtype=torch.float64), torch.randn(1, 1, K, dtype=torch.float64)

    def score(pq, pk):
        return (apply_rope_2d(q, _angles(*pq)) * apply_rope_2d(k, _angles(*pk))).sum()

    s = score((5, 2), (1, 7))
    tol = {"atol": 1e-5, "rtol": 1e-5}  # the rotation runs in fp32
    torch.testing.assert_close(score((14, 30), (10, 35)), s, **tol)  # same (dx, dy) = (4, -5)
    torch.testing.assert_close(score((4, -5), (0, 0)), s, **tol)
    assert not torch.allclose(score((5, 2), (1, 8)), s)  # another offset, another score
    q2 = torch.randn(4, 2, K)
    torch.testing.assert_close(  # norms preserved
        apply_rope_2d(q2, rope_2d_angles(torch.arange(4.0), torch.arange(4.0), K)).norm(dim=-1),
        q2.norm(dim=-1),
    )


def test_varlen_attention_matches_reference_and_isolates_images():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 14])
    q, k, v = (torch.randn(14, 2, 8, requires_grad=True) for _ in range(3))
    out = varlen_attention(q, k, v, cu)
    ref = varlen_attention_reference(q, k, v, cu)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    grads_ref = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    v2 = v.detach().clone()
    v2[6:] += 100.0  # change image 3 only
    torch.testing.assert_close(varlen_attention(q, k, v2, cu)[:6], out[:6])


def test_pos_emb_identity_at_table_size_and_bilinear_elsewhere():
    cfg = vision_preset("moonvit-tiny")
    pe = PosEmb(cfg)
    init_vision_weights(pe)
    assert torch.equal(pe.grid(16, 16), pe.weight.flatten(0, 1))
    const = PosEmb(cfg)
    with torch.no_grad():
        const.weight.copy_(torch.arange(cfg.vt_hidden_size, dtype=torch.float32))
    torch.testing.assert_close(const.grid(6, 10), const.weight[0, 0].expand(60, -1))
    assert pe([(1, 6, 10), (1, 4, 4)]).shape == (76, cfg.vt_hidden_size)
    video = pe([(2, 4, 4)])
    assert video.shape == (32, cfg.vt_hidden_size) and not torch.allclose(video[:16], video[16:])


def test_merger_order_and_frame_mean():
    h, w, D = 4, 6, 3
    idx = torch.arange(h * w).float()
    x = torch.stack([idx, idx * 0, idx * 0], -1)  # feature 0 = patch index
    out = merge_patches(x, [(1, h, w)])
    assert out.shape == ((h // 2) * (w // 2), 4 * D)
    # token 1 = neighbourhood at merged (row 0, col 1): patches (0,2) (0,3) (1,2) (1,3)
    assert out[1, 0::D].tolist() == [2.0, 3.0, 8.0, 9.0]
    # token 3 = merged (row 1, col 0): patches (2,0) (2,1) (3,0) (3,1)
    assert out[3, 0::D].tolist() == [12.0, 13.0, 18.0, 19.0]
    two = merge_patches(torch.cat([x, x + 10]), [(2, h, w)])
    torch.testing.assert_close(two, out + 5.0)  # the mean of frames x and x + 10
    with pytest.raises(ValueError, match="patches"):
        merge_patches(x[:-1], [(1, h, w)])
    with pytest.raises(ValueError, match="even"):
        merge_patches(x, [(1, 3, 8)])


def test_tower_packs_images_independently():
    torch.manual_seed(0)
    cfg = vision_preset("moonvit-tiny")
    tower, proj = MoonViT(cfg), PatchMergerProjector(cfg)
    init_vision_weights(tower)
    init_vision_weights(proj)
    grids = [(1, 4, 6), (1, 2, 2), (1, 6, 2)]
    n = [t * h * w for t, h, w in grids]
    px = torch.randn(sum(n), 3, 14, 14)
    packed = proj(tower(px, torch.tensor(grids)))
    assert packed.shape == (6 + 1 + 3, cfg.text_hidden_size)
    alone = proj(tower(px[n[0] : n[0] + n[1]], [grids[1]]))
    torch.testing.assert_close(packed[6:7], alone, atol=1e-5, rtol=1e-5)
    ref = proj(tower(px, grids, attn_fn=varlen_attention_reference))
    torch.testing.assert_close(packed, ref, atol=1e-5, rtol=1e-5)
    assert cu_seqlens_from_grid(grids).tolist() == [0, 24, 28, 40]
    with pytest.raises(ValueError, match="pixel_values"):
        tower(px[:-1], grids)
