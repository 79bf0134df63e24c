"""Re-layout of packed documents (`cu_seqlens`) so they never share a recurrent state.

Documents are copied into a zero-padded layout where each one starts on a boundary: either one row per
document ([N, T_max], the recurrent path) or one row with every document padded to a multiple of the
chunk size (the chunk path). Padding is exact for KDA: with k = 0, g = 0 and beta = 0 a token leaves the
state unchanged, so the state after a document's padding is its final state.
"""

import torch


def padded_starts(lengths: list[int], multiple: int) -> tuple[list[int], int]:
    """Start of each document when each is padded to a multiple of `multiple`, and the total length."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += -(-n // multiple) * multiple
    return starts, total


def token_index(lengths: list[int], starts: list[int], device) -> torch.Tensor:
    """Destination of every packed token in the padded layout -> LongTensor [T]."""
    lens = torch.tensor(lengths, device=device)
    shift = torch.tensor(starts, device=device) - (torch.cumsum(lens, 0) - lens)
    return torch.arange(int(lens.sum()), device=device) + torch.repeat_interleave(shift, lens)


def scatter_tokens(x: torch.Tensor, index: torch.Tensor, total: int) -> torch.Tensor:
    """x [T, ...] -> [total, ...] with x[t] at index[t] and zeros elsewhere (differentiable)."""
    return x.new_zeros(total, *x.shape[1:]).index_copy(0, index, x)


def gather_tokens(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Inverse of `scatter_tokens`: y [total, ...] -> [T, ...]."""
    return y.index_select(0, index)
