/* 8 fp32 lanes (GCC / Clang vector extension: AVX on x86-64, two NEON registers on arm64) for the kernels'
 * reductions. Written out because gcc scalarises the 8-partial-sums array form of a reduction once it
 * is inlined into a larger loop (seen in attn_res.c). Used by attn_res.c, kda_halves.c, small_gemm.h and
 * gemv.h. */
#ifndef K3_LANES_H
#define K3_LANES_H

#include <stdint.h>
#include <string.h>

typedef float lanes8 __attribute__((vector_size(32)));

static inline lanes8 load8(const float *p) {
    lanes8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 fp32 lanes: one AVX-512 register (two AVX2 ones), for products that stream 64-byte rows */
typedef float lanes16 __attribute__((vector_size(64)));

static inline lanes16 load16(const float *p) {
    lanes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(lanes8 v) {
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += v[j];
    return s;
}

/* sum of x[c]^2 for c < K: 8 lane partial sums, then across the lanes, then the tail */
static inline float sum_squares(const float *restrict x, int64_t K) {
    lanes8 s8 = {0};
    int64_t c = 0;
    for (; c + 8 <= K; c += 8) {
        const lanes8 v = load8(x + c);
        s8 += v * v;
    }
    float s = sum8(s8);
    for (; c < K; c++) s += x[c] * x[c];
    return s;
}

#endif
