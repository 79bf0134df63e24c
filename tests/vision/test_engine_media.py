"""Engine generation with per-sequence embedding overrides (image tokens): equal to the model's own
forward on the same inputs_embeds, through chunked prefill and the prefix cache; image keys in the
cache hashes."""

import pytest
import torch

from k3.config import preset
from k3.infer.cache.prefix_cache import chain_hashes
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.media import MediaSpan, check_media
from k3.infer.sequence import SamplingParams
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM

PAD = 7  # stands in for <|media_pad|>


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def nano():
    config = preset("k3-nano").replace(dtype="float32")
    model = K3ForCausalLM(config)
    init_weights(model, 0.5, config.num_hidden_layers, seed=0)
    return model.eval()


def _prompt(n_before: int, n_img: int, n_after: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 200, (n_before + n_after,), generator=g).tolist()
    return ids[:n_before] + [PAD] * n_img + ids[n_before:]


def _span(start: int, n: int, width: int, seed: int) -> MediaSpan:
    g = torch.Generator().manual_seed(seed)
    return MediaSpan(start, torch.randn(n, width, generator=g), key=f"img{seed}")


@torch.no_grad()
def _reference(model, prompt: list[int], spans, steps: int) -> list[int]:
    """Greedy decoding with the plain model on inputs_embeds (pads replaced), uncached."""
    ids, out = list(prompt), []
    for _ in range(steps):
        e = model.model.embed_tokens(torch.tensor([ids]))
        for s in spans:
            e[0, s.start : s.stop] = s.embeds
        nxt = int(model(inputs_embeds=e).logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


def _engine(model, **kw) -> Engine:
    cfg = dict(page_size=16, prefix_unit=16, num_pages=64, max_num_seqs=4, max_model_len=256)
    return Engine(model, EngineConfig(**(cfg | kw)), eos_token_id=-1)


GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.mark.parametrize("chunk", [1024, 8])
def test_engine_with_embeddings_equals_model_forward(nano, chunk):
    D = nano.config.hidden_size
    prompt = _prompt(5, 12, 9, seed=1)
    spans = [_span(5, 12, D, seed=2)]
    want = _reference(nano, prompt, spans, GREEDY.max_tokens)
    eng = _engine(nano, max_prefill_chunk=chunk, enable_prefix_cache=False)
    seq = eng.add_request(prompt, GREEDY, media=spans)
    while eng.has_unfinished:
        eng.step()
    assert seq.output == want
    # the override matters: without it (plain pad embeddings) the model says something else
    assert _reference(nano, prompt, [], GREEDY.max_tokens) != want


def test_two_images_batched_with_text_only(nano):
    D = nano.config.hidden_size
    p1 = _prompt(3, 8, 4, seed=3)
    p1 = p1 + [PAD] * 4 + [11, 12]  # a second image
    s1 = [_span(3, 8, D, seed=4), _span(15, 4, D, seed=5)]
    p2 = _prompt(15, 0, 6, seed=6)
    eng = _engine(nano, enable_prefix_cache=False)
    a = eng.add_request(p1, GREEDY, media=s1)
    b = eng.add_request(p2, GREEDY)
    while eng.has_unfinished:
        eng.step()
    assert a.output == _reference(nano, p1, s1, GREEDY.max_tokens)
    assert b.output == _reference(nano, p2, [], GREEDY.max_tokens)


def test_prefix_cache_never_reuses_another_images_positions(nano):
    """Same token ids, different image: the hit stops before the image; same image: it is reused."""
    D = nano.config.hidden_size
    prompt = _prompt(20, 16, 30, seed=7)  # the image covers positions [20, 36): units 1 and 2 (unit 16)
    img_a, img_b = _span(20, 16, D, seed=8), _span(20, 16, D, seed=9)
    eng = _engine(nano)
    a = eng.add_request(prompt, GREEDY, media=[img_a])
    while eng.has_unfinished:
        eng.step()
    b = eng.add_request(prompt, GREEDY, media=[img_b])
    while eng.has_unfinished:
        eng.step()
    assert b.cached_tokens <= 16  # only the unit before the image may be shared
    assert b.output == _reference(nano, prompt, [img_b], GREEDY.max_tokens)
    assert a.output == _reference(nano, prompt, [img_a], GREEDY.max_tokens)
    c = eng.add_request(prompt, GREEDY, media=[img_a])
    while eng.has_unfinished:
        eng.step()
    assert c.cached_tokens >= 48  # the same image: its units come from the cache
    assert c.output == a.output


def test_chain_hashes_include_media_keys():
    toks = list(range(64))
    plain = chain_hashes(toks, 16, "")
    span_a = MediaSpan(20, torch.zeros(8, 4), "a")
    span_b = MediaSpan(20, torch.zeros(8, 4), "b")
    ha, hb = chain_hashes(toks, 16, "", media=[span_a]), chain_hashes(toks, 16, "", media=[span_b])
    assert ha[0] == hb[0] == plain[0]  # the unit before the image is shared
    assert ha[1] != hb[1] and ha[1] != plain[1]
    assert all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))  # the chain stays apart afterwards
    assert chain_hashes(toks, 16, "", media=[span_a]) == ha


def test_check_media_rejects_bad_spans():
    good = MediaSpan(2, torch.zeros(3, 8), "k")
    check_media([good], 10, 8)
    with pytest.raises(ValueError, match="inside"):
        check_media([MediaSpan(8, torch.zeros(3, 8), "k")], 10, 8)
    with pytest.raises(ValueError, match="embeds"):
        check_media([MediaSpan(2, torch.zeros(3, 5), "k")], 10, 8)
    with pytest.raises(ValueError, match="disjoint"):
        check_media([good, MediaSpan(4, torch.zeros(2, 8), "k")], 10, 8)
