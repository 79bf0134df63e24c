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
 * every row block of A passes over them; `gemm_nn_stream` is for an A read from memory once (the
 * routed experts' weights). Used by kda_fused.c, mla_stream.c and moe_experts.c.
 */
#ifndef K3_SMALL_GEMM_H
#define K3_SMALL_GEMM_H

#include <stdint.h>

#include "lanes.h"

static inline void store8(float *p, lanes8 v) { memcpy(p, &v, sizeof v); }

/* C[R x 16] (=, +=, -=: mode 0, 1, -1) A[R x k] B[k x 16], R <= 6 a compile-time constant after inlining */
static inline __attribute__((always_inline)) void tile_rx16(int R, int64_t k, const float *restrict A,
                                                            int64_t lda, const float *restrict B, int64_t ldb,
                                                            float *restrict C, int64_t ldc, int mode) {
    lanes8 acc[12] = {0};
    for (int64_t p = 0; p < k; p++) {
        const lanes8 b0 = load8(B + p * ldb), b1 = load8(B + p * ldb + 8);
        for (int r = 0; r < R; r++) {
            const float a = A[r * lda + p];
            acc[2 * r] += a * b0;
            acc[2 * r + 1] += a * b1;
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 2; s++) {
            float *c = C + r * ldc + 8 * s;
            const lanes8 x = acc[2 * r + s];
            store8(c, mode == 0 ? x : mode > 0 ? load8(c) + x : load8(c) - x);
        }
}

#ifdef __AVX512F__
typedef float lanes16 __attribute__((vector_size(64)));

static inline lanes16 load16(const float *p) {
    lanes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* tile_rx16 on 32 columns: C[R x 32] (=, +=, -=) A[R x k] B[k x 32] */
static inline __attribute__((always_inline)) void tile_rx32(int R, int64_t k, const float *restrict A,
                                                            int64_t lda, const float *restrict B, int64_t ldb,
                                                            float *restrict C, int64_t ldc, int mode) {
    lanes16 acc[12] = {0};
    for (int64_t p = 0; p < k; p++) {
        const lanes16 b0 = load16(B + p * ldb), b1 = load16(B + p * ldb + 16);
        for (int r = 0; r < R; r++) {
            const float a = A[r * lda + p];
            acc[2 * r] += a * b0;
            acc[2 * r + 1] += a * b1;
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 2; s++) {
            float *c = C + r * ldc + 16 * s;
            const lanes16 x = acc[2 * r + s];
            lanes16 y = x;
            if (mode) {
                y = load16(c);
                y = mode > 0 ? y + x : y - x;
            }
            memcpy(c, &y, sizeof y);
        }
}
#endif

/* rows [i, i + R) of C, all n columns; R in 1..6 */
static inline void rows_x16(int R, int64_t n, int64_t k, const float *A, int64_t lda, const float *B, int64_t ldb,
                     float *C, int64_t ldc, int mode) {
    int64_t j0 = 0;
#ifdef __AVX512F__
    for (; j0 + 32 <= n; j0 += 32) {
        switch (R) {
        case 6: tile_rx32(6, k, A, lda, B + j0, ldb, C + j0, ldc, mode); break;
        case 5: tile_rx32(5, k, A, lda, B + j0, ldb, C + j0, ldc, mode); break;
        case 4: tile_rx32(4, k, A, lda, B + j0, ldb, C + j0, ldc, mode); break;
        case 3: tile_rx32(3, k, A, lda, B + j0, ldb, C + j0, ldc, mode); break;
        case 2: tile_rx32(2, k, A, lda, B + j0, ldb, C + j0, ldc, mode); break;
        default: tile_rx32(1, k, A, lda, B + j0, ldb, C + j0, ldc, mode); break;
        }
    }
#endif
    for (int64_t j = j0; j < n; j += 16) {
        switch (R) {
        case 6: tile_rx16(6, k, A, lda, B + j, ldb, C + j, ldc, mode); break;
        case 5: tile_rx16(5, k, A, lda, B + j, ldb, C + j, ldc, mode); break;
        case 4: tile_rx16(4, k, A, lda, B + j, ldb, C + j, ldc, mode); break;
        case 3: tile_rx16(3, k, A, lda, B + j, ldb, C + j, ldc, mode); break;
        case 2: tile_rx16(2, k, A, lda, B + j, ldb, C + j, ldc, mode); break;
        default: tile_rx16(1, k, A, lda, B + j, ldb, C + j, ldc, mode); break;
        }
    }
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

/* gemm_nn for an A streamed from memory (a weight matrix read once): each row block is read whole,
 * row after row, while the next one is prefetched; B (the small operand) stays in L1 / L2 */
static inline void gemm_nn_stream(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda, const float *B,
                                  int64_t ldb, float *C, int64_t ldc, int mode) {
    for (int64_t i = 0; i < m; i += 6) {
        const int R = m - i < 6 ? (int)(m - i) : 6;
        for (int64_t r = i + 6; r < i + 12 && r < m; r++)
            for (int64_t p = 0; p < k; p += 16) __builtin_prefetch(A + r * lda + p, 0, 3);
        rows_x16(R, n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc, mode);
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
