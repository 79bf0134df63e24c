"""Engine-side implementations of the model's per-layer state interface (k3.model.state) over the
engine-owned pools: MLA latents in pages, KDA states in slots.

`PagedMLAState` writes the step's new latents into the sequences' pages and hands the layer all latents
of the batch as one contiguous [B, S, R+Dr] gather (simple and correct; a paged attention kernel can
replace the gather later). Rows in one call share their cached length, the dense-layout contract of the
MLA layer. KDA states are gathered from the slot pool into a plain `KDAState` and scattered back after.
"""

from __future__ import annotations

import torch


def page_positions(block_table: list[int], start: int, stop: int, page_size: int) -> torch.Tensor:
    """Flat pool indices [stop - start] of token positions [start, stop) of a sequence."""
    first, last = start // page_size, -(-stop // page_size)
    pages = torch.tensor(block_table[first:last], dtype=torch.long)
    rows = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    return rows[start - first * page_size : stop - first * page_size]


class PagedMLAState:
    """One MLA layer's view of B sequences with equal cached length `length` (pool [P*page_size, R+Dr])."""

    def __init__(self, pool: torch.Tensor, write_idx: torch.Tensor, read_idx: torch.Tensor, length: int):
        self.pool, self.write_idx, self.read_idx, self._length = pool, write_idx, read_idx, length

    @property
    def length(self) -> int:
        return self._length

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """new [B, T, R+Dr] -> all latents [B, S, R+Dr], S = length + T (new ones written to the pages)."""
        B, T, W = new.shape
        if self.write_idx.numel() != B * T or W != self.pool.shape[1]:
            raise ValueError(
                f"new latents {tuple(new.shape)} do not match the planned write of "
                f"{self.write_idx.numel()} tokens x {self.pool.shape[1]}"
            )
        self.pool[self.write_idx] = new.reshape(B * T, W).to(self.pool.dtype)
        self._length += T
        return self.pool[self.read_idx]
