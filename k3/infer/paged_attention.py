"""MLA attention of one new token per row over that row's paged latents: the engine's decode attention.

`paged_mla_decode` writes each row's new latent into its page, then attends the row's query over its
c_b + 1 keys with the absorbed form (k3.ops.mla): one dense [B, H, 1, S] score tensor while H * S stays
under `k3.model.mla.DENSE_MAX_SCORES`, else an online softmax over page blocks read one at a time. Rows
may have different lengths (a ragged batch: row b sees its own keys only).

It is registered as the custom op `k3::paged_mla_decode` so that a compiled decode step
(`k3.infer.decode_step`) traces it as one opaque call: everything around it has static shapes, while the
number of keys it reads grows every step. The op's own body runs eagerly, page gathers and all.
"""

from __future__ import annotations

import torch

from k3.infer.paged_state import PagedBatch, PagedMLAState
from k3.model import mla as mla_layer
from k3.ops.mla import mla_attention_latent, mla_attention_over_blocks, query_positions, ragged_causal_mask

_LIB = torch.library.Library("k3", "FRAGMENT")
_LIB.define(
    "paged_mla_decode(Tensor q_nope, Tensor q_pe, Tensor latent, Tensor(a!) pool, Tensor block_tables, "
    "Tensor lengths, Tensor w_uk, Tensor w_uv, float scale, int page_size) -> Tensor"
)


def _paged_mla_decode(q_nope, q_pe, latent, pool, block_tables, lengths, w_uk, w_uv, scale, page_size):
    """q_nope [B, 1, H, Dn], q_pe [B, 1, H, Dr], latent [B, 1, R+Dr] (the new token's [c_kv | k_pe]),
    pool [rows, R+Dr] (written), block_tables long [B, n_pages], lengths long [B] (cached tokens c_b,
    before this one), w_uk [H, Dn, R], w_uv [H, Dv, R] -> o [B, 1, H, Dv] in the pool's dtype."""
    B, T, H, _ = q_nope.shape
    if T != 1 or latent.shape[:2] != (B, 1):
        raise ValueError(f"one new token per row expected, got q_nope {tuple(q_nope.shape)}")
    n = -(-(int(lengths.max()) + 1) // page_size)  # the pages the longest row covers with its new key
    state = PagedMLAState(pool, PagedBatch(block_tables[:, :n], lengths, 1, page_size))
    S = state.batch.max_length + 1
    ragged = int(lengths.min()) != S - 1  # rows of different lengths: row b sees its own keys only
    if H * S > mla_layer.DENSE_MAX_SCORES:  # long context: stream page blocks (read per call: tests set it)
        state.write(latent)
        q_pos = query_positions(1, S, lengths if ragged else None, q_nope.device)
        blocks = state.blocks(mla_layer.stream_block(B, H, 1))
        o = mla_attention_over_blocks(q_nope, q_pe, blocks, w_uk, w_uv, scale, q_pos)
        return o.to(pool.dtype)
    mask = ragged_causal_mask(lengths, 1, S) if ragged else None
    return mla_attention_latent(q_nope, q_pe, state.append(latent), w_uk, w_uv, scale, mask).to(pool.dtype)


def _paged_mla_decode_fake(q_nope, q_pe, latent, pool, block_tables, lengths, w_uk, w_uv, scale, page_size):
    B, T, H, _ = q_nope.shape
    return q_nope.new_empty(B, T, H, w_uv.shape[1], dtype=pool.dtype)


_LIB.impl("paged_mla_decode", _paged_mla_decode, "CompositeExplicitAutograd")
torch.library.register_fake("k3::paged_mla_decode", _paged_mla_decode_fake, lib=_LIB)
paged_mla_decode = torch.ops.k3.paged_mla_decode


class PagedDecodeMLAState:
    """One MLA layer's view of its pool for rows feeding one token each, with no host reads (so a compiled
    decode step can build it): block_tables long [B, n_pages], lengths long [B] (cached tokens before
    this step). The MLA layer hands it the new latents and queries (`decode_attention`), and it runs
    `paged_mla_decode`. It implements only this one-token form of the state interface (k3.model.state)."""

    def __init__(self, pool: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, page_size: int):
        self.pool, self.block_tables, self.lengths, self.page_size = pool, block_tables, lengths, page_size

    def decode_attention(self, q_nope, q_pe, latent, w_uk, w_uv, scale: float) -> torch.Tensor:
        """Store `latent` [B, 1, R+Dr] as key c_b of each row and attend -> o [B, 1, H, Dv]."""
        tables, lengths = self.block_tables, self.lengths
        return paged_mla_decode(
            q_nope, q_pe, latent, self.pool, tables, lengths, w_uk, w_uv, scale, self.page_size
        )
