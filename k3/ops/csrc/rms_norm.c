/* RMSNorm and the KDA output's gated RMSNorm without autograd (k3/ops/norm.py, gated_norm.py; each has a
 * torch reference with the same contract that tests compare against), one pass over each row:
 *
 * k3_rms_norm:        y = (x / sqrt(mean(x^2) + eps)) * w               rows of [N, D]; w NULL: no scale
 * k3_gated_rms_norm:  y = (o / sqrt(mean(o^2) + eps)) * w * sigmoid(g)  rows of [N, V]
 *
 * The torch forms make five to eight passes over an [N, D] tensor, each from memory once the tensor
 * outgrows L2 (a [2048, 1024] prefill activation is 8 MB): here a row is squared, summed and scaled while
 * it sits in L1. fp32 throughout; the mean of squares accumulates in 8 lanes (lanes.h), then across them.
 * Rows are split over torch's threads (OpenMP) when there are many; denormals are zero meanwhile (ftz.h).
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "exp_poly.h"
#include "ftz.h"
#include "lanes.h"

/* elements from which a call splits its rows over torch's threads (the rows are independent, so the
 * result does not depend on the team's size); fewer: one thread, no team to wake */
#define MIN_PARALLEL_ELEMENTS (1 << 15)

void k3_rms_norm(const float *x, const float *w, float *y, int64_t N, int64_t D, float eps) {
#pragma omp parallel if (N * D >= MIN_PARALLEL_ELEMENTS)
    {
        const unsigned mode = ftz_begin();
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *restrict xr = x + n * D;
            float *restrict yr = y + n * D;
            const float r = 1.0f / sqrtf(sum_squares(xr, D) / (float)D + eps);
            if (w)
                for (int64_t c = 0; c < D; c++) yr[c] = (xr[c] * r) * w[c];
            else
                for (int64_t c = 0; c < D; c++) yr[c] = xr[c] * r;
        }
        ftz_end(mode);
    }
}

void k3_gated_rms_norm(const float *o, const float *g, const float *w, float *y, int64_t N, int64_t V, float eps) {
#pragma omp parallel if (N * V >= MIN_PARALLEL_ELEMENTS)
    {
        const unsigned mode = ftz_begin();
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *restrict orow = o + n * V, *restrict grow = g + n * V;
            float *restrict yr = y + n * V;
            const float r = 1.0f / sqrtf(sum_squares(orow, V) / (float)V + eps);
            for (int64_t c = 0; c < V; c++) yr[c] = ((orow[c] * r) * w[c]) * sigmoid_poly(grow[c]);
        }
        ftz_end(mode);
    }
}

/* The gradients of both norms for training (k3/ops/norm.py, gated_norm.py: `_RMSNormFn`), recomputing
 * each row's r = 1 / sqrt(mean(x^2) + eps) and n = x r. With s = sigmoid(g) (1 without a gate, g NULL)
 * and w = 1 without a weight (w NULL):
 *   y = n w s;   h = dy s;   dn = h w;   dx = r (dn - n mean(dn n))
 *   dw += h n (summed per thread into dw_part [threads, D]; NULL: not wanted);   dg = dy n w s (1 - s) */
/* one row; `gated` and `weighted` are constants at each call below, so every loop is branch-free and
 * vectorises (the flags resolved per element kept the loop scalar) */
static inline void rms_norm_grad_row(const float *restrict xr, const float *restrict gr, const float *restrict w,
                                     const float *restrict dyr, float *restrict dxr, float *restrict dgr,
                                     float *restrict dw, int64_t D, float eps, int gated, int weighted) {
    const float r = 1.0f / sqrtf(sum_squares(xr, D) / (float)D + eps);
    float dot = 0.0f;
    if (gated) /* dg first, while dx holds sigma(g) */
        for (int64_t c = 0; c < D; c++) {
            const float s = sigmoid_poly(gr[c]), nc = xr[c] * r;
            dxr[c] = s;
            dgr[c] = dyr[c] * nc * (weighted ? w[c] : 1.0f) * s * (1.0f - s);
        }
    for (int64_t c = 0; c < D; c++) { /* dx holds dn = dy s w for now */
        const float h = gated ? dyr[c] * dxr[c] : dyr[c], nc = xr[c] * r;
        const float dn = weighted ? h * w[c] : h;
        dxr[c] = dn;
        dot += dn * nc;
        if (dw) dw[c] += h * nc;
    }
    const float k = r * dot / (float)D; /* dx = r dn - x r^2 mean(dn n) */
    for (int64_t c = 0; c < D; c++) dxr[c] = r * dxr[c] - xr[c] * r * k;
}

void k3_rms_norm_grad(const float *x, const float *g, const float *w, const float *dy, float *dx, float *dg,
                      float *dw_part, int64_t N, int64_t D, float eps, int64_t threads) {
#pragma omp parallel num_threads(threads) if (N * D >= MIN_PARALLEL_ELEMENTS && threads > 1)
    {
        const unsigned mode = ftz_begin();
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *restrict dw = dw_part ? dw_part + me * D : NULL;
        if (dw)
            for (int64_t c = 0; c < D; c++) dw[c] = 0.0f;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *xr = x + n * D, *dyr = dy + n * D, *gr = g ? g + n * D : NULL;
            float *dxr = dx + n * D, *dgr = g ? dg + n * D : NULL;
            if (g)
                rms_norm_grad_row(xr, gr, w, dyr, dxr, dgr, dw, D, eps, 1, 1);
            else if (w)
                rms_norm_grad_row(xr, NULL, w, dyr, dxr, NULL, dw, D, eps, 0, 1);
            else
                rms_norm_grad_row(xr, NULL, NULL, dyr, dxr, NULL, NULL, D, eps, 0, 0);
        }
        ftz_end(mode);
    }
}
