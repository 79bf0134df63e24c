"""`k3 chat CHECKPOINT_DIR`: an interactive terminal chat on the engine, streaming tokens as they come.

Reasoning streams dimmed, the answer normally; earlier turns (with their reasoning, preserved thinking)
are rendered back into every new prompt, so the prefix cache serves the conversation so far.
Commands: /reset clears the history, /quit (or EOF) exits.
"""

from __future__ import annotations

import asyncio
import sys

from k3.serve.cli import add_engine_arguments, build_engine


def add_arguments(parser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--no-thinking", action="store_true")


async def _turn(aengine, messages, args) -> dict:
    from k3.chat_format import ChatOptions, encode_chat, marker_ids, parse_marked
    from k3.infer.sequence import SamplingParams

    opts = ChatOptions(thinking=not args.no_thinking)
    prompt = encode_chat(aengine.tokenizer, messages, options=opts)
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
    return {
        "role": "assistant",
        "content": parsed["content"],
        "reasoning_content": parsed["reasoning_content"],
    }


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
        messages.append(await _turn(aengine, messages, args))


def run(args) -> int:
    from k3.infer.async_engine import AsyncEngine

    aengine = AsyncEngine(build_engine(args))
    try:
        asyncio.run(_loop(aengine, args))
    finally:
        aengine.shutdown()
    return 0
