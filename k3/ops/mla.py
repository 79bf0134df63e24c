"""Multi-head latent attention (MLA) references as pure functions (docs/spec.md#mla).

Letters: B batch, T queries, S keys (cache + new tokens), H heads, Dn = qk_nope_head_dim,
Dr = qk_rope_head_dim, Dv = v_head_dim, R = kv_lora_rank.

Every key/value is a function of one per-token latent: the normed `c_kv` [R] plus a head-shared `k_pe` [Dr].
`kv_b_proj.weight` [H*(Dn+Dv), R] viewed as [H, Dn+Dv, R] splits into W_UK [H, Dn, R] and W_UV [H, Dv, R]:

    k_nope[s, h] = W_UK[h] c_kv[s]          v[s, h] = W_UV[h] c_kv[s]
    score[t, s, h] = scale * (q_nope[t, h] . k_nope[s, h] + q_pe[t, h] . k_pe[s])

Three equal ways to compute the same attention:

* `mla_attention_reference` materializes k_nope/v per head (the reference); `mla_attention_causal` is the
  same by query blocks that skip the masked keys (training, prefill);
* `mla_attention_absorbed` folds W_UK into the query (q_lat = W_UK^T q_nope, [H, R]) and W_UV into the
  output, so it attends over the [S, R+Dr] latent directly: MQA with one shared 576-dim key (decode);
  `mla_attention_latent` is the same over the cached [S, R+Dr] latents taken whole (decode);
* `mla_attention_blockwise` is the absorbed form with an online softmax over key blocks, so [T, S] is
  never materialized (long-context prefill); `mla_attention_over_blocks` is its core, taking the keys as
  a stream of latent blocks (the engine reads them page by page from its pool, never gathering [S, R+Dr]).
  With `expand=True` both up-project each block to per-head keys/values instead: fewer multiply-adds
  once a chunk has more than ~R queries (`expand_pays`).

Masks: `causal_mask` builds the boolean [B|1, T, S] mask (True = may attend) for queries that are the
last T of the S keys (the cache convention), optionally block-diagonal by document ids;
`ragged_causal_mask` the [B, T, S] one of a ragged batch, where row b has q_offsets[b] cached keys (its
query t is key q_offsets[b] + t, keys past its end are padding). Scores and the
softmax are computed in fp32; the output has v's (or c_kv's) dtype. A query row with no visible key is
undefined (NaN in the dense references); causal masks never produce one.
"""

import torch

from k3.ops import native


def causal_mask(
    T: int,
    S: int,
    device: torch.device | None = None,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query t (key position S-T+t) sees keys s <= S-T+t, and with doc ids [B, T] / [B, S] only its own
    document -> bool [1 or B, T, S]."""
    if S < T:
        raise ValueError(f"need at least as many keys as queries, got T={T}, S={S}")
    q_pos = torch.arange(S - T, S, device=device)
    mask = (torch.arange(S, device=device)[None, :] <= q_pos[:, None])[None]
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("q_doc_ids and k_doc_ids must be given together")
    if q_doc_ids is not None:
        mask = mask & (q_doc_ids[:, :, None] == k_doc_ids[:, None, :])
    return mask


def _softmax_fp32(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """scores [B, H, T, S] fp32, mask broadcastable to [B, T, S] -> probabilities [B, H, T, S] fp32."""
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None] if mask.dim() == 3 else ~mask, float("-inf"))
    return scores.softmax(dim=-1)


def mla_attention_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Materialized per-head attention.

    q_nope [B, T, H, Dn], q_pe [B, T, H, Dr], k_nope [B, S, H, Dn], k_pe [B, S, Dr] (shared by heads),
    v [B, S, H, Dv], mask bool broadcastable to [B, T, S] (True = attend) or None -> o [B, T, H, Dv].
    """
    scores = torch.einsum("bthd,bshd->bhts", q_nope.float(), k_nope.float())
    scores = scores + torch.einsum("bthd,bsd->bhts", q_pe.float(), k_pe.float())
    p = _softmax_fp32(scores * scale, mask)
    return torch.einsum("bhts,bshd->bthd", p, v.float()).to(v.dtype)


CAUSAL_BLOCK_SCORES = 1 << 17  # `mla_attention_causal`: score elements per query block (512 KB fp32, an L2)


def mla_attention_causal(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor,
    block: int | None = None,
) -> torch.Tensor:
    """`mla_attention_reference` for a causal mask, by query blocks (same result; the prefill path).

    Shapes as in `mla_attention_reference`; `mask` [B or 1, T, S] must be causal in the cache convention
    (query t never sees a key past S - T + t; a ragged or document mask only hides more). Query block
    [a, b) then attends keys [0, S - T + b) only: the fully masked upper-right part of the scores is never
    computed (~half of them at T == S), and each block's [B, H, block, <= S] scores stay in cache across
    the matmul, mask, softmax and matmul over them. `block` (queries per block) defaults to the largest
    multiple of 16 whose scores fit CAUSAL_BLOCK_SCORES, at least 64. The nope and rope parts of the
    query and key are concatenated, so each block's scores are one matmul (the scale folded into q).
    """
    B, T, H, _ = q_nope.shape
    S = k_nope.shape[1]
    if block is None:
        block = max(64, CAUSAL_BLOCK_SCORES // (B * H * S) // 16 * 16)
    q = (torch.cat([q_nope.float(), q_pe.float()], -1) * scale).transpose(1, 2)  # [B, H, T, Dn+Dr]
    k_pe = k_pe.float()[:, :, None].expand(-1, -1, H, -1)
    k = torch.cat([k_nope.float(), k_pe], -1).transpose(1, 2)  # [B, H, S, Dn+Dr]
    vf = v.float().transpose(1, 2)  # [B, H, S, Dv]
    outs = []
    for a in range(0, T, block):
        b = min(T, a + block)
        keys = S - T + b
        scores = q[:, :, a:b] @ k[:, :, :keys].mT  # [B, H, b - a, keys]
        scores = scores.masked_fill_(~mask[:, None, a:b, :keys], float("-inf"))
        outs.append(scores.softmax(-1) @ vf[:, :, :keys])  # [B, H, b - a, Dv]
    return torch.cat(outs, 2).transpose(1, 2).to(v.dtype)


def split_kv_b(kv_b_weight: torch.Tensor, H: int, Dn: int, Dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H*(Dn+Dv), R] -> (W_UK [H, Dn, R], W_UV [H, Dv, R]) as views."""
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != H * (Dn + Dv):
        raise ValueError(
            f"kv_b_weight must be [H*(Dn+Dv)={H * (Dn + Dv)}, R], got {tuple(kv_b_weight.shape)}"
        )
    w = kv_b_weight.view(H, Dn + Dv, -1)
    return w[:, :Dn], w[:, Dn:]


def mla_attention_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the latent (W_UK absorbed into q, W_UV applied after).

    q_nope [B, T, H, Dn], q_pe [B, T, H, Dr], c_kv [B, S, R] (already RMS-normed), k_pe [B, S, Dr],
    w_uk [H, Dn, R], w_uv [H, Dv, R], mask bool broadcastable to [B, T, S] or None -> o [B, T, H, Dv].
    """
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_uk.float())  # [B, T, H, R]
    c = c_kv.float()
    scores = torch.einsum("bthr,bsr->bhts", q_lat, c)
    scores = scores + torch.einsum("bthd,bsd->bhts", q_pe.float(), k_pe.float())
    p = _softmax_fp32(scores * scale, mask)
    o_lat = torch.einsum("bhts,bsr->bthr", p, c)  # [B, T, H, R]
    return torch.einsum("bthr,hvr->bthv", o_lat, w_uv.float()).to(c_kv.dtype)


def mla_attention_latent(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mla_attention_absorbed` over whole latents (same maths, fewer ops: the decode fast path).

    latent [B, S, R+Dr] = [c_kv | k_pe] as cached; the heads fold into query rows, so the scores are one
    [B, H*T, R+Dr] x [B, S, R+Dr]^T batched matmul and the values one more. mask bool broadcastable to
    [B, T, S] or None -> o [B, T, H, Dv] in the latent's dtype.
    """
    B, T, H, _ = q_nope.shape
    R = w_uk.shape[-1]
    q_lat = torch.matmul(q_nope.float().transpose(1, 2), w_uk.float())  # [B, H, T, R]
    q = torch.cat([q_lat, q_pe.float().transpose(1, 2)], -1).view(B, H * T, -1)
    lat = latent.float()
    scores = torch.bmm(q, lat.mT).mul_(scale)  # [B, H*T, S]
    if mask is not None:
        keep = mask.expand(B, T, -1)[:, None].expand(B, H, T, -1).reshape(B, H * T, -1)
        scores.masked_fill_(~keep, float("-inf"))
    o_lat = torch.bmm(scores.softmax(-1), lat[..., :R])  # [B, H*T, R]
    o = torch.matmul(o_lat.view(B, H, T, R), w_uv.float().mT)  # [B, H, T, Dv]
    return o.transpose(1, 2).to(latent.dtype)


def query_positions(T: int, S: int, q_offsets: torch.Tensor | None, device=None) -> torch.Tensor:
    """Key position of each query: q_offsets[b] + t (ragged rows), or S - T + t (the cache convention)
    -> long [B or 1, T]."""
    if q_offsets is None:
        if S < T:
            raise ValueError(f"causal attention needs S >= T, got T={T}, S={S}")
        return torch.arange(S - T, S, device=device)[None]
    if q_offsets.dim() != 1:
        raise ValueError(f"q_offsets must be [B], got {tuple(q_offsets.shape)}")
    if bool((q_offsets < 0).any()) or int(q_offsets.max()) + T > S:
        raise ValueError(f"q_offsets must lie in [0, S - T] = [0, {S - T}], got {q_offsets.tolist()}")
    return q_offsets.to(device=device, dtype=torch.long)[:, None] + torch.arange(T, device=device)


def ragged_causal_mask(q_offsets: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """Row b's query t sits at key position q_offsets[b] + t and sees keys s <= that -> bool [B, T, S].

    Keys past a row's own end (q_offsets[b] + T) are padding of a ragged batch and never visible."""
    q_pos = query_positions(T, S, q_offsets, q_offsets.device)
    return torch.arange(S, device=q_offsets.device)[None, None, :] <= q_pos[:, :, None]


def latent_blocks(c_kv: torch.Tensor, k_pe: torch.Tensor, block_size: int):
    """c_kv [B, S, R], k_pe [B, S, Dr] -> blocks [B, <=block_size, R+Dr] in key order."""
    for s0 in range(0, c_kv.shape[1], block_size):
        yield torch.cat([c_kv[:, s0 : s0 + block_size], k_pe[:, s0 : s0 + block_size]], dim=-1)


def expand_pays(T: int, R: int, Dn: int, Dv: int) -> bool:
    """Whether T queries per row attend over a key block more cheaply with per-head keys/values
    (`expand=True` below) than over the latent (absorbed). Per key and row, expanding costs the
    up-projection R*H*(Dn+Dv) plus H*T*(Dn+Dr+Dv) multiply-adds for scores and values; the absorbed form
    H*T*(2R+Dr). So expanding pays once T > R*(Dn+Dv) / (2R - Dn - Dv) (k3-tiny: 128; the release: 171)."""
    return 2 * R > Dn + Dv and T * (2 * R - Dn - Dv) > R * (Dn + Dv)


def mla_attention_over_blocks(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    blocks,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor | None = None,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_blocks=None,
    expand: bool = False,
) -> torch.Tensor:
    """MLA with an online softmax over a stream of latent key blocks (memory O(H*T*block)).

    q_nope [B, T, H, Dn], q_pe [B, T, H, Dr]; `blocks` yields latents [B, s_i, R+Dr] = [c_kv | k_pe] of
    consecutive key positions starting at 0 (e.g. read block by block from a paged cache); w_uk [H, Dn, R],
    w_uv [H, Dv, R]. Masking is structural: q_pos [B or 1, T] (query t of row b may see keys
    s <= q_pos[b, t]; None = no causal mask) and doc ids q_doc_ids [B, T] with `k_doc_blocks` yielding
    [B, s_i] alongside the blocks -> o [B, T, H, Dv] in the blocks' dtype.

    Two forms of the same sums (see `expand_pays` for which is cheaper):
    * absorbed (default): the heads share the latent key (MQA), so they fold into the query rows: one
      [B, H*T, s_i] score block against the latent per key block, values in latent space (W_UV after);
    * expand=True: each block is up-projected to per-head keys [B*H, s_i, Dn+Dr] and values
      [B*H, s_i, Dv] (the naive form, block by block), scores [B*H, T, s_i].
    Either way the loop is over rows x keys in 3-D batches: `batch` x `rows` queries of `width` values.
    The expanded form without doc ids runs each block as one native call where it can
    (`_over_blocks_native`: fp32 CPU, no autograd; the same sums, tiled by queries to stay in L2).
    """
    if expand and k_doc_blocks is None:
        kernel = _native_expanded_block(q_nope, q_pe, w_uk, w_uv)
        if kernel is not None:
            return _over_blocks_native(kernel, q_nope, q_pe, blocks, w_uk, w_uv, scale, q_pos)
    B, T, H, _ = q_nope.shape
    R = w_uk.shape[-1]
    if expand:
        q = torch.cat([q_nope.float(), q_pe.float()], -1).transpose(1, 2).reshape(B * H, T, -1)
        width = w_uv.shape[1]
    else:
        q_lat = torch.einsum("bthd,hdr->bhtr", q_nope.float(), w_uk.float())
        q = torch.cat([q_lat, q_pe.float().transpose(1, 2)], -1).reshape(B, H * T, -1)
        width = R
    q = q * scale  # [batch, rows, key width], scale folded in
    m = torch.full((*q.shape[:2], 1), float("-inf"), device=q.device)  # running max
    l = torch.zeros(*q.shape[:2], 1, device=q.device)  # running softmax denominator
    acc = torch.zeros(*q.shape[:2], width, device=q.device)  # running numerator
    doc_iter = iter(k_doc_blocks) if k_doc_blocks is not None else None
    q_lo = None if q_pos is None else int(q_pos.min())  # keys up to here are visible to every query
    step = None if doc_iter is not None else _native_softmax_step(q)
    if step is not None and q_pos is not None:  # each score row's query position, [batch * rows] int64
        rows = q_pos.expand(B, T).repeat_interleave(H, 0) if expand else q_pos.expand(B, T).repeat(1, H)
        q_rows = rows.reshape(-1).contiguous()
    s0, dtype = 0, None
    for lat in blocks:
        dtype, s, lat = lat.dtype, lat.shape[1], lat.float()
        keys, values = _block_keys(lat, w_uk, w_uv, H) if expand else (lat, lat[..., :R])
        masked = q_pos is not None and s0 + s - 1 > q_lo  # only blocks reaching past q_lo need the mask
        if step is not None:  # the same block step in one native pass (p written over the scores)
            scores = torch.bmm(q, keys.mT)
            limit = q_rows - (s0 - 1) if masked else None  # row r sees this block's keys j < limit[r]
            corr = step(scores, m, l, limit)
            acc = acc.mul_(corr).baddbmm_(scores, values)
            s0 += s
            continue
        scores = (q @ keys.mT).view(B, H, T, s)
        keep = None
        if masked:
            keep = torch.arange(s0, s0 + s, device=q.device)[None, None, :] <= q_pos[:, :, None]
        if doc_iter is not None:
            same = q_doc_ids[:, :, None] == next(doc_iter)[:, None, :]
            keep = same if keep is None else keep & same
        if keep is not None:
            scores.masked_fill_(~keep[:, None], float("-inf"))
        scores = scores.view(*q.shape[:2], s)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing seen yet
        p = scores.sub_(m_safe).exp_()  # in place: one [batch, rows, s] buffer per block
        corr = torch.exp(m - m_safe)
        l = l * corr + p.sum(-1, keepdim=True)
        acc = torch.baddbmm(acc * corr, p, values)
        m, s0 = m_new, s0 + s
    if dtype is None:
        raise ValueError("blocks yielded no keys")
    o = (acc / l).view(B, H, T, width)
    if expand:
        return o.transpose(1, 2).to(dtype)
    return torch.einsum("bhtr,hvr->bthv", o, w_uv.float()).to(dtype)


# k3_online_softmax_block(scores, R, s, ld, limit, m, l, corr)
_SOFTMAX_ARGS = [native.PTR] + [native.I64] * 3 + [native.PTR] * 4


def _native_softmax_step(q: torch.Tensor):
    """The native online-softmax block step (`k3/ops/csrc/online_softmax.c`) for fp32 CPU queries without
    autograd, or None (no compiler, another device or dtype, a gradient: the torch ops run instead).
    -> step(scores [batch, rows, s], m, l [batch, rows, 1], limit [batch*rows] int64 | None) -> corr."""
    fits = native.fp32_cpu(q) and not (torch.is_grad_enabled() and q.requires_grad)
    fn = native.function("online_softmax", "k3_online_softmax_block", _SOFTMAX_ARGS) if fits else None
    if fn is None:
        return None

    def step(scores, m, l, limit):
        corr = torch.empty_like(m)
        R, s = scores.shape[0] * scores.shape[1], scores.shape[2]
        lim = None if limit is None else limit.data_ptr()
        fn(scores.data_ptr(), R, s, s, lim, m.data_ptr(), l.data_ptr(), corr.data_ptr())
        return corr

    return step


# k3_mla_block_expanded(q, lat, w_kvbT, q_pos, B, H, T, s, s0, R, Dn, Dr, Dv, tile, m, l, acc, scratch,
#                       threads, scratch_per_thread)
_BLOCK_ARGS = [native.PTR] * 4 + [native.I64] * 10 + [native.PTR] * 4 + [native.I64] * 2
NATIVE_QUERY_TILE = 128  # queries per tile: a [128, 256] score tile, one head's keys and values stay in L2
NATIVE_SUB_BLOCK = 256  # keys per step inside the kernel (its SUB_BLOCK)


def _native_expanded_block(q_nope, q_pe, w_uk, w_uv):
    """The tiled native block step (`k3/ops/csrc/mla_stream.c`) for fp32 CPU inputs without autograd,
    outside torch.compile, with the kernel's tiling (Dn, Dr multiples of 8, Dv and Dn + Dv of 16); else
    None."""
    Dn, Dr, Dv = q_nope.shape[-1], q_pe.shape[-1], w_uv.shape[1]
    if Dn % 8 or Dr % 8 or Dv % 16 or (Dn + Dv) % 16:
        return None
    return native.kernel_function(
        "mla_stream", "k3_mla_block_expanded", _BLOCK_ARGS, q_nope, q_pe, w_uk, w_uv
    )


def _over_blocks_native(fn, q_nope, q_pe, blocks, w_uk, w_uv, scale, q_pos):
    """`mla_attention_over_blocks` with expand=True and no doc ids, each latent block in one native call
    that tiles queries so a tile's scores, keys and values stay in L2 (the torch path's [B*H, T, block]
    score block outgrows L2 for long chunks and every pass over it goes to L3)."""
    B, T, H, Dn = q_nope.shape
    Dr, Dv, R = q_pe.shape[-1], w_uv.shape[1], w_uk.shape[-1]
    q = (torch.cat([q_nope, q_pe], -1).transpose(1, 2) * scale).contiguous()  # [B, H, T, Dn+Dr]
    w_kvbT = torch.cat([w_uk, w_uv], 1).reshape(-1, R).t().contiguous()  # [R, H (Dn+Dv)]: kv_b_proj.weight^T
    pos = None if q_pos is None else q_pos.to(torch.int64).expand(B, T).contiguous()
    m = torch.full((B, H, T), float("-inf"))
    l, acc = torch.zeros(B, H, T), torch.zeros(B, H, T, Dv)
    s0, dtype, scratch = 0, None, torch.empty(0)
    for lat in blocks:
        dtype, s, lat = lat.dtype, lat.shape[1], lat.float().contiguous()
        sp = -(-min(s, NATIVE_SUB_BLOCK) // 16) * 16  # keys per kernel step, padded to whole 16-key tiles
        per_thread = sp * (Dn + Dv + Dn + Dr + NATIVE_QUERY_TILE + R + Dr)
        threads = max(1, min(torch.get_num_threads(), B * H))  # (row, head) pairs split over threads
        if scratch.numel() < threads * per_thread:
            scratch = torch.empty(threads * per_thread)
        fn(q.data_ptr(), lat.data_ptr(), w_kvbT.data_ptr(), None if pos is None else pos.data_ptr(),
           B, H, T, s, s0, R, Dn, Dr, Dv, NATIVE_QUERY_TILE, m.data_ptr(), l.data_ptr(), acc.data_ptr(),
           scratch.data_ptr(), threads, per_thread)  # fmt: skip
        s0 += s
    if dtype is None:
        raise ValueError("blocks yielded no keys")
    return (acc / l[..., None]).transpose(1, 2).to(dtype)


def _block_keys(lat: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, H: int):
    """Latent block [B, s, R+Dr] fp32 -> per-head keys [B*H, s, Dn+Dr] (k_pe shared by the heads) and
    values [B*H, s, Dv]."""
    B, s, _ = lat.shape
    R = w_uk.shape[-1]
    c, k_pe = lat[..., :R], lat[..., R:]
    k_nope = torch.einsum("bsr,hdr->bhsd", c, w_uk.float())
    keys = torch.cat([k_nope, k_pe[:, None].expand(B, H, s, k_pe.shape[-1])], -1)
    values = torch.einsum("bsr,hvr->bhsv", c, w_uv.float())
    return keys.reshape(B * H, s, -1), values.reshape(B * H, s, -1)


def mla_attention_blockwise(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    causal: bool = True,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    block_size: int = 512,
    q_offsets: torch.Tensor | None = None,
    expand: bool = False,
) -> torch.Tensor:
    """`mla_attention_absorbed` with an online softmax over key blocks of `block_size` (memory O(T*block));
    expand=True up-projects each block to per-head keys and values instead (`mla_attention_over_blocks`).

    Shapes as in `mla_attention_absorbed`; the mask is given structurally instead of as a [T, S] tensor:
    `causal` (queries are the last T of the S keys, or with q_offsets [B] row b's query t is at key
    position q_offsets[b] + t: a ragged batch, see `ragged_causal_mask`) and/or doc ids q_doc_ids [B, T],
    k_doc_ids [B, S].
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("q_doc_ids and k_doc_ids must be given together")
    if q_offsets is not None and not causal:
        raise ValueError("q_offsets needs causal=True")
    T, S = q_nope.shape[1], c_kv.shape[1]
    q_pos = query_positions(T, S, q_offsets, c_kv.device) if causal else None
    k_docs = None
    if k_doc_ids is not None:
        k_docs = (k_doc_ids[:, s0 : s0 + block_size] for s0 in range(0, S, block_size))
    blocks = latent_blocks(c_kv, k_pe, block_size)
    return mla_attention_over_blocks(
        q_nope, q_pe, blocks, w_uk, w_uv, scale, q_pos, q_doc_ids, k_docs, expand=expand
    )
