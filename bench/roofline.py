"""Decode roofline: the machine's read bandwidth and the bytes one decode token must touch.

    python bench/roofline.py --preset k3-small --context 640 [--threads 2]

A decode token at batch 1 reads every active weight once (nothing is reused across tokens that a cache
could keep, once the model is larger than the cache), so tokens/s <= read bandwidth / bytes per token.

Bandwidth: a STREAM-style read kernel, the sum of a buffer much larger than the last-level cache (64-bit
integer adds, so the compiler vectorizes the reduction without reassociating floats), compiled at run
time with `cc -O3 -march=native -fopenmp` and run on 1 and 2 threads; numpy's sum over the same size is
measured beside it (one thread) and the faster of the two is the figure, as the roofline must not be
lowered by a slow kernel.

Bytes per token (`k3_bytes` from a model's state_dict, `gguf_bytes` from a GGUF file's own tensor
sizes, so each side is charged for its own storage format):
* active weights: every tensor in full, except the routed experts (top_k of E selected per MoE layer:
  k/E of the stacked tensors) and the token embedding (one row; in full when it is also the head);
* KDA state: per KDA layer the recurrent state [H, K, V] fp32 read and written, and the short-conv
  windows [3 H K, W-1] read and written;
* MLA latents: per MLA layer `context` rows of kv_lora_rank + qk_rope_head_dim read, one row written
  (k3: the model dtype; llama.cpp: its F16 K cache, whose view is also V).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

_KERNEL = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
/* Fill n uint64 words, each thread touching the part it will read (first-touch placement). */
void fill(uint64_t *a, size_t n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = i;
}
/* Sum of the buffer: every byte read once, nothing written. */
uint64_t sum(const uint64_t *a, size_t n, int threads) {
    uint64_t s = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(+:s)
    for (size_t i = 0; i < n; i++) s += a[i];
    return s;
}
"""


def _compile_kernel(tmp: Path) -> ctypes.CDLL:
    src, lib = tmp / "read_bw.c", tmp / "read_bw.so"
    src.write_text(_KERNEL)
    cmd = ["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True)
    dll = ctypes.CDLL(str(lib))
    dll.fill.argtypes = dll.sum.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    dll.sum.restype = ctypes.c_uint64
    return dll


def read_bandwidth(threads: tuple[int, ...] = (1, 2), gib: float = 2.0, passes: int = 5) -> dict:
    """Read bandwidth in GB/s (1e9 bytes/s): {"c": {threads: best}, "numpy": best of one thread,
    "best": {threads: max of the two}, "bytes": buffer size}. The buffer is `gib` GiB, far beyond
    the last-level cache, so each pass streams it from memory; the best of `passes` passes counts."""
    import numpy as np

    n = int(gib * 2**30) // 8
    nbytes = n * 8
    out: dict = {"bytes": nbytes, "c": {}, "best": {}}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dll = _compile_kernel(Path(tmp))
        except (OSError, subprocess.CalledProcessError) as e:  # no compiler: numpy alone
            dll, out["c_error"] = None, str(e)
        buf = np.empty(n, dtype=np.uint64)
        ptr = buf.ctypes.data
        if dll is not None:
            dll.fill(ptr, n, max(threads))
            for t in threads:
                best = float("inf")
                for _ in range(passes):
                    t0 = time.perf_counter()
                    dll.sum(ptr, n, t)
                    best = min(best, time.perf_counter() - t0)
                out["c"][t] = nbytes / best / 1e9
        else:
            buf[:] = 1
        best = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        out["numpy"] = nbytes / best / 1e9
        del buf
    for t in threads:
        out["best"][t] = max(out["c"].get(t, 0.0), out["numpy"] if t == 1 else 0.0) or out["numpy"]
    return out


# ---- bytes per decode token ---------------------------------------------------------------------------
def state_bytes(config, context: int, latent_elem: int) -> dict[str, int]:
    """KDA state read + write and MLA latents read (+ one row written) for one decode token at
    `context` tokens; `latent_elem` bytes per latent element (k3: model dtype, llama.cpp: 2)."""
    la = config.linear_attn_config
    n_kda = len(la.kda_layers)
    n_mla = config.num_hidden_layers - n_kda
    H, K = la.num_heads, la.head_dim
    recurrent = H * K * K * 4  # [H, K, V] fp32, V = K
    conv = 3 * H * K * (la.short_conv_kernel_size - 1) * 4
    width = config.kv_lora_rank + config.qk_rope_head_dim
    return dict(
        kda_state=n_kda * 2 * (recurrent + conv),
        mla_latents=n_mla * (context + 1) * width * latent_elem,
    )


def k3_bytes(model, config, context: int) -> dict[str, int]:
    """Bytes one decode token touches in a k3 model (any storage: f32, MXFP4-packed experts, ...)."""
    frac = config.num_experts_per_token / config.num_experts
    weights = experts = 0
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in state
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue  # the embedding, counted in full below
        nbytes = t.numel() * t.element_size()
        if ".experts." in name:  # routed experts, stacked [E, ...] (packed codes and scales too)
            experts += int(nbytes * frac)
        elif name.endswith("embed_tokens.weight") and not tied:
            weights += nbytes // t.shape[0]  # one row
        else:
            weights += nbytes
    elem = model.model.embed_tokens.weight.element_size()
    return dict(weights=weights, routed_experts=experts, **state_bytes(config, context, elem))


def gguf_bytes(path: str | Path, config, context: int) -> dict[str, int]:
    """The same count from a GGUF file's tensors, at the sizes llama.cpp holds them (its types)."""
    from gguf import GGUFReader

    frac = config.num_experts_per_token / config.num_experts
    tensors = GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    weights = experts = 0
    for t in tensors:
        n = int(t.n_bytes)
        if "_exps" in t.name:  # ffn_{gate,up,down}_exps: the stacked routed experts
            experts += int(n * frac)
        elif t.name == "token_embd.weight" and "output.weight" in names:
            weights += n // config.vocab_size
        else:
            weights += n
    return dict(weights=weights, routed_experts=experts, **state_bytes(config, context, 2))


def roofline(bytes_per_token: dict[str, int], bandwidth_gbs: float) -> float:
    """The decode bound in tokens/s."""
    return bandwidth_gbs * 1e9 / sum(bytes_per_token.values())


def main(argv=None) -> None:
    import torch

    from k3.config import preset
    from k3.model.transformer import K3ForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-small")
    p.add_argument("--context", type=int, default=640, help="tokens in the context at the decode step")
    p.add_argument("--gib", type=float, default=2.0, help="bandwidth buffer size")
    a = p.parse_args(argv)
    bw = read_bandwidth(gib=a.gib)
    print(f"read bandwidth GB/s: C {bw['c']}, numpy (1 thread) {bw['numpy']:.1f}; cpus {os.cpu_count()}")
    config = preset(a.preset)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    b = k3_bytes(model, config, a.context)
    print(f"{a.preset} f32 bytes/token: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in b.items()))
    for t, g in bw["best"].items():
        print(f"  {t} thread(s): <= {roofline(b, g):.1f} tokens/s")


if __name__ == "__main__":
    main()
