/* Routed experts with SiTU-GLU or SwiGLU for inference (k3/ops/moe.py, `experts_native`): one call per MoE layer
 * instead of ~100 torch ops, each expert's rows kept in L2 from gather to scatter.
 *
 * Slots (token, choice) arrive sorted by expert: expert e owns slots [off_e, off_e + counts[e]). Per
 * expert with c > 0 slots:
 *   X [c, Dl]  = z[token_of_slot]                        gathered rows
 *   G [c, I]   = X w1_e^T,  U = X w3_e^T                 two SGEMMs
 *   G          = SiTU(G, U) (act 0; situ.h, the situ_glu.c element) or SiLU(G) U (act 1), in place
 *   Y [c, Dl]  = G w2_e^T                                 SGEMM
 *   out[token_of_slot[s]] += weight[s] * Y[s - off_e]     fp32, in slot order (as index_add_ would)
 * The matrix products go through the BLAS `sgemm_` the caller passes (the one torch itself links, so
 * the products are the same kernels torch.mm runs); w1, w3 [E, I, Dl] and w2 [E, Dl, I] are row-major
 * stacks, read in place. `scratch` holds max(c) * (Dl + 2 I) floats.
 */
#include <stdint.h>
#include <string.h>

#include "situ.h"

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

/* Row-major C [rows, n] = A [rows, k] B^T with B row-major [n, k]: column-major C^T = B^T' A^T, i.e.
 * sgemm('T', 'N', n, rows, k, B (ld k), A (ld k), C (ld n)). */
static void rows_times_transposed(sgemm_fn sgemm, const float *a, const float *b, float *c, int rows, int n,
                                  int k) {
    const float one = 1.0f, zero = 0.0f;
    sgemm("T", "N", &n, &rows, &k, &one, b, &k, a, &k, &zero, c, &n);
}

void k3_experts_situ(void *sgemm_ptr, const float *z, const int64_t *token_of_slot, const float *weight,
                     const int64_t *counts, int64_t E, int64_t Dl, int64_t I, const float *w1, const float *w3,
                     const float *w2, float *scratch, float *out, int64_t act, float beta1, float beta2) {
    sgemm_fn sgemm = (sgemm_fn)sgemm_ptr;
    int64_t off = 0;
    for (int64_t e = 0; e < E; off += counts[e], e++) {
        const int64_t c = counts[e];
        if (c == 0) continue;
        float *x = scratch, *g = x + c * Dl, *u = g + c * I;
        const int64_t *tok = token_of_slot + off;
        for (int64_t r = 0; r < c; r++) memcpy(x + r * Dl, z + tok[r] * Dl, (size_t)Dl * sizeof(float));
        rows_times_transposed(sgemm, x, w1 + e * I * Dl, g, (int)c, (int)I, (int)Dl);
        rows_times_transposed(sgemm, x, w3 + e * I * Dl, u, (int)c, (int)I, (int)Dl);
        if (act == 0)
            situ_rows(g, u, g, c * I, beta1, beta2);
        else
            for (int64_t i = 0; i < c * I; i++) g[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
        rows_times_transposed(sgemm, g, w2 + e * Dl * I, x, (int)c, (int)Dl, (int)I);  /* Y over X */
        for (int64_t r = 0; r < c; r++) {
            float *restrict dst = out + tok[r] * Dl;
            const float *restrict y = x + r * Dl;
            const float p = weight[off + r];
            for (int64_t d = 0; d < Dl; d++) dst[d] += p * y[d];
        }
    }
}
