"""A request body made ready for the engine, in the server's worker threads (never on the event loop):
parsed and checked against every limit, validated against the documented schema (422; k3.serve.protocol,
k3.serve.openapi), rendered (chat) and tokenized, its output budget fitted to the context; a vision
request's images checked by their headers, then decoded and embedded in their own thread.

An unknown model is 404, a prompt that does not fit the context 400 with its token count; tokenizing
errors answer 400 for that request alone. Chat prompts mark the chat format's markers as reserved ids
(SamplingParams.reserved_text), so text that spells a marker stays text. Images: OpenAI `image_url` parts
as data: URLs (base64 PNG/JPEG); remote URLs, undecodable, truncated or oversized images and literal
image placeholders answer 400; nothing in a request makes the server read a file or fetch a URL. Each
image's size and token count come from its header, so --max-images, --max-image-pixels and the context
are checked before any pixel is decoded, and each image's content hash enters the prefix-cache keys of
the units its tokens occupy (`k3.infer.media`).
"""

from __future__ import annotations

from pydantic import ValidationError

from k3.chat_format import ChatOptions, encode_segments, render
from k3.chat_parse import marker_ids
from k3.infer.memory import release_free_memory
from k3.infer.sequence import SamplingParams
from k3.serve.body import parse_json
from k3.serve.config import ServeConfig
from k3.serve.errors import APIError
from k3.serve.protocol import ChatCompletionRequest, CompletionRequest
from k3.vision.image_io import ImageError

BIG_BODY = 1 << 20  # after preparing a body this large, free C-heap pages go back to the OS


class Preparer:
    """Request bodies -> engine inputs for one server (its config, tokenizer and vision side, if any)."""

    def __init__(self, cfg: ServeConfig, tok, vision):
        self.cfg, self.tok, self.vision = cfg, tok, vision
        self.markers = tuple(marker_ids(tok).items()) if tok is not None else ()
        # no text longer than this fits the context: no token stands for more characters than its bytes
        # (or, for a reserved name in a completions prompt, its name)
        longest = (
            1 if tok is None else max([len(b) for b in tok.ranks()] + [len(r.name) for r in tok.reserved])
        )
        self.max_prompt_chars = cfg.max_model_len * longest

    def check_stops(self, data: dict) -> None:
        """The stop-string limits on the parsed JSON, before anything walks a flood of them."""
        cfg = self.cfg
        stops = data.get("stop")
        stops = [stops] if isinstance(stops, str) else stops if isinstance(stops, list) else []
        if len(stops) > cfg.max_stop_strings:
            raise APIError(422, f"stop: {len(stops)} stop strings; at most {cfg.max_stop_strings} "
                           "(--max-stop-strings)", param="stop")  # fmt: skip
        if any(isinstance(x, str) and len(x) > cfg.max_stop_chars for x in stops):
            raise APIError(422, f"stop: a stop string is over {cfg.max_stop_chars} characters "
                           "(--max-stop-chars)", param="stop")  # fmt: skip

    def validate(self, raw: bytes, model_cls):
        """body -> the request model, every limit checked."""
        cfg = self.cfg
        data = parse_json(raw, cfg.max_json_depth, before_walk=self.check_stops)
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

    def check_text_size(self, n_chars: int, param: str) -> None:
        if n_chars > self.max_prompt_chars:
            raise APIError(400, f"prompt text has {n_chars} characters; no text over {self.max_prompt_chars} "
                           f"fits the context of {self.cfg.max_model_len} tokens", param=param)  # fmt: skip

    def chat(self, raw: bytes):
        """-> (request, options, prompt ids, image headers, max_tokens)."""
        cfg, tok, vision = self.cfg, self.tok, self.vision
        try:
            req = self.validate(raw, ChatCompletionRequest)
            opts = _chat_options(req)
            messages = [_message(m) for m in req.messages]
            urls = [] if vision is not None else None
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            try:
                segments = _render(messages, tools, opts, urls)
                self.check_text_size(sum(len(t) for t, marker in segments if not marker), "messages")
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

    def completion(self, raw: bytes):
        """-> (request, prompt ids, max_tokens)."""
        cfg = self.cfg
        try:
            req = self.validate(raw, CompletionRequest)
            text = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
            if isinstance(text, str):
                self.check_text_size(len(text), "prompt")
            prompt = _completion_prompt(self.tok, req.prompt)
            wanted = cfg.output_cap if req.max_tokens is None else req.max_tokens
            return req, prompt, _fit(len(prompt), wanted, cfg.max_model_len, 0)
        finally:
            if len(raw) > BIG_BODY:
                release_free_memory()

    def load_images(self, heads, prompt):
        """(runs in the image thread) decode, pre-process and embed a fitting request's images."""
        try:
            images = self.vision.load(heads)
            return self.vision.spans(prompt, images)
        finally:
            release_free_memory()  # the decoded pixels' memory goes back to the OS


def sampling_params(
    req, max_tokens: int, logprobs=None, prompt_logprobs=None, reserved_text=()
) -> SamplingParams:
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
