"""The embedded default SFT task: a stdlib lookup agent, generated from what the interpreter ships.

The user asks about a function or class of a module in `stdlib_tools.MODULES`; the assistant thinks in
one short sentence, calls `signature`, `doc` or `find` with the exact name from the question, reads the
result and answers with it verbatim. Kinds of conversation (weights in KINDS):

    signature   "What arguments does `textwrap.indent` take?"     -> signature(name) -> answer
    doc         "What does `textwrap.indent` do?"                 -> doc(name)       -> answer
    find        "Which module defines `dedent`?"                  -> find(name)      -> answer
    both        "What does `X` do, and what does it take?"        -> doc + signature in one turn -> answer
    follow_up   a signature question, its answer, then "And what does it do?" -> doc(name) -> answer

Names are written as code, in backticks, everywhere (question, thinking, answer): the tokenizer then
cuts a name into the same tokens in the question as in the call's argument, so the call copies tokens
(a plain " textwrap" after a space is another token than the argument's "textwrap").

Split: a module is held out when crc32(name) % HOLDOUT_MOD == 0 (a fixed quarter of the modules), so
held-out conversations ask about names the SFT data never contains. Everything is a pure function of the
seed and of the interpreter's stdlib (the same Python gives the same data).
"""

from __future__ import annotations

import inspect
import json
import random
import re
import sys
import zlib
from functools import cache

from k3.agent import stdlib_tools as st

HOLDOUT_MOD = 4
MAX_SIGNATURE_CHARS = 40
DOC_CHARS = (8, 60)
KINDS = {"signature": 0.3, "doc": 0.3, "find": 0.2, "both": 0.1, "follow_up": 0.1}
# share of training conversations about a made-up name (`made_up`: it looks like a real one): the
# tool answers "error: ..." and the assistant reports it. A few hundred real names can be memorized;
# made-up ones can only be copied from the question, which is the skill the held-out split measures.
MADE_UP = 0.6
TRAIN_QUESTIONS = 4  # questions in one training conversation: 1 to this many


def held_out(module: str) -> bool:
    return zlib.crc32(module.encode()) % HOLDOUT_MOD == 0


def split_modules(split: str) -> list[str]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [m for m in st.MODULES if held_out(m) == (split == "heldout")]


@cache
def entries(mod: str) -> tuple[tuple[str, str, str, bool], ...]:
    """(dotted name, signature, doc line, unique bare name) of the module's askable objects: public
    functions and classes defined there, short signature and one-line docstring, ASCII only."""
    out = []
    for name, obj in sorted(vars(st.module(mod)).items()):
        if name.startswith("_") or not (
            inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)
        ):
            continue
        if not st.defined_in(mod, name):
            continue
        dotted = f"{mod}.{name}"
        sig, line = st.signature(dotted), st.doc(dotted)
        if sig.startswith("error") or line.startswith("error") or len(sig) > MAX_SIGNATURE_CHARS:
            continue
        if not (DOC_CHARS[0] <= len(line) <= DOC_CHARS[1]) or not (dotted + sig + line).isascii():
            continue
        out.append((dotted, sig, line, st.find(name) == mod))
    return tuple(out)


def _call(n: int, tool: str, name: str) -> dict:
    args = json.dumps({"name": name})
    return {"id": f"call_{n}", "type": "function", "function": {"name": tool, "arguments": args}}


def _lookup(conv: list, tool: str, name: str, question: str, think: str) -> str:
    """Append user question, the assistant's call, the tool result; return the result."""
    n = sum(len(m.get("tool_calls") or ()) for m in conv) + 1
    result = st.FUNCTIONS[tool](name)
    conv += [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": think,
            "tool_calls": [_call(n, tool, name)],
        },
        {"role": "tool", "tool_call_id": f"call_{n}", "content": result},
    ]
    return result


def _answer(conv: list, text: str, think: str = "The tool answered; I quote it.") -> None:
    conv.append({"role": "assistant", "content": text, "reasoning_content": think})


@cache
def _pieces(modules: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(lower-case words, Capitalised words): the snake_case and CamelCase parts of every name the modules
    hold (private ones too) and of the stdlib's module names, ~2,500 words, so that copying is learned
    for most of the vocabulary, not for a few hundred names. A held-out module's name or a held-out
    function's or class's name is never one of them."""
    held = {m for m in st.MODULES if held_out(m)}
    held |= {e[0].split(".")[1] for m in held for e in entries(m)}
    names = [n for m in modules for n in dir(st.module(m))] + sorted(sys.stdlib_module_names)
    words = {w for n in names for w in re.findall(r"[A-Z]+[a-z0-9]*|[a-z][a-z0-9]*", n)} - held
    return tuple(sorted(w for w in words if w.islower())), tuple(sorted(w for w in words if not w.islower()))


def made_up(rng: random.Random, modules: list[str]) -> str:
    """A dotted name that does not exist but looks like the real ones: a module of `modules` or one made
    of their words, then one to three words joined as a class (CamelCase) or a function (snake_case or
    run together). Names that look real can only be copied, not recalled, which is what the held-out
    split measures."""
    lower, upper = _pieces(tuple(modules))
    while True:
        mod = rng.choice(modules) if rng.random() < 0.5 else "".join(rng.sample(lower, rng.randint(1, 2)))
        k = rng.randint(1, 3)
        if rng.random() < 0.35:
            name = "".join(rng.sample(upper, k))
        else:
            name = rng.choice(("_", "")).join(rng.sample(lower, k))
        dotted = f"{mod}.{name}"
        if len(mod) > 14 or len(name) > 22:  # as long as the real ones
            continue
        if st.signature(dotted).startswith("error") and st.find(name).startswith("error"):
            return dotted


QUESTIONS = {  # tool -> (question templates, the thinking before the call)
    "find": (
        ["Which module defines `{}`?", "Where is `{}` defined?"],
        "The user asks where `{}` is defined; I call find.",
    ),
    "signature": (
        ["What arguments does `{}` take?", "What is the signature of `{}`?"],
        "The user wants the signature of `{}`; I call signature.",
    ),
    "doc": (["What does `{}` do?", "What is `{}` for?"], "The user asks what `{}` does; I call doc."),
}


def _ask(rng: random.Random, conv: list, tool: str, name: str) -> str:
    """Append a question about `name` that `tool` answers, the call and its result; return the result."""
    questions, think = QUESTIONS[tool]
    return _lookup(conv, tool, name, rng.choice(questions).format(name), think.format(name))


def _made_up_conversation(rng: random.Random, modules: list[str]) -> dict:
    dotted = made_up(rng, modules)
    tool = rng.choice(["signature", "doc", "find"])
    name = dotted.split(".", 1)[1] if tool == "find" else dotted
    conv: list[dict] = []
    res = _ask(rng, conv, tool, name)
    _answer(conv, f"`{name}`: {res}")
    return {"messages": conv, "tools": st.TOOLS}


def conversation(rng: random.Random, modules: list[str], made_up_share: float = 0.0) -> dict:
    """One conversation {"messages": [...], "tools": TOOLS} about a random name of `modules` (with
    probability `made_up_share`, about a made-up name of one of them)."""
    if made_up_share and rng.random() < made_up_share:
        return _made_up_conversation(rng, modules)
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    pool = [e for m in modules for e in entries(m) if kind != "find" or e[3]]
    dotted, sig, line, _ = rng.choice(pool)
    conv: list[dict] = []
    if kind in ("signature", "follow_up"):
        res = _ask(rng, conv, "signature", dotted)
        _answer(conv, f"`{dotted}` takes {res}.")
        if kind == "follow_up":
            res = _lookup(conv, "doc", dotted, "And what does it do?", f"It is `{dotted}`; I call doc.")
            _answer(conv, f"`{dotted}`: {res}")
    elif kind == "doc":
        res = _ask(rng, conv, "doc", dotted)
        _answer(conv, f"`{dotted}`: {res}")
    elif kind == "find":
        bare = dotted.split(".", 1)[1]
        res = _ask(rng, conv, "find", bare)
        _answer(conv, f"`{bare}` is defined in {res}.")
    else:  # both: two calls in one turn
        think = f"The user asks what `{dotted}` does and takes; I call doc and signature."
        calls = [_call(1, "doc", dotted), _call(2, "signature", dotted)]
        conv += [
            {"role": "user", "content": f"What does `{dotted}` do, and what does it take?"},
            {"role": "assistant", "content": "", "reasoning_content": think, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": line},
            {"role": "tool", "tool_call_id": "call_2", "content": sig},
        ]
        _answer(conv, f"`{dotted}`: {line} It takes {sig}.")
    return {"messages": conv, "tools": st.TOOLS}


def chained(parts: list[dict]) -> dict:
    """One conversation asking the questions of `parts` one after another (call ids renumbered)."""
    messages: list[dict] = []
    n = 0
    for part in parts:
        ids = {}
        for m in part["messages"]:
            m = dict(m)
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    n += 1
                    ids[c["id"]] = f"call_{n}"
                    calls.append({**c, "id": ids[c["id"]]})
                m["tool_calls"] = calls
            if m["role"] == "tool":
                m["tool_call_id"] = ids[m["tool_call_id"]]
            messages.append(m)
    return {"messages": messages, "tools": st.TOOLS}


def conversations(n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """`n` conversations of `split` ("train" or "heldout"), a pure function of (n, split, seed). A
    training conversation asks 1 to TRAIN_QUESTIONS questions in a row (more lookups to learn from per
    token of the shared tool declarations); a held-out one asks one (its own follow-up aside)."""
    rng = random.Random(f"{split}-{seed}")
    modules = split_modules(split)
    if split == "heldout":  # real names only, one question
        return [conversation(rng, modules) for _ in range(n)]
    return [
        chained([conversation(rng, modules, MADE_UP) for _ in range(rng.randint(1, TRAIN_QUESTIONS))])
        for _ in range(n)
    ]


def write_jsonl(convs: list[dict], path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")


def expected_turns(conv: dict) -> list[dict]:
    """Per user turn of a reference conversation: {"user": text, "calls": [[(tool, args)...] per call
    turn], "facts": [tool results the answer must contain]} (what `k3 eval-agent` checks)."""
    turns: list[dict] = []
    for m in conv["messages"]:
        if m["role"] == "user":
            turns.append({"user": m["content"], "calls": [], "facts": []})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            turns[-1]["calls"].append(
                [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
            )
        elif m["role"] == "tool":
            turns[-1]["facts"].append(m["content"])
    return turns
