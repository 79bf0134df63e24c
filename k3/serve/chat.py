"""`k3 chat CHECKPOINT_DIR`: an interactive terminal chat on the engine, streaming tokens as they come.

Reasoning streams dimmed, the answer normally; earlier turns (with their reasoning, preserved thinking)
are rendered back into every new prompt, so the prefix cache serves the conversation so far.
Commands: /reset clears the history, /quit (or EOF) exits.

Tools: with `--tools stdlib` (the default) the prompt declares the embedded task's tools (signature, doc,
find: k3.agent.stdlib_tools) and the chat runs the tool loop itself: each call the model makes is shown,
run, its result shown and sent back, and the model continues, up to MAX_TOOL_ROUNDS times a turn. A
checkpoint that `k3 sft` never trained on conversations (no sft_config.json beside it) gets a warning:
such a model continues Python text and knows nothing of the chat format.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from k3.serve.cli import add_engine_arguments, build_engine


def add_arguments(parser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--no-thinking", action="store_true")
    parser.add_argument(
        "--tools",
        choices=("stdlib", "none"),
        default="stdlib",
        help="stdlib (default): declare and run the stdlib lookup tools; none: no tools",
    )


MAX_TOOL_ROUNDS = 4


def trained_on_chats(checkpoint: str) -> bool:
    """Whether `k3 sft` made this model: its sft_config.json sits beside it (run directory, a release
    that `k3 quantize` copied it into) or in the run above a checkpoints/step-N directory."""
    d = Path(checkpoint)
    return any((p / "sft_config.json").exists() for p in (d, d.parent.parent))


async def _turn(aengine, messages, args) -> dict:
    from k3.chat_format import ChatOptions, encode_chat
    from k3.chat_parse import marker_ids, parse_marked
    from k3.infer.sequence import SamplingParams

    tools = None
    if args.tools == "stdlib":
        from k3.agent.stdlib_tools import TOOLS as tools
    opts = ChatOptions(thinking=not args.no_thinking)
    prompt = encode_chat(aengine.tokenizer, messages, tools, options=opts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=0.95,
                            reserved_text=tuple(marker_ids(aengine.tokenizer).items()))  # fmt: skip
    shown = {"reasoning_content": "", "content": ""}
    parsed, text = shown, ""
    async for ev in aengine.generate(prompt, params):
        text += ev.text  # each event brings its new text; markers only from the marker ids
        parsed = parse_marked(text, opts.thinking)
        for key, style in (("reasoning_content", "\033[2m"), ("content", "")):
            new = parsed[key][len(shown[key]) :] if parsed[key].startswith(shown[key]) else ""
            if new:
                sys.stdout.write(f"{style}{new}\033[0m")
                sys.stdout.flush()
        shown = {k: parsed[k] for k in shown}
    print()
    out = {
        "role": "assistant",
        "content": parsed["content"],
        "reasoning_content": parsed["reasoning_content"],
    }
    if parsed["tool_calls"]:
        out["tool_calls"] = parsed["tool_calls"]
    return out


async def _answer(aengine, messages, args) -> None:
    """One user turn: generate; while the model calls tools (and rounds are left), run them and go on."""
    from k3.agent.stdlib_tools import call_tool

    for _ in range(MAX_TOOL_ROUNDS):
        msg = await _turn(aengine, messages, args)
        messages.append(msg)
        if not msg.get("tool_calls") or args.tools == "none":
            return
        for call in msg["tool_calls"]:
            fn = call["function"]
            result = call_tool(fn["name"], fn["arguments"])
            print(f"\033[36m[tool] {fn['name']}({fn['arguments']}) -> {result}\033[0m")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


async def _loop(aengine, args) -> None:
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if line.strip() == "/quit":
            return
        if line.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        await _answer(aengine, messages, args)


def run(args) -> int:
    from k3.infer.async_engine import AsyncEngine

    engine = build_engine(args)
    if not trained_on_chats(args.checkpoint):
        print(
            f"k3 chat: warning: {args.checkpoint} was never trained on conversations (no sft_config.json); "
            "it continues text and knows nothing of the chat format (fine-tune it: k3 sft RUN --out OUT)",
            file=sys.stderr,
        )
    aengine = AsyncEngine(engine)
    try:
        asyncio.run(_loop(aengine, args))
    finally:
        aengine.shutdown()
    return 0
