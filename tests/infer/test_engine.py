"""Engine == the model's naive generate (greedy), independent of batching, chunking and preemption."""

import pytest
import torch

from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.generate import generate

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def reference(model, p, n=12):
    return generate(model, torch.tensor([p]), n)[0, len(p) :].tolist()


def small(**kw):
    base = dict(page_size=16, prefix_unit=16, num_pages=64, max_model_len=512, max_num_seqs=8)
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("cache", [False, True], ids=["cache_off", "cache_on"])
def test_greedy_matches_naive_generate(nano, cache, prompt):
    engine = Engine(nano, small(enable_prefix_cache=cache))
    for n, seed in [(1, 0), (17, 1), (40, 2)]:
        p = prompt(n, seed)
        (seq,) = engine.generate([p], GREEDY)
        assert seq.output == reference(nano, p), (n, seed)
        assert seq.finish_reason == "length"


def test_batched_equals_one_at_a_time(nano, prompt):
    prompts = [prompt(n, s) for n, s in [(5, 3), (33, 4), (20, 5), (33, 6), (2, 7)]]
    alone = [Engine(nano, small()).generate([p], GREEDY)[0].output for p in prompts]
    together = Engine(nano, small()).generate(prompts, GREEDY)
    assert [s.output for s in together] == alone
    assert alone[1] == reference(nano, prompts[1])


def test_chunked_prefill_equals_whole_prefill(nano, prompt):
    p = prompt(90, 8)
    whole = Engine(nano, small(max_prefill_chunk=512)).generate([p], GREEDY)[0].output
    chunked = (
        Engine(nano, small(max_prefill_chunk=7, max_num_batched_tokens=9)).generate([p], GREEDY)[0].output
    )
    assert chunked == whole == reference(nano, p)


def test_preemption_recomputes_exactly(nano, prompt):
    prompts = [prompt(30, s) for s in range(10, 14)]
    engine = Engine(nano, small(num_pages=8, max_model_len=128, enable_prefix_cache=False))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output == reference(nano, p, 20)
    assert engine.scheduler.pages.num_free == 8  # everything released


def test_sampling_seeded_and_batch_independent(nano, prompt):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=123, ignore_eos=True)
    p = prompt(12, 9)
    a = Engine(nano, small()).generate([p], params)[0].output
    b = Engine(nano, small()).generate([prompt(25, 1), p], [GREEDY, params])[1].output
    c = Engine(nano, small()).generate([p], SamplingParams(**{**params.__dict__, "seed": 7}))[0].output
    assert a == b and a != c
    top1 = SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True)
    assert Engine(nano, small()).generate([p], top1)[0].output == reference(nano, p)


def test_stop_token_max_tokens_and_logprobs(nano, prompt):
    p = prompt(10, 10)
    ref = reference(nano, p)
    stop_at = ref[4]
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop_at,), logprobs=3, ignore_eos=True)
    seq = Engine(nano, small()).generate([p], params)[0]
    assert seq.output == ref[: ref.index(stop_at) + 1] and seq.finish_reason == "stop"
    with torch.no_grad():
        logits = nano(torch.tensor([p])).logits[0, -1].log_softmax(-1)
    lp, top = seq.logprobs[0]
    assert abs(lp - float(logits[ref[0]].detach())) < 1e-4 and top[0][0] == ref[0] and len(top) == 3
    zero = Engine(nano, small()).generate([p], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert zero.output == [] and zero.finish_reason == "length" and len(zero.prompt_logprobs) == len(p) - 1
    with torch.no_grad():
        full = nano(torch.tensor([p])).logits[0].log_softmax(-1)
    assert abs(zero.prompt_logprobs[3][0] - float(full[3, p[4]])) < 1e-4


def test_bad_requests_raise(nano, prompt):
    engine = Engine(nano, small())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.add_request([10_000])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 600)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_stop_strings_cut_the_text(nano, prompt):
    from k3.tokenizer_train import train_tokenizer

    tok = train_tokenizer(["the quick brown fox " * 20], vocab_size=1024)  # ids 0..255 are the bytes
    p = [ord(c) for c in "the quick brown"]
    free = Engine(nano, small(), tokenizer=tok).generate([p], GREEDY)[0]
    assert free.text == tok.decode(free.output)
    visible = [i for i, ch in enumerate(free.text) if ch.isprintable() and ch != "\ufffd"]
    stop = free.text[visible[len(visible) // 2]]
    cut = Engine(nano, small(), tokenizer=tok).generate(
        [p], SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True)
    )[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]


def test_incremental_detokenizing_equals_decoding_the_whole_output():
    """The engine decodes only the tokens after the last whole character; a character whose bytes span
    several tokens (the byte-level fallback of rare characters) shows only once complete."""
    from types import SimpleNamespace

    from k3.infer.sequence import Sequence
    from k3.tokenizer_train import train_tokenizer

    tok = train_tokenizer(["plain ascii words and more words\n"] * 20, vocab_size=512)
    text = "héllo wörld 日本語 🙂 ok ∑x ≤ 3 \U0001f9ea end"
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 2  # most non-ASCII bytes are tokens of their own
    engine = SimpleNamespace(tokenizer=tok)
    seq = Sequence(prompt=[1])
    for i in ids:
        seq.output.append(i)
        got = Engine._detokenize(engine, seq)
        whole = tok.decode(seq.output)
        assert got == whole
    assert got == text and seq.stable_ids == len(ids)
