/* The elementwise part of chunked KDA's two-half forward (k3/ops/kda/halves.py), one pass per
 * (chunk, head) matrix instead of ~30 torch ops over a group of them.
 *
 * `k3_kda_halves_prep` computes, for every matrix p of a group, exactly what `halves_local` builds
 * around its one matmul (see halves.py for the maths and the ranges that keep every factor finite):
 *   rows [p][a][0][r] = q exp(gin - tot_a / 2) * scale / |q|      (row half a, token r; the A_qk rows)
 *   rows [p][a][1][r] = k exp(gin - tot_a / 2) * beta / |k|       (the A_kk rows)
 *   cols [p][s][a][r] = column set s, half a: k exp(tot_a / 2 - gin) / |k| for a == s, the set-0 half 0
 *                        times exp(tot_0 / 2) exp(tot_1 / 2) for s = 1, a = 0, zero for s = 0, a = 1
 *   qg   [p][t]       = rows_q exp(mid_a)          X[p][t][V:] = rows_k exp(mid_a)    X[p][t][:V] = v beta
 *   kdec [p][t]       = cols[a][a] exp(tail_a)     decay[p]    = exp(tot_0 + tot_1)
 * with gin the cumulative log decay inside each half. `k3_kda_causal_rows` copies the q rows of the
 * matmul's result into A_qk with everything above the diagonal set to 0 (those products may be inf).
 *
 * Inputs are strided views (chunk, head, token, channel); the channel stride must be 1. Outputs are
 * contiguous, in the layouts of halves.py. exp is a polynomial the compiler vectorises (~2 ulp), fed
 * only arguments in [-87, 88] (halves.py's bounds; exp_poly's own clamp at -87 is halves.py's EXP_FLOOR).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kda_factors.h"
#include "lanes.h"

typedef struct {
    int64_t g, bh, t;  /* strides (elements) of chunk-in-group, head, token; channel stride is 1 */
} strides3;

void k3_kda_halves_prep(
    const float *q, strides3 sq, const float *k, strides3 sk, const float *v, strides3 sv,
    const float *g, strides3 sg, const float *beta, strides3 sb,
    int64_t G, int64_t BH, int64_t C, int64_t K, int64_t V, float scale, float eps,
    float *rows, float *cols, float *qg, float *X, float *kdec, float *decay) {
    const int64_t h = C / 2, hK = h * K;
    float *gin = malloc(sizeof(float) * (size_t)(C * K + 4 * K));
    float *vec = gin + C * K;  /* 4 per-channel vectors */
    float *e_half0 = vec, *e_half1 = vec + K, *e_mid1 = vec + 2 * K, *e_tail0 = vec + 3 * K;
    for (int64_t gi = 0; gi < G; gi++) {
        for (int64_t b = 0; b < BH; b++) {
            const int64_t p = gi * BH + b;
            const float *qp = q + gi * sq.g + b * sq.bh, *kp = k + gi * sk.g + b * sk.bh;
            const float *vp = v + gi * sv.g + b * sv.bh, *gp = g + gi * sg.g + b * sg.bh;
            const float *bp = beta + gi * sb.g + b * sb.bh;
            float *rows_p = rows + p * 4 * hK, *cols_p = cols + p * 4 * hK;
            float *qg_p = qg + p * C * K, *kdec_p = kdec + p * C * K, *X_p = X + p * C * (V + K);
            half_cumsum(gp, sg.t, gin, C, K);
            const float *tot0 = gin + (h - 1) * K, *tot1 = gin + (C - 1) * K;
            channel_factors(tot0, tot1, e_half0, e_half1, e_mid1, e_tail0, decay + p * K, K);
            for (int64_t t = 0; t < C; t++) {
                const int64_t a = t / h, r = t % h;
                const float *qt = qp + t * sq.t, *kt = kp + t * sk.t, *vt = vp + t * sv.t, *gt = gin + t * K;
                const float *tot = a ? tot1 : tot0, *e_mid = a ? e_mid1 : e_half0, *e_tail = a ? e_half1 : e_tail0;
                const float bt = bp[t * sb.t];
                const float iq = scale / sqrtf(sum_squares(qt, K) + eps);
                const float ik = 1.0f / sqrtf(sum_squares(kt, K) + eps), ikb = ik * bt;
                float *row_q = rows_p + a * 2 * hK + r * K, *row_k = row_q + hK;
                float *col = cols_p + a * 2 * hK + a * hK + r * K;  /* set a, half a */
                float *qg_t = qg_p + t * K, *kdec_t = kdec_p + t * K, *X_t = X_p + t * (V + K);
                token_rows(qt, kt, gt, tot, e_mid, e_tail, iq, ik, ikb, row_q, row_k, col, qg_t, X_t + V, kdec_t, K);
                for (int64_t c = 0; c < V; c++) X_t[c] = vt[c] * bt;
                if (a == 0) {  /* set 1, half 0: the same columns seen from the second half's reference */
                    float *col10 = cols_p + 2 * hK + r * K;
                    for (int64_t c = 0; c < K; c++) col10[c] = col[c] * e_half0[c] * e_half1[c];
                } else {  /* set 0, half 1: row half 0 never sees these columns */
                    memset(cols_p + hK + r * K, 0, sizeof(float) * (size_t)K);
                }
            }
        }
    }
    free(gin);
}

/* A [M][2][2][h][C] (row half, q|k, row, column) -> A_qk [M][C][C] with row t = a h + r, columns
 * above t set to 0 */
void k3_kda_causal_rows(const float *A, float *A_qk, int64_t M, int64_t C) {
    const int64_t h = C / 2;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t t = 0; t < C; t++) {
            const int64_t a = t / h, r = t % h;
            const float *src = A + ((m * 2 + a) * 2 * h + r) * C;
            float *dst = A_qk + (m * C + t) * C;
            memcpy(dst, src, sizeof(float) * (size_t)(t + 1));
            memset(dst + t + 1, 0, sizeof(float) * (size_t)(C - t - 1));
        }
    }
}
