"""Held-out image QA accuracy of a VL checkpoint THROUGH THE SERVER: start `k3 serve CKPT` (uvicorn on
127.0.0.1), ask each held-out synthetic question with its image as a PNG data: URL in an OpenAI
`image_url` part (the official `openai` client, a few requests in flight), and score exact match.

    python -m k3.serve.vl_eval runs/tiny-vl -n 400 --out runs/tiny-vl/server_eval.json

The questions are `k3.vision.synthetic.examples("heldout", seed, n)`, the split `k3.train.vl`
never trains on (the same ones its in-process `heldout_eval.json` scores), so the two figures compare.
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

MODEL = "kimi-k3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, port: int, max_num_seqs: int, timeout_s: float = 120.0) -> subprocess.Popen:
    """`python -m k3.serve.cli CKPT` on 127.0.0.1:port; returns once /health answers."""
    cmd = [sys.executable, "-m", "k3.serve.cli", ckpt, "--port", str(port), "--max-model-len", "1024",
           "--page-size", "16", "--max-num-seqs", str(max_num_seqs)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not answer /health within {timeout_s} s")


def ask(client, image, question: str, max_tokens: int = 12) -> str:
    from k3.vision.image_io import encode_data_url

    parts = [
        {"type": "image_url", "image_url": {"url": encode_data_url(image)}},
        {"type": "text", "text": question},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    return (r.choices[0].message.content or "").strip()


def evaluate(base_url: str, examples, concurrency: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        preds = list(pool.map(lambda ex: ask(client, ex.image, ex.question), examples))
    wall = time.time() - t0
    right: dict[str, list[int]] = {}
    for ex, pred in zip(examples, preds, strict=True):
        right.setdefault(ex.kind, []).append(int(pred == ex.answer))
    total = sum(sum(v) for v in right.values()) / len(examples)
    wrong = [
        {"question": ex.question, "answer": ex.answer, "pred": p}
        for ex, p in zip(examples, preds, strict=True)
        if p != ex.answer
    ]
    return {
        "accuracy": total,
        "per_kind": {k: sum(v) / len(v) for k, v in sorted(right.items())},
        "n": len(examples),
        "wall_s": round(wall, 1),
        "wrong_examples": wrong[:20],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("-n", type=int, default=400, help="held-out questions (default 400)")
    p.add_argument("--seed", type=int, default=0, help="the training run's --seed (the held-out stream)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    if args.n < 1 or args.concurrency < 1:
        p.error("-n and --concurrency must be >= 1")
    from k3.vision import synthetic

    examples = synthetic.examples("heldout", args.seed, args.n)
    port = _free_port()
    proc = start_server(args.checkpoint, port, max_num_seqs=max(4, args.concurrency))
    try:
        result = evaluate(f"http://127.0.0.1:{port}", examples, args.concurrency)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    result |= {"checkpoint": str(args.checkpoint), "seed": args.seed, "via": "k3 serve + openai client"}
    print(json.dumps({k: v for k, v in result.items() if k != "wrong_examples"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
