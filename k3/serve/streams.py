"""Answers built from a request's engine events: the whole response, or its SSE stream (chat: role,
reasoning / content deltas, tool calls, finish, usage; completions: each event's new text), with the
latency timing and the watcher that cancels a request whose client hung up."""

from __future__ import annotations

import sys
import time

from fastapi import Request

from k3.chat_parse import parse_marked
from k3.serve import responses as R
from k3.serve.errors import ClientGone, request_failed
from k3.serve.metrics import ServerMetrics
from k3.serve.protocol import error_body


async def watch_disconnect(request: Request, on_gone) -> None:
    """Wait for the client to hang up (the body is already read, so the next ASGI message is the
    disconnect), then call `on_gone`. Cancelled when the response is complete."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                on_gone()
                return
    except (OSError, RuntimeError):  # the connection is already gone
        on_gone()


class Timing:
    """Arrival, first-token and last-token times of one request, for the latency histograms."""

    def __init__(self, stats: ServerMetrics, start: float):
        self.stats, self.start, self.first, self.tokens = stats, start, None, 0

    def saw(self, n_tokens: int) -> None:
        if n_tokens and self.first is None:
            self.first = time.perf_counter()
        self.tokens += n_tokens

    def done(self) -> None:
        self.stats.observe_request(self.start, self.first, time.perf_counter(), self.tokens)


async def request_events(agen, first, timing: Timing):
    """The request's events from the first on; a cancelled one (client gone) raises ClientGone."""
    try:
        ev = first
        while True:
            if ev.finish_reason == "abort" and not ev.error:
                raise ClientGone
            timing.saw(len(ev.new_tokens))
            yield ev
            if ev.finished:
                timing.done()
                return
            ev = await agen.__anext__()
    except StopAsyncIteration:
        return
    finally:
        await agen.aclose()  # aborts the request if it did not finish (client went away)


async def guarded(body, watcher):
    """A stream's chunks; an unexpected failure ends it with an error event and [DONE] instead of a
    cut connection, and the disconnect watcher stops with the stream."""
    try:
        async for chunk in body:
            yield chunk
    except ClientGone:
        return
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in the stream
        print(f"k3 serve: stream: {type(e).__name__}: {e}", file=sys.stderr)
        yield R.sse(error_body(f"internal error: {type(e).__name__}", "server_error", None, 500))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        await body.aclose()


async def collect(events):
    tokens, lps, texts, last = [], [], [], None
    async for ev in events:
        if ev.error:
            raise request_failed(ev.error)
        tokens += ev.new_tokens
        lps += ev.logprobs
        texts.append(ev.text)
        last = ev
    return tokens, lps, "".join(texts), last


async def chat_full(events, rid, ctx, want_logprobs: bool):
    tok, model, n_prompt, thinking, _ = ctx
    tokens, lps, text, last = await collect(events)
    parsed = parse_marked(text, thinking)  # the markers are the generated marker ids, never spelled text
    message = {
        "role": "assistant",
        "content": parsed["content"],
        "reasoning_content": parsed["reasoning_content"],
    }
    finish = last.finish_reason
    if parsed["tool_calls"]:
        message["tool_calls"], finish = parsed["tool_calls"], "tool_calls"
    logprobs = R.chat_logprobs(tok, tokens, lps) if want_logprobs else None
    return R.chat_response(
        rid, model, message, finish, R.usage(n_prompt, len(tokens), last.cached_tokens), logprobs
    )


async def chat_stream(events, first, rid, ctx, include_usage: bool):
    """SSE chunks of a chat completion: role, reasoning / content deltas, tool calls, finish, usage.
    Each event brings only its new (marked) text; the deltas are what the parse of the text so far adds.
    `first` is the first event (also the first `events` yields); kept for callers that pass it."""
    tok, model, n_prompt, thinking, _ = ctx
    yield R.sse(R.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
    sent = {"reasoning_content": "", "content": ""}
    n_out, texts = 0, []
    async for ev in events:
        if ev.error:
            yield R.sse(error_body(request_failed(ev.error).message, "server_error", None, 500))
            break
        n_out += len(ev.new_tokens)
        texts.append(ev.text)
        if not ev.text and not ev.finished:
            continue
        parsed = parse_marked("".join(texts), thinking)
        texts = ["".join(texts)]
        delta = {}
        for key in sent:
            if len(parsed[key]) > len(sent[key]) and parsed[key].startswith(sent[key]):
                delta[key], sent[key] = parsed[key][len(sent[key]) :], parsed[key]
        if delta:
            yield R.sse(R.chat_chunk(rid, model, delta))
        if ev.finished:
            calls = parsed["tool_calls"]
            if calls:
                yield R.sse(
                    R.chat_chunk(rid, model, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
                )
            yield R.sse(R.chat_chunk(rid, model, {}, "tool_calls" if calls else ev.finish_reason))
            if include_usage:
                yield R.sse(R.chat_chunk(rid, model, {}, use=R.usage(n_prompt, n_out, ev.cached_tokens)))
    yield "data: [DONE]\n\n"


async def completion_full(events, rid, ctx):
    tok, model, prompt, req = ctx
    tokens, lps, out_text, last = await collect(events)
    text = (tok.decode(prompt) if req.echo else "") + out_text
    logprobs = None
    if req.logprobs is not None:
        logprobs = R.completion_logprobs(tok, prompt, last.prompt_logprobs, tokens, lps, req.echo)
    use = R.usage(len(prompt), len(tokens), last.cached_tokens)
    return R.completion_response(rid, model, text, last.finish_reason, use, logprobs)


async def completion_stream(events, rid, ctx, include_usage: bool = False):
    """SSE chunks of a text completion: each event's new text as it comes (the engine holds back what
    a stop string or the next token may still change)."""
    tok, model, prompt, req = ctx
    if req.echo:
        yield R.sse(R.completion_response(rid, model, tok.decode(prompt), None, None))
    n_out = 0
    async for ev in events:
        n_out += len(ev.new_tokens)
        if ev.error:
            yield R.sse(error_body(request_failed(ev.error).message, "server_error", None, 500))
            break
        if ev.text:
            yield R.sse(R.completion_response(rid, model, ev.text, None, None))
        if ev.finished:
            yield R.sse(R.completion_response(rid, model, "", ev.finish_reason, None))
            if include_usage:
                use = R.usage(len(prompt), n_out, ev.cached_tokens)
                yield R.sse({**R.completion_response(rid, model, "", None, use), "choices": []})
    yield "data: [DONE]\n\n"
