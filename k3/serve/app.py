"""HTTP routes: /v1/models, /v1/chat/completions, /v1/completions (stream and not), /health, /metrics.

Every request body is read with a size cap (413), decoded as UTF-8 (400), parsed as JSON (400) and
validated (422); a wrong API key is 401, an unknown model 404, a prompt or max_tokens that does not fit
the context 400, a full queue 503. Errors use OpenAI's error JSON. A streaming client that disconnects
aborts its request (the async engine frees the slot). The API key is also the prefix-cache salt, so
tenants never share cached state.

Images (an engine with `.vision`, `k3.vision.serving.load_vl_engine`): user messages may carry OpenAI
`image_url` parts as data: URLs (base64 PNG/JPEG). Remote URLs, undecodable, truncated or oversized
images and literal image placeholders in the text answer 400 for that request alone; the images are
decoded and embedded before the request reaches the engine, and each image's content hash enters the
prefix-cache keys of the units its tokens occupy (`k3.infer.media`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from k3.chat_format import ChatOptions, encode_segments, parse_generation, render
from k3.infer.async_engine import AsyncEngine, QueueFull
from k3.infer.sequence import SamplingParams
from k3.serve import responses as R
from k3.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now
from k3.vision.image_io import ImageError


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str = "kimi-k3"
    api_key: str | None = None
    max_model_len: int = 8192
    max_body_bytes: int = 4 << 20


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def create_app(engine: AsyncEngine, cfg: ServeConfig) -> FastAPI:
    app = FastAPI(title="k3")
    tok = engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.status), status_code=e.status)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):  # a bug answers 500 in the OpenAI shape; the server keeps running
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error", None, 500), 500)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return JSONResponse(
            error_body(str(e.detail), "invalid_request_error", None, e.status_code), e.status_code
        )

    async def parse(request: Request, model_cls):
        salt = _auth(request, cfg)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            raise APIError(413, f"request body over {cfg.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > cfg.max_body_bytes:
            raise APIError(413, f"request body over {cfg.max_body_bytes} bytes")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError(400, "request body is not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise APIError(400, f"malformed JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"])
            raise APIError(422, f"{param}: {err['msg']}", param=param) from None
        if req.model != cfg.served_model_name:
            raise APIError(404, f"model {req.model!r} does not exist", "not_found_error", "model")
        return req, salt

    async def start(prompt: list[int], params: SamplingParams, salt: str, media=()):
        """-> (async event iterator, first event); errors before any output become HTTP errors."""
        agen = engine.generate(prompt, params, salt, media=media)
        try:
            first = await agen.__anext__()
        except QueueFull as e:
            raise APIError(503, str(e), "server_overloaded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        if first.error:
            raise APIError(500, "engine failure", "server_error")
        return agen, first

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(R.metrics_text(engine.metrics()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(request, cfg)
        card = {"id": cfg.served_model_name, "object": "model", "created": now(), "owned_by": "k3",
                "max_model_len": cfg.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req, salt = await parse(request, ChatCompletionRequest)
        opts = _chat_options(req)
        messages = [_message(m) for m in req.messages]
        vision = getattr(engine.engine, "vision", None)
        urls = [] if vision is not None else None
        try:
            segments = render(messages, req.tools, opts, images=urls)
            images = await asyncio.to_thread(vision.load, urls) if urls else []
            prompt = vision.encode(tok, segments, images) if images else encode_segments(tok, segments)
        except ImageError as e:
            raise APIError(400, f"messages: image_url: {e} ({e.reason})", param="messages") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        max_tokens = _fit(len(prompt), req.max_completion_tokens or req.max_tokens, cfg.max_model_len, 1)
        top = (req.top_logprobs or 0) if req.logprobs else None
        media = await asyncio.to_thread(vision.spans, prompt, images) if images else ()
        agen, first = await start(prompt, _params(req, max_tokens, logprobs=top), salt, media)
        rid, ctx = (
            new_id("chatcmpl"),
            (tok, cfg.served_model_name, len(prompt), opts.thinking, req.stop_list()),
        )
        if req.stream:
            include = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                _chat_stream(agen, first, rid, ctx, include), media_type="text/event-stream"
            )
        return await _chat_full(agen, first, rid, ctx, top is not None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, salt = await parse(request, CompletionRequest)
        prompt = _completion_prompt(tok, req.prompt)
        max_tokens = _fit(len(prompt), 16 if req.max_tokens is None else req.max_tokens, cfg.max_model_len, 0)
        lp = req.logprobs
        params = _params(
            req, max_tokens, logprobs=lp, prompt_logprobs=lp if (req.echo and lp is not None) else None
        )
        agen, first = await start(prompt, params, salt)
        rid, ctx = new_id("cmpl"), (tok, cfg.served_model_name, prompt, req)
        if req.stream:
            return StreamingResponse(
                _completion_stream(agen, first, rid, ctx), media_type="text/event-stream"
            )
        return await _completion_full(agen, first, rid, ctx)

    return app


# ---- request helpers ----------------------------------------------------------------------------------
def _auth(request: Request, cfg: ServeConfig) -> str:
    """Check the bearer key (when the server has one) -> the tenant salt."""
    header = request.headers.get("authorization", "")
    key = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if cfg.api_key is not None and key != cfg.api_key:
        raise APIError(401, "invalid or missing API key", "authentication_error")
    return key


def _fit(prompt_len: int, max_tokens: int | None, max_model_len: int, min_tokens: int) -> int:
    if prompt_len > max_model_len:
        raise APIError(400, f"prompt has {prompt_len} tokens; the context is {max_model_len}", param="prompt")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    if max_tokens < min_tokens or prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"max_tokens={max_tokens} out of range: need {min_tokens} <= max_tokens <= "
            f"{max_model_len - prompt_len} for a {prompt_len}-token prompt",
            param="max_tokens",
        )
    return max_tokens


def _params(req, max_tokens: int, logprobs=None, prompt_logprobs=None) -> SamplingParams:
    try:
        return SamplingParams(
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
    kw = req.chat_template_kwargs or {}
    try:
        opts = ChatOptions(thinking=bool(kw.get("thinking", True)),
                           thinking_effort=req.reasoning_effort or kw.get("thinking_effort", "max"),
                           preserve_thinking=bool(kw.get("preserve_thinking", True)))  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param="reasoning_effort") from None
    return opts


def _message(m) -> dict:
    d = m.model_dump(exclude_none=True)
    if d["role"] == "developer":
        d["role"] = "system"
    return d


def _completion_prompt(tok, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise APIError(400, "only one prompt per request is supported", param="prompt")
    ids = tok.encode(prompt, allow_special=True) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "prompt is empty", param="prompt")
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {tok.vocab_size})", param="prompt")
    return ids


# ---- response builders ----------------------------------------------------------------------------
async def _events(agen, first):
    try:
        yield first
        async for ev in agen:
            yield ev
    finally:
        await agen.aclose()  # aborts the request if it did not finish (client went away)


async def _collect(agen, first):
    tokens, lps, last = [], [], None
    async for ev in _events(agen, first):
        if ev.error:
            raise APIError(500, "engine failure", "server_error")
        tokens += ev.new_tokens
        lps += ev.logprobs
        last = ev
    return tokens, lps, last


async def _chat_full(agen, first, rid, ctx, want_logprobs: bool):
    tok, model, n_prompt, thinking, _ = ctx
    tokens, lps, last = await _collect(agen, first)
    parsed = parse_generation(last.text, thinking)
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


async def _chat_stream(agen, first, rid, ctx, include_usage: bool):
    tok, model, n_prompt, thinking, stops = ctx
    yield R.sse(R.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
    sent = {"reasoning_content": "", "content": ""}
    n_out = 0
    async for ev in _events(agen, first):
        if ev.error:
            yield R.sse(error_body("engine failure", "server_error"))
            break
        n_out += len(ev.new_tokens)
        parsed = parse_generation(ev.text if ev.finished else _stable(ev.text, stops), thinking)
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


async def _completion_full(agen, first, rid, ctx):
    tok, model, prompt, req = ctx
    tokens, lps, last = await _collect(agen, first)
    text = (tok.decode(prompt) if req.echo else "") + last.text
    logprobs = None
    if req.logprobs is not None:
        logprobs = R.completion_logprobs(tok, prompt, last.prompt_logprobs, tokens, lps, req.echo)
    use = R.usage(len(prompt), len(tokens), last.cached_tokens)
    return R.completion_response(rid, model, text, last.finish_reason, use, logprobs)


async def _completion_stream(agen, first, rid, ctx):
    tok, model, prompt, req = ctx
    if req.echo:
        yield R.sse(R.completion_response(rid, model, tok.decode(prompt), None, None))
    sent = ""
    async for ev in _events(agen, first):
        if ev.error:
            yield R.sse(error_body("engine failure", "server_error"))
            break
        stable = ev.text if ev.finished else _stable(ev.text, req.stop_list())
        if len(stable) > len(sent) and stable.startswith(sent):
            yield R.sse(R.completion_response(rid, model, stable[len(sent) :], None, None))
            sent = stable
        if ev.finished:
            yield R.sse(R.completion_response(rid, model, "", ev.finish_reason, None))
    yield "data: [DONE]\n\n"


def _stable(text: str, stops: tuple[str, ...]) -> str:
    """Text that can be streamed now: no trailing partial UTF-8 character, no possible stop-string start."""
    text = text.rstrip("\ufffd")
    hold = max((len(s) - 1 for s in stops), default=0)
    return text[: len(text) - hold] if hold else text
