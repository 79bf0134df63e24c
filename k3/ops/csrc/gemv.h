/* Matrix-vector products for decode: Y[b, o] = W[o, :] . X[b, :] for a few rows b of X, fp32.
 *
 * At decode the weights are read once per token and dominate the time, so every product streams each
 * weight row exactly once, in order, and applies it to all B inputs while it is in L1 (the inputs, B x I
 * floats, stay in L1/L2); for one input the rows go one after another, a single stream. 16-lane vectors
 * (one AVX-512 register, two AVX2 ones) and 64-byte loads; a tail shorter than 16 runs scalar. */
#ifndef K3_GEMV_H
#define K3_GEMV_H

#include <stdint.h>
#include <string.h>

#include "lanes.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* weight rows ahead that the products prefetch. The weights of a small model sit in L3, which one core
 * reads at ~20 GB/s only with many lines in flight: the hardware prefetcher does not run far enough
 * ahead of short rows (an expert's 128-256 inputs), and prefetching eight rows ahead takes the routed
 * experts' products at 4 inputs from 15-24 to 32-40 GB/s on two threads (and is neutral on long rows) */
#define GEMV_PREFETCH_ROWS 8
/* bytes ahead that batch-1 products prefetch. They read one weight row after another, a single stream
 * per thread, which out of the cache reads ~13 % faster than four rows side by side (33-35 against 30
 * GB/s on two threads, 2 MB pages, 630 MB of 2-4 KB rows); the prefetch carries the stream across the
 * row and page boundaries */
#define GEMV_PREFETCH_BYTES 8192

typedef float v4 __attribute__((vector_size(16)));

static inline float hsum16(lanes16 v) {
    /* pairwise, so that the order is fixed whatever the vector width the compiler picks: lane j plus
     * lane j + 8, then j + 4, j + 2, j + 1, in halves of vector registers (a sum through memory and
     * scalar adds cost more than the 16-lane products it ends when the rows are short) */
    lanes8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    const lanes8 a = lo + hi;
    v4 l4, h4;
    memcpy(&l4, &a, sizeof l4);
    memcpy(&h4, (const char *)&a + sizeof l4, sizeof h4);
    const v4 b = l4 + h4;
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* hsum16 of 16 vectors at once: lane k of the result is exactly hsum16(v[k]) (the same pairs added in
 * the same order: lanes 8 apart, then 4, then 2, then 1; float addition is commutative), in 15 pairwise
 * shuffle-and-add steps instead of 16 separate reductions */
static inline lanes16 hsum16x16(const lanes16 v[16]) {
    typedef int32_t vi __attribute__((vector_size(64)));
    const vi halves_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi halves_hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi quads_lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi quads_hi = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi pairs_lo = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi pairs_hi = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    lanes16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i]'s j + j+8; lanes 8-15: v[2i+1]'s */
        a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], halves_lo) + __builtin_shuffle(v[2 * i], v[2 * i + 1], halves_hi);
    for (int i = 0; i < 4; i++) /* four lanes per vector: j + j+4 */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], quads_lo) + __builtin_shuffle(a[2 * i], a[2 * i + 1], quads_hi);
    for (int i = 0; i < 2; i++) /* two lanes per vector: (b0 + b2), (b1 + b3) */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], pairs_lo) + __builtin_shuffle(b[2 * i], b[2 * i + 1], pairs_hi);
    return __builtin_shuffle(c[0], c[1], even) + __builtin_shuffle(c[0], c[1], odd);
}

#define GEMV_WIDE_MAX_I 1536 /* gemv_rows_wide: rows of at most this many inputs (eight of them in L1) */

/* bf16 -> fp32 is exact: the 16 bits are the top half of the float's */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
static inline lanes16 load16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    lanes16 f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float bf16_at(const uint16_t *p, int64_t j) {
    const uint32_t u = (uint32_t)p[j] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 weights: dot, gemv_rows */
#define WT float
#define LOADW(p) load16(p)
#define WAT(p, j) ((p)[j])
#define NAME(f) f
#include "gemv_products.h"
#undef WT
#undef LOADW
#undef WAT
#undef NAME

/* rows o0..o1 of Y = W X^T as `gemv_rows`, for many inputs (a prompt chunk) with rows of at most
 * GEMV_WIDE_MAX_I floats: eight weight rows (32 KB at 1,024 inputs, kept in L1) x two inputs per pass, so
 * each input vector loaded from L2 serves eight products rather than four (k3-small's 1,024 x 1,024 and
 * 512 x 1,024 products on two threads: 250-258 -> 256-277 GFLOP/s). Every output is still one 16-lane
 * accumulation over i, hsum16, then the scalar tail: the same bits as `gemv_rows` gives it */
static void gemv_rows_wide(const float *restrict W, int64_t I, const float *restrict X, int64_t ldx, int64_t B,
                           float *restrict Y, int64_t ldy, int64_t o0, int64_t o1) {
    int64_t o = o0;
    for (; o + 8 <= o1; o += 8) {
        const float *ws[8];
        for (int r = 0; r < 8; r++) ws[r] = W + (o + r) * I;
        for (int64_t b = 0; b < B; b += 2) {
            const int64_t nb = B - b < 2 ? B - b : 2; /* a last single input stands in for its pair */
            const float *xs[2] = {X + b * ldx, X + (b + nb - 1) * ldx};
            lanes16 acc[16] = {{0}};
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                const lanes16 x0 = load16(xs[0] + i), x1 = load16(xs[1] + i);
                for (int r = 0; r < 8; r++) {
                    const lanes16 w = load16(ws[r] + i);
                    acc[2 * r] += w * x0;
                    acc[2 * r + 1] += w * x1;
                }
            }
            const lanes16 sums = hsum16x16(acc);
            for (int r = 0; r < 8; r++)
                for (int c = 0; c < nb; c++) {
                    float sum = sums[2 * r + c];
                    for (int64_t j = i; j < I; j++) sum += ws[r][j] * xs[c][j];
                    Y[(b + c) * ldy + o + r] = sum;
                }
        }
    }
    if (o < o1) gemv_rows(W, I, X, ldx, B, Y, ldy, o, o1); /* the last 1-7 rows */
}

/* bf16 weights: dot_bf16, gemv_rows_bf16 */
#define WT uint16_t
#define LOADW(p) load16_bf16(p)
#define WAT(p, j) bf16_at(p, j)
#define NAME(f) f##_bf16
#include "gemv_products.h"
#undef WT
#undef LOADW
#undef WAT
#undef NAME

/* ---- many inputs (a prompt chunk) over bf16, Q8_0 or MXFP4 weights ------------------------------------
 * Eight rows at a time are widened into an fp32 block (48 KB at most, on the stack) that `gemv_rows_wide`
 * then runs over every input, so each weight is converted once per call rather than once per few inputs
 * (the conversions share the ports of the multiply-adds: k3-small's bf16 prompt rows 222 -> ~400 tok/s).
 * Every widening is exact and lays the row out as its own product reads it, so the sums are the bits of
 * that type's gemv_rows. `widen(w, scales, row, I, out)` writes row `row` of the matrix as I floats. */
typedef void (*widen_row_fn)(const void *w, const void *scales, int64_t row, int64_t I, float *out);

static void gemv_rows_staged(widen_row_fn widen, const void *w, const void *scales, int64_t I,
                             const float *restrict X, int64_t ldx, int64_t B, float *restrict Y, int64_t ldy,
                             int64_t o0, int64_t o1) {
    float block[8 * GEMV_WIDE_MAX_I];
    for (int64_t o = o0; o < o1; o += 8) {
        const int64_t n = o1 - o < 8 ? o1 - o : 8;
        for (int64_t r = 0; r < n; r++) widen(w, scales, o + r, I, block + r * I);
        if (n == 8)
            gemv_rows_wide(block, I, X, ldx, B, Y + o, ldy, 0, 8);
        else
            gemv_rows(block, I, X, ldx, B, Y + o, ldy, 0, n);
    }
}

static void widen_bf16(const void *w, const void *scales, int64_t row, int64_t I, float *out) {
    (void)scales;
    const uint16_t *p = (const uint16_t *)w + row * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
        const lanes16 v = load16_bf16(p + i);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < I; i++) out[i] = bf16_at(p, i);
}

/* ---- Q8_0 weights (llama.cpp's 8-bit blocks: int8 codes [O, I], one scale per 32 inputs [O, I/32]) ----
 * A weight is its code times its block's scale, exact in fp32 (8 by 11 significant bits), so the products
 * sum exactly what they would over the widened fp32 matrix, in gemv_rows' order: a Q8_0 matrix gives the
 * bits of its fp32 copy while reading a quarter of the bytes. I is a multiple of 32. */
typedef int32_t v16i __attribute__((vector_size(64)));

/* 16 codes widened and scaled. Written with the instruction set's own sign extension: gcc turns the
 * vector-extension conversion of 16 int8 into a chain of scalar inserts */
static inline lanes16 load16_q8(const int8_t *q, float s) {
    lanes16 v;
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#else
    for (int j = 0; j < 16; j++) v[j] = (float)q[j];
#endif
    return v * s;
}

static inline float dot_q8(const int8_t *restrict q, const float *restrict sc, const float *restrict x, int64_t n) {
    lanes16 acc = {0};
    for (int64_t i = 0; i < n; i += 16) {
        __builtin_prefetch((const char *)(q + i) + GEMV_PREFETCH_BYTES / 4);
        acc += load16_q8(q + i, sc[i / 32]) * load16(x + i);
    }
    return hsum16(acc);
}

/* rows o0..o1 of Y = W X^T for a Q8_0 W: four rows x four inputs per pass (as gemv_rows), one row after
 * another at batch 1 */
static void gemv_rows_q8(const int8_t *restrict Q, const float *restrict S, int64_t I, const float *restrict X,
                         int64_t ldx, int64_t B, float *restrict Y, int64_t ldy, int64_t o0, int64_t o1) {
    const int64_t nb = I / 32;
    int64_t o = o0;
    if (B == 1) {
        for (; o < o1; o++) Y[o] = dot_q8(Q + o * I, S + o * nb, X, I);
        return;
    }
    for (; o + 4 <= o1; o += 4)
        for (int64_t b = 0; b < B; b += 4) {
            const int64_t n = B - b < 4 ? B - b : 4;
            const float *xs[4];
            for (int c = 0; c < 4; c++) xs[c] = X + (b + (c < n ? c : 0)) * ldx;
            lanes16 acc[16] = {{0}};
            for (int64_t i = 0; i < I; i += 16) {
                lanes16 wv[4];
                for (int r = 0; r < 4; r++) wv[r] = load16_q8(Q + (o + r) * I + i, S[(o + r) * nb + i / 32]);
                const lanes16 xv[4] = {load16(xs[0] + i), load16(xs[1] + i), load16(xs[2] + i), load16(xs[3] + i)};
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 4; c++) acc[4 * r + c] += wv[r] * xv[c];
            }
            const lanes16 sums = hsum16x16(acc);
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < n; c++) Y[(b + c) * ldy + o + r] = sums[4 * r + c];
        }
    for (; o < o1; o++)
        for (int64_t b = 0; b < B; b++) Y[b * ldy + o] = dot_q8(Q + o * I, S + o * nb, X + b * ldx, I);
}

/* row `row` of a Q8_0 matrix (scales: its [O, I/32] block scales) as fp32, for gemv_rows_staged */
static void widen_q8(const void *w, const void *scales, int64_t row, int64_t I, float *out) {
    const int8_t *q = (const int8_t *)w + row * I;
    const float *s = (const float *)scales + row * (I / 32);
    for (int64_t i = 0; i < I; i += 16) {
        const lanes16 v = load16_q8(q + i, s[i / 32]);
        memcpy(out + i, &v, sizeof v);
    }
}

/* ---- MXFP4 weights (OCP MX: E2M1 codes, one E8M0 scale per 32 inputs; the compressed-tensors layout:
 * byte j of a block holds element 2j in its low nibble, 2j+1 in its high nibble) --------------------
 * The weights are decoded in registers, 16 codes at a time through a 16-entry table, and never
 * written out: a decode reads 17 bytes per 32 weights instead of 128. The inputs are first split per
 * block into their even and odd elements (`mx_split_input`), so the low and high nibbles each meet a
 * contiguous vector of inputs. */

/* 16 bytes zero-extended to 32-bit lanes, with the instruction set's own extension (gcc turns the
 * vector-extension conversion into scalar inserts: MXFP4 decode 2x slower) */
static inline v16i bytes16(const uint8_t *p) {
    v16i v;
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#else
    for (int j = 0; j < 16; j++) v[j] = p[j];
#endif
    return v;
}

static const lanes16 MX_E2M1 = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0(uint8_t e) {
    /* 2^(e - 127); e = 0 is 2^-127 (a subnormal), e = 255 is NaN by the format */
    if (e == 255) return __builtin_nanf("");
    if (e == 0) return 0x1p-127f;
    uint32_t bits = (uint32_t)e << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* X [B, ldx] (I a multiple of 32) -> Xs [B, I]: per 32-block its 16 even elements, then its 16 odd */
static void mx_split_input(const float *X, int64_t ldx, int64_t B, int64_t I, float *Xs) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t k = 0; k < I; k += 32)
            for (int j = 0; j < 16; j++) {
                Xs[b * I + k + j] = X[b * ldx + k + 2 * j];
                Xs[b * I + k + 16 + j] = X[b * ldx + k + 2 * j + 1];
            }
}

/* rows o0..o1 of Y = W X^T for an MXFP4 W: packed [O, I/2], scales [O, I/32]; Xs from mx_split_input */
static void gemv_rows_mx(const uint8_t *restrict packed, const uint8_t *restrict scales, int64_t I,
                         const float *restrict Xs, int64_t B, float *restrict Y, int64_t ldy, int64_t o0,
                         int64_t o1) {
    const int64_t nb = I / 32;
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *q = packed + o * (I / 2), *sc = scales + o * nb;
        for (int64_t b0 = 0; b0 < B; b0 += 4) {
            const int64_t nbat = B - b0 < 4 ? B - b0 : 4;
            lanes16 acc[4] = {{0}, {0}, {0}, {0}};
            for (int64_t k = 0; k < nb; k++) {
                const v16i codes = bytes16(q + 16 * k);
                const float s = e8m0(sc[k]); /* a power of two: the scaled values are exact (or flushed) */
                const lanes16 lo = __builtin_shuffle(MX_E2M1, codes & 15) * s;
                const lanes16 hi = __builtin_shuffle(MX_E2M1, codes >> 4) * s;
                for (int64_t r = 0; r < nbat; r++) {
                    const float *x = Xs + (b0 + r) * I + 32 * k;
                    acc[r] += lo * load16(x); /* the order of gemv_rows over [lo, hi] and the split input */
                    acc[r] += hi * load16(x + 16);
                }
            }
            for (int64_t r = 0; r < nbat; r++) Y[(b0 + r) * ldy + o] = hsum16(acc[r]);
        }
    }
}

/* row `row` of an MXFP4 matrix (packed codes; scales: its E8M0 bytes) as fp32 laid out as the split input
 * is, [lo 16, hi 16] per 32-block, each value scaled exactly: gemv_rows_mx's sums in its order */
static void widen_mx(const void *w, const void *scales, int64_t row, int64_t I, float *out) {
    const uint8_t *q = (const uint8_t *)w + row * (I / 2), *sc = (const uint8_t *)scales + row * (I / 32);
    for (int64_t k = 0; k < I / 32; k++) {
        const v16i codes = bytes16(q + 16 * k);
        const float s = e8m0(sc[k]);
        const lanes16 lo = __builtin_shuffle(MX_E2M1, codes & 15) * s;
        const lanes16 hi = __builtin_shuffle(MX_E2M1, codes >> 4) * s;
        memcpy(out + 32 * k, &lo, sizeof lo);
        memcpy(out + 32 * k + 16, &hi, sizeof hi);
    }
}

#endif
