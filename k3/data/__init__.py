"""Training data: corpus loading (corpus.py), packing into batches (packing.py), and `prepare_data`.

`prepare_data` is the one call a training script needs::

    data = prepare_data(path=None, vocab_size=8192)          # stdlib corpus; cached after the first run
    loader = PackedLoader(data.train, seq_len=1024, batch_size=8, eos_id=data.tokenizer.eos_id, seed=0)
    batch = next(loader)                                     # input_ids, labels, cu_seqlens, doc_ids

It trains (or loads the cached) tokenizer on the training split and tokenizes both splits once; all of it
is cached under ``$K3_CACHE_DIR/tokenizers/<corpus fingerprint>-<vocab_size>/`` (see docs/training.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from k3.data.corpus import (
    DEFAULT_VAL_PERCENT,
    Corpus,
    CorpusStats,
    corpus_fingerprint,
    in_val_split,
    load_corpus,
    stdlib_root,
)
from k3.data.packing import (
    PackedLoader,
    TokenizedDocs,
    block_causal_mask,
    cu_seqlens_from_doc_ids,
    load_or_tokenize,
    tokenize_documents,
)
from k3.data.rows import ShuffledRows
from k3.tokenizer import DEFAULT_VOCAB_SIZE, K3Tokenizer, load_or_train_tokenizer, tokenizer_cache_path

__all__ = [
    "DEFAULT_VAL_PERCENT",
    "Corpus",
    "CorpusStats",
    "PackedLoader",
    "PreparedData",
    "ShuffledRows",
    "TokenizedDocs",
    "block_causal_mask",
    "corpus_fingerprint",
    "cu_seqlens_from_doc_ids",
    "in_val_split",
    "load_corpus",
    "load_or_tokenize",
    "prepare_data",
    "stdlib_root",
    "tokenize_documents",
]


@dataclass
class PreparedData:
    tokenizer: K3Tokenizer
    train: TokenizedDocs
    val: TokenizedDocs
    fingerprint: str
    cache_path: Path  # the tokenizer directory; the token arrays sit beside tokenizer.json


def prepare_data(
    path: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_percent: float = DEFAULT_VAL_PERCENT,
    cache_dir: str | os.PathLike | None = None,
) -> PreparedData:
    """Tokenizer + tokenized train/val splits of the corpus at ``path`` (``None`` = stdlib), cached."""
    fingerprint = corpus_fingerprint(path, val_percent)
    loaded: dict[str, list[str]] = {}

    def documents(split: str):
        def load() -> list[str]:
            if split not in loaded:
                loaded[split] = load_corpus(path, split, val_percent).documents
            return loaded[split]

        return load

    tokenizer = load_or_train_tokenizer(fingerprint, documents("train"), vocab_size, cache_dir)
    cache_path = tokenizer_cache_path(fingerprint, vocab_size, cache_dir)
    train = load_or_tokenize(tokenizer, cache_path, "train", documents("train"))
    val = load_or_tokenize(tokenizer, cache_path, "val", documents("val"))
    return PreparedData(tokenizer, train, val, fingerprint, cache_path)
