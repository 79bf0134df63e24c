"""Parsing a generation of K3's XTML chat format (`k3.chat_format` renders it) back into OpenAI fields.

`parse_generation_ids` (token ids) and `parse_marked` (an engine's text with the marker ids decoded as
MARKED characters) read the structure from the reserved marker ids alone, so generated text that spells
`<|open|>` and the like stays text; `parse_generation` reads spelled markers from plain text. All of them
tolerate a truncated generation (streaming).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from k3.chat_format import CLOSE, END, MARKERS, OPEN, SEP

# What the parser takes for the markers in `marked` text: lone UTF-16 surrogates, which no decoding of
# bytes yields, so only a reserved marker id becomes one (`marked_text`); text that spells a marker's
# name stays text. `parse_generation` (plain text) keeps taking the spelled names.
MARKED = {OPEN: "\ud800", CLOSE: "\ud801", SEP: "\ud802", END: "\ud803"}


@dataclass(frozen=True)
class _Grammar:
    open: str
    close: str
    sep: str
    markers: tuple[str, ...]
    tag: re.Pattern
    call: re.Pattern


def _grammar(o: str, c: str, s: str, markers: tuple[str, ...]) -> _Grammar:
    eo, ec, es = re.escape(o), re.escape(c), re.escape(s)
    tag = re.compile(eo + r"(\w+)((?: \w+=\"[^\"]*\")*)" + es)
    call = re.compile(eo + r"call((?: \w+=\"[^\"]*\")*)" + es + "(.*?)" + ec + "call" + es, re.S)
    return _Grammar(o, c, s, markers, tag, call)


_SPELLED = _grammar(OPEN, CLOSE, SEP, MARKERS)
_MARKED = _grammar(MARKED[OPEN], MARKED[CLOSE], MARKED[SEP], tuple(MARKED.values()))
_UNMARK = str.maketrans({v: k for k, v in MARKED.items()})
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def marker_ids(tokenizer) -> dict[int, str]:
    """{reserved id: its character in marked text} for the four markers (SamplingParams.reserved_text)."""
    return {tokenizer.token_to_id(name): ch for name, ch in MARKED.items()}


def marked_text(tokenizer, ids: list[int]) -> str:
    """Generated ids -> marked text: the marker ids as MARKED characters, everything else decoded."""
    return tokenizer.decode(ids, reserved_text=marker_ids(tokenizer))


def _unesc(v: str) -> str:
    return v.replace("&quot;", '"').replace("&amp;", "&")


def _strip_partial_marker(text: str, g: _Grammar) -> str:
    """Drop a trailing prefix of a marker (streaming: it may become a marker with the next token)."""
    for k in range(min(len(text), max(map(len, g.markers))), 0, -1):
        if any(m.startswith(text[-k:]) for m in g.markers):
            return text[:-k]
    return text


def _channel(text: str, name: str, g: _Grammar) -> tuple[str, str, bool]:
    """Body of a channel that is already open -> (body, rest after its close, closed?)."""
    end = text.find(f"{g.close}{name}{g.sep}")
    if end < 0:
        return _strip_partial_marker(text.split(g.close)[0], g), "", False
    return text[:end], text[end + len(g.close + name + g.sep) :], True


def _parse_calls(text: str, g: _Grammar) -> list[dict]:
    calls = []
    for m in g.call.finditer(text):
        attrs = {k: _unesc(v) for k, v in _ATTR.findall(m.group(1))}
        args, raw = {}, None
        for a in g.tag.finditer(m.group(2)):
            kind, a_attrs = a.group(1), {k: _unesc(v) for k, v in _ATTR.findall(a.group(2))}
            body, _, _ = _channel(m.group(2)[a.end() :], kind, g)
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


def _parse(text: str, thinking: bool, g: _Grammar) -> dict:
    reasoning, rest = "", text
    if thinking:
        reasoning, rest, closed = _channel(text, "think", g)
        if not closed:
            return {"reasoning_content": reasoning, "content": "", "tool_calls": []}
        head = f"{g.open}response{g.sep}"
        rest = rest[len(head) :] if rest.startswith(head) else ("" if head.startswith(rest) else rest)
    content, rest, _ = _channel(rest, "response", g)
    calls = _parse_calls(rest, g) if f"{g.open}tools{g.sep}" in rest else []
    return {"reasoning_content": reasoning, "content": content, "tool_calls": calls}


def parse_generation(text: str, thinking: bool = True) -> dict:
    """Generated text (after the generation prompt) -> {reasoning_content, content, tool_calls}, the
    markers read from their spelled names. Tolerates a truncated generation (what is there so far,
    without partial markers). For a model's output use `parse_generation_ids` / `parse_marked`: here
    text that spells a marker is taken for one."""
    return _parse(text, thinking, _SPELLED)


def parse_marked(text: str, thinking: bool = True) -> dict:
    """`parse_generation` of marked text (`marked_text`, or an engine's text with SamplingParams'
    reserved_text = `marker_ids`): only real marker ids are structure. A marker id inside a body comes
    back as its name, as a plain decode shows it."""
    out = _parse(text, thinking, _MARKED)
    out["reasoning_content"] = out["reasoning_content"].translate(_UNMARK)
    out["content"] = out["content"].translate(_UNMARK)
    for call in out["tool_calls"]:
        fn = call["function"]
        fn["name"], fn["arguments"] = fn["name"].translate(_UNMARK), fn["arguments"].translate(_UNMARK)
    return out


def parse_generation_ids(tokenizer, ids: list[int], thinking: bool = True) -> dict:
    """Generated token ids -> {reasoning_content, content, tool_calls}: thinking, response and tool
    calls are read from the reserved marker ids alone; text that spells a marker stays text."""
    return parse_marked(marked_text(tokenizer, ids), thinking)
