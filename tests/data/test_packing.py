"""Packing: stream order, segment bookkeeping (cu_seqlens/doc_ids/mask), resumption, ranks, caching."""

import json

import numpy as np
import pytest
import torch

import k3.tokenizer_train as tokenizer_train
from k3.data import prepare_data
from k3.data.packing import (
    PackedLoader,
    TokenizedDocs,
    block_causal_mask,
    cu_seqlens_from_doc_ids,
    load_or_tokenize,
    tokenize_documents,
)
from k3.tokenizer_train import train_tokenizer

EOS = 9999


def _docs(lengths):
    """Document d holds the distinct tokens 100*d + 1, ..., so any token identifies its document."""
    pieces = [np.arange(100 * d + 1, 100 * d + 1 + n, dtype=np.int32) for d, n in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedDocs(np.concatenate([np.zeros(0, np.int32), *pieces]), offsets)


DOCS = _docs([5, 17, 1, 0, 40, 3, 8, 23, 2, 11])


def _stream(docs, order):
    return np.concatenate([np.append(docs.doc(d), EOS) for d in order])


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def test_unshuffled_stream_is_every_token_in_order():
    B, T = 2, 7
    loader = PackedLoader(DOCS, seq_len=T, batch_size=B, eos_id=EOS, shuffle=False)
    batches = _take(loader, 20)  # 280 tokens > 2 epochs of 120
    inputs = torch.cat([b["input_ids"].reshape(-1) for b in batches]).numpy()
    labels = torch.cat([b["labels"].reshape(-1) for b in batches]).numpy()
    stream = np.tile(_stream(DOCS, range(DOCS.num_docs)), 4)
    np.testing.assert_array_equal(inputs, stream[: len(inputs)])
    np.testing.assert_array_equal(labels, stream[1 : len(inputs) + 1])
    assert loader.batches_per_epoch == (DOCS.num_tokens + DOCS.num_docs) // (B * T)


def test_shuffled_epochs_are_seeded_permutations():
    loader = PackedLoader(DOCS, seq_len=12, batch_size=1, eos_id=EOS, seed=3)
    n = DOCS.num_tokens + DOCS.num_docs
    stream = torch.cat([b["input_ids"][0] for b in _take(loader, 3 * n // 12)]).numpy()
    epochs = [stream[:n], stream[n : 2 * n]]
    orders = []
    for ep in epochs:
        docs = np.split(ep, np.nonzero(ep == EOS)[0] + 1)[:-1]
        order = [int(d[0]) // 100 if len(d) > 1 else None for d in docs]
        orders.append(order)
        nonempty = sorted(o for o in order if o is not None)
        assert nonempty == [d for d in range(DOCS.num_docs) if DOCS.doc(d).size]
        assert len(docs) == DOCS.num_docs
    assert orders[0] != orders[1]
    other = PackedLoader(DOCS, seq_len=12, batch_size=1, eos_id=EOS, seed=4)
    assert not torch.equal(
        next(other)["input_ids"], next(PackedLoader(DOCS, 12, 1, EOS, seed=3))["input_ids"]
    )


def test_batch_layout_and_segments_consistent():
    B, T = 3, 16
    loader = PackedLoader(DOCS, seq_len=T, batch_size=B, eos_id=EOS, seed=1)
    for batch in _take(loader, 12):
        x, y, cu, ids = batch["input_ids"], batch["labels"], batch["cu_seqlens"], batch["doc_ids"]
        assert x.shape == y.shape == ids.shape == (B, T)
        assert x.dtype == y.dtype == ids.dtype == cu.dtype == torch.int64
        assert cu[0] == 0 and cu[-1] == B * T and bool((cu[1:] > cu[:-1]).all())
        assert torch.equal(cu_seqlens_from_doc_ids(ids), cu)
        assert torch.equal(ids.reshape(-1), torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff()))
        flat = x.reshape(-1)
        starts = set(cu[:-1].tolist())
        assert {b * T for b in range(B)} <= starts  # every row start is a segment start
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            seg = flat[s:e]
            assert not bool((seg[:-1] == EOS).any())  # an EOS only ever ends a segment
            body = seg[seg != EOS]
            assert len(set((body // 100).tolist())) <= 1  # a segment is one document
            if e < B * T and e % T != 0:
                assert seg[-1] == EOS  # mid-row boundaries are exactly after EOS
        assert torch.equal(y[:, :-1], x[:, 1:])


def test_block_causal_mask_tiny_example():
    ids = torch.tensor([[0, 0, 1, 1, 1], [2, 3, 3, 3, 3]])
    mask = block_causal_mask(ids)
    expected0 = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        dtype=torch.bool,
    )
    expected1 = torch.tensor(
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]],
        dtype=torch.bool,
    )
    assert mask.shape == (2, 5, 5) and mask.dtype == torch.bool
    assert torch.equal(mask[0], expected0) and torch.equal(mask[1], expected1)
    assert cu_seqlens_from_doc_ids(ids).tolist() == [0, 2, 5, 6, 10]


def test_resume_gives_identical_batches():
    make = lambda: PackedLoader(DOCS, seq_len=9, batch_size=2, eos_id=EOS, seed=7)
    straight = make()
    _take(straight, 5)
    state = json.loads(json.dumps(straight.state_dict()))  # plain, serialisable
    expected = _take(straight, 15)
    resumed = PackedLoader(DOCS, seq_len=9, batch_size=2, eos_id=EOS, seed=123)  # seed comes from state
    resumed.load_state_dict(state)
    for a, b in zip(expected, _take(resumed, 15), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.state_dict() == straight.state_dict()
    with pytest.raises(ValueError, match="num_docs"):
        PackedLoader(_docs([3, 4]), 9, 2, EOS).load_state_dict(state)


def test_ranks_split_the_global_batch():
    full = _take(PackedLoader(DOCS, seq_len=5, batch_size=4, eos_id=EOS, seed=2), 6)
    parts = [_take(PackedLoader(DOCS, 5, 2, EOS, seed=2, rank=r, world_size=2), 6) for r in range(2)]
    for step, batch in enumerate(full):
        assert torch.equal(torch.cat([parts[r][step]["input_ids"] for r in range(2)]), batch["input_ids"])
        assert torch.equal(torch.cat([parts[r][step]["labels"] for r in range(2)]), batch["labels"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        PackedLoader(DOCS, seq_len=0, batch_size=1, eos_id=EOS)
    with pytest.raises(ValueError, match="rank"):
        PackedLoader(DOCS, seq_len=4, batch_size=1, eos_id=EOS, rank=2, world_size=2)
    with pytest.raises(ValueError, match="docs"):
        PackedLoader(_docs([]), seq_len=4, batch_size=1, eos_id=EOS)


@pytest.fixture(scope="module")
def small_tok():
    return train_tokenizer(["some text to learn from, again and again\n"] * 50, vocab_size=640)


def test_tokenize_and_cache(small_tok, tmp_path):
    texts = ["first doc\n", "second, longer document ✓", "x"]
    td = tokenize_documents(small_tok, texts)
    assert td.tokens.dtype == np.int32 and td.offsets.dtype == np.int64 and td.num_docs == 3
    assert [small_tok.decode(td.doc(d).tolist()) for d in range(3)] == texts
    calls = []
    fn = lambda: calls.append(1) or texts
    a = load_or_tokenize(small_tok, tmp_path, "train", fn)
    b = load_or_tokenize(small_tok, tmp_path, "train", fn)
    assert calls == [1]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(b.offsets, td.offsets)
    (tmp_path / "offsets-train.npy").write_bytes(b"corrupt")
    load_or_tokenize(small_tok, tmp_path, "train", fn)
    assert calls == [1, 1]


def test_prepare_data_end_to_end_cached(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"f{i}.txt").write_text(f"file {i}: the quick brown fox {i * i}\n" * (i % 4 + 1))
    first = prepare_data(corpus, vocab_size=600, val_percent=10, cache_dir=tmp_path / "cache")
    assert first.train.num_docs + first.val.num_docs == 60 and first.val.num_docs > 0
    assert (first.cache_path / "tokens-val.npy").is_file()
    monkeypatch.setattr(
        tokenizer_train, "train_tokenizer", lambda *a, **k: pytest.fail("retrained on a cache hit")
    )
    import k3.data

    monkeypatch.setattr(k3.data, "load_splits", lambda *a, **k: pytest.fail("read the corpus on a cache hit"))
    second = prepare_data(corpus, vocab_size=600, val_percent=10, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(first.train.tokens, second.train.tokens)
    assert not first.cached and second.cached and second.stats == first.stats
    assert first.stats["files"] == 60 and first.stats["val_documents"] == first.val.num_docs
    batch = next(PackedLoader(second.train, 32, 2, second.tokenizer.eos_id))
    assert int(batch["input_ids"].max()) < second.tokenizer.vocab_size
