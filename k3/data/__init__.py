"""Training data: corpus loading (corpus.py), packing into batches (packing.py), and `prepare_data`.

`prepare_data` is the one call a training script needs::

    data = prepare_data(path=None, vocab_size=8192)          # stdlib corpus; cached after the first run
    loader = PackedLoader(data.train, seq_len=1024, batch_size=8, eos_id=data.tokenizer.eos_id, seed=0)
    batch = next(loader)                                     # input_ids, labels, cu_seqlens, doc_ids

It trains (or loads the cached) tokenizer on the training split and tokenizes both splits once; all of it
is cached under ``$K3_CACHE_DIR/tokenizers/<corpus fingerprint>-<vocab_size>/`` (see docs/data.md),
with ``corpus.json``: what loading read, held out and skipped (`PreparedData.stats`, `describe_data`).
A bad record raises ValueError unless ``skip_bad`` (k3.data.corpus); a cache built with ``skip_bad``
that skipped records is read again without it, so the same error comes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from k3.data.corpus import (
    DEFAULT_VAL_PERCENT,
    Corpus,
    CorpusStats,
    corpus_fingerprint,
    in_val_split,
    load_corpus,
    load_splits,
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
from k3.tokenizer import DEFAULT_VOCAB_SIZE, K3Tokenizer
from k3.tokenizer_train import load_or_train_tokenizer, tokenizer_cache_path

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
    "describe_data",
    "in_val_split",
    "load_corpus",
    "load_splits",
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
    cached: bool = False  # the tokenizer and both token arrays came from the cache
    # files, skipped_files, bad_records, empty_documents, {train,val}_{documents,bytes}, val_percent
    stats: dict = field(default_factory=dict)


STATS_FILE = "corpus.json"


def prepare_data(
    path: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_percent: float = DEFAULT_VAL_PERCENT,
    cache_dir: str | os.PathLike | None = None,
    skip_bad: bool = False,
) -> PreparedData:
    """Tokenizer + tokenized train/val splits of the corpus at ``path`` (``None`` = stdlib), cached.
    ValueError at the first bad record unless ``skip_bad`` (then skipped and counted in ``stats``)."""
    fingerprint = corpus_fingerprint(path, val_percent)
    cache_path = tokenizer_cache_path(fingerprint, vocab_size, cache_dir)
    stats = _read_stats(cache_path / STATS_FILE)
    loaded: dict = {}

    def load_all() -> dict:
        if not loaded:
            loaded.update(load_splits(path, ("train", "val"), val_percent, skip_bad))
        return loaded

    if stats is None or (stats["bad_records"] and not skip_bad):
        stats = _stats(load_all(), val_percent)  # raises at a bad record without skip_bad
    if stats["train_documents"] == 0:
        raise ValueError(f"data: no training documents in {describe_data(stats, path)}")
    misses = []

    def documents(split: str):
        def load() -> list[str]:
            misses.append(split)
            return load_all()[split].documents

        return load

    tokenizer = load_or_train_tokenizer(fingerprint, documents("train"), vocab_size, cache_dir)
    train = load_or_tokenize(tokenizer, cache_path, "train", documents("train"))
    val = load_or_tokenize(tokenizer, cache_path, "val", documents("val"))
    _write_stats(cache_path / STATS_FILE, stats)
    return PreparedData(tokenizer, train, val, fingerprint, cache_path, cached=not misses, stats=stats)


def _stats(splits: dict, val_percent: float) -> dict:
    s = splits["train"].stats
    return dict(
        files=s.files_read,
        skipped_files=s.files_skipped_binary + s.files_skipped_unreadable,
        bad_records=s.bad_records,
        empty_documents=s.empty_documents,
        train_documents=splits["train"].stats.documents,
        train_bytes=splits["train"].stats.bytes,
        val_documents=splits["val"].stats.documents,
        val_bytes=splits["val"].stats.bytes,
        val_percent=val_percent,
    )


def _read_stats(path: Path) -> dict | None:
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return stats if isinstance(stats, dict) and "bad_records" in stats else None


def _write_stats(path: Path, stats: dict) -> None:
    if _read_stats(path) == stats:
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(stats, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the numbers are recomputed next time
        pass


def describe_data(stats: dict, path: str | None) -> str:
    """One line: what a run read, held out and skipped (from `PreparedData.stats`)."""
    mb = lambda n: f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:,} bytes"  # noqa: E731
    docs = stats["train_documents"] + stats["val_documents"]
    files = stats["files"]
    line = (
        f"{path or 'the Python standard library'}: {docs:,} documents, "
        f"{mb(stats['train_bytes'] + stats['val_bytes'])} from {files:,} file{'s' * (files != 1)}; "
        f"held out {stats['val_documents']:,} documents ({mb(stats['val_bytes'])}, "
        f"{stats['val_percent']:g} % by key) for validation"
    )
    skipped = [
        f"{stats['skipped_files']:,} files not UTF-8 text or unreadable" if stats["skipped_files"] else "",
        f"{stats['bad_records']:,} bad records (--skip-bad)" if stats["bad_records"] else "",
        f"{stats['empty_documents']:,} empty documents" if stats["empty_documents"] else "",
    ]
    skipped = [s for s in skipped if s]
    return line + ("; skipped " + ", ".join(skipped) if skipped else "")
