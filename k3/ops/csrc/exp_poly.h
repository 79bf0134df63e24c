/* Shared by the native kernels (the .c files beside it): a vectorisable single-precision exp. */
#ifndef K3_EXP_POLY_H
#define K3_EXP_POLY_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x in [-87, 88]: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial.
 * Written so that gcc vectorises it (with -fno-trapping-math): ternary clamps, and n rounded to the
 * nearest integer by adding and subtracting 1.5 * 2^23 instead of a call to floorf. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif
