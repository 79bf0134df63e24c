/* The KDA layer's pointwise steps without autograd, one pass each (k3/ops/conv.py, gate.py; each has a
 * torch reference with the same contract that tests compare against).
 *
 * k3_conv_silu:       y[b, t, c] = SiLU(sum_j w[j, c] x[b, t - W + 1 + j, c]), x = the history [B, C, W-1]
 *                     (oldest first; NULL = zeros) followed by u [B, T, C]; w transposed to [W, C].
 * k3_kda_safe_gate:   g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias[h, c])) over rows of [H, K].
 * All fp32; the channel loops vectorise (exp_poly.h's exp), SiLU and sigmoid as 1 / (1 + exp(-x)).
 * Rows are split over torch's threads (OpenMP) when there are many; denormals are zero meanwhile (ftz.h).
 */
#include <math.h>
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "exp_poly.h"
#include "ftz.h"

/* rows (tokens) from which a call splits them over torch's threads (an OpenMP team of its size; the rows
 * are independent, so the result does not depend on it); fewer: one thread, no team to wake */
#define MIN_PARALLEL_ROWS 64

void k3_conv_silu(const float *u, const float *hist, const float *w, float *y, int64_t B, int64_t T, int64_t C,
                  int64_t W) {
#pragma omp parallel if (B * T >= MIN_PARALLEL_ROWS)
    {
    const unsigned mode = ftz_begin();
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const float *ub = u + b * T * C, *hb = hist ? hist + b * C * (W - 1) : NULL;
            float *yb = y + b * T * C;
            float *restrict out = yb + t * C;
            if (t >= W - 1) { /* every tap inside u: the vectorised common case */
                const float *restrict x0 = ub + (t - W + 1) * C;
                for (int64_t c = 0; c < C; c++) out[c] = w[c] * x0[c];
                for (int64_t j = 1; j < W; j++) {
                    const float *restrict xj = x0 + j * C, *restrict wj = w + j * C;
                    for (int64_t c = 0; c < C; c++) out[c] += wj[c] * xj[c];
                }
            } else { /* the first W-1 tokens read the history */
                for (int64_t c = 0; c < C; c++) out[c] = 0.0f;
                for (int64_t j = 0; j < W; j++) {
                    const int64_t p = t - W + 1 + j; /* < 0: history column W-1+p */
                    for (int64_t c = 0; c < C; c++) {
                        const float x = p >= 0 ? ub[p * C + c] : (hb ? hb[c * (W - 1) + (W - 1 + p)] : 0.0f);
                        out[c] += w[j * C + c] * x;
                    }
                }
            }
            for (int64_t c = 0; c < C; c++) out[c] = out[c] * sigmoid_poly(out[c]);
        }
    }
    ftz_end(mode);
    }
}

void k3_kda_safe_gate(const float *z, const float *A_log, const float *dt_bias, float lower_bound, float *g,
                      int64_t N, int64_t H, int64_t K) {
#pragma omp parallel if (N >= MIN_PARALLEL_ROWS)
    {
    const unsigned mode = ftz_begin();
#pragma omp for collapse(2) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++) {
            const float a = expf(A_log[h]);
            const float *restrict zr = z + (n * H + h) * K, *restrict bias = dt_bias + h * K;
            float *restrict gr = g + (n * H + h) * K;
            for (int64_t c = 0; c < K; c++) gr[c] = lower_bound * sigmoid_poly(a * (zr[c] + bias[c]));
        }
    ftz_end(mode);
    }
}

/* The short conv of packed documents for training (k3/ops/conv.py, `_ConvSiLUDocs`): u [T, C] holds the
 * documents back to back and first[t] is the index of the first token of t's document, so a tap that
 * would read before it reads zero instead (no history: training rows start empty).
 *
 * k3_conv_silu_docs:      y[t, c] = SiLU(pre[t, c]),  pre[t, c] = sum_{j: p >= first[t]} w[j, c] u[p, c],
 *                         p = t - W + 1 + j
 * k3_conv_silu_docs_grad: from dy [T, C]: dpre = dy SiLU'(pre) (pre recomputed; scratch [T, C]), then
 *                         du[t, c] = sum_j w[j, c] dpre[t + W - 1 - j, c] over the outputs of t's document,
 *                         dw[j, c] = sum_t dpre[t, c] u[t - W + 1 + j, c] over taps inside the document;
 *                         dw is summed per thread into dw_part [threads, W, C] (the caller adds the rows).
 */
static inline void conv_pre_docs(const float *restrict u, const float *restrict w, int64_t first, int64_t t,
                                 int64_t C, int64_t W, float *restrict out) {
    for (int64_t c = 0; c < C; c++) out[c] = 0.0f;
    for (int64_t j = 0; j < W; j++) {
        const int64_t p = t - W + 1 + j;
        if (p < first) continue;
        const float *restrict xj = u + p * C, *restrict wj = w + j * C;
        for (int64_t c = 0; c < C; c++) out[c] += wj[c] * xj[c];
    }
}

void k3_conv_silu_docs(const float *u, const float *w, const int64_t *first, float *y, int64_t T, int64_t C,
                       int64_t W) {
#pragma omp parallel if (T >= MIN_PARALLEL_ROWS)
    {
        const unsigned mode = ftz_begin();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *restrict out = y + t * C;
            conv_pre_docs(u, w, first[t], t, C, W, out);
            for (int64_t c = 0; c < C; c++) out[c] = out[c] * sigmoid_poly(out[c]);
        }
        ftz_end(mode);
    }
}

void k3_conv_silu_docs_grad(const float *u, const float *w, const int64_t *first, const float *dy, float *dpre,
                            float *du, float *dw_part, int64_t T, int64_t C, int64_t W, int64_t threads) {
#pragma omp parallel num_threads(threads) if (T >= MIN_PARALLEL_ROWS && threads > 1)
    {
        const unsigned mode = ftz_begin();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *restrict d = dpre + t * C;
            const float *restrict g = dy + t * C;
            conv_pre_docs(u, w, first[t], t, C, W, d); /* pre, then overwritten by its gradient */
            for (int64_t c = 0; c < C; c++) {
                const float s = sigmoid_poly(d[c]);
                d[c] = g[c] * (s + d[c] * s * (1.0f - s));
            }
        }
        /* (the implicit barrier: every dpre row is written before any is read) */
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *restrict dw = dw_part + me * W * C;
        for (int64_t i = 0; i < W * C; i++) dw[i] = 0.0f;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *restrict out = du + t * C;
            for (int64_t c = 0; c < C; c++) out[c] = 0.0f;
            for (int64_t j = 0; j < W; j++) {
                const int64_t q = t + W - 1 - j; /* the output that reads t through tap j */
                if (q >= T || first[q] != first[t]) continue;
                const float *restrict dq = dpre + q * C, *restrict wj = w + j * C;
                for (int64_t c = 0; c < C; c++) out[c] += wj[c] * dq[c];
            }
            const float *restrict dt = dpre + t * C;
            for (int64_t j = 0; j < W; j++) {
                const int64_t p = t - W + 1 + j;
                if (p < first[t]) continue;
                const float *restrict xp = u + p * C;
                float *restrict dwj = dw + j * C;
                for (int64_t c = 0; c < C; c++) dwj[c] += dt[c] * xp[c];
            }
        }
        ftz_end(mode);
    }
}
