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

/* w . x: one 16-lane accumulation over i, hsum16, then the scalar tail (every product path sums a row
 * this way, so a result does not depend on the path). Prefetches GEMV_PREFETCH_BYTES past each cache
 * line of `w` it reads: at batch 1 the rows are read one after another, so this runs one stream ahead */
static inline float dot(const float *restrict w, const float *restrict x, int64_t n) {
    lanes16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __builtin_prefetch((const char *)(w + i) + GEMV_PREFETCH_BYTES);
        acc += load16(w + i) * load16(x + i);
    }
    float s = hsum16(acc);
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

/* rows o0..o1 of Y = W X^T: W [O, I] (row stride I), X [B, ldx], Y [B, ldy] */
static void gemv_rows(const float *restrict W, int64_t I, const float *restrict X, int64_t ldx, int64_t B,
                      float *restrict Y, int64_t ldy, int64_t o0, int64_t o1) {
    int64_t o = o0;
    if (B == 1) { /* one row after another: a single sequential stream per thread */
        for (; o < o1; o++) Y[o] = dot(W + o * I, X, I);
        return;
    }
    /* four weight rows x four inputs per pass: 16 accumulators, 8 loads per 16 FMAs (one row at a time
     * would need 5 loads per 4), reduced together (hsum16x16); the last 1-3 inputs run the same block
     * with the block's first input standing in for the missing ones (their sums are dropped). Each
     * output is still one 16-lane accumulation over i, hsum16, then the scalar tail, exactly as in the
     * other paths, so a row's result does not depend on B */
    const int64_t passes = (B + 3) / 4; /* over the block's rows, one per four inputs */
    for (; o + 4 <= o1 && B >= 2; o += 4) {
        const float *ws[4] = {W + o * I, W + (o + 1) * I, W + (o + 2) * I, W + (o + 3) * I};
        for (int64_t b = 0; b < B; b += 4) {
            const int64_t nb = B - b < 4 ? B - b : 4, pass = b / 4;
            const float *xs[4];
            for (int c = 0; c < 4; c++) xs[c] = X + (b + (c < nb ? c : 0)) * ldx;
            lanes16 acc[16] = {{0}};
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                /* the prefetches of the rows ahead are spread over the passes (pass p takes rows p, p +
                 * passes, ...; from the fifth pass on none): all four rows in the first pass would
                 * outnumber the core's line fill buffers and stall its loads while the later passes,
                 * which find the block in L1, issue none (k3-small, 1,024 x 1,024 at 16 inputs on two
                 * threads: 194 -> 223 GFLOP/s) */
                for (int64_t r = pass; r < 4; r += passes) __builtin_prefetch(ws[r] + GEMV_PREFETCH_ROWS * I + i);
                const lanes16 wv[4] = {load16(ws[0] + i), load16(ws[1] + i), load16(ws[2] + i), load16(ws[3] + i)};
                const lanes16 xv[4] = {load16(xs[0] + i), load16(xs[1] + i), load16(xs[2] + i), load16(xs[3] + i)};
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 4; c++) acc[4 * r + c] += wv[r] * xv[c];
            }
            const lanes16 sums = hsum16x16(acc);
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < nb; c++) {
                    float sum = sums[4 * r + c];
                    for (int64_t j = i; j < I; j++) sum += ws[r][j] * xs[c][j];
                    Y[(b + c) * ldy + o + r] = sum;
                }
        }
    }
    for (; o < o1; o++) {
        const float *w = W + o * I;
        int64_t b = 0;
        for (; b + 4 <= B; b += 4) {
            const float *x0 = X + b * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            lanes16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                const lanes16 wv = load16(w + i);
                a0 += wv * load16(x0 + i);
                a1 += wv * load16(x1 + i);
                a2 += wv * load16(x2 + i);
                a3 += wv * load16(x3 + i);
            }
            float s0 = hsum16(a0), s1 = hsum16(a1), s2 = hsum16(a2), s3 = hsum16(a3);
            for (; i < I; i++) {
                s0 += w[i] * x0[i];
                s1 += w[i] * x1[i];
                s2 += w[i] * x2[i];
                s3 += w[i] * x3[i];
            }
            Y[b * ldy + o] = s0, Y[(b + 1) * ldy + o] = s1, Y[(b + 2) * ldy + o] = s2, Y[(b + 3) * ldy + o] = s3;
        }
        for (; b < B; b++) Y[b * ldy + o] = dot(w, X + b * ldx, I);
    }
}

/* rows o0..o1 of Y = W X^T as `gemv_rows`, for many inputs (a prompt chunk) with rows of at most
 * GEMV_WIDE_MAX_I floats: eight weight rows (32 KB at 1,024 inputs, kept in L1) x two inputs per pass, so
 * each input vector loaded from L2 serves eight products rather than four (k3-small's 1,024 x 1,024 and
 * 512 x 1,024 products on two threads: 250-258 -> 256-277 GFLOP/s). Every output is still one 16-lane
 * accumulation over i, hsum16, then the scalar tail: the same bits as `gemv_rows` gives it */
#define GEMV_WIDE_MAX_I 1536
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

/* ---- MXFP4 weights (OCP MX: E2M1 codes, one E8M0 scale per 32 inputs; the compressed-tensors layout:
 * byte j of a block holds element 2j in its low nibble, 2j+1 in its high nibble) --------------------
 * The weights are decoded in registers, 16 codes at a time through a 16-entry table, and never
 * written out: a decode reads 17 bytes per 32 weights instead of 128. The inputs are first split per
 * block into their even and odd elements (`mx_split_input`), so the low and high nibbles each meet a
 * contiguous vector of inputs. */
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

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
                v16b raw;
                memcpy(&raw, q + 16 * k, sizeof raw);
                const v16i codes = __builtin_convertvector(raw, v16i);
                const lanes16 lo = __builtin_shuffle(MX_E2M1, codes & 15), hi = __builtin_shuffle(MX_E2M1, codes >> 4);
                const float s = e8m0(sc[k]);
                for (int64_t r = 0; r < nbat; r++) {
                    const float *x = Xs + (b0 + r) * I + 32 * k;
                    acc[r] += (lo * load16(x) + hi * load16(x + 16)) * s;
                }
            }
            for (int64_t r = 0; r < nbat; r++) Y[(b0 + r) * ldy + o] = hsum16(acc[r]);
        }
    }
}

#endif
