/* Row-major fp32 products of small matrices that sit in L1 / L2 (chunked KDA's 64 x 64 blocks), with a
 * register-blocked micro-kernel: 6 rows x 16 columns of C in 12 eight-lane accumulators, one broadcast of
 * A and two loads of B per 12 multiply-adds (the BLIS Haswell shape). On 64 x 64 x 64 it runs ~1.3x
 * faster than MKL's sgemm on the same data, which packs both operands first.
 *
 * With AVX-512 the columns go 32 at a time while at least 32 are left: the same 6-row shape on 16-lane
 * registers (12 accumulators, one broadcast of A and two loads of B per 12 multiply-adds), twice the
 * work per instruction. Each element of C is still the sum over p in order, whatever the tile, so the
 * results do not depend on which tile computed them.
 *
 * Every n must be a multiple of 16 (the callers check); any m and k. `gemm_nn_panels` is the same product
 * for operands that outgrow L1 (kept in L2): it walks B in 64 x 64 panels (16 KB) that stay in L1 while
 * every row block of A passes over them. Used by kda_fused.c and mla_stream.c.
 */
#ifndef K3_SMALL_GEMM_H
#define K3_SMALL_GEMM_H

#include <stdint.h>

#include "lanes.h"

/* C[R x 2w] (=, +=, -=: mode 0, 1, -1) A[R x k] B[k x 2w] on vectors of w lanes (vec, loaded by load): 12
 * accumulators, R <= 6 a compile-time constant after inlining */
#define DEFINE_TILE(name, vec, load)                                                                        \
    static inline __attribute__((always_inline)) void name(int R, int64_t k, const float *restrict A,       \
                                                           int64_t lda, const float *restrict B,            \
                                                           int64_t ldb, float *restrict C, int64_t ldc,     \
                                                           int mode) {                                      \
        enum { w = sizeof(vec) / sizeof(float) };                                                           \
        vec acc[12] = {0};                                                                                  \
        for (int64_t p = 0; p < k; p++) {                                                                   \
            const vec b0 = load(B + p * ldb), b1 = load(B + p * ldb + w);                                   \
            for (int r = 0; r < R; r++) {                                                                   \
                const float a = A[r * lda + p];                                                             \
                acc[2 * r] += a * b0;                                                                       \
                acc[2 * r + 1] += a * b1;                                                                   \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int s = 0; s < 2; s++) {                                                                   \
                float *c = C + r * ldc + w * s;                                                             \
                const vec x = acc[2 * r + s], y = mode == 0 ? x : mode > 0 ? load(c) + x : load(c) - x;     \
                memcpy(c, &y, sizeof y);                                                                    \
            }                                                                                               \
    }

DEFINE_TILE(tile_rx16, lanes8, load8) /* 16 columns */
#ifdef __AVX512F__
DEFINE_TILE(tile_rx32, lanes16, load16) /* 32 columns */
#endif

/* tile(R, ...) with R in 1..6 made a compile-time constant */
#define WITH_ROWS(R, tile, ...)                                                                             \
    switch (R) {                                                                                            \
    case 6: tile(6, __VA_ARGS__); break;                                                                    \
    case 5: tile(5, __VA_ARGS__); break;                                                                    \
    case 4: tile(4, __VA_ARGS__); break;                                                                    \
    case 3: tile(3, __VA_ARGS__); break;                                                                    \
    case 2: tile(2, __VA_ARGS__); break;                                                                    \
    default: tile(1, __VA_ARGS__); break;                                                                   \
    }

/* rows [i, i + R) of C, all n columns; R in 1..6 */
static inline void rows_x16(int R, int64_t n, int64_t k, const float *A, int64_t lda, const float *B, int64_t ldb,
                     float *C, int64_t ldc, int mode) {
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j + 32 <= n; j += 32) WITH_ROWS(R, tile_rx32, k, A, lda, B + j, ldb, C + j, ldc, mode)
#endif
    for (; j < n; j += 16) WITH_ROWS(R, tile_rx16, k, A, lda, B + j, ldb, C + j, ldc, mode)
}

/* C[m x n] (=, +=, -=) A[m x k] B[k x n] */
static inline void gemm_nn(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda, const float *B, int64_t ldb,
                    float *C, int64_t ldc, int mode) {
    for (int64_t i = 0; i < m; i += 6) {
        const int R = m - i < 6 ? (int)(m - i) : 6;
        rows_x16(R, n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc, mode);
    }
}

/* The same with A lower triangular (A[i][j] = 0 for j > i, stored as zeros): rows [i, i + R) read only
 * the first i + R columns of A and rows of B. */
static inline void gemm_nn_lower(int64_t m, int64_t n, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float *C, int64_t ldc, int mode) {
    for (int64_t i = 0; i < m; i += 6) {
        const int R = m - i < 6 ? (int)(m - i) : 6;
        rows_x16(R, n, i + R, A + i * lda, lda, B, ldb, C + i * ldc, ldc, mode);
    }
}

#define PANEL 64

/* gemm_nn over 64 x 64 panels of B (k panels outermost: after the first one the tiles accumulate) */
static inline void gemm_nn_panels(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, int mode) {
    for (int64_t p0 = 0; p0 < k; p0 += PANEL) {
        const int64_t kb = k - p0 < PANEL ? k - p0 : PANEL;
        const int step_mode = p0 == 0 || mode != 0 ? mode : 1;
        for (int64_t j0 = 0; j0 < n; j0 += PANEL) {
            const int64_t nb = n - j0 < PANEL ? n - j0 : PANEL;
            gemm_nn(m, nb, kb, A + p0, lda, B + p0 * ldb + j0, ldb, C + j0, ldc, step_mode);
        }
    }
}

#endif
