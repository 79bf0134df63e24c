"""Long-context prefill: peak memory and time vs the analytic memory curve.

Each (preset, prompt length L) runs in a fresh subprocess: build the random-init model and a random
prompt, reset the kernel's peak-RSS counter (`/proc/self/clear_refs` <- 5), then build an engine sized
for exactly L + 1 tokens (`k3 generate`'s `engine_config`: one sequence, no prefix cache) and prefill the
prompt in chunks of --chunk tokens (max_tokens=1). Measured: the prefill's wall time and its peak memory
above the RSS just before the engine existed (VmHWM - RSS; weights, interpreter and prompt excluded,
and a 3-chunk warm-up prefill ran before, so code pages and lazy inits count as baseline; its garbage is
collected and the heap trimmed before the baseline is read). The child runs with
MALLOC_MMAP_THRESHOLD_=64 KiB: glibc's default dynamic threshold keeps freed multi-MiB activations in the
heap, and RSS then tracks the allocator's high-water mark instead of live tensors (measured on k3-nano:
+28 MiB at 2K and +35 MiB at 8K tokens over a fixed 1 MiB threshold). At 1 MiB the heap still held the
many smaller tensors, and k3-nano's delta at 4K tokens varied from 3.9 to 16.4 MiB between identical
runs; at 64 KiB, with the trimmed baseline, three runs agreed within 0.35 MiB (14.1 / 14.3 / 13.9 MiB
at 4K, 16.0 / 16.1 / 16.0 at 16K: the difference is the cache's 1.9 MiB). Every allocation of 64 KiB
or more is then its own mapping, so the reported times include those page faults (k3-nano 16K: 2.8 vs
2.1 s).

The analytic curve of that delta (everything but the last term follows from the config):

    cache(L)   = ceil((L+1)/page) * page * (kv_lora_rank + qk_rope_head_dim) * n_mla_layers * bytes
    kda        = n_kda_layers * (3 * C * (W-1) * bytes + H * K * V * 4)       one slot's KDA state
    prompt     = 8 * L                                    the engine's own list of the prompt's ids
    act        = one chunk's activations: measured once per preset at L0 = --calib-chunks chunks
                 (delta(L0) - cache(L0) - kda - prompt(L0)), then held constant

Any remaining jitter is damped by repetition: every run that takes under --repeat-below seconds is
repeated (--repeats in all) and its median delta is the measurement, the calibration included; the
longer runs, whose deltas are tens of MiB, run once.

So the check is that memory grows by the latent cache and nothing else: at L >> L0 the measured delta
must stay within 10% of cache(L) + kda + prompt(L) + act (the goal at 64K on k3-nano). Totals (RSS
before + delta vs RSS before + analytic) are reported too. The streaming MLA path (k3.model.mla) is what
keeps `act` constant; k3-full's 1M-token figures come from `k3 plan` (docs/long_context.md).

    python bench/long_context.py --json runs/long_context.json          # full
    python bench/long_context.py --quick                                                  # < 3 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FULL = [("k3-nano", 16384), ("k3-nano", 65536), ("k3-nano", 262144), ("k3-tiny", 16384), ("k3-tiny", 65536)]
QUICK = [("k3-nano", 16384), ("k3-nano", 65536)]
MMAP_THRESHOLD = 1 << 16  # glibc: every allocation >= 64 KiB is its own mapping, unmapped when freed


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _settle() -> None:
    """Free the warm-up's garbage and hand the heap's free pages back to the kernel (glibc malloc_trim),
    so the baseline RSS does not depend on what the warm-up happened to leave in the heap."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline is just noisier
        pass


def child(preset_name: str, L: int, chunk: int, page_size: int) -> dict:
    """Runs in the fresh subprocess: one prefill of L tokens -> measurements (bytes, seconds)."""
    import torch

    from k3.config import preset
    from k3.infer.engine import Engine
    from k3.infer.sequence import SamplingParams
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM

    torch.manual_seed(0)
    config = preset(preset_name)
    model = K3ForCausalLM(config)
    init_weights(model, config.initializer_range, config.num_hidden_layers, seed=0)
    model = model.to(getattr(torch, config.dtype)).eval()
    prompt = torch.randint(0, config.vocab_size, (L,), generator=torch.Generator().manual_seed(1)).tolist()
    warm = prompt[: 3 * chunk]  # code pages and lazy inits of both MLA paths belong to the baseline
    Engine(model, measured_config(len(warm), chunk, page_size)).generate([warm], SamplingParams(max_tokens=1))
    _settle()
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS := current RSS
        f.write("5")
    before = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    engine = Engine(model, measured_config(L, chunk, page_size))
    t_alloc = time.perf_counter() - t0
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    t_total = time.perf_counter() - t0
    peak = _status_kib("VmHWM") * 1024
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(
        preset=preset_name,
        tokens=L,
        chunk=chunk,
        page_size=page_size,
        rss_before=before,
        peak=peak,
        delta=peak - before,
        weights=weights,
        seconds=t_total - t_alloc,
        alloc_seconds=t_alloc,
        threads=torch.get_num_threads(),
    )


def analytic_terms(preset_name: str, L: int, page_size: int) -> dict:
    """The config-determined terms of the curve (bytes)."""
    import torch

    from k3.config import preset

    c = preset(preset_name)
    nbytes = torch.empty(0, dtype=getattr(torch, c.dtype)).element_size()
    n_mla = sum(not c.is_kda_layer(i) for i in range(c.num_hidden_layers))
    n_kda = c.num_hidden_layers - n_mla
    la = c.linear_attn_config
    C, W, H, K = la.num_heads * la.head_dim, la.short_conv_kernel_size, la.num_heads, la.head_dim
    rows = -(-(L + 1) // page_size) * page_size
    return dict(
        cache=rows * (c.kv_lora_rank + c.qk_rope_head_dim) * n_mla * nbytes,
        kda=n_kda * (3 * C * (W - 1) * nbytes + H * K * K * 4),
        prompt=8 * L,
        latent_bytes_per_token=(c.kv_lora_rank + c.qk_rope_head_dim) * n_mla * nbytes,
    )


def measured_config(L: int, chunk: int, page_size: int):
    """`k3 generate`'s config for L + 1 tokens with the engine's heap thresholds left alone: the child's
    MALLOC_MMAP_THRESHOLD_ must hold, or freed activations would stay in RSS and count as growth."""
    import dataclasses

    from k3.infer.generate_cli import engine_config

    return dataclasses.replace(engine_config(L, 1, chunk, page_size), keep_freed_memory=False)


def run_child(preset_name: str, L: int, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        preset_name,
        str(L),
        "--chunk",
        str(args.chunk),
        "--page-size",
        str(args.page_size),
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{preset_name} L={L}: child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(preset_name: str, L: int, args) -> dict:
    """`run_child`, repeated while cheap (see the module docstring) -> its result with the median delta
    (and the fastest time); `deltas` lists every run's."""
    runs = [run_child(preset_name, L, args)]
    if runs[0]["seconds"] < args.repeat_below:
        runs += [run_child(preset_name, L, args) for _ in range(args.repeats - 1)]
    deltas = sorted(r["delta"] for r in runs)
    best = min(runs, key=lambda r: r["seconds"])
    return dict(best, delta=deltas[len(deltas) // 2], deltas=deltas)


def mib(x: float) -> float:
    return x / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, metavar=("PRESET", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    p.add_argument("--runs", help="PRESET:TOKENS,... (default: the full list)")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--calib-chunks", type=int, default=4, help="L0 = this many chunks")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement while they are cheap")
    p.add_argument("--repeat-below", type=float, default=30.0, help="repeat runs shorter than this (s)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", help="write the result here (k3 bench format)")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.chunk, args.page_size)))
        return 0
    runs = QUICK if args.quick else FULL
    if args.runs:
        runs = [(r.split(":")[0], int(r.split(":")[1])) for r in args.runs.split(",")]
    rows, act = [], {}
    for name in dict.fromkeys(n for n, _ in runs):
        L0 = args.calib_chunks * args.chunk
        m = measure(name, L0, args)
        t = analytic_terms(name, L0, args.page_size)
        act[name] = m["delta"] - t["cache"] - t["kda"] - t["prompt"]
        print(
            f"{name}: calibration at L0={L0}: delta {mib(m['delta']):.1f} MiB, act {mib(act[name]):.1f} MiB",
            flush=True,
        )
    for name, L in runs:
        m = measure(name, L, args)
        t = analytic_terms(name, L, args.page_size)
        analytic = t["cache"] + t["kda"] + t["prompt"] + act[name]
        row = dict(
            m,
            **t,
            act=act[name],
            analytic=analytic,
            ratio=m["delta"] / analytic,
            total_ratio=(m["rss_before"] + m["delta"]) / (m["rss_before"] + analytic),
            tokens_per_s=L / m["seconds"],
        )
        rows.append(row)
        print(
            f"{name} L={L:>7}: prefill {m['seconds']:7.1f} s ({row['tokens_per_s']:6.0f} tok/s)  "
            f"peak delta {mib(m['delta']):7.1f} MiB vs analytic {mib(analytic):7.1f} MiB "
            f"(cache {mib(t['cache']):.1f} + act {mib(act[name]):.1f} + kda/prompt "
            f"{mib(t['kda'] + t['prompt']):.1f}) ratio {row['ratio']:.3f}; "
            f"total {mib(m['rss_before'] + m['delta']):.0f} MiB, ratio {row['total_ratio']:.3f}",
            flush=True,
        )
        if args.json:  # after every run, so a long run interrupted still leaves what it measured
            write_json(args, rows, act)
    return 0


def write_json(args, rows: list[dict], act: dict) -> None:
    figures = []
    for r in rows:
        figures.append(
            dict(
                figure=f"{r['preset']} prefill {r['tokens'] // 1024}K: peak memory above the weights",
                value=round(mib(r["delta"]), 2),
                unit="MiB",
                peer="analytic: latent cache + 1 chunk",
                peer_value=round(mib(r["analytic"]), 2),
                ratio=round(r["ratio"], 4),
                goal=0.1,
                goal_op="~",
            )
        )
        figures.append(
            dict(
                figure=f"{r['preset']} prefill {r['tokens'] // 1024}K: time",
                value=round(r["seconds"], 2),
                unit="s",
                peer=None,
                peer_value=None,
                ratio=None,
                goal=None,
            )
        )
    plots = []
    for name in act:
        rs = [r for r in rows if r["preset"] == name]
        xs = [r["tokens"] for r in rs]
        plots.append(
            dict(
                name=f"memory_{name}",
                title=f"{name}: chunked-prefill peak memory above the weights",
                xlabel="prompt tokens",
                ylabel="MiB",
                logx=True,
                series=[
                    dict(label="measured", x=xs, y=[mib(r["delta"]) for r in rs], style="o-"),
                    dict(label="analytic", x=xs, y=[mib(r["analytic"]) for r in rs], style="s--"),
                    dict(label="latent cache alone", x=xs, y=[mib(r["cache"]) for r in rs], style=":"),
                ],
            )
        )
    out = dict(
        bench="long_context",
        figures=figures,
        plots=plots,
        runs=rows,
        act_bytes=act,
        params=dict(
            chunk=args.chunk,
            page_size=args.page_size,
            calib_chunks=args.calib_chunks,
            quick=args.quick,
            threads=os.environ.get("OMP_NUM_THREADS"),
        ),
    )
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
