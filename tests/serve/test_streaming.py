"""Streaming deltas: each engine event brings only its new (marked) text; the chat deltas concatenate to
the parse of the whole text, with no partial character or partial channel shown."""

import asyncio
import json

from k3.chat_parse import MARKED
from k3.infer.async_engine import Event
from k3.serve.streams import chat_stream

C, S, O = MARKED["<|close|>"], MARKED["<|sep|>"], MARKED["<|open|>"]


def test_chat_stream_deltas_concatenate_to_the_final_text():
    pieces = ["I", " ", "\u20ac", f"{C}th", f"ink{S}{O}response{S}ok"]
    events = [Event([1], False, text=t) for t in pieces[:-1]] + [Event([1], True, "stop", text=pieces[-1])]

    async def agen():
        for e in events:
            yield e

    async def collect():
        ctx = (None, "m", 3, True, ())
        return [chunk async for chunk in chat_stream(agen(), events[0], "id", ctx, False)]

    chunks = [json.loads(c[6:]) for c in asyncio.run(collect()) if c.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I \u20ac"
    assert "".join(d.get("content", "") for d in deltas) == "ok"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
