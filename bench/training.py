"""Training throughput and MFU: optimizer steps of k3-mini on random tokens vs a torch.matmul peak.

The steps are the trainer's own (`k3.train.step.train_step`: forward, backward, grad clip, Per-Head
Muon + AdamW, QK-Clip, Quantile Balancing), on the `k3 train` demo's model and batch shape (k3-mini,
16 x 256 tokens, one document per row) with random token ids -- the data does not change the work.
The FLOPs per token are the trainer's accounting (`k3.train.metrics.flops_per_token`,
docs/training.md), and the peak is the best square fp32 `torch.matmul` rate measured in this process
(`measure_matmul_peak`), so

    MFU = FLOPs/token x tokens/s / peak          ("100 %" = what this CPU's BLAS reaches on a big GEMM)

Also reported: the same MFU for forward + backward alone (no optimizer step), which separates the model
math from Muon's Newton-Schulz iterations (not counted as model FLOPs).

    python bench/training.py                                # k3-mini, 16 x 256, 2 warm-up + 6 timed steps
    python bench/training.py --quick --json out.json        # the same, 1 + 2 steps

Goals (the demo's shapes, 2 threads): whole-step MFU >= 35 %, forward + backward alone >= 45 %.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from k3.benchmark.result import figure, write_result
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM
from k3.train.config import TrainConfig
from k3.train.metrics import flops_per_token, measure_matmul_peak
from k3.train.param_groups import build_optimizers
from k3.train.step import MaxLogitMonitor, forward_loss, train_step

QUICK = ("--warmup", "1", "--steps", "2", "--fwd-bwd", "1")  # later flags override these
STEP_MFU_GOAL, FWD_BWD_MFU_GOAL = 0.35, 0.45  # at the demo's shapes on 2 threads (docs/training.md)


def random_batch(B: int, T: int, vocab: int, gen: torch.Generator) -> dict:
    """One micro-batch in the packed-loader format, one document per row: input_ids, labels [B, T]."""
    ids = torch.randint(0, vocab - 256, (B, T + 1), generator=gen)  # below the reserved block
    return dict(
        input_ids=ids[:, :-1].contiguous(),
        labels=ids[:, 1:].contiguous(),
        cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int64),
        doc_ids=torch.arange(B, dtype=torch.int64)[:, None].expand(B, T).contiguous(),
    )


def build(tc: TrainConfig):
    config = tc.model_config()
    model = K3ForCausalLM(config)
    init_weights(model, config.initializer_range, config.num_hidden_layers, seed=tc.seed)
    model.train()
    opts = build_optimizers(model, **tc.optimizer_options())
    return model, config, opts


def timed_steps(fn, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="k3-mini")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    p.add_argument("--fwd-bwd", type=int, default=3, help="timed forward+backward passes without a step")
    p.add_argument("--optimizer", default="muon", choices=("muon", "adamw"))
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (and a bf16 matmul peak)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the figures (k3 bench format) to this file")
    p.add_argument("--quick", action="store_true", help=f"fewer steps: {' '.join(QUICK)}")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    if a.quick:  # the quick settings, then the command line again (an explicit flag wins)
        a = p.parse_args([*QUICK, *argv])
    for key in ("seq_len", "batch", "steps"):
        if getattr(a, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')}: must be >= 1, got {getattr(a, key)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tc = TrainConfig(
        preset=a.preset,
        seq_len=a.seq_len,
        batch_size=a.batch,
        optimizer=a.optimizer,
        bf16=a.bf16,
        seed=a.seed,
    )
    model, config, opts = build(tc)
    monitor = MaxLogitMonitor(model)
    gen = torch.Generator().manual_seed(a.seed)
    tokens = a.batch * a.seq_len

    def step():
        res = train_step(
            model,
            [random_batch(a.batch, a.seq_len, config.vocab_size, gen)],
            opts,
            grad_clip=tc.grad_clip,
            bf16=tc.bf16,
            monitor=monitor,
            qk_clip_tau=tc.qk_clip_tau,
        )
        if res.skipped:
            raise RuntimeError(f"training step skipped (loss {res.loss}, grad norm {res.grad_norm})")

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        forward_loss(model, random_batch(a.batch, a.seq_len, config.vocab_size, gen), tc.bf16).backward()
        monitor.pop()

    dtype = torch.bfloat16 if a.bf16 else torch.float32
    peak = measure_matmul_peak(dtype, seconds=1.5)
    step_s = timed_steps(step, a.warmup, a.steps)
    fb_s = timed_steps(fwd_bwd, 1, a.fwd_bwd) if a.fwd_bwd else []
    peak = max(peak, measure_matmul_peak(dtype, seconds=1.5))  # before and after: the less disturbed one

    flops = flops_per_token(model, config, a.seq_len)
    med = statistics.median(step_s)
    tok_s = tokens / med
    n_params = sum(q.numel() for q in model.parameters())
    print(
        f"{a.preset}: {n_params / 1e6:.1f}M params, batch {a.batch} x {a.seq_len}, {a.optimizer}, "
        f"{'bf16' if a.bf16 else 'fp32'}, {torch.get_num_threads()} thread(s)"
    )
    print(
        f"step times (s): {', '.join(f'{t:.2f}' for t in step_s)}; median {med:.2f} s -> {tok_s:,.0f} tok/s"
    )
    print(
        f"FLOPs/token {flops['total'] / 1e6:.1f} M (dense {flops['dense'] / 1e6:.1f}, "
        f"mla {flops['mla'] / 1e6:.1f}, kda {flops['kda'] / 1e6:.1f}); matmul peak {peak / 1e9:.1f} GFLOP/s"
    )
    mfu = flops["total"] * tok_s / peak
    print(f"MFU (whole step) {100 * mfu:.1f} %")
    figures = [
        figure(
            f"MFU of a training step ({a.preset}, {a.batch}x{a.seq_len}, {a.optimizer})",
            flops["total"] * tok_s / 1e9,
            "GFLOP/s",
            peer="fp32 torch.matmul peak" if not a.bf16 else "bf16 torch.matmul peak",
            peer_value=peak / 1e9,
            goal=STEP_MFU_GOAL,
            tokens_per_s=tok_s,
        ),
    ]
    fb_med = statistics.median(fb_s) if fb_s else None
    if fb_med:
        fb_mfu = flops["total"] * tokens / fb_med / peak
        print(f"forward+backward alone: median {fb_med:.2f} s -> MFU {100 * fb_mfu:.1f} %")
        figures.append(
            figure(
                "MFU of forward + backward alone (no optimizer step)",
                flops["total"] * tokens / fb_med / 1e9,
                "GFLOP/s",
                peer="same matmul peak",
                peer_value=peak / 1e9,
                goal=FWD_BWD_MFU_GOAL,
                tokens_per_s=tokens / fb_med,
            )
        )
    figures.insert(0, figure("training tokens/s", tok_s, "tok/s"))
    if a.json:
        params = {k: v for k, v in vars(a).items() if k != "json"}
        params.update(threads_used=torch.get_num_threads(), params=n_params)
        write_result(
            a.json,
            "training",
            figures,
            params,
            step_seconds=step_s,
            fwd_bwd_seconds=fb_s,
            flops_per_token=flops,
            peak_flops=peak,
            mfu=mfu,
        )


if __name__ == "__main__":
    main()
