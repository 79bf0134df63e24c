"""The fixed evaluation set scores every validation byte once; the compressors see exactly those bytes."""

import bz2
import gzip
import lzma

import numpy as np
import pytest
import torch

from k3.data import TokenizedDocs
from k3.data.eval_set import IGNORE_INDEX, build_eval_set
from k3.train.baselines import compressor_bpb, eval_set_bytes

EOS = 99


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, 50, n).astype(np.int32) for n in lengths]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedDocs(np.concatenate(toks), offsets)


def test_every_token_and_every_eos_is_a_target_once():
    docs = _docs([5, 1, 17, 9, 30])
    es = build_eval_set(docs, seq_len=8, eos_id=EOS)
    labels = es.labels.flatten()
    real = labels[labels != IGNORE_INDEX]
    expected = np.concatenate([np.append(docs.doc(int(d)), EOS) for d in es.order])
    assert real.tolist() == expected.tolist()
    assert es.input_ids[0, 0] == EOS  # "start of a file" before the first document
    assert (labels[real.numel() :] == IGNORE_INDEX).all() and real.numel() > es.rows * 8 - 8


def test_segments_never_cross_a_document_or_a_row():
    docs = _docs([5, 1, 17, 9, 30])
    es = build_eval_set(docs, seq_len=8, eos_id=EOS)
    flat_in = es.input_ids.flatten()
    flat_seg = es.doc_ids.flatten()
    # an input that follows a closing EOS starts a new segment; nothing else does inside a row
    for i in range(1, docs.num_tokens + docs.num_docs):  # the stream's inputs (not the padding)
        if i % 8 and flat_in[i - 1] == EOS:
            assert flat_seg[i] != flat_seg[i - 1], i
        elif i % 8 and flat_in[i - 1] != EOS:
            assert flat_seg[i] == flat_seg[i - 1], i


def test_batches_pad_and_take_a_prefix():
    docs = _docs([40, 33, 20])
    es = build_eval_set(docs, seq_len=8, eos_id=EOS)
    batches = list(es.batches(4))
    assert sum(b["input_ids"].shape[0] for b in batches) == 4 * len(batches) >= es.rows
    n_targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    assert n_targets == docs.num_tokens + docs.num_docs
    prefix = list(es.batches(4, max_tokens=9))  # two rows
    assert len(prefix) == 1 and int((prefix[0]["labels"] != IGNORE_INDEX).sum()) == 16
    two = [list(es.batches(4, rank=r, world_size=2)) for r in (0, 1)]
    assert all(b["input_ids"].shape[0] == 2 for bs in two for b in bs)
    for b in batches:  # cu_seqlens and doc_ids describe the same segments
        starts = torch.nonzero(torch.diff(b["doc_ids"].flatten(), prepend=torch.tensor([-1]))).flatten()
        assert b["cu_seqlens"].tolist() == [*starts.tolist(), b["input_ids"].numel()]


def test_empty_docs_raise():
    with pytest.raises(ValueError, match="docs"):
        build_eval_set(TokenizedDocs(np.zeros(0, np.int32), np.zeros(1, np.int64)), 8, EOS)


def test_compressors_match_the_tools_settings():
    data = b"def f(x):\n    return x + 1\n" * 50 + bytes(range(256))
    got = compressor_bpb(data)
    assert got["gzip -9"] == 8 * len(gzip.compress(data, 9, mtime=0)) / len(data)
    assert got["bz2 -9"] == 8 * len(bz2.compress(data, 9)) / len(data)
    assert got["xz -9e"] == 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)
    assert all(0 < v < 8 for v in got.values())
    with pytest.raises(ValueError, match="data"):
        compressor_bpb(b"")


class _ByteTok:
    """Token i < 256 stands for byte i."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8")


def test_eval_set_bytes_are_the_scored_bytes():
    docs = _docs([5, 8, 3])
    order = np.array([2, 0, 1])
    table = np.ones(256, dtype=np.int64)
    data = eval_set_bytes(docs, order, _ByteTok(), table)
    assert data == b"".join(bytes(docs.doc(int(d)).tolist()) for d in order)
    table[0] = 2  # a table that disagrees with the decoded text: the comparison would be unfair
    with pytest.raises(ValueError, match="bytes"):
        eval_set_bytes(_docs([5, 8, 3], seed=0), order, _ByteTok(), table)


def test_final_evaluation_in_large_inference_batches_equals_the_reference():
    """The final evaluation's path (inference mode, ~8k-token batches, head + loss from the hidden states
    in HEAD_ROWS chunks) gives the sums of the full-logits reference run at the training micro-batch."""
    from k3.config import load_config
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM
    from k3.train import evaluate as ev

    cfg = load_config("k3-nano")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    init_weights(model, cfg.initializer_range, cfg.num_hidden_layers, seed=0)
    docs = _docs([40, 3, 100, 17, 60, 9, 250, 33])
    es = build_eval_set(docs, 32, EOS)
    nbytes = np.ones(cfg.vocab_size, dtype=np.int64)
    batch = next(es.batches(4))
    inputs = {k: batch[k] for k in ("input_ids", "cu_seqlens", "doc_ids")}
    labels = batch["labels"].flatten()
    with torch.no_grad():
        fast, ref = ev._target_nats(model, inputs, labels), ev._target_nats_reference(model, inputs, labels)
    assert float(fast) == pytest.approx(float(ref), rel=1e-6) and float(ref) > 0
    rows = ev.eval_batch_rows(32, 2, rows=es.rows)
    assert rows == es.rows and ev.eval_batch_rows(32, 2) == 256 and ev.eval_batch_rows(128, 3, 2) == 64
    small = ev.evaluate(model, es, nbytes, EOS, seq_len=32, batch_size=2)
    old_head_rows, ev.HEAD_ROWS = ev.HEAD_ROWS, 7  # chunks that do not divide the rows
    try:
        large = ev.evaluate(model, es, nbytes, EOS, seq_len=32, batch_size=rows, inference=True)
    finally:
        ev.HEAD_ROWS = old_head_rows
    assert large["tokens"] == small["tokens"] == int((es.labels != IGNORE_INDEX).sum())
    assert large["val_loss"] == pytest.approx(small["val_loss"], rel=1e-5)
    assert model.training  # restored
