"""Training rows in random order: every batch holds pieces of many files, not consecutive rows of one.

`PackedLoader` (packing.py) hands out the rows of the packed stream in stream order, so the rows of one
batch are consecutive text: a 50 KB file is ~60 rows of 256 tokens, a whole batch from one file. The
per-step loss then swings with the file (measured on the stdlib, 16 x 256 tokens: a spread of ~0.4 nats
per step, single steps at 2x the lowest loss so far) and each step's gradient sees one kind of code.
`ShuffledRows` cuts the same stream into the same kind of rows but serves them in a seeded random
order, so a batch is B rows from B random places of the corpus.

Epoch ``e``: documents in the order ``default_rng(SeedSequence([seed, e])).permutation(n)`` (as
PackedLoader), concatenated with one EOS after each; the stream is cut into ``(len - 1) // T`` rows
(row ``r`` holds tokens ``[r*T, r*T + T + 1)``; the few tokens past the last whole row are left out of
that epoch only); the rows are served in the order ``default_rng(SeedSequence([seed, e, 1]))
.permutation(rows)``. Epochs follow each other; a batch may hold the last rows of one and the first of
the next. Segments (``doc_ids`` / ``cu_seqlens``) restart at every row and document start, as in
PackedLoader, so no context crosses a file or a row. State: (epoch, rows served in it); resuming
rebuilds the epoch's stream and order from the seed, so a resumed run sees the same batches.
"""

from __future__ import annotations

import numpy as np
import torch

from k3.data.packing import TokenizedDocs, check_loader_args, rows_to_batch


class ShuffledRows:
    """Endless, deterministic, resumable batches of randomly ordered rows (see the module doc).

    ``next()`` consumes ``batch_size * world_size`` rows; this rank gets rows ``[rank*B, (rank+1)*B)``
    of them. A batch: ``input_ids``, ``labels`` [B, T] long, ``cu_seqlens`` [N+1], ``doc_ids`` [B, T].
    """

    def __init__(
        self,
        docs: TokenizedDocs,
        seq_len: int,
        batch_size: int,
        eos_id: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        check_loader_args(docs, seq_len, batch_size, rank, world_size)
        if docs.num_tokens + docs.num_docs - 1 < seq_len:
            raise ValueError(f"seq_len={seq_len}: the data holds fewer tokens than one row")
        self.docs, self.seq_len, self.batch_size, self.eos_id = docs, seq_len, batch_size, eos_id
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._epoch, self._served = 0, 0
        self._built: int | None = None  # the epoch whose stream / order are in memory

    @property
    def rows_per_epoch(self) -> int:
        return (self.docs.num_tokens + self.docs.num_docs - 1) // self.seq_len

    @property
    def batches_per_epoch(self) -> int:
        return self.rows_per_epoch // (self.batch_size * self.world_size)

    def state_dict(self) -> dict:
        return dict(
            kind="shuffled_rows",
            epoch=self._epoch,
            served=self._served,
            seed=self.seed,
            num_docs=self.docs.num_docs,
            num_tokens=self.docs.num_tokens,
        )

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (its seed replaces ours); the data must be the same documents."""
        if state.get("kind") != "shuffled_rows":
            raise ValueError("state: not a ShuffledRows state (saved by another loader)")
        for key in ("num_docs", "num_tokens"):
            if state[key] != getattr(self.docs, key):
                raise ValueError(
                    f"state[{key!r}]={state[key]} does not match this data ({getattr(self.docs, key)})"
                )
        self.seed, self._epoch, self._served = int(state["seed"]), int(state["epoch"]), int(state["served"])
        self._built = None

    def __iter__(self) -> ShuffledRows:
        return self

    def _build(self, epoch: int) -> None:
        """The epoch's stream [L] int32, document-start flags [L] bool and row order [rows]."""
        n = self.docs.num_docs
        order = np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(n)
        lengths = np.diff(self.docs.offsets)[order] + 1  # + EOS
        ends = np.cumsum(lengths)
        stream = np.full(int(ends[-1]), self.eos_id, dtype=np.int32)
        starts = np.zeros(len(stream), dtype=bool)
        for d, end, length in zip(order, ends, lengths, strict=True):
            lo = int(end - length)
            stream[lo : lo + length - 1] = self.docs.doc(int(d))
            starts[lo] = True
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, 1]))
        self._stream, self._starts = stream, starts
        self._rows = rng.permutation(self.rows_per_epoch)
        self._built = epoch

    def _next_row(self) -> tuple[np.ndarray, np.ndarray]:
        """([T+1] tokens, [T] document-start flags) of the next row in the shuffled order."""
        if self._served == self.rows_per_epoch:
            self._epoch, self._served = self._epoch + 1, 0
        if self._built != self._epoch:
            self._build(self._epoch)
        lo = int(self._rows[self._served]) * self.seq_len
        self._served += 1
        return self._stream[lo : lo + self.seq_len + 1], self._starts[lo : lo + self.seq_len].copy()

    def __next__(self) -> dict[str, torch.Tensor]:
        B = self.batch_size
        rows = []
        for r in range(B * self.world_size):
            row = self._next_row()
            if r // B == self.rank:
                rows.append(row)
        return rows_to_batch(rows)
