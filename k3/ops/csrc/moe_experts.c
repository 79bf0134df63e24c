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

#include "blas.h"
#include "situ.h"

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
        gemm_abt(sgemm, x, (int)Dl, w1 + e * I * Dl, (int)Dl, g, (int)I, (int)c, (int)I, (int)Dl, 0.0f);
        gemm_abt(sgemm, x, (int)Dl, w3 + e * I * Dl, (int)Dl, u, (int)I, (int)c, (int)I, (int)Dl, 0.0f);
        if (act == 0)
            situ_rows(g, u, g, c * I, beta1, beta2);
        else
            for (int64_t i = 0; i < c * I; i++) g[i] = g[i] * sigmoid_poly(g[i]) * u[i];
        gemm_abt(sgemm, g, (int)I, w2 + e * Dl * I, (int)I, x, (int)Dl, (int)c, (int)Dl, (int)I, 0.0f);  /* Y over X */
        for (int64_t r = 0; r < c; r++) {
            float *restrict dst = out + tok[r] * Dl;
            const float *restrict y = x + r * Dl;
            const float p = weight[off + r];
            for (int64_t d = 0; d < Dl; d++) dst[d] += p * y[d];
        }
    }
}
