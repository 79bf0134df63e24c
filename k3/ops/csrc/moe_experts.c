/* Routed experts with SiTU-GLU or SwiGLU for inference (k3/ops/moe.py, `experts_native`): one call per MoE layer
 * instead of ~100 torch ops, each expert's rows kept in L2 from gather to scatter.
 *
 * Slots (token, choice) arrive sorted by expert: expert e owns slots [off_e, off_e + counts[e]). Per
 * expert with c > 0 slots:
 *   X [c, Dl]  = z[token_of_slot]                        gathered rows
 *   G [c, I]   = X w1_e^T,  U = X w3_e^T                 gate and up products
 *   G          = SiTU(G, U) (act 0; situ.h, the situ_glu.c element) or SiLU(G) U (act 1), in place
 *   Y [c, Dl]  = G w2_e^T                                 down product
 *   out[token_of_slot[s]] += weight[s] * Y[s - off_e]     fp32, in slot order (as index_add_ would)
 * The products go through the BLAS `sgemm_` the caller passes (the one torch itself links), for any c:
 * at a prefill's hundreds of slots per expert it beat small_gemm.h's unpacked panel products on the
 * weights as stored (k3-small, 2,048 tokens, ~256 slots an expert: 306 against 273 GFLOP/s for the
 * layer, ~3.5 % of the whole prefill), and it takes the few slots of a decode step without padding.
 * w1, w3 [E, I, Dl] and w2 [E, Dl, I] are row-major stacks, read in place. `scratch` holds
 * max(c) * (Dl + 2 I) floats per thread.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "blas.h"
#include "situ.h"

static void glu_in_place(float *g, const float *u, int64_t n, int64_t act, float beta1, float beta2) {
    if (act == 0)
        situ_rows(g, u, g, n, beta1, beta2);
    else
        for (int64_t i = 0; i < n; i++) g[i] = g[i] * sigmoid_poly(g[i]) * u[i];
}

/* out[tok[r]] += weight[r] * y[r] for r < c (y rows Dl floats apart) */
static void scatter_add(float *out, const int64_t *tok, const float *weight, const float *y, int64_t c, int64_t Dl) {
    for (int64_t r = 0; r < c; r++) {
        float *restrict dst = out + tok[r] * Dl;
        const float *restrict yr = y + r * Dl;
        const float p = weight[r];
        for (int64_t d = 0; d < Dl; d++) dst[d] += p * yr[d];
    }
}

/* one expert on BLAS products */
static void expert(sgemm_fn sgemm, const float *z, const int64_t *tok, const float *weight, int64_t c, int64_t Dl,
                   int64_t I, const float *w1, const float *w3, const float *w2, float *scratch, float *out,
                   int64_t act, float beta1, float beta2) {
    float *x = scratch, *g = x + c * Dl, *u = g + c * I;
    for (int64_t r = 0; r < c; r++) memcpy(x + r * Dl, z + tok[r] * Dl, (size_t)Dl * sizeof(float));
    gemm_abt(sgemm, x, (int)Dl, w1, (int)Dl, g, (int)I, (int)c, (int)I, (int)Dl, 0.0f);
    gemm_abt(sgemm, x, (int)Dl, w3, (int)Dl, u, (int)I, (int)c, (int)I, (int)Dl, 0.0f);
    glu_in_place(g, u, c * I, act, beta1, beta2);
    gemm_abt(sgemm, g, (int)I, w2, (int)I, x, (int)Dl, (int)c, (int)Dl, (int)I, 0.0f); /* Y over X */
    scatter_add(out, tok, weight, x, c, Dl);
}

/* Experts run on `threads` threads (an OpenMP team, torch's own runtime): thread t takes the experts
 * whose slots fall in its share of all slots, with its own scratch; thread 0 accumulates into out, the
 * others into their own [T, Dl] partial sums, added to out at the end (so a token's sum runs in another
 * order with more than one thread; each thread count is deterministic). A BLAS call inside the team runs
 * single-threaded (the BLAS sees the active parallel region). */
void k3_experts_situ(void *sgemm_ptr, const float *z, const int64_t *token_of_slot, const float *weight,
                     const int64_t *counts, int64_t E, int64_t Dl, int64_t I, const float *w1, const float *w3,
                     const float *w2, float *scratch, float *out, int64_t act, float beta1, float beta2,
                     int64_t T, int64_t threads, int64_t scratch_per_thread) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) total += counts[e];
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *mine = scratch + t * scratch_per_thread;
        float *acc = t == 0 ? out : scratch + nt * scratch_per_thread + (t - 1) * T * Dl;
        if (t > 0) memset(acc, 0, sizeof(float) * (size_t)(T * Dl));
        int64_t off = 0;
        for (int64_t e = 0; e < E; off += counts[e], e++) {
            const int64_t c = counts[e], mid = 2 * off + c; /* the expert's middle slot, doubled */
            if (c == 0 || mid * nt < 2 * total * t || mid * nt >= 2 * total * (t + 1)) continue;
            const float *w1e = w1 + e * I * Dl, *w3e = w3 + e * I * Dl, *w2e = w2 + e * Dl * I;
            expert((sgemm_fn)sgemm_ptr, z, token_of_slot + off, weight + off, c, Dl, I, w1e, w3e, w2e, mine, acc,
                   act, beta1, beta2);
        }
#pragma omp barrier
        const int64_t lo = T * t / nt, hi = T * (t + 1) / nt;
        for (int64_t u = 1; u < nt; u++) {
            const float *part = scratch + nt * scratch_per_thread + (u - 1) * T * Dl;
            for (int64_t i = lo * Dl; i < hi * Dl; i++) out[i] += part[i];
        }
    }
}
