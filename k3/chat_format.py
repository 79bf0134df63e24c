"""K3's XTML chat format (SPEC §6.2): render OpenAI-style messages to token ids, parse generations back.

Grammar (no whitespace between elements; markers are the reserved tokens <|open|> <|close|> <|sep|>):

    tag     = <|open|>NAME attr="v" ...<|sep|>BODY<|close|>NAME<|sep|>      (attr values escape & then ")
    message = <|open|>message role="R"[ name=".."][ type=".."]<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>

Prompt order: (a) with tools, a system message type="tool-declare" (a "# Tools" sentence + the tool list
as compact JSON in a json code fence); (b) with thinking on and an effort, a system message
type="thinking-effort"; (c) the conversation. An assistant message is a `think` channel (thinking on;
rendered even when empty), a `response` channel, and optionally a `tools` channel of `call` tags
(tool="NAME" index="N", N 1-based in the turn) whose bodies are `argument` tags (key, type; strings raw,
other values JSON) or one `json type="object"` block when the arguments are not a JSON object. Tool
results are `message role="tool" tool="NAME" index="N"`. The generation prompt opens an assistant
message and its `think` (thinking on) or `response` channel.

Preserved thinking: every earlier assistant turn is rendered with its own `reasoning_content` (as K3 was
trained; `preserve_thinking=False` renders those channels empty). Structural text is encoded with the
markers; all user, tool and argument text is encoded with reserved names disallowed, so it cannot forge
markers (`K3Tokenizer.encode(allow_special=False)`).

Images: with an `images` list passed to `render`, a user message's OpenAI `image_url` content part
becomes the plain text `<|kimi_image_placeholder|>` followed by a newline at its place among the text
parts, and its URL is appended to `images`; the model side expands each placeholder into the media
tokens (`k3.vision.media`, SPEC §5.4). A literal placeholder anywhere in the message text is refused
(ValueError), so text cannot claim an image slot. Without `images`, image parts raise ValueError.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from k3.vision.config import IMAGE_PLACEHOLDER

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END)
EFFORTS = ("low", "high", "max")
ROLES = ("system", "user", "assistant", "tool")
TOOLS_HEADER = "# Tools\nYou can call the following tools. Their declarations, as JSON:\n"
IMAGE_SLOT = IMAGE_PLACEHOLDER + "\n"  # what one image_url part renders as


@dataclass
class ChatOptions:
    thinking: bool = True
    thinking_effort: str | None = "max"
    preserve_thinking: bool = True

    def __post_init__(self):
        if self.thinking_effort == "none":
            self.thinking, self.thinking_effort = False, None
        if self.thinking_effort is not None and self.thinking_effort not in EFFORTS:
            raise ValueError(
                f"thinking_effort must be one of {EFFORTS} or 'none', got {self.thinking_effort!r}"
            )


# ---- rendering: a list of segments (text, is_marker) ------------------------------------------------
def _esc(v: str) -> str:
    return v.replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, **attrs) -> list[tuple[str, bool]]:
    head = tag + "".join(f' {k}="{_esc(str(v))}"' for k, v in attrs.items() if v is not None)
    return [(OPEN, True), (head, False), (SEP, True)]


def _close(tag: str) -> list[tuple[str, bool]]:
    return [(CLOSE, True), (tag, False), (SEP, True)]


def _tag(tag: str, body: str, **attrs) -> list[tuple[str, bool]]:
    return _open(tag, **attrs) + ([(body, False)] if body else []) + _close(tag)


def _message(role: str, body: list[tuple[str, bool]], **attrs) -> list[tuple[str, bool]]:
    return _open("message", role=role, **attrs) + body + _close("message") + [(END, True)]


def _text(content, images: list | None = None) -> str:
    """OpenAI content: a string, None, or a list of {"type": "text", "text": ...} parts, and, when
    `images` collects them, {"type": "image_url", "image_url": {"url": ...}} parts (-> IMAGE_SLOT)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not (isinstance(content, list) and all(isinstance(p, dict) for p in content)):
        raise ValueError("message content must be a string or a list of content parts")
    out = []
    for p in content:
        kind = p.get("type")
        if kind == "text":
            out.append(str(p.get("text", "")))
        elif kind == "image_url" and images is not None:
            url = p.get("image_url")
            images.append(url.get("url") if isinstance(url, dict) else url)
            out.append(IMAGE_SLOT)
        elif kind == "image_url":
            raise ValueError("image_url content parts are accepted only in user messages, by a vision model")
        else:
            raise ValueError(f"unsupported content part type {kind!r} (text or image_url)")
    return "".join(out)


def _arg_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    return {str: "string", int: "number", float: "number", type(None): "null", dict: "object",
            list: "array"}[type(v)]  # fmt: skip


def _call(call: dict, index: int) -> list[tuple[str, bool]]:
    fn = call.get("function") or {}
    name, raw = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ValueError("tool_calls[].function.name must be a non-empty string")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        args = None
    if isinstance(args, dict):
        body = []
        for k, v in args.items():
            text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=(",", ":"))
            body += _tag("argument", text, key=k, type=_arg_type(v))
    else:
        body = _tag("json", raw if isinstance(raw, str) else json.dumps(raw), type="object")
    return _open("call", tool=name, index=index) + body + _close("call")


def _assistant(msg: dict, opts: ChatOptions, last: bool) -> list[tuple[str, bool]]:
    body = []
    if opts.thinking:
        keep = opts.preserve_thinking or last
        body += _tag("think", (msg.get("reasoning_content") or "") if keep else "")
    body += _tag("response", _text(msg.get("content")))
    calls = msg.get("tool_calls") or []
    if calls:
        body += _open("tools") + sum((_call(c, i + 1) for i, c in enumerate(calls)), []) + _close("tools")
    return _message("assistant", body, name=msg.get("name"))


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    options: ChatOptions | None = None,
    add_generation_prompt: bool = True,
    images: list | None = None,
) -> list[tuple[str, bool]]:
    """Messages (OpenAI chat format) -> segments [(text, is_marker)] of the prompt. `images`: a list
    that collects the user messages' image_url URLs in order (one placeholder each in the text)."""
    opts = options or ChatOptions()
    first_image = len(images) if images is not None else 0
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    segs: list[tuple[str, bool]] = []
    if tools:
        decl = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
        segs += _message("system", [(f"{TOOLS_HEADER}```json\n{decl}\n```", False)], type="tool-declare")
    if opts.thinking and opts.thinking_effort:
        text = (
            f"Supported thinking efforts: low, medium, high, max. "
            f"Selected: thinking_effort={opts.thinking_effort}"
        )
        segs += _message("system", [(text, False)], type="thinking-effort")
    calls: dict[str, tuple[str, int]] = {}  # tool_call_id -> (name, index) of the latest assistant turn
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        if role == "assistant":
            segs += _assistant(msg, opts, i == last_assistant)
            calls = {c.get("id", ""): ((c.get("function") or {}).get("name"), j + 1)
                     for j, c in enumerate(msg.get("tool_calls") or [])}  # fmt: skip
        elif role == "tool":
            name, index = calls.get(msg.get("tool_call_id", ""), (msg.get("name"), None))
            segs += _message("tool", [(_text(msg.get("content")), False)], tool=name, index=index)
        else:
            content = _text(msg.get("content"), images if role == "user" else None)
            segs += _message(role, [(content, False)], name=msg.get("name"))
    if images is not None:
        found = sum(text.count(IMAGE_PLACEHOLDER) for text, marker in segs if not marker)
        if found != len(images) - first_image:
            raise ValueError(
                f"message text must not contain the image placeholder {IMAGE_PLACEHOLDER!r} "
                "(send images as image_url content parts)"
            )
    if add_generation_prompt:
        segs += _open("message", role="assistant") + _open("think" if opts.thinking else "response")
    return segs


def to_text(segments: list[tuple[str, bool]]) -> str:
    return "".join(s for s, _ in segments)


def encode_segments(tokenizer, segments: list[tuple[str, bool]]) -> list[int]:
    """Markers -> their reserved ids; every other piece encoded with reserved names disallowed."""
    ids: list[int] = []
    for text, marker in segments:
        ids += [tokenizer.token_to_id(text)] if marker else tokenizer.encode(text, allow_special=False)
    return ids


def encode_chat(tokenizer, messages, tools=None, options=None, add_generation_prompt=True) -> list[int]:
    return encode_segments(tokenizer, render(messages, tools, options, add_generation_prompt))


# ---- parsing a generation ---------------------------------------------------------------------------
_TAG = re.compile(r"<\|open\|>(\w+)((?: \w+=\"[^\"]*\")*)<\|sep\|>")
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def _unesc(v: str) -> str:
    return v.replace("&quot;", '"').replace("&amp;", "&")


def _strip_partial_marker(text: str) -> str:
    """Drop a trailing prefix of a marker (streaming: it may become a marker with the next token)."""
    for k in range(min(len(text), 9), 0, -1):
        if any(m.startswith(text[-k:]) for m in MARKERS):
            return text[:-k]
    return text


def _channel(text: str, name: str) -> tuple[str, str, bool]:
    """Body of a channel that is already open -> (body, rest after its close, closed?)."""
    end = text.find(f"{CLOSE}{name}{SEP}")
    if end < 0:
        return _strip_partial_marker(text.split(CLOSE)[0]), "", False
    return text[:end], text[end + len(CLOSE + name + SEP) :], True


def _parse_calls(text: str) -> list[dict]:
    calls = []
    for m in re.finditer(
        r"<\|open\|>call((?: \w+=\"[^\"]*\")*)<\|sep\|>(.*?)<\|close\|>call<\|sep\|>", text, re.S
    ):
        attrs = {k: _unesc(v) for k, v in _ATTR.findall(m.group(1))}
        args, raw = {}, None
        for a in _TAG.finditer(m.group(2)):
            kind, a_attrs = a.group(1), {k: _unesc(v) for k, v in _ATTR.findall(a.group(2))}
            body, _, _ = _channel(m.group(2)[a.end() :], kind)
            if kind == "json":
                raw = body
            elif kind == "argument":
                key, typ = a_attrs.get("key", ""), a_attrs.get("type", "string")
                try:
                    args[key] = body if typ == "string" else json.loads(body)
                except json.JSONDecodeError:
                    args[key] = body
        arguments = raw if raw is not None else json.dumps(args, ensure_ascii=False)
        calls.append({"id": f"call_{len(calls) + 1}", "type": "function",
                      "function": {"name": attrs.get("tool", ""), "arguments": arguments}})  # fmt: skip
    return calls


def parse_generation(text: str, thinking: bool = True) -> dict:
    """Generated text (after the generation prompt) -> {reasoning_content, content, tool_calls}.
    Tolerates a truncated generation (what is there so far, without partial markers)."""
    reasoning, rest = "", text
    if thinking:
        reasoning, rest, closed = _channel(text, "think")
        if not closed:
            return {"reasoning_content": reasoning, "content": "", "tool_calls": []}
        head = f"{OPEN}response{SEP}"
        rest = rest[len(head) :] if rest.startswith(head) else ("" if head.startswith(rest) else rest)
    content, rest, _ = _channel(rest, "response")
    calls = _parse_calls(rest) if f"{OPEN}tools{SEP}" in rest else []
    return {"reasoning_content": reasoning, "content": content, "tool_calls": calls}
