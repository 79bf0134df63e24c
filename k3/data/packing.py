"""Pack tokenized documents into fixed-length training rows with document boundaries.

Token stream. Each epoch orders the documents by a seeded permutation (or keeps corpus order) and
concatenates them, every document *followed* by ``eos_id`` (``<|end_of_msg|>``, the stop token, so a
model trained on the stream learns to end a document and generation stops there). Epochs follow each
other without a gap. No BOS is used (the chat path prepends none either, docs/spec_text.md#tokenizer).

Rows. Row ``r`` holds stream tokens ``[r*T, r*T + T + 1)``: ``input_ids = row[:-1]``, ``labels = row[1:]``,
so consecutive rows' inputs tile the stream exactly and every token is predicted once. The label of a
document's EOS is the next document's first token (harmless, and it keeps the stream dense).

Segments. A *segment* is the part of one document inside one row (its trailing EOS included). The
model must not let attention or recurrent state cross a segment: every document start and every row
start begins a new segment. A batch flattens its B rows to ``B*T`` tokens and describes segments twice:

  * ``cu_seqlens`` [N+1] int64 -- segment start offsets in the flattened batch, ``0 .. B*T`` (the KDA
    varlen convention, B=1 packing);
  * ``doc_ids`` [B, T] int64 -- the segment index of every token (``0 .. N-1``, increasing), from which
    :func:`block_causal_mask` builds the block-diagonal causal attention mask.

Resumption. :class:`PackedLoader` keeps its position as (epoch, document index in the epoch order,
offset in that document); ``state_dict()`` / ``load_state_dict()`` carry it with the shuffle seed, so a
resumed run sees exactly the batches an uninterrupted one would.

Tokenized documents live in one flat int32 array plus int64 offsets (:class:`TokenizedDocs`), built
once with the tokenizer's multi-threaded batch encode and cached as ``.npy`` (memory-mapped on load).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3.tokenizer import K3Tokenizer

_ENCODE_CHUNK = 512  # documents per encode_batch call


@dataclass
class TokenizedDocs:
    """Documents as one flat token array: document ``d`` is ``tokens[offsets[d]:offsets[d+1]]``."""

    tokens: np.ndarray  # [num_tokens] int32, no separators
    offsets: np.ndarray  # [num_docs + 1] int64, offsets[0] == 0, offsets[-1] == num_tokens

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d] : self.offsets[d + 1]]


def tokenize_documents(tokenizer: K3Tokenizer, docs: Iterable[str]) -> TokenizedDocs:
    """Encode ``docs`` (reserved names not matched) into a :class:`TokenizedDocs`."""
    docs = list(docs)
    pieces, lengths = [], []
    for i in range(0, len(docs), _ENCODE_CHUNK):
        for ids in tokenizer.encode_batch(docs[i : i + _ENCODE_CHUNK]):
            pieces.append(np.asarray(ids, dtype=np.int32))
            lengths.append(len(ids))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedDocs(tokens, offsets)


def load_or_tokenize(
    tokenizer: K3Tokenizer, directory: str | os.PathLike, name: str, docs_fn: Callable[[], Iterable[str]]
) -> TokenizedDocs:
    """``<directory>/tokens-<name>.npy`` + ``offsets-<name>.npy`` if present and consistent, else tokenize
    ``docs_fn()`` and write them. Keep ``directory`` specific to the tokenizer (its cache dir)."""
    d = Path(directory)
    tok_path, off_path = d / f"tokens-{name}.npy", d / f"offsets-{name}.npy"
    try:
        td = TokenizedDocs(np.load(tok_path, mmap_mode="r"), np.load(off_path))
        if td.offsets[0] == 0 and td.num_tokens == len(td.tokens) and np.all(np.diff(td.offsets) >= 0):
            if len(td.tokens) == 0 or int(td.tokens.max()) < tokenizer.vocab_size:
                return td
    except (OSError, ValueError, IndexError):
        pass
    td = tokenize_documents(tokenizer, docs_fn())
    d.mkdir(parents=True, exist_ok=True)
    for path, arr in ((off_path, td.offsets), (tok_path, td.tokens)):
        tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npy")
        np.save(tmp, arr)
        os.replace(tmp, path)
    return td


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] segment ids -> [B, T, T] bool, True where query i may attend key j (same segment, j <= i)."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return same & causal


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] segment ids -> [N+1] int64 segment starts over the flattened ``B*T`` tokens.

    A segment starts wherever the id changes and at every row start.
    """
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int64)


class PackedLoader:
    """Endless, deterministic, resumable iterator of packed batches (see the module doc).

    Each ``next()`` consumes ``batch_size * world_size`` rows of the stream; this rank gets rows
    ``[rank*B, (rank+1)*B)`` of them, so every rank can share one state. A batch is a dict:
    ``input_ids`` [B, T] long, ``labels`` [B, T] long, ``cu_seqlens`` [N+1] int64, ``doc_ids`` [B, T] int64.
    """

    def __init__(
        self,
        docs: TokenizedDocs,
        seq_len: int,
        batch_size: int,
        eos_id: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        check_loader_args(docs, seq_len, batch_size, rank, world_size)
        self.docs, self.seq_len, self.batch_size, self.eos_id = docs, seq_len, batch_size, eos_id
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self._cursor = (0, 0, 0)  # (epoch, index into the epoch's document order, offset in that document)
        self._orders: dict[int, np.ndarray] = {}

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches in one pass over the stream (documents + one EOS each)."""
        return (self.docs.num_tokens + self.docs.num_docs) // (
            self.seq_len * self.batch_size * self.world_size
        )

    def state_dict(self) -> dict:
        epoch, doc_index, offset = self._cursor
        return dict(
            epoch=epoch,
            doc_index=doc_index,
            offset=offset,
            seed=self.seed,
            shuffle=self.shuffle,
            num_docs=self.docs.num_docs,
            num_tokens=self.docs.num_tokens,
        )

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (its seed/shuffle replace ours); the data must be the same documents."""
        for key in ("num_docs", "num_tokens"):
            if state[key] != getattr(self.docs, key):
                raise ValueError(
                    f"state[{key!r}]={state[key]} does not match this data ({getattr(self.docs, key)})"
                )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._cursor = (int(state["epoch"]), int(state["doc_index"]), int(state["offset"]))
        self._orders.clear()

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        B = self.batch_size
        rows = []
        for r in range(B * self.world_size):
            row = self._next_row()
            if r // B == self.rank:
                rows.append(row)
        return rows_to_batch(rows)

    def _next_row(self) -> tuple[np.ndarray, np.ndarray]:
        """([T+1] tokens, [T] document-start flags) of the next row; advances the cursor by T tokens."""
        tokens, starts, cursor = self._read(self._cursor, self.seq_len)
        last, _, _ = self._read(cursor, 1)
        self._cursor = cursor
        return np.concatenate([tokens, last]), starts

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = self.docs.num_docs
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                order = rng.permutation(n)
            else:
                order = np.arange(n)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1} | {epoch: order}
        return self._orders[epoch]

    def _read(
        self, cursor: tuple[int, int, int], n: int
    ) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
        """``n`` stream tokens from ``cursor``: ([n] int64 tokens, [n] bool doc-start flags, cursor after)."""
        epoch, index, offset = cursor
        tokens, starts = np.empty(n, dtype=np.int64), np.zeros(n, dtype=bool)
        filled = 0
        while filled < n:
            d = int(self._order(epoch)[index])
            lo, hi = int(self.docs.offsets[d]), int(self.docs.offsets[d + 1])
            length = hi - lo + 1  # + EOS
            take = min(n - filled, length - offset)
            starts[filled] = offset == 0
            body = min(offset + take, hi - lo) - offset  # tokens of the document itself in this piece
            tokens[filled : filled + body] = self.docs.tokens[lo + offset : lo + offset + body]
            if body < take:
                tokens[filled + take - 1] = self.eos_id
            filled, offset = filled + take, offset + take
            if offset == length:
                offset, index = 0, index + 1
                if index == self.docs.num_docs:
                    index, epoch = 0, epoch + 1
        return tokens, starts, (epoch, index, offset)


def check_loader_args(docs: TokenizedDocs, seq_len: int, batch_size: int, rank: int, world_size: int) -> None:
    """The arguments every row loader (PackedLoader, k3.data.rows.ShuffledRows) refuses, by name."""
    for key, v in (("seq_len", seq_len), ("batch_size", batch_size), ("world_size", world_size)):
        if v < 1:
            raise ValueError(f"{key} must be >= 1, got {v}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if docs.num_docs == 0:
        raise ValueError("docs holds no documents")


def rows_to_batch(rows: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    """A packed batch from B rows of ([T+1] tokens, [T] document-start flags): input_ids, labels [B, T]
    long; segments restart at every row and document start (cu_seqlens [N+1], doc_ids [B, T])."""
    inputs = np.stack([r[0] for r in rows])  # [B, T+1]
    starts = np.stack([r[1] for r in rows])  # [B, T]
    starts[:, 0] = True
    B, T = starts.shape
    flat = torch.from_numpy(starts.reshape(-1))
    cu = torch.nonzero(flat).flatten()
    return dict(
        input_ids=torch.from_numpy(inputs[:, :-1]).long(),
        labels=torch.from_numpy(inputs[:, 1:]).long(),
        cu_seqlens=torch.cat([cu, cu.new_tensor([B * T])]).to(torch.int64),
        doc_ids=(torch.cumsum(flat.long(), 0) - 1).view(B, T),
    )
