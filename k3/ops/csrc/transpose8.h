/* An 8 x 8 fp32 block transpose: eight 8-lane loads, three shuffle stages and eight stores with AVX; the
 * plain element loop elsewhere. Used by kda_fused.c. */
#ifndef K3_TRANSPOSE8_H
#define K3_TRANSPOSE8_H

#include <stdint.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

/* dst[j][i] = src[i][j] for i, j < 8; rows lds and ldd floats apart */
static inline void transpose8(const float *restrict src, int64_t lds, float *restrict dst, int64_t ldd) {
#ifdef __AVX__
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) { /* interleave row pairs */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* then pairs of pairs: 4 x 4 blocks within each 128-bit half */
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) { /* then swap the 128-bit halves across row blocks 0-3 and 4-7 */
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
#else
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) dst[j * ldd + i] = src[i * lds + j];
#endif
}

#endif
