"""Streaming deltas from growing output text: partial UTF-8 and possible stop strings are held back."""

import asyncio
import json

from k3.infer.async_engine import Event
from k3.serve.app import _chat_stream, _stable


def test_stable_holds_back_partial_characters_and_stop_prefixes():
    assert _stable("ab\ufffd\ufffd", ()) == "ab"
    assert _stable("hello wor", ("world",)) == "hello"
    assert _stable("plain", ()) == "plain"


def test_chat_stream_deltas_concatenate_to_the_final_text():
    texts = [
        "I",
        "I \ufffd",
        "I \u20ac",
        "I \u20ac<|close|>th",
        "I \u20ac<|close|>think<|sep|><|open|>response<|sep|>ok",
    ]
    events = [Event([1], False, text=t) for t in texts[:-1]] + [Event([1], True, "stop", text=texts[-1])]

    async def agen():
        for e in events:
            yield e

    async def collect():
        ctx = (None, "m", 3, True, ())
        return [chunk async for chunk in _chat_stream(agen(), events[0], "id", ctx, False)]

    chunks = [json.loads(c[6:]) for c in asyncio.run(collect()) if c.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I \u20ac"
    assert "".join(d.get("content", "") for d in deltas) == "ok"
    assert all("\ufffd" not in d.get("reasoning_content", "") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
