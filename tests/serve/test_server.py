"""The OpenAI-compatible server through the official `openai` client against a real uvicorn process."""

import json
import time
import urllib.error
import urllib.request

import openai  # the `test` extra installs it with the `serve` extras
import pytest

MODEL = "kimi-k3"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


def raw_post(url: str, body: bytes, key: str = "sk-test") -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert json.loads(urllib.request.urlopen(server + "/health").read()) == {"status": "ok"}


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (msg.reasoning_content, msg.content, "length")
    assert len(reasoning + content) > 0


def test_chat_with_tools_history_and_logprobs(client):
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
    history = CHAT + [
        {"role": "assistant", "content": "", "reasoning_content": "look it up",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "fox: 3 hits"},
    ]  # fmt: skip
    kw = dict(max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, reasoning_effort="high")
    r = client.chat.completions.create(model=MODEL, messages=history, tools=tools, **kw)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and len(lp[0].top_logprobs) == 2
    assert lp[0].logprob == pytest.approx(lp[0].top_logprobs[0].logprob)  # greedy picks the top token


def test_completions_text_ids_echo_logprobs(client):
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    a = client.completions.create(prompt="the lazy dog", **kw)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(prompt="the lazy dog", stream=True, **kw)
    )
    assert streamed == a.choices[0].text and a.usage.completion_tokens == 8
    ids = [5, 6, 7, 8, 9, 10]
    score = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = score.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and score.usage.completion_tokens == 0


def test_prefix_cache_metrics(client, server, scrape):
    metrics = scrape
    before = metrics(server)
    prompt = list(range(20, 150))
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = metrics(server)
    assert after["k3_prefix_cache_hit_tokens_total"] - before["k3_prefix_cache_hit_tokens_total"] >= 112
    assert after["k3_requests_total"] - before["k3_requests_total"] == 2


@pytest.mark.parametrize("case", ["key", "model", "types", "too_long", "max_tokens", "big", "seed"])
def test_error_classes(client, server, case):
    base = client.with_options(api_key="wrong") if case == "key" else client
    kw = dict(model="nope" if case == "model" else MODEL, prompt="hi", max_tokens=4)
    if case == "types":
        kw["extra_body"] = {"temperature": "hot"}
    if case == "too_long":
        kw["prompt"] = [1] * 1100
    if case == "max_tokens":
        kw["max_tokens"] = 10_000
    if case == "big":
        kw["prompt"] = "x " * 20_000
    if case == "seed":
        kw["seed"] = 2**64
    expected = {
        "key": 401,
        "model": 404,
        "types": 422,
        "too_long": 400,
        "max_tokens": 422,  # above --max-output-tokens (the context by default): the schema's maximum
        "big": 413,
        "seed": 422,
    }
    expected = expected[case]
    with pytest.raises(openai.APIStatusError) as e:
        base.completions.create(**kw)
    assert e.value.status_code == expected
    assert e.value.body["message"] and "type" in e.value.body  # OpenAI error JSON
    if case == "too_long":  # the token counts
        assert "1100 tokens" in e.value.body["message"] and "1024" in e.value.body["message"]


def test_malformed_bodies(server):
    url = server + "/v1/chat/completions"
    assert raw_post(url, b'{"model": "kimi-k3", "messages": [')[0] == 400
    status, body = raw_post(url, b'{"model": "kimi-k3", "messages": "\xff\xfe"}')
    assert status == 400 and "UTF-8" in body["error"]["message"]
    assert raw_post(url, b"[1, 2]")[0] == 400
    assert raw_post(url, b'{"model": "kimi-k3", "messages": []}')[0] == 422
    assert raw_post(url, b'{"model": "kimi-k3", "messages": [{"role": "wizard", "content": "x"}]}')[0] == 422
    assert raw_post(server + "/v1/nothing", b"{}")[0] == 404


def test_queue_full_then_disconnect_frees_slots(client, server, scrape):
    metrics = scrape
    kw = dict(model=MODEL, prompt="the fox", max_tokens=200, temperature=0, stream=True,
              extra_body={"ignore_eos": True})  # fmt: skip
    streams = [client.completions.create(**kw) for _ in range(2)]
    for s in streams:
        next(iter(s))
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**{**kw, "stream": False, "max_tokens": 2})
    assert e.value.status_code == 503
    for s in streams:
        s.close()
    deadline = time.time() + 20
    while metrics(server)["k3_num_requests_running"] > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert metrics(server)["k3_num_requests_running"] == 0
    r = client.completions.create(model=MODEL, prompt="the fox", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_terminal_chat(checkpoint):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "k3.cli", "chat", str(checkpoint), "--max-tokens", "6",
           "--max-model-len", "1024", "--page-size", "16", "--no-thinking"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        cmd, input="hello\n/reset\nthe fox\n/quit\n", capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("> ") == 4


def test_compile_flag_starts_and_serves(checkpoint, launch):
    """`k3 serve --compile` warms up whichever decode step the engine runs (the native C step here,
    which has nothing to compile) and then serves."""
    s = launch(checkpoint, "--compile", "--max-model-len", "256")
    try:
        body = json.dumps({"model": MODEL, "prompt": "the quick", "max_tokens": 4, "ignore_eos": True})
        status, out = raw_post(s.url + "/v1/completions", body.encode())
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 4
    finally:
        s.stop()
