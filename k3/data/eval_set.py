"""The fixed evaluation set: every validation document once, in one seeded order, cut into rows.

Stream. ``[EOS] d_0 [EOS] d_1 [EOS] ... d_{n-1} [EOS]`` with the documents in the order of
``np.random.default_rng(seed).permutation(n)`` (seed 0 for every run and model): the targets are the
stream without its leading EOS, i.e. every token of every validation document plus each document's
closing EOS. The leading EOS stands for "start of a file", so a document's first token is predicted
from nothing, as the first document of a training row is. Hence the scored bytes are exactly the UTF-8
bytes of the validation documents (``EvalSet.texts`` concatenated in this order), which is what the
compressor baselines compress (k3.train.baselines).

Rows. Row ``r`` holds stream tokens ``[r*T, r*T + T + 1)`` (inputs ``[:-1]``, labels ``[1:]``) like the
training loader; the last row is padded with EOS inputs and ignored (-100) labels. Segments (``doc_ids``)
restart at every row and at every document's first token, so no context crosses a document or a row:
the same view of the text the model trains on. A prefix of the rows (``max_tokens``) is a random subset
of the documents' pieces, cheap enough for evaluations during training; all rows is the final number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from k3.data.packing import TokenizedDocs

IGNORE_INDEX = -100


@dataclass(frozen=True)
class EvalSet:
    """Validation rows: input_ids, labels, doc_ids [R, T] int64 (labels -100 past the stream's end)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor
    order: np.ndarray  # [n] the document order of the stream

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def batches(self, batch_size: int, max_tokens: int | None = None, rank: int = 0, world_size: int = 1):
        """Batches of `batch_size` rows (this rank's `batch_size // world_size` of each) over the first
        ceil(max_tokens / T) rows (all rows for None / 0); a short last batch is padded with ignored
        rows so every rank gets the same shapes. Yields dicts like the training loader's."""
        n = self.rows if not max_tokens else min(self.rows, -(-max_tokens // self.seq_len))
        per_rank = batch_size // world_size
        for lo in range(0, n, batch_size):
            idx = torch.arange(lo, lo + batch_size)
            real = idx < n
            idx = torch.where(real, idx, 0)
            ids, labels, docs = self.input_ids[idx], self.labels[idx].clone(), self.doc_ids[idx]
            labels[~real] = IGNORE_INDEX
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            yield _batch(ids[mine], labels[mine], docs[mine])


def _batch(input_ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor) -> dict:
    """A packed batch from rows; segment ids renumbered 0..N-1 over the batch, cu_seqlens to match."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = starts.flatten()
    cu = torch.nonzero(flat).flatten()
    return dict(
        input_ids=input_ids,
        labels=labels,
        cu_seqlens=torch.cat([cu, cu.new_tensor([B * T])]).to(torch.int64),
        doc_ids=(torch.cumsum(flat.long(), 0) - 1).view(B, T),
    )


def build_eval_set(docs: TokenizedDocs, seq_len: int, eos_id: int, seed: int = 0) -> EvalSet:
    """The rows of every document in `docs` (see the module doc); ValueError when there are none."""
    if docs.num_docs == 0:
        raise ValueError("docs: the evaluation set needs at least one document")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    order = np.random.default_rng(seed).permutation(docs.num_docs)
    pieces, seg = [np.array([eos_id], dtype=np.int64)], [np.zeros(1, dtype=np.int64)]
    for i, d in enumerate(order):
        body = np.asarray(docs.doc(int(d)), dtype=np.int64)
        pieces.append(np.concatenate([body, [eos_id]]))
        seg.append(np.full(len(body) + 1, i + 1, dtype=np.int64))  # the closing EOS ends this document
    stream, seg_ids = np.concatenate(pieces), np.concatenate(seg)
    n_targets = len(stream) - 1
    rows = -(-n_targets // seq_len)
    pad = rows * seq_len + 1 - len(stream)
    stream = np.concatenate([stream, np.full(pad, eos_id, dtype=np.int64)])
    seg_ids = np.concatenate([seg_ids, np.full(pad, seg_ids[-1] + 1, dtype=np.int64)])
    labels = stream[1:].copy()
    labels[n_targets:] = IGNORE_INDEX
    inputs = torch.from_numpy(stream[:-1].reshape(rows, seq_len))
    return EvalSet(
        input_ids=inputs,
        labels=torch.from_numpy(labels.reshape(rows, seq_len)),
        doc_ids=torch.from_numpy(seg_ids[:-1].reshape(rows, seq_len)),
        order=order,
    )
