/* Chunked KDA's state passes over one group of chunks, forward and backward (k3/ops/kda/chunk.py,
 * `_forward` / `_backward`; their torch loops beside them are the reference): the part of the chunked
 * algorithm that is sequential over chunks. In torch it is four or five small batched products per chunk
 * (~600 calls a layer at k3-mini's training shape, dispatch-bound); here each (batch x head) row walks its
 * chunks in one call, its blocks in L1 / L2, with small_gemm.h's products. Rows are independent and split
 * over torch's threads (OpenMP). All fp32; denormals are zero meanwhile (ftz.h), as in the torch path.
 *
 * Layout: G chunks of the group, R = batch x heads rows, chunk-major: row r of chunk j is index j R + r of
 * X [.., C, V + K] (U = its first V columns, W the last K), k_dec [.., C, K], decay [.., K], v_new / dv_new
 * [.., C, V], dS_out / dS_next [.., K, V]; states [G + 1][R][K][V]. first[j] / last[j]: the segment
 * (independent sequence) that starts / ends at chunk j, or -1. V must be a multiple of 16.
 *
 * forward, per row:  S = (first[j] >= 0 ? h0[first[j]] or 0 : the state entering the group (carry, j = 0)
 *                      or the one the previous chunk left);  states[j] = S
 *                    V' = U - W S;   states[j + 1] = decay * S + k_dec^T V';   finals[last[j]] = states[j + 1]
 *                    carry <- the state leaving the group
 * backward, per row (chunks in reverse): dS = (last[j] >= 0 ? dfinals[last[j]] or 0 : the carried one)
 *                    dS_next[j] = dS;   dv_new[j] += k_dec dS;
 *                    dS = decay * dS + dS_out[j] - W^T dv_new[j];   dh0[first[j]] = dS;   carry <- dS
 */
#include <stdint.h>
#include <string.h>

#include "ftz.h"
#include "small_gemm.h"

/* out[c][r] = in[r][c] for an [rows x cols] block with row stride ld */
static void transpose_block(const float *restrict in, int64_t ld, int64_t rows, int64_t cols, float *restrict out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) out[c * rows + r] = in[r * ld + c];
}

/* dst = decay[k] * src[k][:] for the K rows of a [K][V] state */
static void scale_rows(const float *restrict src, const float *restrict decay, float *restrict dst, int64_t K,
                       int64_t V) {
    for (int64_t k = 0; k < K; k++)
        for (int64_t v = 0; v < V; v++) dst[k * V + v] = decay[k] * src[k * V + v];
}

void k3_kda_state_forward(int64_t G, int64_t R, int64_t C, int64_t K, int64_t V, const float *X,
                          const float *k_dec, const float *decay, float *states, float *v_new, float *carry,
                          const int64_t *first, const int64_t *last, const float *h0, float *finals) {
    const int64_t KV = K * V;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const unsigned mode = ftz_begin();
        float kdT[K * C];
        for (int64_t j = 0; j < G; j++) {
            const int64_t i = j * R + r;
            float *S = states + i * KV, *S_next = states + (i + R) * KV;
            if (first[j] >= 0) {
                if (h0)
                    memcpy(S, h0 + (first[j] * R + r) * KV, KV * sizeof *S);
                else
                    memset(S, 0, KV * sizeof *S);
            } else if (j == 0 && carry + r * KV != S) {
                memcpy(S, carry + r * KV, KV * sizeof *S);
            }
            const float *x = X + i * C * (V + K);
            float *vn = v_new + i * C * V;
            for (int64_t t = 0; t < C; t++) memcpy(vn + t * V, x + t * (V + K), V * sizeof *vn);
            gemm_nn(C, V, K, x + V, V + K, S, V, vn, V, -1); /* V' = U - W S */
            scale_rows(S, decay + i * K, S_next, K, V);
            transpose_block(k_dec + i * C * K, K, C, K, kdT);
            gemm_nn(K, V, C, kdT, C, vn, V, S_next, V, 1); /* + k_dec^T V' */
            if (last[j] >= 0) memcpy(finals + (last[j] * R + r) * KV, S_next, KV * sizeof *S_next);
        }
        memcpy(carry + r * KV, states + (G * R + r) * KV, KV * sizeof *carry);
        ftz_end(mode);
    }
}

void k3_kda_state_backward(int64_t G, int64_t R, int64_t C, int64_t K, int64_t V, const float *X,
                           const float *k_dec, const float *decay, const float *dS_out, float *dv_new,
                           float *dS_next, float *carry, const int64_t *first, const int64_t *last,
                           const float *dfinals, float *dh0) {
    const int64_t KV = K * V;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const unsigned mode = ftz_begin();
        float WT[K * C], dS[K * V];
        memcpy(dS, carry + r * KV, KV * sizeof *dS);
        for (int64_t j = G - 1; j >= 0; j--) {
            const int64_t i = j * R + r;
            if (last[j] >= 0) {
                if (dfinals)
                    memcpy(dS, dfinals + (last[j] * R + r) * KV, KV * sizeof *dS);
                else
                    memset(dS, 0, KV * sizeof *dS);
            }
            memcpy(dS_next + i * KV, dS, KV * sizeof *dS);
            float *dvn = dv_new + i * C * V;
            gemm_nn(C, V, K, k_dec + i * C * K, K, dS, V, dvn, V, 1); /* dv_new += k_dec dS */
            const float *dec = decay + i * K, *out = dS_out + i * KV;
            for (int64_t k = 0; k < K; k++)
                for (int64_t v = 0; v < V; v++) dS[k * V + v] = dec[k] * dS[k * V + v] + out[k * V + v];
            transpose_block(X + i * C * (V + K) + V, V + K, C, K, WT);
            gemm_nn(K, V, C, WT, C, dvn, V, dS, V, -1); /* - W^T dv_new */
            if (first[j] >= 0 && dh0) memcpy(dh0 + (first[j] * R + r) * KV, dS, KV * sizeof *dS);
        }
        memcpy(carry + r * KV, dS, KV * sizeof *carry);
        ftz_end(mode);
    }
}
