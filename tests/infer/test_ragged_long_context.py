"""Ragged batching and the streaming MLA path in the engine: decode rows of different cached lengths share
one forward; prefill in chunks of any size == one pass == the model's naive generate."""

import pytest
import torch

import k3.model.mla as mla_mod
from k3.infer.cache.paged_mla import PagedMLAState
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.generate import generate

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def reference(model, p, n=6):
    return generate(model, torch.tensor([p]), n)[0, len(p) :].tolist()


def small(**kw):
    base = dict(page_size=16, prefix_unit=16, num_pages=64, max_model_len=512, max_num_seqs=8)
    return EngineConfig(**{**base, **kw})


def record_forwards(engine) -> list[tuple[int, list[int]]]:
    """Wrap the runner: -> list of (tokens per row, cached lengths of the rows) per forward."""
    calls, inner = [], engine.runner._forward

    def spy(seqs, n):
        calls.append((n, [s.num_computed for s in seqs]))
        return inner(seqs, n)

    engine.runner._forward = spy
    return calls


@pytest.fixture
def streaming(monkeypatch):
    """Force the streaming MLA path (blocks of 5 keys) and forbid the dense gather of the paged pool."""
    monkeypatch.setattr(mla_mod, "DENSE_MAX_SCORES", 0)
    monkeypatch.setattr(mla_mod, "MIN_BLOCK", 5)

    def no_gather(self, new):
        raise AssertionError("the dense gather ran on the streaming path")

    monkeypatch.setattr(PagedMLAState, "append", no_gather)


@pytest.mark.parametrize("stream", [False, True], ids=["dense", "streaming"])
def test_ragged_decode_equals_one_at_a_time(nano, prompt, request, stream):
    if stream:
        request.getfixturevalue("streaming")
    prompts = [prompt(n, s) for n, s in [(3, 30), (29, 31), (11, 32), (50, 33)]]
    alone = [Engine(nano, small()).generate([p], GREEDY)[0].output for p in prompts]
    engine = Engine(nano, small())
    calls = record_forwards(engine)
    together = engine.generate(prompts, GREEDY)
    assert [s.output for s in together] == alone
    assert alone[3] == reference(nano, prompts[3])
    ragged = [c for n, c in calls if n == 1 and len(c) == 4]
    assert ragged and all(len(set(c)) == 4 for c in ragged)  # all four rows, four lengths, one forward


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 64], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_any_size_equals_one_pass(nano, prompt, streaming, chunk):
    """Streaming path on every chunk (the cache grows chunk by chunk) == the naive reference."""
    p = prompt(45, 40)
    cfg = small(max_prefill_chunk=chunk, max_num_batched_tokens=chunk, enable_prefix_cache=False)
    engine = Engine(nano, cfg)
    calls = record_forwards(engine)
    (seq,) = engine.generate([p], GREEDY)
    assert seq.output == reference(nano, p)
    assert [n for n, _ in calls[: -(-45 // chunk)]] == [
        min(chunk, 45 - i * chunk) for i in range(-(-45 // chunk))
    ]


def test_ragged_prefill_chunks_share_a_forward(nano, prompt, streaming):
    """A prefix-cache hit puts one prompt 32 tokens ahead of another: equal chunks, different offsets."""
    shared = prompt(40, 50)
    a, b = prompt(45, 51), shared + prompt(21, 52)
    cfg = small(max_prefill_chunk=16, max_num_batched_tokens=32)
    engine = Engine(nano, cfg)
    engine.generate([shared], GREEDY)  # caches the first 32 tokens (two units) of b's prompt
    calls = record_forwards(engine)
    seqs = engine.generate([a, b], GREEDY)
    assert [s.output for s in seqs] == [reference(nano, a), reference(nano, b)]
    assert (16, [0, 32]) in calls  # a's first chunk beside b's first uncached chunk
