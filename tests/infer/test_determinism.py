"""One answer per request (EngineConfig.deterministic): a target request's tokens and top-5 logprobs are
equal bit for bit (`==` on floats) whatever its prefill chunking, its batch mates, the prefix-cache
state and the thread count, greedy and seeded at temperature 1; prefill rows equal decode rows."""

import inspect
import json
import random

import pytest
import torch

from k3.checkpoint.io import load_checkpoint
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.tokenizer import K3Tokenizer

GREEDY = SamplingParams(max_tokens=32, logprobs=5)
SEEDED = SamplingParams(max_tokens=32, logprobs=5, temperature=1.0, seed=1234)


def answer(seq) -> tuple:
    """What a client sees of a request: its tokens and every (logprob, top-5) pair, as exact floats."""
    return tuple(seq.output), tuple((lp, tuple(top)) for lp, top in seq.logprobs)


def run(model, target, params, *, threads=1, before=(), after=(), warm=(), **config) -> tuple:
    """The target's answer from a fresh deterministic engine: `warm` prompts run to completion first
    (the prefix cache keeps them), `before` requests are mid-flight when the target arrives, `after`
    ones arrive one step later."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg = dict(page_size=64, num_pages=160, max_model_len=2048, max_num_seqs=32, deterministic=True)
        engine = Engine(model, EngineConfig(**{**cfg, **config}))
        assert engine.runner.exact == engine.config.deterministic, "the native step does not run this model"
        if warm:
            engine.generate(list(warm), SamplingParams(max_tokens=2))
        rng = random.Random(len(before) * 31 + len(after))
        others = [engine.add_request(p, SamplingParams(max_tokens=rng.randint(1, 40))) for p in before]
        for _ in range(2 if before else 0):
            engine.step()
        seq = engine.add_request(target, params)
        engine.step()
        others += [engine.add_request(p, SamplingParams(max_tokens=rng.randint(1, 40))) for p in after]
        while engine.has_unfinished:
            engine.step()
        assert all(s.status.name == "FINISHED" for s in others)
        return answer(seq)
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trained(trained_nano):
    model, _ = load_checkpoint(trained_nano)
    return model.float().eval(), K3Tokenizer.from_dir(trained_nano)


def texts(tok, n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    """n prompts of lo..hi tokens cut from the standard library's own source (varied, real text)."""
    rng = random.Random(seed)
    source = inspect.getsource(json.decoder) + inspect.getsource(random) + inspect.getsource(inspect)
    ids = tok.encode(source)
    out = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        s = rng.randrange(0, len(ids) - k)
        out.append(ids[s : s + k])
    return out


@pytest.fixture(scope="module")
def case(trained):
    """(model, target prompt of 520 tokens, other prompts of 5..400 tokens)."""
    model, tok = trained
    (target,) = texts(tok, 1, seed=7, lo=520, hi=520)
    return model, target, texts(tok, 40, seed=8, lo=5, hi=400)


@pytest.fixture(scope="module")
def alone(case):
    """The target's answers run alone in one chunk: what every other arrangement must equal."""
    model, target, _ = case
    return {p: run(model, target, p) for p in (GREEDY, SEEDED)}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [64, 96, 200, 1000])
def test_prefill_chunking(case, alone, params, chunk):
    model, target, _ = case
    got = run(model, target, params, max_prefill_chunk=chunk, max_num_batched_tokens=chunk)
    assert got == alone[params]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("shared", [64, 100, 256, 400, 640])
def test_prefix_cache_hits(case, alone, params, shared):
    """A request sharing the target's first `shared` tokens ran before it: the target resumes from its
    cached latents and KDA snapshot (640 > the target's 520 tokens: a hit on all of it but the last)."""
    model, target, others = case
    warm = target[:shared] + others[0][: max(0, 650 - shared)]
    got = run(model, target, params, warm=[warm])
    assert got == alone[params]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mates", [1, 7, 31])
def test_batch_mates(case, alone, params, mates):
    model, target, others = case
    half = mates // 2
    got = run(model, target, params, before=others[: mates - half], after=others[mates - half : mates])
    assert got == alone[params]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_two_threads(case, alone, params):
    model, target, others = case
    got = run(model, target, params, threads=2, before=others[:3], max_prefill_chunk=96)
    assert got == alone[params]


def test_prefill_of_generated_tokens_equals_their_decode(case, alone):
    """A prompt that ends with the first 16 tokens the target generated continues with the other 16 and
    the same logprobs: prefill rows give the bits decode gave."""
    model, target, _ = case
    tokens, lps = alone[GREEDY]
    got = run(model, target + list(tokens[:16]), SamplingParams(max_tokens=16, logprobs=5))
    assert got == (tokens[16:], lps[16:])


def test_the_test_can_fail(case, alone):
    """The torch prefill path (deterministic off) differs from the native one in the last bits."""
    model, target, _ = case
    got = run(model, target, GREEDY, deterministic=False, max_prefill_chunk=96)
    assert got[1] != alone[GREEDY][1]


@pytest.fixture(scope="module")
def small():
    """k3-small at random init, fp32, and the same weights with MXFP4-packed routed experts."""
    import copy

    from k3.config import preset
    from k3.model.transformer import K3ForCausalLM
    from k3.quant.packed import pack_model_experts

    torch.manual_seed(0)
    model = K3ForCausalLM(preset("k3-small").replace(dtype="float32")).eval()
    return {"f32": model, "mxfp4": pack_model_experts(copy.deepcopy(model)).eval()}


@pytest.mark.parametrize("fmt", ["f32", "mxfp4"])
def test_k3_small_every_arrangement(small, fmt):
    """(a) alone, (b) chunks of 96, (c) after a prefix-cache hit on 256 tokens, (d) among 7 requests."""
    model = small[fmt]
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, model.config.vocab_size, (520,), generator=g).tolist()
    others = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 150, 40, 77)]
    for params in (GREEDY, SEEDED):  # two threads: the bits do not depend on it (test_two_threads)
        ref = run(model, target, params, threads=2)
        assert run(model, target, params, threads=2, max_prefill_chunk=96, max_num_batched_tokens=96) == ref
        assert run(model, target, params, threads=2, warm=[target[:256] + others[0]]) == ref
        assert run(model, target, params, threads=2, before=others[:2], after=others[2:]) == ref
