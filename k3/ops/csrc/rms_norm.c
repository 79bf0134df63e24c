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
            const float *restrict xr = x + n * D, *restrict dyr = dy + n * D;
            const float *restrict gr = g ? g + n * D : NULL;
            float *restrict dxr = dx + n * D;
            const float r = 1.0f / sqrtf(sum_squares(xr, D) / (float)D + eps);
            float dot = 0.0f;
            for (int64_t c = 0; c < D; c++) { /* dx holds dn for now */
                const float s = gr ? sigmoid_poly(gr[c]) : 1.0f;
                const float h = dyr[c] * s, dn = w ? h * w[c] : h, nc = xr[c] * r;
                dxr[c] = dn;
                dot += dn * nc;
                if (dw) dw[c] += h * nc;
                if (gr) dg[n * D + c] = dyr[c] * nc * (w ? w[c] : 1.0f) * s * (1.0f - s);
            }
            const float mean = dot / (float)D;
            for (int64_t c = 0; c < D; c++) dxr[c] = r * (dxr[c] - xr[c] * r * mean);
        }
        ftz_end(mode);
    }
}
