"""Streaming MLA attention over key blocks == dense attention, for ragged batches (per-row query offsets)
and block sizes that do not divide S."""

import pytest
import torch

from k3.ops.mla import (
    causal_mask,
    mla_attention_blockwise,
    mla_attention_over_blocks,
    mla_attention_reference,
    query_positions,
    ragged_causal_mask,
    split_kv_b,
)

H, DN, DR, DV, R = 3, 16, 8, 12, 20
SCALE = (DN + DR) ** -0.5


def _inputs(B, T, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    return r(B, T, H, DN), r(B, T, H, DR), r(B, S, R), r(B, S, DR), r(H * (DN + DV), R) * 0.5


def _naive(q_nope, q_pe, c_kv, k_pe, kv_b, mask):
    kv = (c_kv @ kv_b.T).view(*c_kv.shape[:2], H, DN + DV)
    return mla_attention_reference(q_nope, q_pe, kv[..., :DN], k_pe, kv[..., DN:], SCALE, mask)


def _rel_err(ref, got):
    return ((ref.double() - got.double()).abs().max() / ref.double().abs().max()).item()


def test_ragged_mask_layout():
    m = ragged_causal_mask(torch.tensor([0, 2]), 2, 4)
    assert m[0].tolist() == [[True, False, False, False], [True, True, False, False]]
    assert m[1].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert torch.equal(ragged_causal_mask(torch.tensor([3, 3]), 2, 5), causal_mask(2, 5).expand(2, 2, 5))
    with pytest.raises(ValueError, match="q_offsets"):
        query_positions(2, 4, torch.tensor([0, 3]))  # row 1 would need 5 keys


@pytest.mark.parametrize("T,offsets,block", [(1, [0, 6, 13], 5), (4, [9, 0, 3], 3), (3, [2, 2, 7], 64)])
def test_ragged_blockwise_equals_naive_and_rows_alone(T, offsets, block):
    """Row b has offsets[b] cached keys + T new; keys past its end are garbage and must not matter."""
    off = torch.tensor(offsets)
    B, S = len(offsets), max(offsets) + T
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, S, seed=T)
    for b, c in enumerate(offsets):  # padding: large garbage, which would dominate any leaked score
        c_kv[b, c + T :], k_pe[b, c + T :] = 50.0, -50.0
    ref = _naive(q_nope, q_pe, c_kv, k_pe, kv_b, ragged_causal_mask(off, T, S))
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    got = mla_attention_blockwise(
        q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, SCALE, block_size=block, q_offsets=off
    )
    assert _rel_err(ref, got) < 1e-5
    for b, c in enumerate(offsets):  # each row equals attending over its own keys alone
        n = c + T
        sl = (slice(b, b + 1), slice(0, n))
        alone = _naive(q_nope[b : b + 1], q_pe[b : b + 1], c_kv[sl], k_pe[sl], kv_b, causal_mask(T, n))
        assert _rel_err(alone, got[b : b + 1]) < 1e-5, b


def test_uneven_block_stream_equals_dense():
    """Any split of the keys into consecutive blocks (sizes 1, 4, 2, 6, 0-free) gives the same output."""
    B, T, S = 2, 5, 13
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, S, seed=7)
    lat = torch.cat([c_kv, k_pe], -1)
    cuts = [0, 1, 5, 7, 13]
    blocks = (lat[:, a:b] for a, b in zip(cuts, cuts[1:], strict=False))
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    got = mla_attention_over_blocks(q_nope, q_pe, blocks, w_uk, w_uv, SCALE, query_positions(T, S, None))
    assert _rel_err(_naive(q_nope, q_pe, c_kv, k_pe, kv_b, causal_mask(T, S)), got) < 1e-5
    with pytest.raises(ValueError, match="no keys"):
        mla_attention_over_blocks(q_nope, q_pe, iter([]), w_uk, w_uv, SCALE)


def test_bf16_blocks_keep_dtype_and_agree():
    B, T, S = 1, 4, 37
    q_nope, q_pe, c_kv, k_pe, kv_b = _inputs(B, T, S, seed=3)
    c16, k16 = c_kv.bfloat16(), k_pe.bfloat16()
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    got = mla_attention_blockwise(q_nope, q_pe, c16, k16, w_uk, w_uv, SCALE, block_size=10)
    assert got.dtype == torch.bfloat16
    ref = _naive(q_nope, q_pe, c16.float(), k16.float(), kv_b, causal_mask(T, S))
    assert _rel_err(ref, got) < 1e-2
