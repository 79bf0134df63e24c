"""Three renderers of the XTML chat format agree token for token: k3.chat_format (segments, each encoded on
its own), our Jinja template (k3/chat_template.jinja, shipped in tokenizer_config.json) and the release's
template as llama.cpp bundles it, both rendered by jinja2 the way HF `apply_chat_template` does and
tokenized as one string with the markers allowed (the chat path's `encode(allow_special=True)`)."""

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3.chat_format import ChatOptions, chat_template, encode_segments, render, to_text
from k3.data.corpus import load_corpus
from k3.tokenizer_train import train_tokenizer

BUILD_COMMAND = "bench/peers/llamacpp.sh"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city (天气), in °C or °F",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "Units": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1}}}}},
    {"type": "function", "function": {"name": "run_python", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}}}}},
]  # fmt: skip
CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
        {"city": "Paris", "days": 3, "metric": True, "note": None, "opts": {"hourly": [6, 12]},
         "tags": ["a"]})}},
    {"id": "call_2", "type": "function", "function": {"name": "run_python",
                                                      "arguments": '{"code": "print(1 + 1)\\n"}'}},
    {"id": "call_3", "type": "function", "function": {"name": "run_python",
                                                      "arguments": "print(2) {not json"}},
]  # fmt: skip
HISTORY = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Weather in Paris, then compute 1 + 1."},
    {"role": "assistant", "reasoning_content": "Two tools are needed.\nFirst the weather.", "content": "",
     "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_2", "content": "2\n"},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_3", "content": "SyntaxError"},
    {"role": "assistant", "reasoning_content": "Summarise both.", "content": "It is 21 °C; 1 + 1 = 2."},
    {"role": "user", "content": "Thanks! And in Tokyo (東京)?"},
]  # fmt: skip
IMAGES = [{"role": "user", "content": [
    {"type": "text", "text": "Compare these two pictures:"},
    {"type": "image_url", "image_url": {"url": "data:a"}},
    {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": "data:b"}},
    {"type": "text", "text": ". Which is brighter?"}]}]  # fmt: skip

# (messages, tools, options as chat_format takes them); each also renders with add_generation_prompt off
CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "hi"}], None, {}),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
               None, {}),
    "tools": (HISTORY[:2], TOOLS, {}),
    "tool_history": (HISTORY, TOOLS, {}),
    "tool_history_no_thinking": (HISTORY, TOOLS, {"thinking": False}),
    "unmatched_results": (HISTORY[:3] + [{"role": "tool", "name": "get_weather", "content": "sunny"},
                                         {"role": "tool", "content": "2"}], TOOLS, {}),  # fmt: skip
    "thinking_off": (HISTORY[6:] + HISTORY[6:], None, {"thinking": False}),
    "effort_low": (HISTORY[:2], None, {"thinking_effort": "low"}),
    "effort_high": (HISTORY[:2], TOOLS, {"thinking_effort": "high"}),
    "no_effort": (HISTORY[:2], None, {"thinking_effort": None}),
    "multi_turn": ([{"role": "user", "content": f"question {i}"} if i % 2 == 0 else
                    {"role": "assistant", "reasoning_content": f"thought {i}", "content": f"answer {i}"}
                    for i in range(7)], None, {}),  # fmt: skip
    "images": (IMAGES, None, {"thinking": False}),
    "names": ([{"role": "user", "name": 'Ann & "Bob"', "content": "hello"},
               {"role": "assistant", "name": "kimi", "content": "hi"}], None, {}),  # fmt: skip
    "new_tools": ([{"role": "user", "content": "q"}, {"role": "system", "tools": TOOLS[1:]},
                   {"role": "user", "content": "now run it"}], TOOLS[:1], {}),  # fmt: skip
    "tool_choice_required": (HISTORY[:2], TOOLS, {"tool_choice": "required"}),
    "tool_choice_none": (HISTORY[:2], TOOLS, {"tool_choice": "none"}),
    "json_object": (HISTORY[:2], None, {"response_format": {"type": "json_object"}}),
    "json_schema": (HISTORY[:2], None, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {"temp": {"type": "number"}}}}}}),
    "unicode": ([{"role": "user", "content": "日本語のテキスト、한국어, emoji 🎉\n\n```py\nx = 1\n```"}],
                None, {}),
}  # fmt: skip


def _hf_env(case_sensitive_dictsort: bool = False) -> ImmutableSandboxedEnvironment:
    """jinja2 set up as transformers' apply_chat_template sets it up (sandbox, trim/lstrip blocks, loop
    controls, its tojson and raise_exception). With `case_sensitive_dictsort`, `dictsort` orders keys by
    code point as llama.cpp's template engine always does (jinja2's default ignores case)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    if case_sensitive_dictsort:
        env.filters["dictsort"] = lambda value, *a, **k: sorted(value.items())
    return env


def _peer_root() -> Path:
    return Path(os.environ.get("K3_PEERS") or Path.home() / ".cache" / "k3" / "peers") / "llama.cpp-0.3.36"


def _peer_missing(what: str, path: Path):
    if os.environ.get("K3_SKIP_PEERS") == "1":
        pytest.skip(f"K3_SKIP_PEERS=1: the llama.cpp peer's {what} is not used")
    pytest.fail(f"the llama.cpp peer's {what} is missing ({path}); build it with `{BUILD_COMMAND}`")


def _bundled_template_path() -> Path:
    path = _peer_root() / "src" / "vendor" / "llama.cpp" / "models" / "templates" / "Kimi-K3.jinja"
    if not path.exists():
        _peer_missing("Kimi-K3.jinja", path)
    return path


def _bundled_template_source() -> str:
    return _bundled_template_path().read_text(encoding="utf-8")


def _template_kwargs(messages, tools, opts: dict, generation: bool) -> dict:
    """What HF / llama.cpp hand a template: tool-call arguments as objects (llama.cpp converts JSON strings
    for templates that read them; a string that is not JSON stays a string), the options as variables."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for c in m.get("tool_calls") or []:
            try:
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
            except json.JSONDecodeError:
                pass
    return dict(messages=messages, tools=tools, add_generation_prompt=generation, **opts)


def _cases():
    for name, (messages, tools, opts) in CONVERSATIONS.items():
        for generation in (True, False):
            yield f"{name}{'' if generation else '/no_prompt'}", messages, tools, opts, generation


@pytest.fixture(scope="module")
def tok():
    """Trained on stdlib code plus the rendered conversations, so markup like `="user"` has merges of its
    own and a template that tokenized across a segment boundary would show."""
    texts = [to_text(render(m, t, ChatOptions(**o), images=[])) for _, m, t, o, _ in _cases()]
    return train_tokenizer(load_corpus(None, "train").documents[:60] + texts * 5, vocab_size=4096)


def _chat_format_ids(tok, messages, tools, opts, generation):
    segs = render(messages, tools, ChatOptions(**opts), add_generation_prompt=generation, images=[])
    return to_text(segs), encode_segments(tok, segs)


def test_our_template_renders_chat_format_token_for_token(tok):
    template = _hf_env().from_string(chat_template())
    n_tokens = 0
    for name, messages, tools, opts, generation in _cases():
        text, ids = _chat_format_ids(tok, messages, tools, opts, generation)
        rendered = template.render(**_template_kwargs(messages, tools, opts, generation))
        assert rendered == text, name
        assert tok.encode(rendered, allow_special=True) == ids, name
        n_tokens += len(ids)
    assert n_tokens > 5_000


def test_bundled_release_template_agrees_token_for_token(tok):
    """The release's template (llama.cpp's Kimi-K3.jinja) renders every conversation as chat_format does."""
    template = _hf_env(case_sensitive_dictsort=True).from_string(_bundled_template_source())
    for name, messages, tools, opts, generation in _cases():
        text, ids = _chat_format_ids(tok, messages, tools, opts, generation)
        rendered = template.render(**_template_kwargs(messages, tools, opts, generation))
        assert rendered == text, name
        assert tok.encode(rendered, allow_special=True) == ids, name


def test_template_options_match_chat_options():
    """Aliases only our template has: enable_thinking (llama.cpp's flag), reasoning_effort, 'none',
    preserve_thinking."""
    template = _hf_env().from_string(chat_template())
    messages = CONVERSATIONS["multi_turn"][0]
    for kwargs, opts in [
        ({"enable_thinking": False}, ChatOptions(thinking=False)),
        ({"reasoning_effort": "low"}, ChatOptions(thinking_effort="low")),
        ({"thinking_effort": "none"}, ChatOptions(thinking_effort="none")),
        ({"preserve_thinking": False}, ChatOptions(preserve_thinking=False)),
    ]:
        rendered = template.render(messages=messages, add_generation_prompt=True, **kwargs)
        assert rendered == to_text(render(messages, options=opts)), kwargs
    for bad in ({"thinking_effort": "medium"}, {"messages": [{"role": "wizard", "content": "x"}]}):
        with pytest.raises(jinja2.exceptions.TemplateError):
            template.render(**({"messages": messages} | bad))


def test_bundled_template_under_jinja2_orders_keys_ignoring_case():
    """A known departure of the bundled template, not of ours: under jinja2 (HF), `dictsort` ignores case,
    so a tool schema with mixed-case keys ("Units" before "city" in the release's sort) comes out in
    another order; llama.cpp's engine sorts by code point and agrees with the release."""
    messages, tools = HISTORY[:2], TOOLS
    text = to_text(render(messages, tools))
    bundled = _hf_env().from_string(_bundled_template_source())
    bundled = bundled.render(messages=messages, tools=tools, add_generation_prompt=True)
    ours = (
        _hf_env()
        .from_string(chat_template())
        .render(messages=messages, tools=tools, add_generation_prompt=True)
    )
    assert ours == text and '"Units":' in text and text.index('"Units":') < text.index('"city":')
    assert bundled != text and bundled.index('"city":') < bundled.index('"Units":')


# A small program on llama.cpp's own chat code (common_chat_templates_apply, its Jinja engine, its
# message normalisation): renders argv[1] (a template) for each case of argv[2] (a JSON list).
_RENDER_CPP = r"""
#include "chat.h"
#include <fstream>
#include <iostream>
#include <sstream>
static std::string slurp(const char * p) {
    std::ifstream f(p); std::stringstream s; s << f.rdbuf(); return s.str();
}
int main(int, char ** argv) {
    auto templates = common_chat_templates_init(nullptr, slurp(argv[1]));
    for (const auto & c : common_json::parse(slurp(argv[2]))) {
        common_chat_templates_inputs in;
        in.messages = common_chat_msgs_parse_oaicompat(c.at("messages"));
        if (!c.at("tools").is_null()) in.tools = common_chat_tools_parse_oaicompat(c.at("tools"));
        in.add_generation_prompt = c.at("add_generation_prompt").get<bool>();
        in.enable_thinking = c.at("enable_thinking").get<bool>();
        for (const auto & kv : c.at("kwargs").items()) in.chat_template_kwargs[kv.key()] = kv.value().dump();
        try { std::cout << common_chat_templates_apply(templates.get(), in).prompt; }
        catch (const std::exception & e) { std::cout << "ERROR: " << e.what(); }
        std::cout << "\n\x1e\n";
    }
}
"""


def _llamacpp_renderer(tmp: Path) -> Path:
    """The program above, compiled against the peer's headers and libllama-common."""
    root = _peer_root()
    if not (root / "READY").exists():
        _peer_missing("build", root / "READY")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.fail(
            "a C++ compiler (g++) is needed to drive llama.cpp's template engine: apt-get install g++"
        )
    src, exe, llama = tmp / "render.cpp", tmp / "render", root / "src" / "vendor" / "llama.cpp"
    src.write_text(_RENDER_CPP)
    includes = [f"-I{llama / d}" for d in ("common", "include", "ggml/include", "vendor")]
    lib = root / "lib"
    cmd = [compiler, "-std=c++17", *includes, str(src), "-o", str(exe), f"-L{lib}", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd + ["-lllama-common", "-lllama"], check=True, capture_output=True)
    return exe


def test_both_templates_in_llamacpps_engine(tmp_path):
    """llama.cpp itself (its Jinja engine and message handling) renders our template and the bundled one
    as chat_format does, on the conversations its message model carries: no user / assistant names, no
    images, no mid-conversation tool declarations, every tool with a description (it adds an empty one),
    tool-call arguments that are JSON (it refuses others)."""
    exe = _llamacpp_renderer(tmp_path)
    cases, want = [], []
    for name, messages, tools, opts, generation in _cases():
        if name.startswith(("names", "images", "new_tools")):
            continue
        messages, tools = copy.deepcopy(messages), copy.deepcopy(tools)
        for t in tools or []:
            t["function"].setdefault("description", "")
        messages = [m for m in messages if m.get("tool_call_id") != "call_3"]
        for m in messages:
            if m.get("tool_calls"):
                m["tool_calls"] = [c for c in m["tool_calls"] if c["id"] != "call_3"]
        thinking = ChatOptions(**opts).thinking
        cases.append(dict(messages=messages, tools=tools, add_generation_prompt=generation,
                          enable_thinking=thinking, kwargs=opts))  # fmt: skip
        want.append(to_text(render(messages, tools, ChatOptions(**opts), generation)))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "ours.jinja").write_text(chat_template())
    for template in (tmp_path / "ours.jinja", _bundled_template_path()):
        run = subprocess.run(
            [exe, template, tmp_path / "cases.json"], capture_output=True, text=True, check=True
        )
        assert run.stdout.split("\n\x1e\n")[:-1] == want, template.name
    assert len(want) >= 30
