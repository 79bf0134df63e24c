"""K3's XTML chat format (docs/spec_text.md#chat-format): render OpenAI-style messages to token ids
(parsing generations back is `k3.chat_parse`).

Grammar (no whitespace between elements; markers are the reserved tokens <|open|> <|close|> <|sep|>):

    tag     = <|open|>NAME attr="v" ...<|sep|>BODY<|close|>NAME<|sep|>      (attr values escape & then ")
    message = <|open|>message role="R"[ name=".."][ type=".."]<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>

Prompt order: (a) with tools, a system message type="tool-declare" (a "# Tools" sentence + the tool list
as key-sorted compact JSON in a json code fence); (b) with thinking on and an effort, a system message
type="thinking-effort"; (c) the conversation; (d) with tool_choice "required"/"none" or a JSON
response_format, a system message type="tool-choice" / "response-format". An assistant message is a
`think` channel (thinking on; rendered even when empty), a `response` channel, and optionally a `tools`
channel of `call` tags (tool="NAME" index="N", N 1-based in the turn) whose bodies are `argument` tags
(key, type; strings raw, other values JSON) or one `json type="object"` block when the arguments string
is not valid JSON. Tool results are `message role="tool" tool="NAME" index="N"`: a run of results that
all answer the latest assistant turn's calls (by tool_call_id) is put in call order and named after
the calls; N counts the results since that turn. A system message with a `tools` list declares more
tools mid-conversation. The generation prompt opens an assistant message and its `think` (thinking on)
or `response` channel.

Fidelity. The fixed sentences, the key sorting and the segment boundaries are the release renderer's
(`encoding_k3.py`, docs/spec_text.md#chat-format): each piece below -- a marker, a tag name, ' key', '="', a
value, '"', a text part, an image placeholder -- is encoded on its own, as the release encodes its segments,
so BPE never merges across them. `k3/chat_template.jinja` (:func:`chat_template`, shipped in
tokenizer_config.json) renders the same text for HF / llama.cpp; a template's output is tokenized as
one string, so it can merge across those boundaries where an attribute value starts or ends with
punctuation or whitespace.

Preserved thinking: every earlier assistant turn is rendered with its own `reasoning_content` (as K3 was
trained; `preserve_thinking=False` renders those channels empty). Structural text is encoded with the
markers; all user, tool and argument text is encoded with reserved names disallowed, so it cannot forge
markers (`K3Tokenizer.encode(allow_special=False)`).

Images: with an `images` list passed to `render`, a user message's OpenAI `image_url` (or `image`)
content part becomes the plain text `<|kimi_image_placeholder|>` at its place among the text parts, and
its URL is appended to `images`; the model side expands each placeholder into the media tokens
(`k3.vision.media`, docs/spec_vision.md#placement). A literal placeholder anywhere in the message text is
refused (ValueError), so text cannot claim an image slot. Without `images`, image parts raise ValueError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from k3.config import IMAGE_PLACEHOLDER

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END)
EFFORTS = ("low", "high", "max")
ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "required", "none")
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
NEW_TOOLS_HEADER = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
)
EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\n"
    "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
    "You MUST NOT call any tools in the next message.",
}
_JSON_FORMAT = (
    "The system is invoked with `response_format={}`.\nYour response must be raw JSON data without markdown "
    "code blocks (```json) or any additional formatting."
)
IMAGE_SLOT = IMAGE_PLACEHOLDER  # what one image_url part renders as (its own segment)
IMAGE_PARTS = ("image_url", "image")

Segment = tuple[str, bool]  # (text, is_marker)


def chat_template() -> str:
    """The Jinja chat template (k3/chat_template.jinja) that renders this module's format as text."""
    return resources.files("k3").joinpath("chat_template.jinja").read_text(encoding="utf-8")


@dataclass
class ChatOptions:
    """thinking / thinking_effort ("none" turns thinking off) / preserve_thinking, as in
    docs/spec_text.md#chat-format; tool_choice ("auto", "required", "none") and response_format (OpenAI's) add
    their system notes."""

    thinking: bool = True
    thinking_effort: str | None = "max"
    preserve_thinking: bool = True
    tool_choice: str | dict | None = None
    response_format: dict | str | None = None

    def __post_init__(self):
        if self.thinking_effort == "none":
            self.thinking, self.thinking_effort = False, None
        if self.thinking_effort is not None and self.thinking_effort not in EFFORTS:
            raise ValueError(
                f"thinking_effort must be one of {EFFORTS} or 'none', got {self.thinking_effort!r}"
            )
        if isinstance(self.tool_choice, str) and self.tool_choice not in TOOL_CHOICES:
            raise ValueError(
                f"tool_choice must be one of {TOOL_CHOICES} or a function, got {self.tool_choice!r}"
            )


# ---- rendering: a list of segments (text, is_marker) ------------------------------------------------
def _esc(v) -> str:
    return str(v).replace("&", "&amp;").replace('"', "&quot;")


def _text(text) -> list[Segment]:
    return [(text, False)] if text else []


def _open(tag: str, **attrs) -> list[Segment]:
    segs = [(OPEN, True), (tag, False)]
    for k, v in attrs.items():
        if v is not None:
            segs += [(f" {k}", False), ('="', False)] + _text(_esc(v)) + [('"', False)]
    return segs + [(SEP, True)]


def _close(tag: str) -> list[Segment]:
    return [(CLOSE, True), (tag, False), (SEP, True)]


def _tag(tag: str, body: list[Segment], **attrs) -> list[Segment]:
    return _open(tag, **attrs) + body + _close(tag)


def _message(role: str, body: list[Segment], **attrs) -> list[Segment]:
    return _tag("message", body, role=role, **attrs) + [(END, True)]


def _sorted_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _system_note(kind: str, body: str) -> list[Segment]:
    return _message("system", _text(body.strip()), type=kind)


def _tool_declare(tools, header: str = TOOLS_HEADER) -> list[Segment]:
    return _message("system", _text(f"{header}```json\n{_sorted_json(tools)}\n```"), type="tool-declare")


def _content(content, images: list | None = None) -> list[Segment]:
    """OpenAI content: a string, None, or a list of {"type": "text", "text": ...} parts, and, when
    `images` collects them, {"type": "image_url", "image_url": {"url": ...}} parts (-> IMAGE_SLOT)."""
    if content is None or isinstance(content, str):
        return _text(content)
    if not (isinstance(content, list) and all(isinstance(p, dict) for p in content)):
        raise ValueError("message content must be a string or a list of content parts")
    out = []
    for p in content:
        kind = p.get("type")
        if kind == "text":
            out += _text(str(p.get("text", "")))
        elif kind in IMAGE_PARTS and images is not None:
            url = p.get(kind)
            images.append(url.get("url") if isinstance(url, dict) else url)
            out += _text(IMAGE_SLOT)
        elif kind in IMAGE_PARTS:
            raise ValueError("image_url content parts are accepted only in user messages, by a vision model")
        else:
            raise ValueError(f"unsupported content part type {kind!r} (text or image_url)")
    return out


def _arg_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    return {str: "string", int: "number", float: "number", type(None): "null", dict: "object",
            list: "array"}[type(v)]  # fmt: skip


def _arguments(raw) -> tuple[dict, str | None]:
    """A call's arguments -> (the object, None), or ({}, raw text) when the text is not valid JSON."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}, None
    if isinstance(raw, str):
        try:
            args = json.loads(raw)
        except json.JSONDecodeError:
            return {}, raw
    else:
        args = raw
    if not isinstance(args, dict):
        raise ValueError("tool_calls[].function.arguments must be a JSON object (or a string holding one)")
    return args, None


def _call(call: dict, index: int) -> list[Segment]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("tool_calls[].function.name must be a non-empty string")
    args, raw = _arguments(fn.get("arguments"))
    if raw is not None:
        body = _tag("json", _text(raw), type="object")
    else:
        body = []
        for k, v in args.items():
            text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            body += _tag("argument", _text(text), key=k, type=_arg_type(v))
    return _tag("call", body, tool=name, index=index)


def _assistant(msg: dict, opts: ChatOptions, last: bool) -> list[Segment]:
    body = []
    if opts.thinking:
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        keep = (opts.preserve_thinking or last) and reasoning is not None and str(reasoning).strip()
        body += _tag("think", _text(str(reasoning)) if keep else [])
    body += _tag("response", _content(msg.get("content")))
    calls = msg.get("tool_calls") or []
    if calls:
        body += _tag("tools", sum((_call(c, i + 1) for i, c in enumerate(calls)), []))
    return _message("assistant", body, name=msg.get("name") or None)


def _call_ids(calls: list) -> dict[str, tuple[int, str | None]]:
    """tool_call id -> (1-based position, function name) of an assistant turn's calls (first id wins)."""
    out = {}
    for pos, c in enumerate(calls, 1):
        if isinstance(c, dict) and c.get("id") is not None and str(c["id"]) not in out:
            fn = c.get("function", c)
            out[str(c["id"])] = (pos, fn.get("name") if isinstance(fn, dict) else None)
    return out


def _result_id(msg: dict) -> str | None:
    rid = msg.get("tool_call_id", msg.get("id"))
    return None if rid is None else str(rid)


def _tool_run(run: list[dict], calls: list, first: int) -> list[Segment]:
    """A run of consecutive tool results; `first` is the index="N" of its first result."""
    ids = _call_ids(calls)
    if all(_result_id(m) in ids for m in run):  # answers to the latest calls: call order, calls' names
        order = sorted(range(len(run)), key=lambda k: ids[_result_id(run[k])][0])
        named = [(run[k], ids[_result_id(run[k])][1]) for k in order]
    else:
        named = [(m, m.get("tool", m.get("name"))) for m in run]
    segs = []
    for n, (msg, name) in enumerate(named, first):
        if name is None and n <= len(calls):  # unnamed, unmatched: the call at its position
            fn = calls[n - 1].get("function", calls[n - 1]) if isinstance(calls[n - 1], dict) else {}
            name = fn.get("name") if isinstance(fn, dict) else None
        if name is None:
            raise ValueError("a tool message needs a tool_call_id of the previous assistant turn, or a name")
        segs += _message("tool", _content(msg.get("content")), tool=name, index=n)
    return segs


def _response_format(fmt) -> list[Segment]:
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind == "json_object":
        return _system_note("response-format", _JSON_FORMAT.format("json_object"))
    if kind != "json_schema":
        return []
    schema = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if isinstance(schema, dict):
        schema = schema.get("schema", schema.get("json_schema", schema))
    text = _JSON_FORMAT.format("json_schema") + "\nThe JSON data must match the following schema:\n"
    return _system_note("response-format", f"{text}```json\n{_sorted_json(schema)}\n```")


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    options: ChatOptions | None = None,
    add_generation_prompt: bool = True,
    images: list | None = None,
) -> list[Segment]:
    """Messages (OpenAI chat format) -> segments [(text, is_marker)] of the prompt. `images`: a list
    that collects the user messages' image_url URLs in order (one placeholder each in the text)."""
    opts = options or ChatOptions()
    first_image = len(images) if images is not None else 0
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
    segs: list[Segment] = _tool_declare(tools) if tools else []
    if opts.thinking and opts.thinking_effort:
        segs += _system_note("thinking-effort", EFFORT_TEXT.format(opts.thinking_effort))
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    calls, results, i = [], 0, 0  # the latest assistant turn's calls; results rendered since it
    while i < len(messages):
        msg, role = messages[i], messages[i]["role"]
        if role == "tool":
            run = [msg]
            while i + len(run) < len(messages) and messages[i + len(run)]["role"] == "tool":
                run.append(messages[i + len(run)])
            segs += _tool_run(run, calls, results + 1)
            results, i = results + len(run), i + len(run)
            continue
        if role == "assistant":
            segs += _assistant(msg, opts, i == last_assistant)
            calls, results = msg.get("tool_calls") or [], 0
        elif role == "system" and msg.get("tools"):
            segs += _tool_declare(msg["tools"], NEW_TOOLS_HEADER)
        else:
            content = _content(msg.get("content"), images if role == "user" else None)
            segs += _message(role, content, name=msg.get("name") or None)
        i += 1
    if isinstance(opts.tool_choice, str) and opts.tool_choice in TOOL_CHOICE_TEXT:
        segs += _system_note("tool-choice", TOOL_CHOICE_TEXT[opts.tool_choice])
    if opts.response_format is not None:
        segs += _response_format(opts.response_format)
    if images is not None:
        # joined, so a placeholder split across text parts is refused too (a template would join them)
        found = "".join(text for text, marker in segs if not marker).count(IMAGE_PLACEHOLDER)
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
