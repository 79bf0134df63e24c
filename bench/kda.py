"""Benchmark k3's chunk_kda against the torch fallback of HF transformers' Kimi Linear KDA (CPU, fp32).

    python bench/kda.py                      # B=1, T=4096, H=4, K=V=64, C=64
    python bench/kda.py --md kda.md
    python bench/kda.py --json out.json      # the numbers, machine-readable (for `k3 bench`)

Reports forward (no grad) and forward+backward wall times (best and median of N), the speedup over
`transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention` (its pure-torch path;
fla is not installed), the agreement of outputs and gradients, and GFLOP/s with the Kimi Linear report's
per-head count 6 T d^2 + 3 T C d + T C^2 (x B H) as a fraction of an fp32 torch.matmul peak measured in
the same run. transformers is a bench-only dependency (`pip install -e '.[bench]'`).
"""

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from k3.benchmark.result import figure, write_result
from k3.ops.kda import chunk_kda


def timeit(fn, reps: int, warmup: int = 1):
    """-> ((best, median) wall seconds over `reps` calls after `warmup` calls, the last result)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return (min(times), statistics.median(times)), out


def matmul_peak(reps: int = 5) -> tuple[float, int]:
    """Best fp32 torch.matmul GFLOP/s over square sizes 1024-2048 -> (GFLOP/s, size)."""
    best = (0.0, 0)
    for n in (1024, 1536, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        (t, _), _ = timeit(lambda a=a, b=b: a @ b, reps, warmup=2)
        best = max(best, (2 * n**3 / t / 1e9, n))
    return best


def kda_flops(B, T, H, d, C) -> float:
    return B * H * (6 * T * d * d + 3 * T * C * d + T * C * C)


def hf_fallback():
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    fn = m.chunk_kimi_delta_attention
    return getattr(fn, "__wrapped__", fn)  # the decorator would route to fla/hub kernels if present


def make_inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))  # the K3 safe gate, in (-5, 0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return q, k, v, g, beta


def fwd_bwd(fn, inputs, do):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o = fn(*leaves)
    o.backward(do)
    return o.detach(), [x.grad for x in leaves]


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--reps", type=int, default=10, help="timed calls of chunk_kda per measurement")
    p.add_argument("--hf-reps", type=int, default=2, help="timed calls of the (slow) HF fallback")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--md", help="also write the report (markdown) to this path")
    p.add_argument("--json", help="also write the numbers (JSON) to this path")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    B, T, H, K, C = a.B, a.T, a.H, a.K, a.chunk
    load = os.getloadavg()[0]
    inputs = make_inputs(B, T, H, K, K)
    do = torch.randn(B, T, H, K, generator=torch.Generator().manual_seed(1))
    hf = hf_fallback()

    def ours(*x):
        return chunk_kda(*x, chunk_size=C)[0]

    def theirs(*x):
        return hf(*x, chunk_size=C, use_qk_l2norm_in_kernel=True)[0]

    peak, peak_n = matmul_peak()
    with torch.no_grad():
        t_fwd, o = timeit(lambda: ours(*inputs), a.reps, warmup=2)
        t_hf_fwd, o_hf = timeit(lambda: theirs(*inputs), a.hf_reps)
    t_fb, (_, grads) = timeit(lambda: fwd_bwd(ours, inputs, do), a.reps, warmup=2)
    t_hf_fb, (_, grads_hf) = timeit(lambda: fwd_bwd(theirs, inputs, do), a.hf_reps, warmup=0)

    flops = kda_flops(B, T, H, K, C)
    gflops = flops / t_fwd[0] / 1e9
    grad_err = ", ".join(f"d{n} {rel(x, y):.1e}" for n, x, y in zip("qkvgb", grads, grads_hf, strict=True))
    lines = [
        f"command: `python {' '.join(sys.argv)}`",
        f"machine: {_cpu_name()}, nproc={os.cpu_count()}, "
        f"torch {torch.__version__} (threads={torch.get_num_threads()}), python {platform.python_version()}, "
        f"load average {load:.1f} at the start",
        f"shape: B={B} T={T} H={H} K=V={K} chunk={C}, fp32, gate -5*sigmoid(randn)",
        "",
        "| | k3 chunk_kda | HF torch fallback | speedup |",
        "|---|---|---|---|",
        _row("forward (no grad)", t_fwd, t_hf_fwd),
        _row("forward + backward", t_fb, t_hf_fb),
        "",
        f"agreement: output rel err {rel(o, o_hf):.2e}, max abs {float((o - o_hf).abs().max()):.2e}; "
        f"gradient rel err {grad_err}",
        f"forward FLOPs (6Td^2 + 3TCd + TC^2 per head): {flops / 1e9:.3f} GFLOP -> {gflops:.1f} GFLOP/s = "
        f"{100 * gflops / peak:.1f}% of the fp32 matmul peak {peak:.1f} GFLOP/s ({peak_n}x{peak_n})",
    ]
    report = "\n".join(lines)
    print(report)
    if a.md:
        with open(a.md, "w") as f:
            f.write("# KDA chunk benchmark\n\n" + report.replace("\n", "  \n", 3) + "\n")
    if a.json:
        agreement = {"o_rel": rel(o, o_hf)}
        agreement |= {f"d{n}_rel": rel(x, y) for n, x, y in zip("qkvgb", grads, grads_hf, strict=True)}
        times = (t_fwd, t_hf_fwd, t_fb, t_hf_fb)
        write_json(a.json, a, times, flops, gflops, (peak, peak_n), load, agreement)


def write_json(path, a, times, flops, gflops, peak, load, agreement) -> None:
    """The k3 bench result: speedups vs the HF fallback (goal >= 20x) and the fraction of the matmul
    peak (goal >= 25 %) as figures, the raw timings and the agreement beside them."""
    t_fwd, t_hf_fwd, t_fb, t_hf_fb = times
    shape = f"B={a.B} T={a.T} H={a.H} K=V={a.K}, fp32"
    ms = lambda t: {"best_ms": t[0] * 1e3, "median_ms": t[1] * 1e3}  # noqa: E731
    figures = [
        figure(f"chunk_kda forward ({shape})", t_fwd[0] * 1e3, "ms", peer="HF kimi_linear torch fallback",
               peer_value=t_hf_fwd[0] * 1e3, ratio=t_hf_fwd[0] / t_fwd[0], goal=20.0),
        figure("chunk_kda forward + backward", t_fb[0] * 1e3, "ms", peer="HF kimi_linear torch fallback",
               peer_value=t_hf_fb[0] * 1e3, ratio=t_hf_fb[0] / t_fb[0], goal=20.0),
        figure("chunk_kda forward GFLOP/s (6Td^2 + 3TCd + TC^2 per head)", gflops, "GFLOP/s",
               peer=f"fp32 torch.matmul peak ({peak[1]}x{peak[1]})", peer_value=peak[0],
               ratio=gflops / peak[0], goal=0.25),
    ]  # fmt: skip
    params = {"B": a.B, "T": a.T, "H": a.H, "K": a.K, "V": a.K, "chunk": a.chunk, "dtype": "float32",
              "threads": torch.get_num_threads()}  # fmt: skip
    machine = {"cpu": _cpu_name(), "nproc": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version(), "load_average_start": load}  # fmt: skip
    write_result(path, "kda", figures, params, machine=machine, flops_forward=flops,
                 forward={"k3": ms(t_fwd), "hf": ms(t_hf_fwd)},
                 forward_backward={"k3": ms(t_fb), "hf": ms(t_hf_fb)}, agreement=agreement)  # fmt: skip


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def _row(name: str, ours: tuple[float, float], theirs: tuple[float, float]) -> str:
    ms = lambda t: f"{t[0] * 1e3:.1f} / {t[1] * 1e3:.1f} ms"
    return f"| {name}, best / median | {ms(ours)} | {ms(theirs)} | {theirs[0] / ours[0]:.1f}x |"


if __name__ == "__main__":
    main()
