"""k3's side of bench/vs_llamacpp.py: a process that times k3's engine one round at a time, on command.

    taskset -c 1 env OMP_NUM_THREADS=1 python bench/engine_worker.py --threads 1 \
        --plan '{"f32": ["DIR", [512, 4096]], "mxfp4": ["DIR", [512]]}' --decode-context 512 --decode-new 256

One Engine per format (`k3.serve.cli.load_engine`, as `k3 serve` loads it: an MXFP4 checkpoint keeps its
routed experts packed) with the engine's best CPU settings: the batch-1 decode step compiled and the
prefill activations fused (`EngineConfig.compile`), no prefix cache (nothing to reuse in these runs),
a prompt prefilled in one chunk. Each engine is warmed up (compiling, a prefill at each length, a
decode) before it prints `@@ {"ready": ...}`; then each line `run` on stdin times one round and prints
`@@ {format: {"prefill": {n: tok/s}, "decode": tok/s}}` (the plan gives each format its checkpoint
folder and prompt lengths):

* prefill: a `max_tokens=1` request of n random token ids (its time includes sampling that token),
  right after an untimed one of the same length: llama-bench runs a warm-up prompt of the test's size
  before each timed one, and the two sides' timed runs start alike only if k3's does too (between
  rounds llama.cpp's run has taken the caches and the cores);
* decode: a request of `decode-context` tokens and `decode-new + 1` output tokens; the time from its
  first token (the prefill's) to its last, over `decode-new` tokens (batch 1, greedy, ignore_eos).

It runs in its own process so that it is pinned as llama.cpp is (taskset, OMP_NUM_THREADS and
torch.set_num_threads), with nothing of the parent (the load client, llama.cpp's bindings) inside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch


def emit(obj: dict) -> None:
    print("@@ " + json.dumps(obj), flush=True)


def make_engine(ckpt: str, max_len: int, chunk: int, compile: bool):
    from k3.infer.config import EngineConfig
    from k3.serve.cli import load_engine

    cfg = EngineConfig(
        page_size=64,
        num_pages=-(-max_len // 64) + 1,
        max_model_len=max_len,
        max_num_seqs=1,
        enable_prefix_cache=False,
        max_num_batched_tokens=chunk,
        max_prefill_chunk=chunk,
        compile=compile,
    )
    return load_engine(ckpt, cfg)


def prefill(engine, prompt: list[int]) -> float:
    from k3.infer.sequence import SamplingParams

    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - t0)


def decode(engine, prompt: list[int], new: int) -> float:
    from k3.infer.sequence import SamplingParams, Status

    seq = engine.add_request(prompt, SamplingParams(max_tokens=new + 1, ignore_eos=True))
    while not seq.output:
        engine.step()
    t0 = time.perf_counter()
    while seq.status is not Status.FINISHED:
        engine.step()
    if len(seq.output) != new + 1:
        raise RuntimeError(f"decode generated {len(seq.output)} tokens, not {new + 1}")
    return new / (time.perf_counter() - t0)


def warmed_engine(ckpt: str, max_len: int, chunk: int, compile: bool, lengths: list[int], a, g):
    """(engine, random-prompt maker) and its warm-up info: compiled, seconds."""
    t0 = time.perf_counter()
    e = make_engine(ckpt, max_len, chunk, compile)
    vocab = e.model.config.vocab_size - 256  # the reserved ids at the top are never prompted

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    decode(e, rand(a.decode_context), 4)  # compiles the decode step
    for n in lengths:
        prefill(e, rand(n))
    step = e.runner.decode  # the backend the engine chose when it was built (k3.infer.decode.backend)
    path = "native" if step.native is not None else "compiled" if step.torch.compile else "eager"
    info = dict(warmup_s=time.perf_counter() - t0, decode_path=path, compile_s=step.torch.compile_seconds)
    return (e, rand), info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--plan", required=True, help="JSON {format: [checkpoint_dir, [prompt lengths]]}")
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-new", type=int, default=256)
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (default: the longest prompt)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    plan = {name: (ckpt, [int(n) for n in lengths]) for name, (ckpt, lengths) in json.loads(a.plan).items()}
    longest = max(n for _, lengths in plan.values() for n in lengths)
    max_len = max(longest, a.decode_context + a.decode_new + 1) + 64
    chunk = a.chunk or max(longest, a.decode_context)
    g = torch.Generator().manual_seed(a.seed)
    engines, info = {}, {}
    for name, (ckpt, lengths) in plan.items():
        try:
            engine, info[name] = warmed_engine(ckpt, max_len, chunk, not a.no_compile, lengths, a, g)
            engines[name] = (*engine, lengths)
        except Exception as e:  # noqa: BLE001 - one format failing leaves the others to measure
            info[name] = dict(error=f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
    emit({"ready": info, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        out = {}
        for name, (e, rand, lengths) in engines.items():
            pre = {}
            for n in lengths:
                prefill(e, rand(n))  # the warm-up run, as llama-bench's before each timed prompt
                pre[str(n)] = prefill(e, rand(n))
            out[name] = dict(prefill=pre, decode=decode(e, rand(a.decode_context), a.decode_new))
        emit(out)


if __name__ == "__main__":
    main()
