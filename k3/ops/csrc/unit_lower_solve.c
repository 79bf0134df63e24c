/* Batched unit-lower-triangular solves for chunked KDA's UT transform (k3/ops/kda/solve.py).
 *
 * For each of M systems, X <- (I + A)^-1 X (forward substitution) or X <- (I + A)^-T X (backward
 * substitution). A is C x C with only its strictly lower triangle read; X is C x N, fp32.
 *
 * Row i of system m of A starts at A + m*a_batch + (i / h)*a_half + (i % h)*a_row: a plain matrix has
 * h = C; the two-half layout of k3/ops/kda/halves.py keeps its row halves a_half apart. Columns of A and
 * of X are contiguous. Row i of X starts at X + m*x_batch + i*x_row.
 *
 * Why not LAPACK: for C = 64 and N = 128, MKL's trsm runs at ~15 GFLOP/s on one core, most of it call
 * and packing overhead. Here each output row keeps a 64-column strip in registers while the rows it
 * depends on are folded in (one load and one FMA per 8 multiply-adds), ~2x faster.
 */
#include <stdint.h>

#define STRIP 64

/* x_i[0:STRIP] -= sum_j coef[j * coef_stride] x_j[0:STRIP] over rows j = j0 .. j1-1 (fixed width: the
 * compiler keeps the strip in vector registers) */
static inline void fold_strip(float *restrict xi, const float *restrict coef, int64_t coef_stride,
                              const float *restrict X, int64_t x_row, int64_t j0, int64_t j1) {
    float acc[STRIP];
    for (int t = 0; t < STRIP; t++) acc[t] = xi[t];
    for (int64_t j = j0; j < j1; j++) {
        const float c = coef[j * coef_stride];
        const float *restrict xj = X + j * x_row;
        for (int t = 0; t < STRIP; t++) acc[t] -= c * xj[t];
    }
    for (int t = 0; t < STRIP; t++) xi[t] = acc[t];
}

/* the same for a narrower last strip of w < STRIP columns */
static void fold_tail(float *restrict xi, const float *restrict coef, int64_t coef_stride,
                      const float *restrict X, int64_t x_row, int64_t j0, int64_t j1, int64_t w) {
    for (int64_t j = j0; j < j1; j++) {
        const float c = coef[j * coef_stride];
        const float *restrict xj = X + j * x_row;
        for (int64_t t = 0; t < w; t++) xi[t] -= c * xj[t];
    }
}

static void fold(float *xi, const float *coef, int64_t coef_stride, const float *X, int64_t x_row,
                 int64_t j0, int64_t j1, int64_t w) {
    if (w == STRIP)
        fold_strip(xi, coef, coef_stride, X, x_row, j0, j1);
    else
        fold_tail(xi, coef, coef_stride, X, x_row, j0, j1, w);
}

#define MIN_PARALLEL_WORK (1 << 17) /* C x N elements over all systems */

void k3_unit_lower_solve(const float *A, int64_t a_batch, int64_t a_half, int64_t a_row, int64_t h,
                         float *X, int64_t x_batch, int64_t x_row, int64_t M, int64_t C, int64_t N,
                         int transpose) {
    /* the systems are independent: split over torch's threads (OpenMP) when there are enough of them,
     * so the result does not depend on the team's size */
#pragma omp parallel for schedule(static) if (M >= 4 && M * C * N >= MIN_PARALLEL_WORK)
    for (int64_t m = 0; m < M; m++) {
        const float *Am = A + m * a_batch;
        for (int64_t n0 = 0; n0 < N; n0 += STRIP) {
            const int64_t w = N - n0 < STRIP ? N - n0 : STRIP;
            float *Xm = X + m * x_batch + n0;
            if (!transpose) {  /* x_i -= sum_{j < i} A[i, j] x_j, rows in increasing order */
                for (int64_t i = 1; i < C; i++) {
                    const float *a = Am + (i / h) * a_half + (i % h) * a_row;
                    fold(Xm + i * x_row, a, 1, Xm, x_row, 0, i, w);
                }
            } else {  /* x_i -= sum_{j > i} A[j, i] x_j, rows in decreasing order; A[j, i] for j >= h
                       * lies a_half - h * a_row further than with the plain row stride */
                for (int64_t i = C - 2; i >= 0; i--) {
                    const int64_t split = i + 1 > h ? i + 1 : h;  /* rows j in [i+1, split) are in the top half */
                    const float *col = Am + i;
                    if (i + 1 < split)
                        fold(Xm + i * x_row, col, a_row, Xm, x_row, i + 1, split, w);
                    fold(Xm + i * x_row, col + a_half - h * a_row, a_row, Xm, x_row, split, C, w);
                }
            }
        }
    }
}
