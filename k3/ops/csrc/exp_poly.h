/* Shared by the native kernels (the .c files beside it): a vectorisable single-precision exp (and expm1,
 * sigmoid built on it). */
#ifndef K3_EXP_POLY_H
#define K3_EXP_POLY_H

#include <stdint.h>
#include <string.h>

/* The shared range reduction for x already in [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2; returns
 * exp(r) - 1 - r = r^2 P(r) (Cephes' degree-6 polynomial for exp(r) without its first two terms) and
 * sets *r and *two_n = 2^n. Written so that gcc vectorises it (with -fno-trapping-math): n is rounded to
 * the nearest integer by adding and subtracting 1.5 * 2^23 instead of a call to floorf, and 2^n is built
 * from that sum's bits (its low mantissa bits hold n + 2^22) rather than by converting n to an integer. */
static inline float exp_reduced_in_range(float x, float *r_out, float *two_n) {
    const float shifted = x * 1.44269504088896341f + 12582912.0f;
    const float n = shifted - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits - 0x4B400000 + 127) << 23;  /* 0x4B400000: the bits of 1.5 * 2^23 */
    memcpy(two_n, &bits, sizeof *two_n);
    *r_out = r;
    return p * r * r;
}

/* the same for any x: clamped to [-87, 88] first (ternary clamps, vectorisable) */
static inline float exp_reduced(float x, float *r_out, float *two_n) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    return exp_reduced_in_range(x, r_out, two_n);
}

/* exp(x) and exp(x) - 1 for x in [-87, 88] (clamped outside) from one reduction, each as accurate as on
 * its own: exp(x) - 1 avoids the cancellation of exp(x) - 1 near 0 (for |x| < ln2 / 2, n = 0, it is
 * r + r^2 P(r) exactly as the polynomial gives it; elsewhere |result| > 0.29), and 1 + expm1 would lose
 * exp's relative accuracy where exp(x) is small. The wrappers below take one of the two; the compiler
 * drops the other. */
static inline float exp_expm1_poly(float x, float *em1) {
    float r, two_n;
    const float q = exp_reduced(x, &r, &two_n);
    *em1 = (q + r) * two_n + (two_n - 1.0f);
    return (q + r + 1.0f) * two_n;
}

/* exp_expm1_poly for x <= 0 (clamped at -87 only: one compare and blend fewer per call) */
static inline float exp_expm1_nonpositive(float x, float *em1) {
    float r, two_n;
    const float q = exp_reduced_in_range(x < -87.0f ? -87.0f : x, &r, &two_n);
    *em1 = (q + r) * two_n + (two_n - 1.0f);
    return (q + r + 1.0f) * two_n;
}

/* exp(x) for x <= 0 (clamped at -87 only) */
static inline float exp_nonpositive(float x) {
    float unused;
    return exp_expm1_nonpositive(x, &unused);
}

static inline float exp_poly(float x) {
    float unused;
    return exp_expm1_poly(x, &unused);
}

static inline float expm1_poly(float x) {
    float em1;
    (void)exp_expm1_poly(x, &em1);
    return em1;
}

/* sigmoid(x) = 1 / (1 + exp(-x)) (SiLU is x sigmoid(x)); exact limits 0 and 1 at the clamp */
static inline float sigmoid_poly(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

#endif
