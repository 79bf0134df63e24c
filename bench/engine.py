"""Engine throughput vs transformers' KimiLinearForCausalLM at matched dims, in the same run.

Both models are random-init from one K3 config (HF gets `config.to_hf()` with hidden_act=silu, since
SiTU is ours; it has no AttnRes and full-width experts, so its parameter count differs -- printed).
Measured on the same inputs, best of 3 after a warm-up, the sides taking turns run by run (a slow spell
of a shared machine then falls on all of them):
* prefill tokens/s at batch 1 (k3: a max_tokens=1 request without prefix cache; HF: one forward with
  use_cache=True and logits_to_keep=1, as its generate's prefill);
* decode tokens/s at batch 1 (generation time minus the prefill time, over N new tokens);
* batch-B throughput (B equal-length prompts, N new tokens each; generated tokens / wall time).
Goals: >= 5x prefill, >= 3x decode at batch 1, and batch-32 throughput vs HF generate.
k3 runs its engine as a server would: one engine per shape, kept across the repeats, with the batch-1
decode step compiled and the prefill activations fused (`EngineConfig.compile`; `--no-compile` for the
eager engine; with compiling on, an eager `k3-eager` row is measured beside it). The compile time (once
per engine) is printed, not counted in the rates.
Every timing is kept twice: wall clock (the headline) and this process's CPU time (steadier on a shared
machine: time other processes take from ours does not count), each the best of its repeats.

    python bench/engine.py --preset k3-tiny --prompt 512 --new 32 --batch 32   # docs/benchmarks.md
    python bench/engine.py --json out.json    # + the figures in the `k3 bench` format and the machine
"""

import argparse
import time
from pathlib import Path

import torch

from k3.config import preset
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.sequence import SamplingParams
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM


def build(name: str, dtype: torch.dtype, device: str):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = preset(name).replace(dtype=str(dtype).removeprefix("torch."))
    k3 = K3ForCausalLM(config)
    init_weights(k3, config.initializer_range, config.num_hidden_layers, seed=0)
    hf_cfg = {**config.to_hf(), "hidden_act": "silu"}
    hf = KimiLinearForCausalLM(KimiLinearConfig(**hf_cfg))
    return k3.to(device, dtype).eval(), hf.to(device, dtype).eval(), config


def timed(fns: dict, repeat: int = 3) -> dict[str, tuple[float, float]]:
    """name -> (wall, CPU) seconds of each fn, the best of `repeat` runs after a warm-up (the least
    disturbed by other load on the machine). The fns take turns run by run, so a slow spell of a shared
    machine falls on every side rather than on whichever ran then."""
    for fn in fns.values():
        fn()
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def decode_rate(tokens: int, seconds: float) -> float:
    """tokens / seconds; NaN when noise made the generation no slower than the prefill alone."""
    return tokens / seconds if seconds > 0 else float("nan")


class K3Runner:
    """k3's side: one Engine per (batch, max_len), made on first use and kept, as a server keeps its
    engine (a compiled decode step is compiled once per engine; `compile_seconds` sums them)."""

    def __init__(self, model, compile: bool):
        self.model, self.compile, self.engines = model, compile, {}

    def __call__(self, prompts, new: int, max_len: int) -> None:
        key = (len(prompts), max_len)
        if key not in self.engines:
            cfg = EngineConfig(page_size=64, num_pages=-(-len(prompts) * max_len // 64) + len(prompts),
                               max_model_len=max_len, max_num_seqs=len(prompts), enable_prefix_cache=False,
                               max_num_batched_tokens=4096, max_prefill_chunk=4096,
                               compile=self.compile)  # fmt: skip
            self.engines[key] = Engine(self.model, cfg)
        self.engines[key].generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))

    @property
    def compile_seconds(self) -> float:
        return sum(e.runner.decode.torch.compile_seconds or 0.0 for e in self.engines.values())


@torch.no_grad()
def hf_run(model, prompts, new: int) -> None:
    x = torch.tensor(prompts, device=model.device)
    if new <= 1:  # the prefill as HF's generate runs it: logits of the last position only
        model(x, use_cache=True, logits_to_keep=1)
    else:
        model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-prompt", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="k3: EngineConfig.compile (compiled batch-1 decode, fused activations; default on)",
    )
    p.add_argument("--json", type=Path, help="write the figures (k3 bench format) and the machine here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    k3, hf, config = build(a.preset, getattr(torch, a.dtype), a.device)
    count = lambda m: sum(t.numel() for t in m.parameters()) / 1e6
    params_m = {"k3": count(k3), "hf": count(hf)}
    print(
        f"{a.preset}: k3 {params_m['k3']:.1f}M params, HF KimiLinear {params_m['hf']:.1f}M params, "
        f"{a.dtype} {a.device}, {torch.get_num_threads()} threads"
    )
    g = torch.Generator().manual_seed(0)
    one = [torch.randint(0, config.vocab_size - 300, (a.prompt,), generator=g).tolist()]
    max_len = a.prompt + a.new + 64
    batch = [
        torch.randint(0, config.vocab_size - 300, (a.batch_prompt,), generator=g).tolist()
        for _ in range(a.batch)
    ]
    k3_runner = K3Runner(k3, a.compile)
    runs = {
        "k3": lambda ps, n, m=max_len: k3_runner(ps, n, m),
        "hf": lambda ps, n, m=None: hf_run(hf, ps, n),
    }
    if a.compile:  # the eager engine beside it, for reference (not a headline figure)
        eager = K3Runner(k3, False)
        runs["k3-eager"] = lambda ps, n, m=max_len: eager(ps, n, m)
    rates = {}  # name -> clock -> (prefill tok/s, decode tok/s at B=1, batch gen tok/s)
    pre = timed({name: lambda run=run: run(one, 1) for name, run in runs.items()})
    gen = timed({name: lambda run=run: run(one, a.new + 1) for name, run in runs.items()})
    thr = timed(
        {name: lambda run=run: run(batch, a.new, a.batch_prompt + a.new + 64) for name, run in runs.items()}
    )
    for name in runs:
        t_pre, t_gen, t_thr = pre[name], gen[name], thr[name]
        rates[name] = {
            clock: (a.prompt / t_pre[i], decode_rate(a.new, t_gen[i] - t_pre[i]), a.batch * a.new / t_thr[i])
            for i, clock in enumerate(("wall", "cpu"))
        }
    cols = ("prefill tok/s", "decode tok/s (B=1)", f"batch-{a.batch} gen tok/s")
    for clock in ("wall", "cpu"):
        print(f"{clock:10s} {cols[0]:>9s} {cols[1]:>19s} {cols[2]:>20s}")
        for name in runs:
            pre, dec, thr = rates[name][clock]
            print(f"  {name:8s} {pre:9.0f} {dec:19.1f} {thr:20.1f}")
    if a.compile:
        secs = k3_runner.compile_seconds
        print(f"k3: decode compiled once per engine ({secs:.0f} s in all); k3-eager: the same engine without")
    ratio = {c: [k / h for k, h in zip(rates["k3"][c], rates["hf"][c], strict=True)] for c in ("wall", "cpu")}
    (rp, rd, rt), (cp, cd, ct) = ratio["wall"], ratio["cpu"]
    print(
        f"k3 / HF (wall): prefill {rp:.1f}x (goal >= 5x), decode {rd:.1f}x (goal >= 3x), batch-{a.batch} "
        f"{rt:.1f}x;  CPU time: {cp:.1f}x, {cd:.1f}x, {ct:.1f}x"
    )
    if a.json:
        write_json(a, rates, params_m, k3_runner.compile_seconds)


def write_json(a, rates: dict, params_m: dict, compile_seconds: float) -> None:
    from k3.benchmark.report import machine_info
    from k3.benchmark.result import figure, write_result

    names = (
        (f"prefill tok/s, batch 1, {a.prompt} tokens", 5.0),
        ("decode tok/s, batch 1", 3.0),
        (f"batch-{a.batch} generation tok/s ({a.batch_prompt}-token prompts, {a.new} new)", None),
    )
    figures = []
    for i, (name, goal) in enumerate(names):
        k, h = rates["k3"]["wall"][i], rates["hf"]["wall"][i]
        kc, hc = rates["k3"]["cpu"][i], rates["hf"]["cpu"][i]
        figures.append(
            figure(
                name,
                k,
                "tok/s",
                peer="HF KimiLinear",
                peer_value=h,
                ratio=k / h,
                goal=goal,
                cpu_time=dict(value=kc, peer_value=hc, ratio=kc / hc),
            )  # fmt: skip
        )
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "json"}
    params["torch_threads"] = torch.get_num_threads()
    params["compile_seconds"] = compile_seconds
    write_result(a.json, "engine", figures, params, rates=rates, params_m=params_m,
                 machine=machine_info(Path(__file__).resolve().parent.parent))  # fmt: skip


if __name__ == "__main__":
    main()
