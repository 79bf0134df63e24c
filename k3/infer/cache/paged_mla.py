"""The engine's paged MLA latents: one pool per MLA layer, rows grouped in pages, read through block tables.

A forward's rows may have different cached lengths c_b (a ragged batch: decode rows of any lengths, or
prefill chunks of equal size T at different offsets). `PagedBatch` holds what all MLA layers of one
forward share -- the rows' page tables [B, n_pages] and lengths -- and computes pool row indices from
them. Two states implement the model's MLA state protocol (`k3.model.state.MLACache`) over a layer's pool:

* `PagedMLAState`, for prefill chunks: `append` writes the T new latents into the rows' pages and
  gathers all keys [B, max(c_b) + T, R+Dr] (row b valid up to c_b + T; past that the index points at
  page 0, which the causal mask hides) -- the dense path; `write` + `blocks` write, then yield the keys
  block by block, each gathered straight from the pages, so a long context never has a second
  [S, R+Dr] copy beside the pool (the layer's streaming path);
* `PagedDecodeMLAState`, for one token per row: it attends itself (`attends_decode`) through the custom
  op `k3::paged_mla_decode`, so that a compiled decode step (`k3.infer.decode.torch_step`) traces the
  attention as one opaque call while everything around it keeps static shapes.

KDA states are gathered from the slot pool into a plain `KDAState` and scattered back after (the model
runner); a KDA layer at T tokens per row does not care how long each row's history is.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from k3.model import mla as mla_layer
from k3.model.state import MLACache
from k3.ops.mla import mla_attention_latent, mla_attention_over_blocks, query_positions, ragged_causal_mask


class PagedBatch:
    """B sequences feeding T tokens each: block_tables long [B, n_pages] (padded with page 0) covering
    positions [0, max(c_b) + T), cached lengths long [B] (on the pool's device)."""

    def __init__(self, block_tables: torch.Tensor, lengths: torch.Tensor, T: int, page_size: int):
        if block_tables.dim() != 2 or lengths.shape != (block_tables.shape[0],):
            raise ValueError(
                f"block_tables must be [B, n_pages] and lengths [B], got {tuple(block_tables.shape)} "
                f"and {tuple(lengths.shape)}"
            )
        self.block_tables, self.lengths, self.T, self.page_size = block_tables, lengths, T, page_size
        self.max_length = int(lengths.max())
        if block_tables.shape[1] * page_size < self.max_length + T:
            raise ValueError(
                f"block_tables cover {block_tables.shape[1]} pages < {self.max_length + T} tokens"
            )
        self._write: torch.Tensor | None = None
        self._read: torch.Tensor | None = None

    @classmethod
    def from_tables(
        cls, tables: list[list[int]], lengths: list[int], T: int, page_size: int, device=None
    ) -> PagedBatch:
        """Python page lists (each covering at least its c_b + T tokens) -> a padded batch on `device`."""
        n = -(-(max(lengths) + T) // page_size)
        for b, (t, c) in enumerate(zip(tables, lengths, strict=True)):
            if len(t) * page_size < c + T:
                raise ValueError(f"row {b}: block table of {len(t)} pages cannot hold {c + T} tokens")
        padded = [t[:n] + [0] * (n - len(t[:n])) for t in tables]
        return cls(
            torch.tensor(padded, dtype=torch.long, device=device),
            torch.tensor(lengths, dtype=torch.long, device=device),
            T,
            page_size,
        )

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Key positions long [B, n] or [n] (same for every row) -> pool row indices [B, n]."""
        ps = self.page_size
        if positions.dim() == 1:
            return self.block_tables[:, positions // ps] * ps + positions % ps
        return self.block_tables.gather(1, positions // ps) * ps + positions % ps

    def range_rows(self, start: int, stop: int) -> torch.Tensor:
        """Pool rows [B, stop - start] of key positions start .. stop - 1 (`rows` of a range, built from
        whole pages: a few small ops instead of an indexed gather per position)."""
        ps = self.page_size
        pages = self.block_tables[:, start // ps : -(-stop // ps), None] * ps
        offset = start % ps
        return (pages + torch.arange(ps, device=pages.device)).flatten(1)[:, offset : offset + stop - start]

    @property
    def write_rows(self) -> torch.Tensor:
        """Pool rows [B*T] of the new tokens (positions c_b .. c_b + T - 1 of each row)."""
        if self._write is None:
            pos = self.lengths[:, None] + torch.arange(self.T, device=self.lengths.device)
            self._write = self.rows(pos).flatten()
        return self._write

    @property
    def read_rows(self) -> torch.Tensor:
        """Pool rows [B, max(c_b) + T] of every key position (the dense gather)."""
        if self._read is None:
            self._read = self.range_rows(0, self.max_length + self.T)
        return self._read


class PagedMLAState(MLACache):
    """One MLA layer's latents for a `PagedBatch` in its pool [num_pages * page_size, R+Dr]."""

    def __init__(self, pool: torch.Tensor, batch: PagedBatch):
        self.pool, self.batch, self._written = pool, batch, False

    @property
    def length(self) -> int:
        """The longest row's cached length (the layer reads `lengths` for the per-row ones)."""
        return self.batch.max_length + (self.batch.T if self._written else 0)

    @property
    def lengths(self) -> torch.Tensor:
        return self.batch.lengths + (self.batch.T if self._written else 0)

    def write(self, new: torch.Tensor) -> None:
        """new [B, T, R+Dr] -> the rows' pages (once per forward)."""
        B, T, W = new.shape
        b = self.batch
        if self._written or (B, T) != (b.lengths.shape[0], b.T) or W != self.pool.shape[1]:
            raise ValueError(
                f"new latents {tuple(new.shape)} do not match the planned write of "
                f"[{b.lengths.shape[0]}, {b.T}, {self.pool.shape[1]}] (once per forward)"
            )
        self.pool.index_copy_(0, b.write_rows, new.reshape(B * T, W).to(self.pool.dtype))
        self._written = True

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """new [B, T, R+Dr] -> all latents [B, max(c_b) + T, R+Dr] (new ones written to the pages)."""
        self.write(new)
        return self._gather(self.batch.read_rows)

    def blocks(self, block_size: int) -> Iterator[torch.Tensor]:
        """-> latents [B, <= block_size, R+Dr] of key positions [0, length) in order, one page gather each."""
        S = self.length
        for s0 in range(0, S, block_size):
            yield self._gather(self.batch.range_rows(s0, min(S, s0 + block_size)))

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Pool rows [B, n] -> latents [B, n, R+Dr] (index_select: ~4x faster than advanced indexing on
        CPU for a decode step's few hundred rows)."""
        return self.pool.index_select(0, rows.flatten()).view(*rows.shape, self.pool.shape[1])


# ---- one token per row: the decode attention as one custom op ----------------------------------
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


class PagedDecodeMLAState(MLACache):
    """One MLA layer's view of its pool for rows feeding one token each, with no host reads (so a compiled
    decode step can build it): block_tables long [B, n_pages], lengths long [B] (cached tokens before
    this step). The MLA layer hands it the new latents and queries (`decode_attention`), and it runs
    `paged_mla_decode`. It implements only this one-token form of the state protocol (k3.model.state)."""

    attends_decode = True

    def __init__(self, pool: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, page_size: int):
        self.pool, self.block_tables, self.lengths, self.page_size = pool, block_tables, lengths, page_size

    def decode_attention(self, q_nope, q_pe, latent, w_uk, w_uv, scale: float) -> torch.Tensor:
        """Store `latent` [B, 1, R+Dr] as key c_b of each row and attend -> o [B, 1, H, Dv]."""
        tables, lengths = self.block_tables, self.lengths
        return paged_mla_decode(
            q_nope, q_pe, latent, self.pool, tables, lengths, w_uk, w_uv, scale, self.page_size
        )
