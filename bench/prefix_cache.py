"""Prefix-cache benchmark: replay a multi-turn coding-agent session and measure reuse and TTFT.

Each turn's prompt is the whole conversation so far (previous prompt + the model's output) + a tool
output + a new user message, so the ideal cache serves everything but the new text. The session runs
>= 10 turns and grows past 8K tokens. Conversation text is synthetic token ids (the cache works on ids;
a harness that re-renders earlier turns exactly, as preserved thinking does, produces the same ids).

Reported:
* reuse = cached prompt tokens / the theoretical ceiling, where the ceiling of a turn is its longest
  common prefix with any earlier request's prompt + output, at most P - 1 (the last prompt token must
  be computed to get logits); goal >= 95 %;
* time to first token at the last turn with the cache (warm, after the session) vs without; goal >= 10x.
  Each side is the best of `--repeats` runs (as bench/engine.py takes the best of 3): the real last turn,
  then variants with different new text of the same length after the same conversation, so every cache-on
  run hits the same prefix (a repeat of one prompt would find its own tail cached); the cache-off engine
  runs the same prompts, each right after its cache-on run (on and off alternate, so a slow spell of a
  shared machine falls on both sides). Every run is printed.

    python bench/prefix_cache.py --preset k3-tiny --turns 12 --target-tokens 8500
    python bench/prefix_cache.py --quick --json out.json   # 10 turns to ~2K tokens (a smoke run)

--json writes the figures in the `k3 bench` format (k3/benchmark/result.py) plus the per-turn rows.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from k3.benchmark.result import figure, write_result
from k3.config import preset
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM


def build_model(name: str, dtype: str, device: str):
    config = preset(name).replace(dtype=dtype)
    model = K3ForCausalLM(config)
    init_weights(model, config.initializer_range, config.num_hidden_layers, seed=0)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


def session_turns(turns: int, target: int, vocab: int, out_tokens: int, seed: int) -> list[list[int]]:
    """New tokens per turn (tool output + user message) so the final prompt reaches about `target`."""
    g = torch.Generator().manual_seed(seed)
    per_turn = max(16, (target - turns * out_tokens) // turns)
    sizes = [int(per_turn * (0.5 + torch.rand(1, generator=g).item())) for _ in range(turns)]
    return [torch.randint(0, vocab - 300, (n,), generator=g).tolist() for n in sizes]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def time_to_first_token(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not seq.output:
        engine.step()
    return time.perf_counter() - t0


QUICK = ("--turns", "10", "--target-tokens", "2000", "--out-tokens", "16")  # later flags override these


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--target-tokens", type=int, default=8500)
    p.add_argument("--out-tokens", type=int, default=48, help="generated tokens per turn")
    p.add_argument("--unit", type=int, default=64, help="prefix-match unit (and page size)")
    p.add_argument("--chunk", type=int, default=1024, help="max prefill chunk")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="TTFT runs per side (best taken)")
    p.add_argument("--json", type=Path, help="write the figures (k3 bench format) to this file")
    p.add_argument("--quick", action="store_true", help=f"small settings: {' '.join(QUICK)}")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    if a.quick:  # the quick settings, then the command line again (an explicit flag wins)
        a = p.parse_args([*QUICK, *argv])
    if a.threads:
        torch.set_num_threads(a.threads)
    model = build_model(a.preset, a.dtype, a.device)
    max_len = a.target_tokens * 2 + 1024
    pages = -(-2 * max_len // a.unit)
    cfg = EngineConfig(page_size=a.unit, prefix_unit=a.unit, num_pages=pages, max_model_len=max_len,
                       max_prefill_chunk=a.chunk, max_num_batched_tokens=a.chunk)  # fmt: skip
    engine = Engine(model, cfg)
    convo, seen, ceiling, rows = [], [], 0, []
    params = SamplingParams(max_tokens=a.out_tokens, ignore_eos=True)
    new = session_turns(a.turns, a.target_tokens, model.config.vocab_size, a.out_tokens, a.seed)
    for t, extra in enumerate(new[:-1]):
        convo = convo + extra
        ceil_t = min(len(convo) - 1, max((common_prefix(convo, s) for s in seen), default=0))
        t0 = time.perf_counter()
        (seq,) = engine.generate([convo], params)
        dt = time.perf_counter() - t0
        ceiling += ceil_t
        row = f"prompt {len(convo):6d}  cached {seq.cached_tokens:6d}  ceiling {ceil_t:6d}  {dt:6.2f}s"
        print(f"turn {t + 1:2d}: {row}")
        rows.append(dict(turn=t + 1, prompt=len(convo), cached=seq.cached_tokens, ceiling=ceil_t, seconds=dt))
        seen.append(convo + seq.output)
        convo = convo + seq.output
    last = convo + new[-1]
    ceil_t = min(len(last) - 1, max(common_prefix(last, s) for s in seen))
    g = torch.Generator().manual_seed(a.seed + 1)
    variants = [last] + [  # same conversation, other new text of the same length
        convo + torch.randint(0, model.config.vocab_size - 300, (len(new[-1]),), generator=g).tolist()
        for _ in range(a.repeats - 1)
    ]
    off = Engine(model, EngineConfig(**{**cfg.__dict__, "enable_prefix_cache": False}))
    on_runs, off_runs, total_hits = [], [], 0
    for i, v in enumerate(variants):  # on and off alternate: a slow spell of the machine hits both sides
        on_runs.append(time_to_first_token(engine, v))
        if i == 0:  # every turn's cached prompt tokens, the last included
            total_hits = engine.scheduler.cache.hit_tokens
        off_runs.append(time_to_first_token(off, v))
    ttft_on, ttft_off = min(on_runs), min(off_runs)
    total_ceiling = ceiling + ceil_t
    print(f"turn {a.turns:2d}: prompt {len(last):6d}  ceiling {ceil_t:6d}  (TTFT turn)")
    print(
        "TTFT runs (ms): cache on " + " ".join(f"{t * 1e3:.0f}" for t in on_runs)
        + ", off " + " ".join(f"{t * 1e3:.0f}" for t in off_runs)
    )  # fmt: skip
    pct = 100 * total_hits / max(1, total_ceiling)
    print(f"reuse: {total_hits} / {total_ceiling} ceiling tokens = {pct:.1f}% of the ceiling (goal >= 95%)")
    print(
        f"TTFT at the last turn ({len(last)} tokens, best of {a.repeats}): cache on {ttft_on * 1e3:.0f} ms, "
        f"off {ttft_off * 1e3:.0f} ms, {ttft_off / ttft_on:.1f}x (goal >= 10x)"
    )
    if a.json:
        figures = [
            figure("cached prompt tokens (whole session)", total_hits, "tokens", peer="theoretical ceiling",
                   peer_value=total_ceiling, goal=0.95),
            figure(f"TTFT at the last turn ({len(last)} tokens)", ttft_on, "s", peer="cache off",
                   peer_value=ttft_off, ratio=ttft_off / ttft_on, goal=10),
        ]  # fmt: skip
        turns = [r["turn"] for r in rows]
        plots = [
            dict(name="turns", title=f"prefix cache: {a.preset}, {a.turns}-turn session",
                 xlabel="turn", ylabel="tokens", series=[
                     dict(label="prompt", x=turns, y=[r["prompt"] for r in rows], style="o-"),
                     dict(label="ceiling", x=turns, y=[r["ceiling"] for r in rows], style="s--"),
                     dict(label="cached", x=turns, y=[r["cached"] for r in rows], style="x-")]),
        ]  # fmt: skip
        params = {k: v for k, v in vars(a).items() if k != "json"}
        write_result(a.json, "prefix_cache", figures, params, turns=rows, plots=plots,
                     ttft={"on": ttft_on, "off": ttft_off, "tokens": len(last), "on_runs": on_runs,
                           "off_runs": off_runs})  # fmt: skip


if __name__ == "__main__":
    main()
