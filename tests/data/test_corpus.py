"""Corpus loading: the deterministic train/val split, skip-and-count of bad inputs, JSONL/Parquet, stdlib."""

import hashlib
import json
import os
import re
from collections import Counter

import pytest

from k3.data.corpus import corpus_fingerprint, in_val_split, list_files, load_corpus


def _write(root, rel, data):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)
    return p


@pytest.fixture
def text_dir(tmp_path):
    for i in range(200):
        _write(tmp_path, f"d{i % 7}/file_{i}.txt", f"document {i}\n" * (1 + i % 5))
    return tmp_path


def test_in_val_split_matches_sha1_rule_and_fraction():
    keys = [f"pkg/mod_{i}.py" for i in range(20_000)]
    for key in keys[:50]:
        bucket = int(hashlib.sha1(key.encode()).hexdigest()[:16], 16) % 10_000
        assert in_val_split(key, 2.0) == (bucket < 200)
    frac = sum(in_val_split(k, 2.0) for k in keys) / len(keys)
    assert 0.015 < frac < 0.025
    assert not any(in_val_split(k, 0.0) for k in keys[:100])
    assert all(in_val_split(k, 100.0) for k in keys[:100])


def test_split_is_disjoint_complete_and_deterministic(text_dir):
    train = load_corpus(text_dir, "train", val_percent=10)
    val = load_corpus(text_dir, "val", val_percent=10)
    everything = load_corpus(text_dir, "all")
    assert len(val) > 0 and len(train) > len(val)
    assert Counter(train.documents) + Counter(val.documents) == Counter(everything.documents)
    assert set(train.documents).isdisjoint(val.documents)  # every file's text is unique here
    assert load_corpus(text_dir, "val", val_percent=10).documents == val.documents
    assert train.stats.files_read == 200 and train.stats.documents == len(train)
    assert train.stats.bytes == sum(len(d.encode()) for d in train.documents)
    # the rule depends only on the path relative to the root: a copy elsewhere splits the same way
    copy = text_dir.parent / "copy_of_corpus"
    for f in list_files(text_dir)[1]:
        _write(copy, f.relative_to(text_dir), f.read_bytes())
    assert load_corpus(copy, "val", val_percent=10).documents == val.documents


def test_documents_in_sorted_path_order(tmp_path):
    for name in ["b.txt", "a/z.txt", "a.txt", "c/d/e.txt"]:
        _write(tmp_path, name, name)
    assert load_corpus(tmp_path, "all").documents == ["a.txt", "a/z.txt", "b.txt", "c/d/e.txt"]


def test_binary_unreadable_and_hidden_files_are_skipped_and_counted(tmp_path):
    _write(tmp_path, "good.txt", "hello")
    _write(tmp_path, "sub/good.md", "héllo 世界")
    _write(tmp_path, "nul.txt", b"abc\x00def")
    _write(tmp_path, "latin1.txt", "caf\xe9".encode("latin-1"))
    _write(tmp_path, "image.png", b"not really a png")
    _write(tmp_path, ".hidden/secret.txt", "skip me")
    os.symlink(tmp_path / "missing-target", tmp_path / "broken_link.txt")
    c = load_corpus(tmp_path, "all")
    assert sorted(c.documents) == ["hello", "héllo 世界"]
    assert (c.stats.files_read, c.stats.files_skipped_binary, c.stats.files_skipped_unreadable) == (2, 3, 1)


def test_jsonl_bad_records_stop_at_their_line_or_are_skipped_and_counted(tmp_path):
    good = [json.dumps({"text": f"doc {i}"}) for i in range(300)]
    bad = {
        "{not json": "line 101: not JSON",
        json.dumps(["a", "list"]): "line 101: a JSON list, not an object",
        json.dumps({"content": "no text field"}): "line 101: no 'text' field (keys: content)",
        json.dumps({"text": 42}): "line 101: 'text' is a number, not a string",
        json.dumps({"text": None}): "line 101: 'text' is null, not a string",
    }
    for i, (line, message) in enumerate(bad.items()):
        path = _write(tmp_path / f"case{i}", "data.jsonl", "\n".join([*good[:100], line, *good[100:]]) + "\n")
        for source in (path, path.parent):  # the file itself, or a directory holding it
            with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
                load_corpus(source, "train")
        c = load_corpus(path, "all", skip_bad=True)
        assert c.documents == [f"doc {i}" for i in range(300)] and c.stats.bad_records == 1
    data = "\n".join([*good[:3], "", json.dumps({"text": ""})]).encode() + b"\n" + b'{"text": "\xff\xfe"}\n'
    path = _write(tmp_path, "data.jsonl", data)
    with pytest.raises(ValueError, match=re.escape(f"{path}: line 6: not UTF-8")):
        load_corpus(path, "all")
    c = load_corpus(path, "all", skip_bad=True)  # blank lines are no records; an empty text is counted
    assert c.documents == ["doc 0", "doc 1", "doc 2"] and c.stats.files_read == 1
    assert (c.stats.bad_records, c.stats.empty_documents) == (1, 1)


def test_jsonl_split_is_by_row(tmp_path):
    path = _write(tmp_path, "rows.jsonl", "\n".join(json.dumps({"text": f"row {i}"}) for i in range(300)))
    val = load_corpus(path, "val", val_percent=10).documents
    expected = [f"row {i}" for i in range(300) if in_val_split(f"rows.jsonl#{i}", 10)]
    assert val == expected and 10 < len(val) < 60
    assert set(val).isdisjoint(load_corpus(path, "train", val_percent=10).documents)


def test_parquet_or_clear_error(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        _write(tmp_path, "data.parquet", b"PAR1 placeholder")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            load_corpus(tmp_path, "all")
        return
    pq.write_table(pa.table({"text": ["alpha", None, "gamma"], "id": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"body": ["no text column"]}), tmp_path / "b.parquet")
    _write(tmp_path, "c.parquet", b"garbage, not parquet")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'a.parquet'}: row 2: 'text' is null")):
        load_corpus(tmp_path, "all")
    with pytest.raises(ValueError, match="b.parquet: not a readable Parquet file with a 'text' column"):
        load_corpus(tmp_path / "b.parquet", "all")
    c = load_corpus(tmp_path, "all", skip_bad=True)
    assert c.documents == ["alpha", "gamma"]
    assert (c.stats.files_read, c.stats.files_skipped_unreadable, c.stats.lines_skipped_malformed) == (
        1,
        2,
        1,
    )
    val = load_corpus(tmp_path / "a.parquet", "val", val_percent=50, skip_bad=True).documents
    assert val == [t for i, t in [(0, "alpha"), (2, "gamma")] if in_val_split(f"a.parquet#{i}", 50)]


def test_parquet_missing_pyarrow_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    _write(tmp_path, "data.parquet", b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_corpus(tmp_path, "all")


def test_bad_arguments_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="no_such_dir"):
        load_corpus(tmp_path / "no_such_dir")
    with pytest.raises(ValueError, match="no_such_dir"):
        corpus_fingerprint(tmp_path / "no_such_dir")
    with pytest.raises(ValueError, match="split"):
        load_corpus(tmp_path, "test")
    with pytest.raises(ValueError, match="val_percent"):
        load_corpus(tmp_path, "train", val_percent=150)


def test_fingerprint_tracks_files_and_split(text_dir):
    fp = corpus_fingerprint(text_dir)
    assert fp == corpus_fingerprint(text_dir) and len(fp) == 16
    assert corpus_fingerprint(text_dir, val_percent=5.0) != fp
    _write(text_dir, "new.txt", "new")
    fp2 = corpus_fingerprint(text_dir)
    assert fp2 != fp
    _write(text_dir, "new.txt", "newer content")
    assert corpus_fingerprint(text_dir) != fp2


def test_stdlib_corpus_found_and_split_deterministically():
    root, files = list_files(None)
    rels = [f.relative_to(root).as_posix() for f in files]
    assert len(rels) > 500 and "os.py" in rels and rels == sorted(rels)
    assert not any(r.startswith("site-packages/") or "__pycache__" in r for r in rels)
    val_files = [r for r in rels if in_val_split(r, 2.0)]
    assert 0.005 * len(rels) < len(val_files) < 0.05 * len(rels)
    val = load_corpus(None, "val")
    assert val.documents == load_corpus(None, "val").documents and len(val) > 0
    train, everything = load_corpus(None, "train"), load_corpus(None, "all")
    assert Counter(train.documents) + Counter(val.documents) == Counter(everything.documents)
    assert train.stats.files_read > 500
