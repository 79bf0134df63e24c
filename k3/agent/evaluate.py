"""`k3 eval-agent CHECKPOINT`: score a chat model as a tool-calling agent through the real API.

Starts `k3 serve CHECKPOINT` on 127.0.0.1 (a free port; it stops by itself after `--lifetime` s), drives
the embedded task's held-out conversations (k3.agent.stdlib_task, modules never in the SFT data) with
the `openai` SDK and `tools`, runs every tool call the server returns (k3.agent.stdlib_tools), sends the
results back as `tool` messages (with the assistant turn's `reasoning_content`: preserved thinking), and
asks again until the model answers without a call or `max_requests` per user turn are spent. Greedy
decoding (temperature 0). Scores, over the turns where the reference calls tools:

    valid_json     the turn returned tool calls and every call's arguments parse as a JSON object
    right_call     the calls' function names and arguments equal the reference's exactly (any order)
and over conversations:
    correct        every user turn ends with an answer that contains each reference tool result verbatim
    requests       model requests per user turn (the reference needs calls + 1)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Score a chat model as a tool-calling agent on held-out stdlib lookups via k3 serve."
    p.add_argument("checkpoint", help="model directory (a k3 sft run, or its k3 quantize release)")
    p.add_argument("--conversations", type=int, default=60, help="held-out conversations (default 60)")
    p.add_argument("--seed", type=int, default=0, help="which held-out conversations (default 0)")
    p.add_argument("--max-tokens", type=int, default=192, help="output tokens per request (default 192)")
    p.add_argument("--max-requests", type=int, default=4, help="model requests per user turn (default 4)")
    p.add_argument("--parallel", type=int, default=4, help="conversations in flight (default 4)")
    p.add_argument(
        "--no-preserve-thinking",
        action="store_true",
        help="send chat_template_kwargs.preserve_thinking=false (earlier thinking rendered empty)",
    )
    p.add_argument("--json", metavar="FILE", help="write the scores and every transcript here")
    p.add_argument("--lifetime", type=float, default=1800, help="the server stops after this many s")
    p.add_argument("--url", help="an already running server's base URL instead of starting one")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`k3 serve CHECKPOINT` on 127.0.0.1 as a subprocess; a context manager that stops it."""

    def __init__(self, checkpoint: str, lifetime: float = 1800, max_model_len: int = 2048):
        port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "k3.serve.cli",
            str(checkpoint),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(max_model_len),
            "--shutdown-after",
            str(lifetime),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy()
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(f"checkpoint: k3 serve exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("k3 serve did not come up in 180 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _parsed_args(call) -> dict | None:
    try:
        args = json.loads(call.function.arguments or "")
    except json.JSONDecodeError:
        return None
    return args if isinstance(args, dict) else None


def run_conversation(client, model: str, ref: dict, max_tokens: int, max_requests: int, extra: dict) -> dict:
    """Drive one reference conversation through the API; returns its scores and transcript."""
    from k3.agent import stdlib_tools as st
    from k3.agent.stdlib_task import expected_turns

    messages: list[dict] = []
    rec = {
        "call_turns": 0,
        "valid_json": 0,
        "right_call": 0,
        "requests": [],
        "answered": [],
        "errors": [],
        "messages": messages,
    }
    for turn in expected_turns(ref):
        messages.append({"role": "user", "content": turn["user"]})
        answer, k = None, 0
        for k in range(max_requests):
            try:
                resp = client.chat.completions.create(
                    model=model,
                    messages=messages,
                    tools=st.TOOLS,
                    temperature=0,
                    max_tokens=max_tokens,
                    extra_body=extra,
                )
            except Exception as e:  # noqa: BLE001 - a request the model's own history broke (400: too long...)
                rec["errors"].append(f"{type(e).__name__}: {e}"[:300])
                break
            msg = resp.choices[0].message
            calls = msg.tool_calls or []
            if k < len(turn["calls"]):  # the reference calls tools here
                want = sorted(json.dumps(c, sort_keys=True) for c in turn["calls"][k])
                got = [(c.function.name, _parsed_args(c)) for c in calls]
                rec["call_turns"] += 1
                rec["valid_json"] += bool(calls) and all(a is not None for _, a in got)
                rec["right_call"] += sorted(json.dumps(list(g), sort_keys=True) for g in got) == want
            reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get(
                "reasoning_content"
            )
            out = {"role": "assistant", "content": msg.content or "", "reasoning_content": reasoning or ""}
            if not calls:
                messages.append(out)
                answer = msg.content or ""
                break
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]
            messages.append(out)
            for c in calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": c.id,
                        "content": st.call_tool(c.function.name, c.function.arguments or ""),
                    }
                )
        rec["requests"].append(k + 1)
        rec["answered"].append(answer is not None and all(f in answer for f in turn["facts"]))
        if rec["errors"]:
            break
    rec["correct"] = all(rec["answered"])
    return rec


def evaluate_agent(
    url: str,
    conversations: int = 60,
    seed: int = 0,
    max_tokens: int = 192,
    max_requests: int = 4,
    parallel: int = 4,
    preserve_thinking: bool = True,
) -> dict:
    """Scores of the held-out conversations against the server at `url` (see the module doc)."""
    from openai import OpenAI

    from k3.agent.stdlib_task import conversations as make

    if conversations < 1:
        raise ValueError(f"conversations: must be >= 1, got {conversations}")
    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    extra = {} if preserve_thinking else {"chat_template_kwargs": {"preserve_thinking": False}}
    refs = make(conversations, "heldout", seed)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        recs = list(
            pool.map(lambda r: run_conversation(client, model, r, max_tokens, max_requests, extra), refs)
        )
    turns = sum(r["call_turns"] for r in recs)
    user_turns = [n for r in recs for n in r["requests"]]
    ref_requests = [len(t["calls"]) + 1 for r in refs for t in _turns(r)]
    return {
        "conversations": len(recs),
        "call_turns": turns,
        "valid_json": sum(r["valid_json"] for r in recs) / max(turns, 1),
        "right_call": sum(r["right_call"] for r in recs) / max(turns, 1),
        "correct": sum(r["correct"] for r in recs) / len(recs),
        "requests_per_turn": sum(user_turns) / len(user_turns),
        "reference_requests_per_turn": sum(ref_requests) / len(ref_requests),
        "seconds": time.perf_counter() - t0,
        "request_errors": sum(len(r["errors"]) for r in recs),
        "transcripts": [
            {"correct": r["correct"], "errors": r["errors"], "messages": r["messages"]} for r in recs
        ],
    }


def _turns(ref: dict) -> list[dict]:
    from k3.agent.stdlib_task import expected_turns

    return expected_turns(ref)


def run(args: argparse.Namespace) -> int:
    kw = dict(
        conversations=args.conversations,
        seed=args.seed,
        max_tokens=args.max_tokens,
        max_requests=args.max_requests,
        parallel=args.parallel,
        preserve_thinking=not args.no_preserve_thinking,
    )
    if args.url:
        res = evaluate_agent(args.url.rstrip("/"), **kw)
    else:
        if not Path(args.checkpoint).exists():
            raise ValueError(f"checkpoint: {args.checkpoint} does not exist")
        with LocalServer(args.checkpoint, args.lifetime) as server:
            res = evaluate_agent(server.url, **kw)
    res["checkpoint"] = args.checkpoint
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(
        f"k3 eval-agent {args.checkpoint}: {res['conversations']} held-out conversations, "
        f"{res['call_turns']} "
        f"tool-call turns\n  valid tool-call JSON {100 * res['valid_json']:.1f} %\n"
        f"  right function + arguments {100 * res['right_call']:.1f} %\n"
        f"  conversations answered correctly {100 * res['correct']:.1f} %\n"
        f"  requests per user turn {res['requests_per_turn']:.2f} "
        f"(reference {res['reference_requests_per_turn']:.2f})"
        f"\n  {res['seconds']:.0f} s"
    )
    return 0
