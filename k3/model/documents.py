"""Packed-document bookkeeping: convert between `cu_seqlens` (KDA) and `doc_ids` (MLA masks).

A packed batch [B, T] holds several documents per row; every row boundary is also a document boundary.
`cu_seqlens` [N+1] are cumulative document lengths over the flattened B*T tokens; `doc_ids` [B, T] give
each token a document number that is unique across the whole batch.
"""

import torch


def doc_ids_to_cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] -> cu_seqlens [N+1] int64 (a new document wherever the id changes or a row starts)."""
    b, t = doc_ids.shape
    starts = torch.ones(b, t, dtype=torch.bool, device=doc_ids.device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten()
    end = torch.tensor([b * t], device=doc_ids.device)
    return torch.cat([idx, end]).to(torch.int64)


def cu_seqlens_to_doc_ids(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """cu_seqlens [N+1] over batch*seqlen tokens -> doc_ids [B, T] int64."""
    if cu_seqlens.ndim != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != batch * seqlen:
        raise ValueError(
            f"cu_seqlens must be 1-D, start at 0 and end at B*T={batch * seqlen}; got {cu_seqlens.tolist()}"
        )
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths <= 0).any()):
        raise ValueError("cu_seqlens must be strictly increasing")
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    ids = ids.view(batch, seqlen)
    if batch > 1 and bool((ids[1:, 0] == ids[:-1, -1]).any()):
        raise ValueError("a document in cu_seqlens crosses a row boundary; every row must start a document")
    return ids


def block_causal_mask(
    doc_ids: torch.Tensor | None, q_len: int, k_len: int, device: torch.device | None = None
) -> torch.Tensor:
    """Boolean [B or 1, q_len, k_len] mask (True = attend): causal, and within one document when given.

    Queries are the last q_len positions of the k_len keys (a cache prefix of k_len - q_len tokens).
    """
    offset = k_len - q_len
    qi = torch.arange(q_len, device=device).unsqueeze(1) + offset
    ki = torch.arange(k_len, device=device).unsqueeze(0)
    mask = (ki <= qi).unsqueeze(0)
    if doc_ids is not None:
        if offset != 0:
            raise ValueError("doc_ids masks are only supported without a cache prefix")
        mask = mask & (doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1))
    return mask
