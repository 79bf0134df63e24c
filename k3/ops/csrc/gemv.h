/* Matrix-vector products for decode: Y[b, o] = W[o, :] . X[b, :] for a few rows b of X, fp32.
 *
 * At decode the weights are read once per token and dominate the time, so every product streams each
 * weight row exactly once, in order, and applies it to all B inputs while it is in L1 (the inputs, B x I
 * floats, stay in L1/L2). For one input four weight rows share each load of x. 16-lane vectors (one
 * AVX-512 register, two AVX2 ones) and 64-byte loads; a tail shorter than 16 runs scalar. */
#ifndef K3_GEMV_H
#define K3_GEMV_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 ld16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum16(v16 v) {
    /* pairwise, so that the order is fixed whatever the vector width the compiler picks */
    float s[16];
    memcpy(s, &v, sizeof s);
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += ld16(a + i) * ld16(b + i);
    float s = hsum16(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* rows o0..o1 of Y = W X^T: W [O, I] (row stride I), X [B, ldx], Y [B, ldy] */
static void gemv_rows(const float *restrict W, int64_t I, const float *restrict X, int64_t ldx, int64_t B,
                      float *restrict Y, int64_t ldy, int64_t o0, int64_t o1) {
    int64_t o = o0;
    if (B == 1) {
        for (; o + 4 <= o1; o += 4) {
            const float *w0 = W + o * I, *w1 = w0 + I, *w2 = w1 + I, *w3 = w2 + I;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                const v16 x = ld16(X + i);
                a0 += ld16(w0 + i) * x;
                a1 += ld16(w1 + i) * x;
                a2 += ld16(w2 + i) * x;
                a3 += ld16(w3 + i) * x;
            }
            float s0 = hsum16(a0), s1 = hsum16(a1), s2 = hsum16(a2), s3 = hsum16(a3);
            for (; i < I; i++) {
                s0 += w0[i] * X[i];
                s1 += w1[i] * X[i];
                s2 += w2[i] * X[i];
                s3 += w3[i] * X[i];
            }
            Y[o] = s0, Y[o + 1] = s1, Y[o + 2] = s2, Y[o + 3] = s3;
        }
        for (; o < o1; o++) Y[o] = dot(W + o * I, X, I);
        return;
    }
    for (; o < o1; o++) {
        const float *w = W + o * I;
        int64_t b = 0;
        for (; b + 4 <= B; b += 4) {
            const float *x0 = X + b * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                const v16 wv = ld16(w + i);
                a0 += wv * ld16(x0 + i);
                a1 += wv * ld16(x1 + i);
                a2 += wv * ld16(x2 + i);
                a3 += wv * ld16(x3 + i);
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

#endif
