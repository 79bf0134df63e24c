"""HTTP routes: /v1/models, /v1/chat/completions, /v1/completions (stream and not), /health, /metrics,
/openapi.json, and the web chat page at / (static files in k3/serve/static).

Every request passes the Host check (`k3.serve.guard`; 400 outside --allowed-hosts). Every POST must
say Content-Type application/json (415; none is refused too, so a web page cannot post cross-site
without a CORS preflight), its body is read with a size cap applied while it streams in (413 before the
rest arrives), then, in a pool of worker threads and never on the event loop, decoded as UTF-8 (400),
parsed as strict JSON (400: no NaN, no lone surrogates, at most --max-json-depth deep), checked against
the stop-string limits and validated against the documented schema (422; k3.serve.protocol,
k3.serve.openapi), rendered and tokenized. With `--api-key` (one or more), every route but /health
needs `Authorization: Bearer KEY` (compared in constant time with every key; 401 with
`WWW-Authenticate`); the static page carries no data and asks for the key in the browser. An
unknown model is 404, a prompt that does not fit the context 400 with its token count, a full queue
503 with `Retry-After`. Errors use OpenAI's error JSON. `max_tokens` is an upper bound (at most
`--max-output-tokens`, also its default): generation also ends where the context does (finish_reason
"length").

One request's failure stays its own: tokenizing errors answer 400, a failure while sampling or
detokenizing it ends that request with 500 (or an error event when streaming) while its batch goes on,
and anything else unexpected answers 500 in the OpenAI shape. A client that hangs up -- streaming or
not, running or still queued -- is noticed by a watcher on the connection, which cancels its request:
its pending place is free at once, its slot and pages before the engine's next step. The prefix-cache
salt is a hash of the API key and the request's `cache_salt`: only requests with both the same share
cached state. Chat answers are parsed from the generated marker ids (SamplingParams.reserved_text marks
them in the engine's text), so text that spells a marker stays text.

Images (an engine with `.vision`, `k3.vision.serving.load_vl_engine`): user messages may carry OpenAI
`image_url` parts as data: URLs (base64 PNG/JPEG). Remote URLs, undecodable, truncated or oversized
images and literal image placeholders in the text answer 400 for that request alone; nothing in a
request makes the server read a file or fetch a URL. Each image's size and token count come from its
header, so --max-images, --max-image-pixels and the context are checked before any pixel is decoded;
the images of a request that fits are decoded (in their own thread, one at a time) and embedded before
the request reaches the engine, and each image's content hash enters the prefix-cache keys of the units
its tokens occupy (`k3.infer.media`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from k3.chat_format import ChatOptions, encode_segments, marker_ids, parse_marked, render
from k3.infer.async_engine import AsyncEngine, QueueFull
from k3.infer.memory import release_free_memory
from k3.infer.sequence import SamplingParams
from k3.serve import responses as R
from k3.serve.guard import allowed_host
from k3.serve.metrics import ServerMetrics
from k3.serve.openapi import build_openapi
from k3.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now
from k3.vision.image_io import ImageError

STATIC = Path(__file__).parent / "static"
# the page loads only its own files; no inline script, no remote origin
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
JSON_TYPES = ("application/json",)
BIG_BODY = 1 << 20  # after preparing a body this large, free C-heap pages go back to the OS


@dataclass(frozen=True)
class ServeConfig:
    """The server's settings; every limit is a `k3 serve` option (docs/serving.md, "Security")."""

    served_model_name: str = "kimi-k3"
    api_keys: tuple[str, ...] = ()  # any of them is accepted; each is its own prefix-cache tenant
    max_model_len: int = 8192
    max_body_bytes: int | None = None  # 413 above it; None: body_cap() from the context (and vision)
    retry_after_s: int = 1  # the 503's Retry-After
    max_output_tokens: int | None = None  # per request (422 above it; the default); None: the context
    max_header_bytes: int = 16 << 10  # request line + headers (431 above it)
    max_stop_strings: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_json_depth: int = 64  # nesting of arrays / objects in a body
    max_images: int = 16  # image parts per request
    max_image_pixels: int = 100_000_000  # pixels of a request's images together (header sizes)
    allowed_hosts: frozenset[str] | None = None  # Host names answered (None: any); k3.serve.guard
    cors_origins: tuple[str, ...] = ()  # origins allowed to read answers cross-site (none: closed)
    prepare_threads: int = 2  # the pool that parses, renders and tokenizes requests

    @property
    def output_cap(self) -> int:
        return self.max_output_tokens or self.max_model_len

    def body_cap(self, vision: bool) -> int:
        """Bytes a request body may have. Unset, it is what the context can use: 32 bytes a token (JSON
        escapes included, ~8x what text takes) + 64 KiB of other fields, + 8 MiB of images on a vision
        server; a body no prompt of this context could fill is refused before it is read or parsed."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return (64 << 10) + 32 * self.max_model_len + ((8 << 20) if vision else 0)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}


class _Gone(Response):
    """The answer to a client that hung up: nothing is sent (the guard counts it as status 499)."""

    def __init__(self):
        super().__init__(status_code=499)

    async def __call__(self, scope, receive, send) -> None:
        return None


def create_app(engine: AsyncEngine, cfg: ServeConfig) -> FastAPI:
    app = FastAPI(title="k3", docs_url=None, redoc_url=None, openapi_url=None)
    tok = engine.tokenizer
    vision = getattr(engine.engine, "vision", None)
    body_cap = cfg.body_cap(vision is not None)
    stats = ServerMetrics()
    doc = build_openapi(cfg.served_model_name, engine.engine.vocab_size, cfg.output_cap,
                        vision is not None, bool(cfg.api_keys), stop_limits=(cfg.max_stop_strings,
                        cfg.max_stop_chars))  # fmt: skip
    if cfg.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])  # fmt: skip
    app.add_middleware(_Guard, stats=stats, max_header_bytes=cfg.max_header_bytes, hosts=cfg.allowed_hosts)
    # parsing, rendering and tokenizing run here, never on the event loop; images decode in their own
    # thread, so a request with images never waits behind another's tokenizing or the other way round
    pool = ThreadPoolExecutor(cfg.prepare_threads, thread_name_prefix="k3-prepare")
    image_pool = ThreadPoolExecutor(1, thread_name_prefix="k3-images")
    markers = tuple(marker_ids(tok).items()) if tok is not None else ()
    # no text longer than this fits the context: no token stands for more characters than its bytes
    # (or, for a reserved name in a completions prompt, its name)
    longest = 1 if tok is None else max([len(b) for b in tok.ranks()] + [len(r.name) for r in tok.reserved])
    max_prompt_chars = cfg.max_model_len * longest

    async def in_pool(fn, *args, executor=None):
        return await asyncio.get_running_loop().run_in_executor(executor or pool, fn, *args)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(
            error_body(e.message, e.type, e.param, e.status), status_code=e.status, headers=e.headers
        )

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # routing: 404, 405 (with its Allow header)
        return JSONResponse(
            error_body(str(e.detail), "invalid_request_error", None, e.status_code),
            e.status_code,
            headers=getattr(e, "headers", None),
        )

    async def read(request: Request) -> tuple[bytes, str]:
        """-> (the body, the tenant's key); auth and Content-Type are checked before the body is read."""
        key = _auth(request, cfg)
        ctype = request.headers.get("content-type")
        if ctype is None or ctype.split(";")[0].strip().lower() not in JSON_TYPES:
            # a browser sends a cross-site POST without a CORS preflight only as text/plain, a form or
            # with no Content-Type: refusing all but application/json keeps web pages out
            raise APIError(415, f"Content-Type must be application/json, got {ctype!r}")
        return await _read_body(request, body_cap), key

    def check_stops(data: dict) -> None:
        """The stop-string limits on the parsed JSON, before anything walks a flood of them."""
        stops = data.get("stop")
        stops = [stops] if isinstance(stops, str) else stops if isinstance(stops, list) else []
        if len(stops) > cfg.max_stop_strings:
            raise APIError(422, f"stop: {len(stops)} stop strings; at most {cfg.max_stop_strings} "
                           "(--max-stop-strings)", param="stop")  # fmt: skip
        if any(isinstance(x, str) and len(x) > cfg.max_stop_chars for x in stops):
            raise APIError(422, f"stop: a stop string is over {cfg.max_stop_chars} characters "
                           "(--max-stop-chars)", param="stop")  # fmt: skip

    def validate(raw: bytes, model_cls):
        """(runs in the pool) body -> the request model, every limit checked."""
        data = _parse_json(raw, cfg.max_json_depth, before_walk=check_stops)
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"])
            raise APIError(422, f"{param}: {err['msg']}", param=param) from None
        for key in ("max_tokens", "max_completion_tokens"):
            value = getattr(req, key, None)
            if value is not None and value > cfg.output_cap:
                raise APIError(422, f"{key}: must be <= {cfg.output_cap} (--max-output-tokens)", param=key)
        if req.model != cfg.served_model_name:
            raise APIError(404, f"model {req.model!r} does not exist", "not_found_error", "model")
        return req

    def check_text_size(n_chars: int, param: str) -> None:
        if n_chars > max_prompt_chars:
            raise APIError(400, f"prompt text has {n_chars} characters; no text over {max_prompt_chars} "
                           f"fits the context of {cfg.max_model_len} tokens", param=param)  # fmt: skip

    def prepare_chat(raw: bytes):
        """(runs in the pool) -> (request, options, prompt ids, image headers, max_tokens)."""
        try:
            req = validate(raw, ChatCompletionRequest)
            opts = _chat_options(req)
            messages = [_message(m) for m in req.messages]
            urls = [] if vision is not None else None
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            try:
                segments = _render(messages, tools, opts, urls)
                check_text_size(sum(len(t) for t, marker in segments if not marker), "messages")
                heads = []
                if urls:
                    if len(urls) > cfg.max_images:
                        raise APIError(400, f"messages: {len(urls)} images; at most {cfg.max_images} per "
                                       "request (--max-images)", param="messages")  # fmt: skip
                    heads = vision.headers(urls)  # sizes from the headers: nothing decoded yet
                    pixels = sum(h.pixels for h in heads)
                    if pixels > cfg.max_image_pixels:
                        raise APIError(400, f"messages: the images have {pixels} pixels together; at most "
                                       f"{cfg.max_image_pixels} per request (--max-image-pixels)",
                                       param="messages")  # fmt: skip
                prompt = vision.encode(tok, segments, heads) if heads else encode_segments(tok, segments)
            except (APIError, ImageError):
                raise
            except Exception as e:  # noqa: BLE001 - this request's messages cannot be rendered or tokenized
                raise APIError(400, f"messages: {type(e).__name__}: {e}", param="messages") from None
            wanted = req.max_completion_tokens or req.max_tokens or cfg.output_cap
            max_tokens = _fit(len(prompt), wanted, cfg.max_model_len, 1)
            return req, opts, prompt, heads, max_tokens
        except ImageError as e:
            raise APIError(400, f"messages: image_url: {e} ({e.reason})", param="messages") from None
        finally:
            if len(raw) > BIG_BODY:
                release_free_memory()

    def prepare_completion(raw: bytes):
        """(runs in the pool) -> (request, prompt ids, max_tokens)."""
        try:
            req = validate(raw, CompletionRequest)
            text = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
            if isinstance(text, str):
                check_text_size(len(text), "prompt")
            prompt = _completion_prompt(tok, req.prompt)
            wanted = cfg.output_cap if req.max_tokens is None else req.max_tokens
            return req, prompt, _fit(len(prompt), wanted, cfg.max_model_len, 0)
        finally:
            if len(raw) > BIG_BODY:
                release_free_memory()

    def load_images(heads, prompt):
        """(runs in the image thread) decode, pre-process and embed a fitting request's images."""
        try:
            images = vision.load(heads)
            return vision.spans(prompt, images)
        finally:
            release_free_memory()  # the decoded pixels' memory goes back to the OS

    async def start(request: Request, prompt: list[int], params: SamplingParams, salt: str, media=()):
        """-> (request id, async event iterator, first event, disconnect watcher); errors before any
        output become HTTP errors, and a client gone before its first token raises _ClientGone."""
        rid = engine.new_request_id()
        watcher = asyncio.ensure_future(_watch_disconnect(request, lambda: engine.cancel(rid)))
        agen = engine.generate(prompt, params, salt, media=media, request_id=rid)
        try:
            first = await agen.__anext__()
        except QueueFull as e:
            watcher.cancel()
            retry = {"Retry-After": str(cfg.retry_after_s)}
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
                raise _request_failed(first.error)
            raise _ClientGone
        return rid, agen, first, watcher

    @app.exception_handler(ClientDisconnect)
    async def _client_gone_reading(_, e):
        return _Gone()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        _auth(request, cfg)
        return PlainTextResponse(stats.text(engine.metrics()), media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json")
    async def openapi(request: Request):
        _auth(request, cfg)
        return JSONResponse(doc)

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(request, cfg)
        card = {"id": cfg.served_model_name, "object": "model", "created": now(), "owned_by": "k3",
                "max_model_len": cfg.max_model_len, "vision": vision is not None}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_CSP})

    static_files = {p.name: p for p in STATIC.iterdir() if p.is_file()}  # nothing outside this folder

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in static_files:
            raise APIError(404, f"no static file {name!r}", "not_found_error")
        return FileResponse(static_files[name], headers={"Content-Security-Policy": PAGE_CSP})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        raw, key = await read(request)
        req, opts, prompt, heads, max_tokens = await in_pool(prepare_chat, raw)
        salt = _salt(key, req.cache_salt)
        top = (req.top_logprobs or 0) if req.logprobs else None
        media = ()
        if heads:
            try:
                media = await in_pool(load_images, heads, prompt, executor=image_pool)
            except ImageError as e:
                raise APIError(400, f"messages: image_url: {e} ({e.reason})", param="messages") from None
        params = _params(req, max_tokens, logprobs=top, reserved_text=markers)
        try:
            rid, agen, first, watcher = await start(request, prompt, params, salt, media)
        except _ClientGone:
            return _Gone()
        ctx = (tok, cfg.served_model_name, len(prompt), opts.thinking, req.stop_list())
        timing = _Timing(stats, t0)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            body = _chat_stream(_events(agen, first, timing), first, new_id("chatcmpl"), ctx, include)
            return StreamingResponse(_guarded(body, watcher), media_type="text/event-stream")
        try:
            return await _chat_full(_events(agen, first, timing), new_id("chatcmpl"), ctx, top is not None)
        except _ClientGone:
            return _Gone()
        finally:
            watcher.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        raw, key = await read(request)
        req, prompt, max_tokens = await in_pool(prepare_completion, raw)
        salt = _salt(key, req.cache_salt)
        lp = req.logprobs
        params = _params(
            req, max_tokens, logprobs=lp, prompt_logprobs=lp if (req.echo and lp is not None) else None
        )
        try:
            rid, agen, first, watcher = await start(request, prompt, params, salt)
        except _ClientGone:
            return _Gone()
        ctx = (tok, cfg.served_model_name, prompt, req)
        timing = _Timing(stats, t0)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            body = _completion_stream(_events(agen, first, timing), new_id("cmpl"), ctx, include)
            return StreamingResponse(_guarded(body, watcher), media_type="text/event-stream")
        try:
            return await _completion_full(_events(agen, first, timing), new_id("cmpl"), ctx)
        except _ClientGone:
            return _Gone()
        finally:
            watcher.cancel()

    return app


# ---- the ASGI guard: status counts, and a 500 for anything unexpected ------------------------------------
class _Guard:
    """Counts every response by route and status (a client gone before any byte: 499) and turns an
    exception that escaped a route into a 500 OpenAI error (or, after the response started, a logged
    line: the stream already ended with an error event or was cut by the client)."""

    def __init__(self, app, stats: ServerMetrics, max_header_bytes: int, hosts: frozenset[str] | None = None):
        self.app, self.stats, self.max_header_bytes, self.hosts = app, stats, max_header_bytes, hosts

    async def _refuse(self, scope, send, status: int, message: str) -> None:
        error = error_body(message, "invalid_request_error", None, status)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})
        self.stats.count_response(scope.get("path", ""), status)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > self.max_header_bytes:  # h11 caps only a header block that arrives in pieces
            msg = f"request line + headers over {self.max_header_bytes} bytes (--max-header-bytes)"
            return await self._refuse(scope, send, 431, msg)
        host = next((v for k, v in scope["headers"] if k == b"host"), None)
        host = None if host is None else host.decode("latin-1")
        if not allowed_host(host, self.hosts):  # DNS rebinding: a page's own name sent to 127.0.0.1
            msg = f"Host {host[:100]!r} is not served here (--allowed-hosts)"
            return await self._refuse(scope, send, 400, msg)
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - incl. Rust panics (a BaseException) in a tokenizer
            if status is None:
                error = error_body(f"internal error: {type(e).__name__}", "server_error", None, 500)
                body = json.dumps(error)
                status = 500
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body.encode()})
            print(f"k3 serve: {scope.get('path')}: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            self.stats.count_response(scope.get("path", ""), 499 if status is None else status)


class _ClientGone(Exception):
    """The client hung up; its request was cancelled."""


async def _watch_disconnect(request: Request, on_gone) -> None:
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


async def _read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 as soon as it passes `cap` bytes (a chunked body has no length)."""
    too_big = APIError(
        413, f"request body over {cap} bytes (--max-body-bytes)", headers={"Connection": "close"}
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _parse_json(raw: bytes, max_depth: int = 64, before_walk=None) -> dict:
    """Strict JSON: UTF-8, no NaN / Infinity, no lone surrogate escapes, an object at the top, arrays and
    objects nested at most `max_depth` deep. `before_walk(data)` checks what it can before the walk."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8") from None
    except RecursionError:  # deeper than the decoder's own limit (~1,000)
        raise APIError(400, _too_deep(max_depth)) from None
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise APIError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    if before_walk is not None:
        before_walk(data)
    # valid UTF-8 holds no surrogate: only a \uD800-\uDFFF escape can make one
    too_deep, bad = _walk(data, max_depth, _SURROGATE_ESCAPE.search(raw) is not None)
    if too_deep:
        raise APIError(400, _too_deep(max_depth))
    if bad is not None:
        raise APIError(400, f"{bad or 'body'}: a lone UTF-16 surrogate is not valid Unicode", param=bad)
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_deep(max_depth: int) -> str:
    return f"request body nests arrays / objects over {max_depth} deep (--max-json-depth)"


def _walk(data, max_depth: int, strings: bool = True) -> tuple[bool, str | None]:
    """One pass without recursion -> (nested over max_depth?, the path of the first string (key or
    value) holding a lone surrogate, else None); `strings=False` checks the nesting alone."""
    first_bad = None
    stack = [(data, "", 1)]
    while stack:
        obj, path, depth = stack.pop()
        if isinstance(obj, str):
            if first_bad is None and not _valid_unicode(obj):
                first_bad = path
            continue
        if not isinstance(obj, dict | list):
            continue
        if depth > max_depth:
            return True, None
        values = obj.values() if isinstance(obj, dict) else obj
        if not strings:  # containers only: a list of 250,000 strings costs one pass in C
            stack += [(v, "", depth + 1) for v in values if isinstance(v, dict | list)]
            continue
        items = list(obj.items()) if isinstance(obj, dict) else [(str(i), v) for i, v in enumerate(obj)]
        for k, v in reversed(items):  # reversed: the stack pops them in document order
            name = str(k).encode("utf-8", "backslashreplace").decode()  # printable in the error message
            sub = f"{path}.{name}" if path else name
            stack.append((v, sub, depth + 1))
            if first_bad is None and not _valid_unicode(str(k)):
                stack.append((k, sub, depth + 1))
    return False, first_bad


def _valid_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---- request helpers ----------------------------------------------------------------------------------
def _auth(request: Request, cfg: ServeConfig) -> str:
    """Check the bearer key against every server key in constant time (when the server has keys) ->
    the key (the tenant)."""
    header = request.headers.get("authorization", "")
    key = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if cfg.api_keys:
        # header text is latin-1 (HTTP bytes); compare the bytes the client sent with each key's UTF-8
        given, found = key.encode("latin-1", "replace"), False
        for k in cfg.api_keys:  # all of them, whatever matches: the time says nothing about which
            found |= hmac.compare_digest(given, k.encode("utf-8", "surrogateescape"))
        if not found:
            challenge = {"WWW-Authenticate": "Bearer"}
            raise APIError(401, "invalid or missing API key", "authentication_error", headers=challenge)
    return key


def _salt(key: str, cache_salt: str | None) -> str:
    """The prefix-cache salt of a request: its API key and its `cache_salt` (each part length-prefixed,
    so no two pairs give one salt), hashed."""
    parts = f"{len(key)}:{key}|{len(cache_salt or '')}:{cache_salt or ''}"
    return hashlib.sha256(parts.encode("utf-8", "surrogateescape")).hexdigest()


def _fit(prompt_len: int, max_tokens: int, max_model_len: int, min_tokens: int) -> int:
    """Output tokens to allow: `max_tokens` cut to the context's room; a prompt leaving less room than
    `min_tokens` is a 400 naming both counts."""
    room = max_model_len - prompt_len
    if room < min_tokens:
        raise APIError(
            400,
            f"prompt has {prompt_len} tokens; the context is {max_model_len} tokens (--max-model-len)"
            + (f" and needs room for {min_tokens} output token" if min_tokens else ""),
            param="messages" if min_tokens else "prompt",
        )
    return min(max_tokens, room)


def _request_failed(error: str) -> APIError:
    reason = error.strip().splitlines()[-1][:300] if error.strip() else "engine failure"
    return APIError(500, f"this request failed: {reason}", "server_error")


def _params(req, max_tokens: int, logprobs=None, prompt_logprobs=None, reserved_text=()) -> SamplingParams:
    try:
        return SamplingParams(
            reserved_text=reserved_text,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop_list(),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _chat_options(req: ChatCompletionRequest) -> ChatOptions:
    kw = req.chat_template_kwargs
    effort = req.reasoning_effort or (kw.thinking_effort if kw else None) or "max"
    try:
        return ChatOptions(thinking=kw.thinking if kw else True, thinking_effort=effort,
                           preserve_thinking=kw.preserve_thinking if kw else True)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param="reasoning_effort") from None


def _render(messages: list[dict], tools: list[dict], opts: ChatOptions, urls: list | None):
    """The prompt's segments. A tool result that names no tool and answers no call of the turn before
    it (the chat format needs one of the two) is rendered as the result of a tool named "unknown"
    rather than refused: the schema cannot say which ids the earlier turn used."""
    try:
        return render(messages, tools, opts, images=urls)
    except ValueError as e:
        if "tool message" not in str(e):
            raise
    named = [{**m, "name": "unknown"} if m["role"] == "tool" and "name" not in m else m for m in messages]
    if urls:
        urls.clear()
    return render(named, tools, opts, images=urls)


def _message(m) -> dict:
    d = m.model_dump(exclude_none=True)
    if d["role"] == "developer":
        d["role"] = "system"
    return d


def _completion_prompt(tok, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = tok.encode(prompt, allow_special=True)
        except Exception as e:  # noqa: BLE001 - this prompt cannot be tokenized: its request alone fails
            why = f"{type(e).__name__}: {e}"
            raise APIError(400, f"prompt: cannot be tokenized ({why})", param="prompt") from None
    else:
        ids = list(prompt)
    if not ids:
        raise APIError(400, "prompt is empty", param="prompt")
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise APIError(422, f"prompt: token ids must be in [0, {tok.vocab_size})", param="prompt")
    return ids


# ---- response builders ----------------------------------------------------------------------------
class _Timing:
    """Arrival, first-token and last-token times of one request, for the latency histograms."""

    def __init__(self, stats: ServerMetrics, start: float):
        self.stats, self.start, self.first, self.tokens = stats, start, None, 0

    def saw(self, n_tokens: int) -> None:
        if n_tokens and self.first is None:
            self.first = time.perf_counter()
        self.tokens += n_tokens

    def done(self) -> None:
        self.stats.observe_request(self.start, self.first, time.perf_counter(), self.tokens)


async def _events(agen, first, timing: _Timing):
    """The request's events from the first on; a cancelled one (client gone) raises _ClientGone."""
    try:
        ev = first
        while True:
            if ev.finish_reason == "abort" and not ev.error:
                raise _ClientGone
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


async def _guarded(body, watcher):
    """A stream's chunks; an unexpected failure ends it with an error event and [DONE] instead of a
    cut connection, and the disconnect watcher stops with the stream."""
    try:
        async for chunk in body:
            yield chunk
    except _ClientGone:
        return
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in the stream
        print(f"k3 serve: stream: {type(e).__name__}: {e}", file=sys.stderr)
        yield R.sse(error_body(f"internal error: {type(e).__name__}", "server_error", None, 500))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        await body.aclose()


async def _collect(events):
    tokens, lps, texts, last = [], [], [], None
    async for ev in events:
        if ev.error:
            raise _request_failed(ev.error)
        tokens += ev.new_tokens
        lps += ev.logprobs
        texts.append(ev.text)
        last = ev
    return tokens, lps, "".join(texts), last


async def _chat_full(events, rid, ctx, want_logprobs: bool):
    tok, model, n_prompt, thinking, _ = ctx
    tokens, lps, text, last = await _collect(events)
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


async def _chat_stream(events, first, rid, ctx, include_usage: bool):
    """SSE chunks of a chat completion: role, reasoning / content deltas, tool calls, finish, usage.
    Each event brings only its new (marked) text; the deltas are what the parse of the text so far adds.
    `first` is the first event (also the first `events` yields); kept for callers that pass it."""
    tok, model, n_prompt, thinking, _ = ctx
    yield R.sse(R.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
    sent = {"reasoning_content": "", "content": ""}
    n_out, texts = 0, []
    async for ev in events:
        if ev.error:
            yield R.sse(error_body(_request_failed(ev.error).message, "server_error", None, 500))
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


async def _completion_full(events, rid, ctx):
    tok, model, prompt, req = ctx
    tokens, lps, out_text, last = await _collect(events)
    text = (tok.decode(prompt) if req.echo else "") + out_text
    logprobs = None
    if req.logprobs is not None:
        logprobs = R.completion_logprobs(tok, prompt, last.prompt_logprobs, tokens, lps, req.echo)
    use = R.usage(len(prompt), len(tokens), last.cached_tokens)
    return R.completion_response(rid, model, text, last.finish_reason, use, logprobs)


async def _completion_stream(events, rid, ctx, include_usage: bool = False):
    """SSE chunks of a text completion: each event's new text as it comes (the engine holds back what
    a stop string or the next token may still change)."""
    tok, model, prompt, req = ctx
    if req.echo:
        yield R.sse(R.completion_response(rid, model, tok.decode(prompt), None, None))
    n_out = 0
    async for ev in events:
        n_out += len(ev.new_tokens)
        if ev.error:
            yield R.sse(error_body(_request_failed(ev.error).message, "server_error", None, 500))
            break
        if ev.text:
            yield R.sse(R.completion_response(rid, model, ev.text, None, None))
        if ev.finished:
            yield R.sse(R.completion_response(rid, model, "", ev.finish_reason, None))
            if include_usage:
                use = R.usage(len(prompt), n_out, ev.cached_tokens)
                yield R.sse({**R.completion_response(rid, model, "", None, use), "choices": []})
    yield "data: [DONE]\n\n"
