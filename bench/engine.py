"""Engine throughput vs transformers' KimiLinearForCausalLM at matched dims, in the same run.

Both models are random-init from one K3 config (HF gets `config.to_hf()` with hidden_act=silu, since
SiTU is ours; it has no AttnRes and full-width experts, so its parameter count differs -- printed).
Measured on the same inputs, best of 3 after a warm-up:
* prefill tokens/s at batch 1 (k3: a max_tokens=1 request without prefix cache; HF: one forward with
  use_cache=True);
* decode tokens/s at batch 1 (generation time minus the prefill time, over N new tokens);
* batch-B throughput (B equal-length prompts, N new tokens each; generated tokens / wall time).
Goals (issue 4): >= 5x prefill, >= 3x decode at batch 1, and batch-32 throughput vs HF generate.

    python bench/engine.py --preset k3-tiny --prompt 512 --new 32 --batch 32
"""

import argparse
import time

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


def timed(fn, repeat: int = 3) -> float:
    """Best of `repeat` runs after a warm-up (the least disturbed by other load on the machine)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def k3_run(model, prompts, new: int, max_len: int) -> None:
    cfg = EngineConfig(page_size=64, num_pages=-(-len(prompts) * max_len // 64) + len(prompts),
                       max_model_len=max_len, max_num_seqs=len(prompts), enable_prefix_cache=False,
                       max_num_batched_tokens=4096, max_prefill_chunk=4096)  # fmt: skip
    Engine(model, cfg).generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))


@torch.no_grad()
def hf_run(model, prompts, new: int) -> None:
    x = torch.tensor(prompts, device=model.device)
    if new <= 1:
        model(x, use_cache=True)
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
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    k3, hf, config = build(a.preset, getattr(torch, a.dtype), a.device)
    count = lambda m: sum(t.numel() for t in m.parameters()) / 1e6
    print(
        f"{a.preset}: k3 {count(k3):.1f}M params, HF KimiLinear {count(hf):.1f}M params, {a.dtype} {a.device}"
    )
    g = torch.Generator().manual_seed(0)
    one = [torch.randint(0, config.vocab_size - 300, (a.prompt,), generator=g).tolist()]
    max_len = a.prompt + a.new + 64
    rows = {}
    for name, run in (
        ("k3", lambda ps, n: k3_run(k3, ps, n, max_len)),
        ("hf", lambda ps, n: hf_run(hf, ps, n)),
    ):
        pre = timed(lambda run=run: run(one, 1))
        gen = timed(lambda run=run: run(one, a.new + 1))
        rows[name] = (a.prompt / pre, a.new / max(gen - pre, 1e-9))
    batch = [
        torch.randint(0, config.vocab_size - 300, (a.batch_prompt,), generator=g).tolist()
        for _ in range(a.batch)
    ]
    for name, run in (("k3", lambda: k3_run(k3, batch, a.new, a.batch_prompt + a.new + 64)),
                      ("hf", lambda: hf_run(hf, batch, a.new))):  # fmt: skip
        rows[name] += (a.batch * a.new / timed(run),)
    print(f"{'':4s} {'prefill tok/s':>14s} {'decode tok/s (B=1)':>19s} {f'batch-{a.batch} gen tok/s':>20s}")
    for name, (pre, dec, thr) in rows.items():
        print(f"{name:4s} {pre:14.0f} {dec:19.1f} {thr:20.1f}")
    (kp, kd, kt), (hp, hd, ht) = rows["k3"], rows["hf"]
    print(
        f"k3 / HF: prefill {kp / hp:.1f}x (goal >= 5x), decode {kd / hd:.1f}x (goal >= 3x), "
        f"batch-{a.batch} {kt / ht:.1f}x"
    )


if __name__ == "__main__":
    main()
