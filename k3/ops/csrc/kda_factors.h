/* The per-chunk decay factors of chunked KDA's two-half forward (k3/ops/kda/halves.py has the maths and
 * the ranges that keep every factor finite), shared by kda_halves.c (the elementwise pass of the torch
 * path) and kda_fused.c (the whole forward). */
#ifndef K3_KDA_FACTORS_H
#define K3_KDA_FACTORS_H

#include <stdint.h>

#include "exp_poly.h"

/* gin [C][K]: the cumulative log decay inside each half of a chunk, from the strided rows of g (token
 * stride st, channel stride 1) */
static void half_cumsum(const float *restrict g, int64_t st, float *restrict gin, int64_t C, int64_t K) {
    const int64_t h = C / 2;
    for (int64_t t = 0; t < C; t++) {
        const float *gt = g + t * st;
        float *out = gin + t * K;
        if (t % h == 0)
            for (int64_t c = 0; c < K; c++) out[c] = gt[c];
        else
            for (int64_t c = 0; c < K; c++) out[c] = out[c - K] + gt[c];
    }
}

/* per-channel factors from the half totals tot0, tot1 [K]: exp(tot_a / 2) (which is also exp(mid_0) and
 * the second half's exp(tail)), exp(mid_1), the first half's exp(tail), exp(tot0 + tot1) */
static void channel_factors(const float *restrict tot0, const float *restrict tot1, float *restrict e_half0,
                            float *restrict e_half1, float *restrict e_mid1, float *restrict e_tail0,
                            float *restrict decay, int64_t K) {
    for (int64_t c = 0; c < K; c++) {
        const float half0 = tot0[c] * 0.5f, half1 = tot1[c] * 0.5f, dec = tot0[c] + tot1[c];
        e_half0[c] = exp_poly(half0);
        e_half1[c] = exp_poly(half1);
        e_mid1[c] = exp_poly(tot0[c] + half1);
        e_tail0[c] = exp_poly(dec - half0);
        decay[c] = exp_poly(dec);
    }
}

/* every output row of token t from its q, k rows, in-half decay gt and its half's factors */
static void token_rows(const float *restrict qt, const float *restrict kt, const float *restrict gt,
                       const float *restrict tot, const float *restrict e_mid, const float *restrict e_tail,
                       float iq, float ik, float ikb, float *restrict row_q, float *restrict row_k,
                       float *restrict col, float *restrict qg_t, float *restrict xw, float *restrict kdec_t,
                       int64_t K) {
    for (int64_t c = 0; c < K; c++) {
        const float rc = exp_poly(gt[c] - 0.5f * tot[c]), cd = 1.0f / rc;
        const float rq = qt[c] * rc * iq, rk = kt[c] * rc * ikb, kc = kt[c] * cd * ik;
        row_q[c] = rq;
        row_k[c] = rk;
        col[c] = kc;
        qg_t[c] = rq * e_mid[c];
        xw[c] = rk * e_mid[c];
        kdec_t[c] = kc * e_tail[c];
    }
}

#endif
