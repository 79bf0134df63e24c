/* Attention Residuals mixture without autograd (k3/ops/attnres.py, `attn_res`): one pass per token row
 * over its n source rows, which stay in L1 between the scoring and the mixing.
 *
 * For row t, sources v_i = src[i] + t * D (fp32, contiguous [rows, D]), qk = gamma * w [D]:
 *   s_i   = (v_i . qk) / sqrt(mean(v_i^2) + eps)
 *   a     = softmax_i(s)
 *   out_t = sum_i a_i v_i
 * The dot products and squares accumulate in fp32 in 8 lanes, then across them. Rows are split over
 * torch's threads (OpenMP) when there are many (a prefill's [T, D] sources; the rows are independent, so
 * the result does not depend on the team's size).
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "lanes.h"

#define MAX_SOURCES 64 /* k3.ops.attnres.NATIVE_MAX_SOURCES */
/* source elements from which a call splits its rows over the threads; fewer: one thread, no team to wake */
#define MIN_PARALLEL_ELEMENTS (1 << 16)

static inline void dot_and_square(const float *restrict v, const float *restrict qk, int64_t D, float *dot,
                                  float *sq) {
    lanes8 d8 = {0}, s8 = {0};
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) {
        const lanes8 x = load8(v + c);
        d8 += x * load8(qk + c);
        s8 += x * x;
    }
    float d = sum8(d8), s = sum8(s8);
    for (; c < D; c++) {
        d += v[c] * qk[c];
        s += v[c] * v[c];
    }
    *dot = d;
    *sq = s;
}

/* n in [1, MAX_SOURCES] (the caller checks). */
void k3_attn_res(const int64_t *sources, int64_t n, int64_t rows, int64_t D, const float *qk, float eps,
                 float *out) {
#pragma omp parallel for schedule(static) if (n * rows * D >= MIN_PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        float score[MAX_SOURCES], top = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const float *v = (const float *)(intptr_t)sources[i] + t * D;
            float dot, sq;
            dot_and_square(v, qk, D, &dot, &sq);
            score[i] = dot / sqrtf(sq / (float)D + eps);
            top = score[i] > top ? score[i] : top;
        }
        float total = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            score[i] = expf(score[i] - top);
            total += score[i];
        }
        float *restrict o = out + t * D;
        const float a0 = score[0] / total;
        const float *restrict v0 = (const float *)(intptr_t)sources[0] + t * D;
        for (int64_t c = 0; c < D; c++) o[c] = a0 * v0[c];
        for (int64_t i = 1; i < n; i++) {
            const float a = score[i] / total;
            const float *restrict v = (const float *)(intptr_t)sources[i] + t * D;
            for (int64_t c = 0; c < D; c++) o[c] += a * v[c];
        }
    }
}

/* The mixture's gradients for training (k3/ops/attnres.py, `_AttnRes`), recomputing each row's scores:
 * with r_i = 1 / sqrt(mean(v_i^2) + eps), d_i = v_i . qk, s_i = d_i r_i, a = softmax(s) and g = dout_t,
 *   e_i   = g . v_i,   ds_i = a_i (e_i - sum_j a_j e_j)
 *   dv_i  = a_i g + ds_i (r_i qk - d_i r_i^3 v_i / D)
 *   dqk  += sum_i ds_i r_i v_i                     (summed per thread into dqk_part [threads, D])
 * dsrc holds the n output addresses ([rows, D] each). */
void k3_attn_res_grad(const int64_t *sources, int64_t n, int64_t rows, int64_t D, const float *qk, float eps,
                      const float *dout, const int64_t *dsrc, float *dqk_part, int64_t threads) {
#pragma omp parallel num_threads(threads) if (n * rows * D >= MIN_PARALLEL_ELEMENTS && threads > 1)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *restrict dqk = dqk_part + me * D;
        for (int64_t c = 0; c < D; c++) dqk[c] = 0.0f;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            float score[MAX_SOURCES], r[MAX_SOURCES], d[MAX_SOURCES], e[MAX_SOURCES], top = -INFINITY;
            const float *restrict g = dout + t * D;
            for (int64_t i = 0; i < n; i++) {
                const float *v = (const float *)(intptr_t)sources[i] + t * D;
                float sq, ge;
                dot_and_square(v, qk, D, &d[i], &sq);
                dot_and_square(v, g, D, &ge, &sq);
                e[i] = ge;
                r[i] = 1.0f / sqrtf(sq / (float)D + eps);
                score[i] = d[i] * r[i];
                top = score[i] > top ? score[i] : top;
            }
            float total = 0.0f, mean_e = 0.0f;
            for (int64_t i = 0; i < n; i++) {
                score[i] = expf(score[i] - top);
                total += score[i];
            }
            for (int64_t i = 0; i < n; i++) {
                score[i] /= total; /* a_i */
                mean_e += score[i] * e[i];
            }
            for (int64_t i = 0; i < n; i++) {
                const float a = score[i], ds = a * (e[i] - mean_e);
                const float kq = ds * r[i], kv = -ds * d[i] * r[i] * r[i] * r[i] / (float)D;
                const float *restrict v = (const float *)(intptr_t)sources[i] + t * D;
                float *restrict dv = (float *)(intptr_t)dsrc[i] + t * D;
                for (int64_t c = 0; c < D; c++) {
                    dv[c] = a * g[c] + kq * qk[c] + kv * v[c];
                    dqk[c] += kq * v[c];
                }
            }
        }
    }
}
