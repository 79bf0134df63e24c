"""Training K3Tokenizers (byte-level BPE under Kimi K2's split, the reserved block on top) and the cache
of trained ones: :func:`load_or_train_tokenizer` keeps them in
``$K3_CACHE_DIR/tokenizers/<corpus fingerprint>-<vocab_size>/`` (default ``~/.cache/k3``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from k3.tokenizer import (
    DEFAULT_MAX_TRAIN_BYTES,
    DEFAULT_VOCAB_SIZE,
    FORMAT_VERSION,
    MIN_VOCAB_SIZE,
    NUM_RESERVED,
    K3Tokenizer,
    byte_level_bpe,
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES
) -> K3Tokenizer:
    """Train byte-level BPE on ``texts`` (its first ``max_train_bytes`` UTF-8 bytes) to ``vocab_size`` ids.

    ``vocab_size`` counts the 256 reserved ids, so BPE learns ``vocab_size - 512`` merges on top of the
    256 byte tokens. If the text supports fewer merges, the unused ordinary ids are filled with
    unreachable ``<|unused_ID|>`` entries so the id layout stays fixed; text that yields no merge at all
    while the vocabulary has room for some is refused (llama.cpp needs merges in a BPE vocabulary).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + 256 reserved), got {vocab_size}"
        )
    base = vocab_size - NUM_RESERVED
    tok = byte_level_bpe(models.BPE())
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=base, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_take_bytes(texts, max_train_bytes), trainer)
    if base > 256 and tok.get_vocab_size() == 256:
        raise ValueError(f"texts yield no BPE merge (vocab_size {vocab_size} has room for {base - 256})")
    if tok.get_vocab_size() < base:
        data = json.loads(tok.to_str())
        data["model"]["vocab"] |= {f"<|unused_{i}|>": i for i in range(tok.get_vocab_size(), base)}
        tok = Tokenizer.from_str(json.dumps(data))
    return K3Tokenizer.from_hf_tokenizer(tok, base, max_train_bytes=max_train_bytes)


def _take_bytes(texts: Iterable[str], max_bytes: int) -> Iterable[str]:
    """The leading texts whose UTF-8 size sums to at most ``max_bytes`` (the last one cut)."""
    left = max_bytes
    for t in texts:
        if left <= 0:
            return
        b = t.encode("utf-8")
        yield t if len(b) <= left else b[:left].decode("utf-8", errors="ignore")
        left -= len(b)


def default_cache_dir() -> Path:
    """``$K3_CACHE_DIR``, else ``~/.cache/k3``: the root of every k3 cache."""
    return Path(os.environ.get("K3_CACHE_DIR") or "~/.cache/k3").expanduser()


def tokenizer_cache_path(
    fingerprint: str, vocab_size: int, cache_dir: str | os.PathLike | None = None
) -> Path:
    """``<cache_dir or default_cache_dir()>/tokenizers/<fingerprint>-<vocab_size>``."""
    return Path(cache_dir or default_cache_dir()) / "tokenizers" / f"{fingerprint}-{vocab_size}"


def load_or_train_tokenizer(
    fingerprint: str,
    texts_fn: Callable[[], Iterable[str]],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike | None = None,
    max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
) -> K3Tokenizer:
    """The valid cached tokenizer for ``fingerprint``, else one trained on ``texts_fn()`` (then cached).

    ``texts_fn`` is only called on a cache miss, so a hit does not even load the corpus.
    """
    path = tokenizer_cache_path(fingerprint, vocab_size, cache_dir)
    cached = _load_cached(path, vocab_size, max_train_bytes)
    if cached is not None:
        return cached
    tok = train_tokenizer(texts_fn(), vocab_size, max_train_bytes)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tok.save(tmp)
    if path.exists():  # stale or foreign: replace
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _load_cached(path: Path, vocab_size: int, max_train_bytes: int) -> K3Tokenizer | None:
    want = dict(format_version=FORMAT_VERSION, vocab_size=vocab_size, max_train_bytes=max_train_bytes)
    try:
        k3 = json.loads((path / "tokenizer_config.json").read_text())["k3"]
        return K3Tokenizer.from_dir(path) if all(k3.get(k) == v for k, v in want.items()) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def bytes_per_token(tokenizer: K3Tokenizer, texts: Iterable[str]) -> float:
    """UTF-8 bytes per token over ``texts`` (compression; higher is better)."""
    texts = list(texts)
    n_tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    if n_tokens == 0:
        raise ValueError("texts must contain at least one non-empty text")
    return sum(len(t.encode("utf-8")) for t in texts) / n_tokens
