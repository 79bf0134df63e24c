"""Training documents: the embedded default corpus (the Python standard library) or a user `--data PATH`.

A *document* is one string: a whole text file, one JSON line's ``"text"`` or one Parquet row's ``text``.

Sources, by file name:
  * ``*.jsonl``   one JSON object per line with a string ``"text"`` field (one document per line);
  * ``*.parquet`` a ``text`` column (one document per row; needs ``pyarrow``);
  * anything else is a text file (one document), unless its extension is an obviously binary one, it
    holds a NUL byte, or it is not valid UTF-8.
``PATH`` may be one such file or a directory walked recursively (hidden entries skipped). Files that are
not text (binary extension, a NUL byte, not UTF-8) or cannot be opened are skipped and counted in
:class:`CorpusStats`. A bad record -- a JSONL line that is not JSON, not an object, without ``"text"`` or
whose ``"text"`` is not a string; a Parquet row whose ``text`` is not a string; a Parquet file without a
``text`` column or that pyarrow cannot read -- raises ValueError naming the file, the line (row) and what
is wrong, unless ``skip_bad`` is set: then it is skipped and counted (``bad_records``). Empty documents
are dropped and counted (``empty_documents``).

Train/val split: each document has a *key* -- its file path relative to the corpus root, plus
``"#<row>"`` for JSONL/Parquet rows -- and goes to validation iff ``sha1(key)`` lands in the lowest
``val_percent`` percent of buckets (:func:`in_val_split`). The rule depends on nothing but the key, so it
is the same on every machine and run, and validation text is never trained on.

Default corpus: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages``,
``dist-packages`` and ``__pycache__`` -- the ``test/`` packages are kept (they are two thirds of the
source and ordinary Python). On CPython 3.11 that is ~1,790 files, ~31 MB; ~1 % (latin-1 encoding tests)
fail UTF-8 decoding and are skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_VAL_PERCENT = 2.0
SPLITS = ("train", "val", "all")
_BUCKETS = 10_000  # split granularity: val_percent is honoured to 0.01 %
_STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "__pycache__"})
_BINARY_EXT = frozenset(
    ".pyc .pyo .so .o .a .dll .dylib .exe .bin .npy .npz .pt .pth .safetensors .ckpt .onnx .pkl .pickle "
    ".zip .gz .tgz .bz2 .xz .zst .7z .tar .whl .jar .png .jpg .jpeg .gif .bmp .ico .webp .tif .tiff "
    ".pdf .mp3 .mp4 .wav .flac .ogg .avi .mov .mkv .woff .woff2 .ttf .otf .sqlite .db .arrow .feather".split()
)


@dataclass
class CorpusStats:
    """What loading read and what it skipped."""

    files_read: int = 0
    files_skipped_binary: int = 0
    files_skipped_unreadable: int = 0
    lines_skipped_malformed: int = 0  # bad records skipped (skip_bad); without it the first one raises
    empty_documents: int = 0  # records or files with an empty text (nothing to train on)
    bytes: int = 0  # UTF-8 bytes of the documents kept in the requested split
    documents: int = 0

    @property
    def bad_records(self) -> int:
        return self.lines_skipped_malformed


@dataclass
class Corpus:
    """The documents of one split, in deterministic (sorted path, then row) order."""

    root: Path
    split: str
    documents: list[str] = field(default_factory=list)
    stats: CorpusStats = field(default_factory=CorpusStats)

    def __len__(self) -> int:
        return len(self.documents)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def in_val_split(key: str, val_percent: float) -> bool:
    """True iff the document with this split key belongs to the validation split."""
    bucket = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") % _BUCKETS
    return bucket < round(val_percent * _BUCKETS / 100)


def _check_args(split: str, val_percent: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= val_percent <= 100.0:
        raise ValueError(f"val_percent must be in [0, 100], got {val_percent}")


def _keep(key: str, split: str, val_percent: float) -> bool:
    return split == "all" or in_val_split(key, val_percent) == (split == "val")


def list_files(path: str | os.PathLike | None = None) -> tuple[Path, list[Path]]:
    """(root, files) of a corpus, files sorted by relative POSIX path. ``None`` = the stdlib corpus.

    Raises ValueError naming the path if it does not exist.
    """
    if path is None:
        root = stdlib_root()
        return root, _walk(root, lambda rel: rel.suffix == ".py", _STDLIB_EXCLUDE)
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"data path does not exist: {str(path)!r}")
    if p.is_file():
        return p.parent, [p]
    return p, _walk(p, lambda rel: not rel.name.startswith("."), frozenset())


def _walk(root: Path, want, exclude_dirs: frozenset[str]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in exclude_dirs and not d.startswith(".")]
        for name in filenames:
            f = Path(dirpath, name)
            if want(f.relative_to(root)):
                found.append(f)
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def corpus_fingerprint(
    path: str | os.PathLike | None = None, val_percent: float = DEFAULT_VAL_PERCENT
) -> str:
    """A 16-hex-digit hash of the corpus file list (relative path, size, mtime) and the split rule.

    Cheap (no file is read) and changes whenever a file is added, removed or rewritten; used as the
    cache key of the tokenizer and of the tokenized arrays.
    """
    root, files = list_files(path)
    h = hashlib.sha1(f"k3-corpus-v1 val_percent={val_percent!r}\n".encode())
    for f in files:
        try:
            st = f.stat()
            h.update(f"{f.relative_to(root).as_posix()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{f.relative_to(root).as_posix()}\t?\n".encode())
    return h.hexdigest()[:16]


def load_corpus(
    path: str | os.PathLike | None = None,
    split: str = "train",
    val_percent: float = DEFAULT_VAL_PERCENT,
    skip_bad: bool = False,
) -> Corpus:
    """Load the documents of ``split`` ("train", "val" or "all") from ``path`` (``None`` = stdlib).
    A bad record raises ValueError (file, line, what is wrong) unless ``skip_bad`` (see the module doc)."""
    return load_splits(path, (split,), val_percent, skip_bad)[split]


def load_splits(
    path: str | os.PathLike | None = None,
    splits: tuple[str, ...] = ("train", "val"),
    val_percent: float = DEFAULT_VAL_PERCENT,
    skip_bad: bool = False,
) -> dict[str, Corpus]:
    """{split: Corpus} of several splits in one pass over the files (the file and record counts of each
    Corpus's stats are those of the whole pass)."""
    for split in splits:
        _check_args(split, val_percent)
    root, files = list_files(path)
    stats = CorpusStats()
    out = {split: Corpus(root=root, split=split) for split in splits}
    for f in files:
        rel = f.relative_to(root).as_posix()
        for key, text in _read_file(f, rel, stats, skip_bad):
            if not text:
                stats.empty_documents += 1
                continue
            for split, corpus in out.items():
                if _keep(key, split, val_percent):
                    corpus.documents.append(text)
                    corpus.stats.bytes += len(text.encode("utf-8"))
    for corpus in out.values():
        corpus.stats = replace(stats, bytes=corpus.stats.bytes, documents=len(corpus.documents))
    return out


def _bad(stats: CorpusStats, skip_bad: bool, where: str, what: str) -> None:
    """A bad record at `where` ("file: line N"): ValueError, or counted when skipping."""
    if not skip_bad:
        raise ValueError(f"data: {where}: {what} (fix it, or pass --skip-bad to skip and count such records)")
    stats.lines_skipped_malformed += 1


def _read_file(f: Path, rel: str, stats: CorpusStats, skip_bad: bool = False) -> Iterator[tuple[str, str]]:
    """Yield (split key, text) for every document in one file, updating ``stats``."""
    suffix = f.suffix.lower()
    if suffix == ".parquet":
        yield from _read_parquet(f, rel, stats, skip_bad)
        return
    if suffix in _BINARY_EXT:
        stats.files_skipped_binary += 1
        return
    try:
        data = f.read_bytes()
    except OSError:
        stats.files_skipped_unreadable += 1
        return
    if suffix == ".jsonl":
        stats.files_read += 1
        yield from _read_jsonl(data, f, rel, stats, skip_bad)
        return
    text = _decode_text(data)
    if text is None:
        stats.files_skipped_binary += 1
        return
    stats.files_read += 1
    yield rel, text


def _decode_text(data: bytes) -> str | None:
    """The UTF-8 text of ``data``, or None if it looks binary (NUL byte or invalid UTF-8)."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_jsonl(
    data: bytes, f: Path, rel: str, stats: CorpusStats, skip_bad: bool
) -> Iterator[tuple[str, str]]:
    for row, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        where = f"{f}: line {row + 1}"
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            _bad(stats, skip_bad, where, f"not UTF-8 ({e.reason} at byte {e.start})")
            continue
        except json.JSONDecodeError as e:
            _bad(stats, skip_bad, where, f"not JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(obj, dict):
            _bad(stats, skip_bad, where, f"a JSON {type(obj).__name__}, not an object with a 'text' field")
            continue
        if "text" not in obj:
            _bad(stats, skip_bad, where, f"no 'text' field (keys: {', '.join(sorted(obj)[:8]) or 'none'})")
            continue
        text = obj["text"]
        if not isinstance(text, str):
            _bad(stats, skip_bad, where, f"'text' is {_json_type(text)}, not a string")
            continue
        yield f"{rel}#{row}", text


def _json_type(value) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _import_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading .parquet data needs pyarrow: pip install pyarrow") from e
    return pq


def _read_parquet(f: Path, rel: str, stats: CorpusStats, skip_bad: bool) -> Iterator[tuple[str, str]]:
    pq = _import_pyarrow_parquet()
    try:
        pf = pq.ParquetFile(f)
        if "text" not in pf.schema_arrow.names:
            raise ValueError(f"no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
        batches = [b.column(0).to_pylist() for b in pf.iter_batches(columns=["text"])]
    except Exception as e:  # any pyarrow / IO failure: the whole file is one bad record
        if not skip_bad:
            raise ValueError(
                f"data: {f}: not a readable Parquet file with a 'text' column ({e}) "
                "(fix it, or pass --skip-bad to skip and count such files)"
            ) from e
        stats.files_skipped_unreadable += 1
        return
    stats.files_read += 1
    row = 0
    for texts in batches:
        for text in texts:
            if isinstance(text, str):
                yield f"{rel}#{row}", text
            else:
                _bad(stats, skip_bad, f"{f}: row {row + 1}", f"'text' is {_json_type(text)}, not a string")
            row += 1
