"""ShuffledRows: one epoch serves every row of the packed stream once, in a seeded order; segments,
resumption and ranks behave as in PackedLoader."""

import numpy as np
import pytest
import torch

from k3.data.packing import TokenizedDocs
from k3.data.rows import ShuffledRows

EOS = 9999


def _docs(lengths):
    """Document d holds the distinct tokens 100*d + 1, ..., so any token identifies its document."""
    pieces = [np.arange(100 * d + 1, 100 * d + 1 + n, dtype=np.int32) for d, n in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedDocs(np.concatenate([np.zeros(0, np.int32), *pieces]), offsets)


DOCS = _docs([5, 17, 1, 0, 40, 3, 8, 23, 2, 11])
T = 6


def _epoch_stream(seed, epoch=0):
    order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(DOCS.num_docs)
    return np.concatenate([np.append(DOCS.doc(d), EOS) for d in order])


def test_an_epoch_is_every_row_once_in_random_order():
    loader = ShuffledRows(DOCS, seq_len=T, batch_size=1, eos_id=EOS, seed=3)
    stream = _epoch_stream(3)
    rows = [next(loader)["input_ids"][0].numpy() for _ in range(loader.rows_per_epoch)]
    expected = [stream[r * T : r * T + T] for r in range(loader.rows_per_epoch)]
    assert sorted(map(tuple, rows)) == sorted(map(tuple, expected))
    assert [tuple(r) for r in rows] != [tuple(r) for r in expected]  # not stream order
    nxt = next(loader)["input_ids"][0].numpy()  # epoch 1: a new document order
    stream1 = _epoch_stream(3, 1)
    assert any((nxt == stream1[r * T : r * T + T]).all() for r in range(loader.rows_per_epoch))


def test_labels_are_the_next_tokens_and_segments_restart_at_documents():
    loader = ShuffledRows(DOCS, seq_len=T, batch_size=4, eos_id=EOS, seed=1)
    for _ in range(5):
        b = next(loader)
        ids, labels, doc_ids = b["input_ids"], b["labels"], b["doc_ids"]
        assert (labels[:, :-1] == ids[:, 1:]).all()
        for r in range(4):
            for t in range(1, T):
                new_doc = ids[r, t - 1] == EOS
                assert (doc_ids[r, t] != doc_ids[r, t - 1]) == bool(new_doc), (r, t)
        assert (doc_ids[1:, 0] != doc_ids[:-1, -1]).all()  # every row starts a segment
        starts = torch.nonzero(torch.diff(doc_ids.flatten(), prepend=torch.tensor([-1]))).flatten()
        assert b["cu_seqlens"].tolist() == [*starts.tolist(), 4 * T]


def test_resume_and_ranks():
    make = lambda **kw: ShuffledRows(DOCS, seq_len=T, batch_size=2, eos_id=EOS, seed=7, **kw)
    a = make()
    for _ in range(9):  # across an epoch boundary
        next(a)
    state = a.state_dict()
    rest = [next(a)["input_ids"] for _ in range(6)]
    b = ShuffledRows(DOCS, seq_len=T, batch_size=2, eos_id=EOS, seed=123)  # the seed comes from the state
    b.load_state_dict(state)
    assert all((x == next(b)["input_ids"]).all() for x in rest)
    full = ShuffledRows(DOCS, seq_len=T, batch_size=4, eos_id=EOS, seed=2)
    parts = [ShuffledRows(DOCS, T, 2, EOS, seed=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(4):
        assert (next(full)["input_ids"] == torch.cat([next(p)["input_ids"] for p in parts])).all()
    with pytest.raises(ValueError, match="num_docs"):
        ShuffledRows(_docs([3, 40]), T, 2, EOS).load_state_dict(state)
    with pytest.raises(ValueError, match="state"):
        make().load_state_dict({"epoch": 0, "doc_index": 0})


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        ShuffledRows(DOCS, seq_len=0, batch_size=1, eos_id=EOS)
    with pytest.raises(ValueError, match="rank"):
        ShuffledRows(DOCS, seq_len=4, batch_size=1, eos_id=EOS, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        ShuffledRows(_docs([2]), seq_len=4, batch_size=1, eos_id=EOS)
