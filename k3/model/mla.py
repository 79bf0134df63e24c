"""Gated multi-head latent attention (MLA) with NoPE, the full-attention mixer of 24 K3 layers
(docs/spec.md#mla).

MLA: DeepSeek-V2 (arXiv 2405.04434) §2.1; NoPE MLA and the output gate: Kimi Linear (arXiv 2510.26692) §4.
x [B, T, D] is the normed AttnRes output; H heads, Dn/Dr/Dv = qk_nope/qk_rope/v head dims, R = kv_lora_rank:

    q                  = W_qb RMSNorm_{q_a_layernorm}(W_qa x)         [H, Dn+Dr] -> q_nope | q_pe
    c_kv | k_pe        = W_kva x                                      [R + Dr], k_pe shared by all heads
    latent             = RMSNorm_{kv_a_layernorm}(c_kv) | k_pe        what the cache stores per token
    k_nope | v         = W_kvb RMSNorm(c_kv)                          [H, Dn+Dv]
    o                  = softmax(scale * (q_nope.k_nope + q_pe.k_pe), causal) v,   scale = (Dn+Dr)^-1/2
    y                  = o_proj(o * sigmoid(g_proj(x)))               output gate from the layer input

K3 applies no rotation (`mla_use_nope`): the Dr "rope" dims are plain extra dot-product dims and position
comes only from the KDA layers. `mla_use_nope=False` is the K2-style ablation: q_pe and k_pe are rotated
(k3.ops.rope) by the token's position (within its document when `doc_ids` is given, else the cache offset
plus arange(T), or explicit `positions`). Latent norm eps is `config.latent_norm_eps` (docs/spec.md#choices).

Attention paths (k3.ops.mla), all equal: naive (materialized per-head K/V, computed in causal query
blocks by `mla_attention_causal`; training, prefill), absorbed (W_UK folded into the query, W_UV into the
output, attending over the latent; decode) and streaming (online softmax over latent blocks read one at
a time from the state; long contexts; each block absorbed, or up-projected to per-head keys/values when
the chunk is long enough for that to need fewer multiply-adds, k3.ops.mla.expand_pays). With a
state the new latents are stored and the queries attend causally over cache + new tokens:

* dense (the state's `append` returns all S latents, one [B, H, T, S] score tensor): when the attention
  is small, H*T*S <= DENSE_MAX_SCORES per row, or `absorb` is given
  (forcing the absorbed or naive form). Without a state naive; with one, absorbed unless the chunk is
  long enough for expanding every cached key to pay (`expand_pays`: T > 128 queries for k3-tiny, 171 for
  the release), e.g. the short aligned remainder of a prompt over a long cache.
* streaming (`write`, then `blocks`): otherwise (every `k3.model.state.MLACache` streams). Block size:
  DENSE_MAX_SCORES // (B*H*T) keys, at least MIN_BLOCK and at most MAX_BLOCK, so the score scratch
  stays ~DENSE_MAX_SCORES fp32 values at most whatever S is (nothing of size S but the cache exists)
  and small enough to stay in cache across the block's passes. In the engine every prefill chunk past
  the first few thousand keys, and long-context decode, take it.
* self-attending (`state.decode_attention`): one token per row over a state with `attends_decode` (the
  engine's paged decode state, which a compiled decode step traces as one op).

Ragged batches: a state with per-row cached lengths `lengths` [B] (k3.model.state) gets a per-row causal
mask (row b's query t is key c_b + t); the RoPE ablation rotates by c_b + t as well.
"""

import torch
from torch import nn

from k3.config import K3Config
from k3.model.layers import Linear, RMSNorm
from k3.model.state import MLAState
from k3.ops.mla import (
    causal_mask,
    expand_pays,
    mla_attention_causal,
    mla_attention_latent,
    mla_attention_over_blocks,
    mla_attention_reference,
    query_positions,
    ragged_causal_mask,
    split_kv_b,
)
from k3.ops.rope import apply_rope

DENSE_MAX_SCORES = 1 << 22  # per-row H*T*S above which a streaming state is read block by block (16 MiB fp32)
MIN_BLOCK = 128  # keys per block at least (bounds the Python loop for many heads x long chunks)
MAX_BLOCK = 512  # keys per block at most: smaller score blocks stay in cache between matmul, exp and sum


def stream_block(B: int, H: int, T: int) -> int:
    """Keys per block when B rows of T queries and H heads stream a state: as many as keep the scores
    within DENSE_MAX_SCORES, within [MIN_BLOCK, MAX_BLOCK] (read at call time: tests change them)."""
    return max(MIN_BLOCK, min(MAX_BLOCK, DENSE_MAX_SCORES // (B * H * T)))


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] (documents contiguous within a row) -> each token's position in its document [B, T]."""
    T = doc_ids.shape[1]
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(start, idx, 0).cummax(dim=1).values


class MLAAttention(nn.Module):
    """Gated MLA token mixer for decoder layer `layer_idx`: x [B, T, D] -> [B, T, D]."""

    def __init__(self, config: K3Config, layer_idx: int, device=None, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads, self.kv_lora_rank = H, config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.scale = config.qk_head_dim**-0.5
        self.use_rope, self.rope_theta = not config.mla_use_nope, config.rope_theta
        eps = config.latent_norm_eps
        lin = lambda i, o: Linear(i, o, device=device, dtype=dtype)
        if config.q_lora_rank is not None:
            self.q_a_proj = lin(D, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps, device=device, dtype=dtype)
            self.q_b_proj = lin(config.q_lora_rank, H * config.qk_head_dim)
        else:
            self.q_proj = lin(D, H * config.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(D, self.kv_lora_rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, device=device, dtype=dtype)
        self.kv_b_proj = lin(self.kv_lora_rank, H * (self.nope_dim + self.v_dim))
        self.g_proj = lin(D, H * self.v_dim) if config.mla_use_output_gate else None
        self.o_proj = lin(H * self.v_dim, D)

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q_nope [B, T, H, Dn], q_pe [B, T, H, Dr] (un-rotated)."""
        q = (
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            if hasattr(self, "q_a_proj")
            else self.q_proj(x)
        )
        q = q.view(*x.shape[:2], self.num_heads, self.nope_dim + self.rope_dim)
        return q.split([self.nope_dim, self.rope_dim], dim=-1)

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> normed c_kv [B, T, R], k_pe [B, T, Dr] (un-rotated)."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(c_kv), k_pe

    def _positions(self, x: torch.Tensor, offset: int, doc_ids, positions, lengths) -> torch.Tensor:
        """RoPE positions [B or 1, T]: explicit, within-document, per-row lengths[b] + arange(T) (ragged),
        or offset + arange(T)."""
        if positions is not None:
            return positions if positions.dim() == 2 else positions[None]
        if doc_ids is not None:
            return doc_positions(doc_ids)
        if lengths is not None:
            return lengths.to(x.device)[:, None] + torch.arange(x.shape[1], device=x.device)
        return torch.arange(offset, offset + x.shape[1], device=x.device)[None]

    def _attend(self, q_nope, q_pe, latent, mask, absorb: bool) -> torch.Tensor:
        """Queries [B, T, H, *] over latents [B, S, R+Dr] -> o [B, T, H, Dv]."""
        if absorb:  # the heads fold into the query rows over the latent as stored
            w_uk, w_uv = self._absorbed_weights()
            return mla_attention_latent(q_nope, q_pe, latent, w_uk, w_uv, self.scale, mask)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(*c_kv.shape[:2], self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        if mask is None:
            return mla_attention_reference(q_nope, q_pe, k_nope, k_pe, v, self.scale, mask)
        return mla_attention_causal(q_nope, q_pe, k_nope, k_pe, v, self.scale, mask)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope_dim, self.v_dim)

    def _streams(self, state, T: int, S: int, absorb: bool | None) -> bool:
        """The attention-path rule of the module docstring."""
        return absorb is None and self.num_heads * T * S > DENSE_MAX_SCORES

    def _attend_stream(self, q_nope, q_pe, state, S: int, lengths) -> torch.Tensor:
        """Queries [B, T, H, *] over the state's latent blocks (online softmax) -> o [B, T, H, Dv]."""
        B, T, H, _ = q_nope.shape
        block = stream_block(B, H, T)
        q_pos = query_positions(T, S, lengths, q_nope.device)
        w_uk, w_uv = self._absorbed_weights()
        expand = expand_pays(T, self.kv_lora_rank, self.nope_dim, self.v_dim)
        return mla_attention_over_blocks(
            q_nope, q_pe, state.blocks(block), w_uk, w_uv, self.scale, q_pos, expand=expand
        )

    def forward(
        self,
        x: torch.Tensor,
        state: MLAState | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        absorb: bool | None = None,
        keep: int | None = None,
    ) -> torch.Tensor:
        """x [B, T, D]; state: the latent cache (k3.model.state), appended to in place; doc_ids [B, T]:
        block-diagonal attention over packed documents (no state); positions [T] or [B, T]: RoPE positions
        (ablation only); absorb: force the dense absorbed (True) or naive (False) form; keep: output only
        the last `keep` positions (0 <= keep <= T; the cache still gets all T latents) -> y [B, keep or T, D].

        `keep` is for a model's last layer, whose other outputs nobody reads: only the kept positions
        query (a prompt's last token over the whole cache costs one query instead of T)."""
        B, T, _ = x.shape
        Tq = T if keep is None else keep
        if not 0 <= Tq <= T:
            raise ValueError(f"keep must be in [0, T={T}], got {keep}")
        one_token = T == 1 and Tq == 1 and absorb is None and positions is None
        if one_token and state is not None and state.attends_decode:
            return self._decode(x, state)
        if doc_ids is not None and (state is not None or doc_ids.shape != (B, T)):
            raise ValueError(f"doc_ids must be [B, T]=[{B}, {T}] and cannot be combined with a state")
        offset = 0 if state is None else state.length
        lengths = None if state is None else state.lengths
        c_kv, k_pe = self._latents(x)
        xq = x[:, T - Tq :]
        q_nope, q_pe = self._queries(xq)
        if self.use_rope:
            pos = self._positions(x, offset, doc_ids, positions, lengths)
            q_pe = apply_rope(q_pe.transpose(1, 2), pos[:, None, T - Tq :], self.rope_theta).transpose(1, 2)
            k_pe = apply_rope(k_pe, pos, self.rope_theta)
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [B, T, R+Dr]
        S = offset + T
        q_lengths = None if lengths is None else lengths + (T - Tq)  # each row's first kept query
        if Tq == 0:
            if state is not None:
                state.write(latent)
            return x.new_empty(B, 0, self.o_proj.out_features)
        # the path is chosen by the call's T, not Tq: the dense path gathers all S cached latents, which
        # the streaming path never holds at once (a prompt's last chunk over a long cache keeps streaming)
        if state is not None and self._streams(state, T, S, absorb):
            state.write(latent)
            o = self._attend_stream(q_nope, q_pe, state, S, q_lengths)
        else:
            if state is not None:
                latent = state.append(latent)
            if lengths is not None and int(lengths.min()) != offset:  # rows differ: per-row causal mask
                mask = ragged_causal_mask(q_lengths.to(x.device), Tq, S)
            elif Tq == 1 and doc_ids is None:
                mask = None  # the last position sees every key
            else:
                q_docs = None if doc_ids is None else doc_ids[:, T - Tq :]
                mask = causal_mask(Tq, S, x.device, q_docs, doc_ids)
            if absorb is None:  # with a cache, whichever form needs fewer multiply-adds (Tq == 1: absorbed)
                expand = expand_pays(Tq, self.kv_lora_rank, self.nope_dim, self.v_dim)
                absorb = state is not None and not expand
            o = self._attend(q_nope, q_pe, latent, mask, absorb)
        return self._output(xq, o)

    def _decode(self, x: torch.Tensor, state) -> torch.Tensor:
        """One token per row, x [B, 1, D], over an engine state that stores the new latents and runs the
        absorbed attention itself (`state.decode_attention`, e.g. k3.infer.cache.paged_mla) -> [B, 1, D]."""
        q_nope, q_pe = self._queries(x)
        c_kv, k_pe = self._latents(x)
        if self.use_rope:  # the new token sits at position c_b of its row
            pos = state.lengths.to(x.device)[:, None]
            q_pe = apply_rope(q_pe.transpose(1, 2), pos[:, None], self.rope_theta).transpose(1, 2)
            k_pe = apply_rope(k_pe, pos, self.rope_theta)
        w_uk, w_uv = self._absorbed_weights()
        o = state.decode_attention(q_nope, q_pe, torch.cat([c_kv, k_pe], dim=-1), w_uk, w_uv, self.scale)
        return self._output(x, o)

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Attention output o [B, T, H, Dv] -> o_proj(o * sigmoid(g_proj(x))) [B, T, D]."""
        o = o.reshape(*x.shape[:2], -1)
        if self.g_proj is not None:
            o = (o.float() * torch.sigmoid(self.g_proj(x).float())).to(o.dtype)
        return self.o_proj(o)
