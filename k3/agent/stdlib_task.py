"""The embedded default SFT task: a stdlib lookup agent, generated from what the interpreter ships.

The user asks about a function or class of a module in `stdlib_tools.MODULES`; the assistant thinks in
one short sentence, calls `signature`, `doc` or `find` with the exact name from the question, reads the
result and answers with it verbatim. Kinds of conversation (weights in KINDS):

    signature   "What arguments does textwrap.indent take?"       -> signature(name) -> answer
    doc         "What does textwrap.indent do?"                   -> doc(name)       -> answer
    find        "Which module defines dedent?"                    -> find(name)      -> answer
    both        "What does X do, and what does it take?"          -> doc + signature in one turn -> answer
    follow_up   a signature question, its answer, then "And what does it do?" -> doc(name) -> answer

Split: a module is held out when crc32(name) % HOLDOUT_MOD == 0 (a fixed quarter of the modules), so
held-out conversations ask about names the SFT data never contains. Everything is a pure function of the
seed and of the interpreter's stdlib (the same Python gives the same data).
"""

from __future__ import annotations

import inspect
import json
import random
import zlib
from functools import cache

from k3.agent import stdlib_tools as st

HOLDOUT_MOD = 4
MAX_SIGNATURE_CHARS = 40
DOC_CHARS = (8, 60)
KINDS = {"signature": 0.3, "doc": 0.3, "find": 0.2, "both": 0.1, "follow_up": 0.1}
# share of training conversations about a made-up name (a real module, words of real names joined): the
# tool answers "error: ..." and the assistant reports it. A few hundred real names can be memorized;
# made-up ones can only be copied from the question, which is the skill the held-out split measures.
MADE_UP = 0.4


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
def _words(modules: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(
        sorted({w for m in modules for e in entries(m) for w in e[0].split(".")[1].lower().split("_") if w})
    )


def made_up(rng: random.Random, modules: list[str]) -> str:
    """A dotted name that does not exist: a module of `modules` and one to three words of its names."""
    words = _words(tuple(modules))
    while True:
        mod = rng.choice(modules)
        name = "_".join(rng.sample(words, rng.randint(1, 3)))
        if not hasattr(st.module(mod), name) and st.find(name).startswith("error"):
            return f"{mod}.{name}"


def _made_up_conversation(rng: random.Random, modules: list[str]) -> dict:
    dotted = made_up(rng, modules)
    tool = rng.choice(["signature", "doc", "find"])
    conv: list[dict] = []
    if tool == "find":
        bare = dotted.split(".", 1)[1]
        q = rng.choice(["Which module defines {}?", "Where is {} defined?"]).format(bare)
        res = _lookup(conv, "find", bare, q, f"The user asks where {bare} is defined; I call find.")
        _answer(conv, f"{bare}: {res}")
    elif tool == "signature":
        q = rng.choice(["What arguments does {} take?", "What is the signature of {}?"]).format(dotted)
        res = _lookup(
            conv, "signature", dotted, q, f"The user wants the signature of {dotted}; I call signature."
        )
        _answer(conv, f"{dotted}: {res}")
    else:
        q = rng.choice(["What does {} do?", "What is {} for?"]).format(dotted)
        res = _lookup(conv, "doc", dotted, q, f"The user asks what {dotted} does; I call doc.")
        _answer(conv, f"{dotted}: {res}")
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
        q = rng.choice(["What arguments does {} take?", "What is the signature of {}?"]).format(dotted)
        res = _lookup(
            conv, "signature", dotted, q, f"The user wants the signature of {dotted}; I call signature."
        )
        _answer(conv, f"{dotted} takes {res}.")
        if kind == "follow_up":
            res = _lookup(conv, "doc", dotted, "And what does it do?", f"It is {dotted}; I call doc.")
            _answer(conv, f"{dotted}: {res}")
    elif kind == "doc":
        q = rng.choice(["What does {} do?", "What is {} for?"]).format(dotted)
        res = _lookup(conv, "doc", dotted, q, f"The user asks what {dotted} does; I call doc.")
        _answer(conv, f"{dotted}: {res}")
    elif kind == "find":
        bare = dotted.split(".", 1)[1]
        q = rng.choice(["Which module defines {}?", "Where is {} defined?"]).format(bare)
        res = _lookup(conv, "find", bare, q, f"The user asks where {bare} is defined; I call find.")
        _answer(conv, f"{bare} is defined in {res}.")
    else:  # both: two calls in one turn
        think = f"The user asks what {dotted} does and takes; I call doc and signature."
        calls = [_call(1, "doc", dotted), _call(2, "signature", dotted)]
        conv += [
            {"role": "user", "content": f"What does {dotted} do, and what does it take?"},
            {"role": "assistant", "content": "", "reasoning_content": think, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": line},
            {"role": "tool", "tool_call_id": "call_2", "content": sig},
        ]
        _answer(conv, f"{dotted}: {line} It takes {sig}.")
    return {"messages": conv, "tools": st.TOOLS}


def conversations(n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """`n` conversations of `split` ("train" or "heldout"), a pure function of (n, split, seed)."""
    rng = random.Random(f"{split}-{seed}")
    modules = split_modules(split)
    share = MADE_UP if split == "train" else 0.0  # the held-out split asks about real names only
    return [conversation(rng, modules, share) for _ in range(n)]


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
