"""Engine-side implementations of the model's per-layer state interface (k3.model.state) over the
engine-owned pools: MLA latents in pages, KDA states in slots.

A forward's rows may have different cached lengths c_b (a ragged batch: decode rows of any lengths, or
prefill chunks of equal size T at different offsets). `PagedBatch` holds what all MLA layers of one
forward share -- the rows' page tables [B, n_pages] and lengths -- and computes pool row indices from
them; `PagedMLAState` is one layer's view over its pool. It implements the whole MLA state interface:

* `append` writes the T new latents into the rows' pages and gathers all keys [B, max(c_b) + T, R+Dr]
  (row b valid up to c_b + T; past that the index points at page 0, padding the causal mask hides) --
  the dense path, for short attention;
* `write` + `blocks` write, then yield the keys block by block, each gathered straight from the pages,
  so a long context never has a second [S, R+Dr] copy beside the pool (the layer's streaming path).

KDA states are gathered from the slot pool into a plain `KDAState` and scattered back after (the model
runner); a KDA layer at T tokens per row does not care how long each row's history is.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


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


class PagedMLAState:
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
