"""`k3 serve --deterministic` with 32 concurrent clients: a target request's text, tokens and top-5
logprobs (floats compared with `==` after their JSON round trip) are the same alone on the idle server
and hidden among 31 other requests of random lengths, greedy and seeded at temperature 1."""

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from k3.tokenizer import K3Tokenizer


def complete(url: str, prompt: list[int], **params) -> dict:
    body = json.dumps({"model": "kimi-k3", "prompt": prompt, **params}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        choice = json.loads(r.read())["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]}


@pytest.fixture(scope="module")
def det_server(trained_nano, launch):
    s = launch(trained_nano, "--deterministic", "--max-model-len", "2048", "--max-num-seqs", "32")
    yield s.url
    s.stop()


@pytest.mark.parametrize(
    "params", [dict(temperature=0.0), dict(temperature=1.0, seed=99)], ids=["greedy", "seeded"]
)
def test_a_request_gets_the_same_bits_among_31_others(trained_nano, det_server, params):
    import inspect

    tok = K3Tokenizer.from_dir(trained_nano)
    ids = tok.encode(inspect.getsource(json.decoder))
    rng = random.Random(3)
    target = ids[100:620]
    others = []
    for _ in range(31):
        n = rng.randint(5, 400)
        s = rng.randrange(0, len(ids) - n)
        others.append((ids[s : s + n], rng.randint(1, 40)))
    params = {**params, "max_tokens": 32, "logprobs": 5}
    alone = complete(det_server, target, **params)
    assert len(alone["logprobs"]["tokens"]) == 32
    with ThreadPoolExecutor(32) as pool:
        half = [pool.submit(complete, det_server, p, max_tokens=m) for p, m in others[:15]]
        mine = pool.submit(complete, det_server, target, **params)
        rest = [pool.submit(complete, det_server, p, max_tokens=m) for p, m in others[15:]]
        results = [f.result() for f in (*half, mine, *rest)]
    assert all(r["text"] is not None for r in results)
    assert mine.result() == alone
