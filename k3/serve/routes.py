"""The HTTP routes, as two routers: `info` (/health, /metrics, /openapi.json, /v1/models, the web page at
/ and its static files) and `generation` (/v1/chat/completions, /v1/completions, streamed or not).

Routes reach the server's parts through `request.app.state.server` (`Server`, built by `create_app`) and
its key through the `api_key` dependency (every route but /health and the page's files; the page carries
no data and asks for the key in the browser). A POST is read with its key checked first, then its
Content-Type, then its body (k3.serve.body), prepared in a worker thread (k3.serve.prepare) and started
on the engine: a full queue is 503 with `Retry-After`, a failure before any output an HTTP error. A client
that hangs up -- streaming or not, running or still queued -- is noticed by a watcher on the connection,
which cancels its request: its pending place is free at once, its slot and pages before the engine's
next step. The prefix-cache salt is a hash of the API key and the request's `cache_salt`: only requests
with both the same share cached state.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse

from k3.infer.async_engine import AsyncEngine, QueueFull
from k3.infer.sequence import SamplingParams
from k3.serve import streams
from k3.serve.auth import api_key, salt
from k3.serve.body import check_content_type, read_body
from k3.serve.config import ServeConfig
from k3.serve.errors import APIError, ClientGone, Gone, request_failed
from k3.serve.metrics import ServerMetrics
from k3.serve.prepare import Preparer, sampling_params
from k3.serve.protocol import new_id, now
from k3.vision.image_io import ImageError

STATIC = Path(__file__).parent / "static"
# the page loads only its own files; no inline script, no remote origin
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
STATIC_FILES = {p.name: p for p in STATIC.iterdir() if p.is_file()}  # nothing outside this folder


@dataclass
class Server:
    """What the routes share: the engine, the settings, the counters, the OpenAPI document, the request
    preparer and its thread pools (parsing, rendering and tokenizing run in `pool`, never on the event
    loop; images decode in `image_pool`, so a request with images never waits behind another's
    tokenizing or the other way round)."""

    engine: AsyncEngine
    cfg: ServeConfig
    stats: ServerMetrics
    doc: dict
    prepare: Preparer
    body_cap: int
    pool: ThreadPoolExecutor
    image_pool: ThreadPoolExecutor

    async def in_pool(self, fn, *args, executor=None):
        return await asyncio.get_running_loop().run_in_executor(executor or self.pool, fn, *args)

    async def read(self, request: Request) -> bytes:
        """The body of a POST whose key the route's dependency checked: Content-Type, then the capped read."""
        check_content_type(request)
        return await read_body(request, self.body_cap)

    async def start(self, request: Request, prompt: list[int], params: SamplingParams, salt: str, media=()):
        """-> (request id, async event iterator, first event, disconnect watcher); errors before any
        output become HTTP errors, and a client gone before its first token raises ClientGone."""
        engine = self.engine
        rid = engine.new_request_id()
        watcher = asyncio.ensure_future(streams.watch_disconnect(request, lambda: engine.cancel(rid)))
        agen = engine.generate(prompt, params, salt, media=media, request_id=rid)
        try:
            first = await agen.__anext__()
        except QueueFull as e:
            watcher.cancel()
            retry = {"Retry-After": str(self.cfg.retry_after_s)}
            busy = f"server busy: {e} (--max-pending)"
            raise APIError(503, busy, "server_overloaded", headers=retry) from None
        except ValueError as e:
            watcher.cancel()
            raise APIError(400, str(e)) from None
        except BaseException:
            watcher.cancel()
            raise
        if first.error or first.finish_reason == "abort":
            watcher.cancel()
            await agen.aclose()
            if first.error:
                raise request_failed(first.error)
            raise ClientGone
        return rid, agen, first, watcher


def server_of(request: Request) -> Server:
    return request.app.state.server


info = APIRouter()
generation = APIRouter()


# ---- info ------------------------------------------------------------------------------------------------
@info.get("/health")
async def health():
    return {"status": "ok"}


@info.get("/metrics", dependencies=[Depends(api_key)])
async def metrics(request: Request):
    s = server_of(request)
    return PlainTextResponse(s.stats.text(s.engine.metrics()), media_type="text/plain; version=0.0.4")


@info.get("/openapi.json", dependencies=[Depends(api_key)])
async def openapi(request: Request):
    return JSONResponse(server_of(request).doc)


@info.get("/v1/models", dependencies=[Depends(api_key)])
async def models(request: Request):
    s = server_of(request)
    card = {"id": s.cfg.served_model_name, "object": "model", "created": now(), "owned_by": "k3",
            "max_model_len": s.cfg.max_model_len, "vision": s.prepare.vision is not None}  # fmt: skip
    return {"object": "list", "data": [card]}


@info.get("/", include_in_schema=False)
async def page():
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_CSP})


@info.get("/static/{name}", include_in_schema=False)
async def static(name: str):
    if name not in STATIC_FILES:
        raise APIError(404, f"no static file {name!r}", "not_found_error")
    return FileResponse(STATIC_FILES[name], headers={"Content-Security-Policy": PAGE_CSP})


# ---- generation ------------------------------------------------------------------------------------------
@generation.post("/v1/chat/completions")
async def chat(request: Request, key: str = Depends(api_key)):
    t0 = time.perf_counter()
    s = server_of(request)
    raw = await s.read(request)
    req, opts, prompt, heads, max_tokens = await s.in_pool(s.prepare.chat, raw)
    top = (req.top_logprobs or 0) if req.logprobs else None
    media = ()
    if heads:
        try:
            media = await s.in_pool(s.prepare.load_images, heads, prompt, executor=s.image_pool)
        except ImageError as e:
            raise APIError(400, f"messages: image_url: {e} ({e.reason})", param="messages") from None
    params = sampling_params(req, max_tokens, logprobs=top, reserved_text=s.prepare.markers)
    try:
        rid, agen, first, watcher = await s.start(request, prompt, params, salt(key, req.cache_salt), media)
    except ClientGone:
        return Gone()
    ctx = (s.prepare.tok, s.cfg.served_model_name, len(prompt), opts.thinking, req.stop_list())
    timing = streams.Timing(s.stats, t0)
    events = streams.request_events(agen, first, timing)
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        body = streams.chat_stream(events, first, new_id("chatcmpl"), ctx, include)
        return StreamingResponse(streams.guarded(body, watcher), media_type="text/event-stream")
    try:
        return await streams.chat_full(events, new_id("chatcmpl"), ctx, top is not None)
    except ClientGone:
        return Gone()
    finally:
        watcher.cancel()


@generation.post("/v1/completions")
async def completions(request: Request, key: str = Depends(api_key)):
    t0 = time.perf_counter()
    s = server_of(request)
    raw = await s.read(request)
    req, prompt, max_tokens = await s.in_pool(s.prepare.completion, raw)
    lp = req.logprobs
    params = sampling_params(
        req, max_tokens, logprobs=lp, prompt_logprobs=lp if (req.echo and lp is not None) else None
    )
    try:
        rid, agen, first, watcher = await s.start(request, prompt, params, salt(key, req.cache_salt))
    except ClientGone:
        return Gone()
    ctx = (s.prepare.tok, s.cfg.served_model_name, prompt, req)
    events = streams.request_events(agen, first, streams.Timing(s.stats, t0))
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        body = streams.completion_stream(events, new_id("cmpl"), ctx, include)
        return StreamingResponse(streams.guarded(body, watcher), media_type="text/event-stream")
    try:
        return await streams.completion_full(events, new_id("cmpl"), ctx)
    except ClientGone:
        return Gone()
    finally:
        watcher.cancel()
