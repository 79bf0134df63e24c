/* One SiTU-GLU element, shared by the kernels that apply it (situ_glu.c, moe_experts.c); the derivation
 * is in situ_glu.c. */
#ifndef K3_SITU_H
#define K3_SITU_H

#include <stdint.h>

#include "exp_poly.h"

static inline float sign_of(float x, float magnitude) { return x < 0.0f ? -magnitude : magnitude; }

/* One element; `shared_exp` (b1 = 4) is a compile-time constant in each loop below, so neither
 * vectorised loop carries the other's branch. */
static inline float situ_one(float g, float u, float k1, float k2, float scale, int shared_exp) {
    const float ag = g < 0.0f ? -g : g, au = u < 0.0f ? -u : u;
    float mg;
    const float eg = exp_expm1_poly(k1 * ag, &mg), mu = expm1_poly(k2 * au);
    const float s = shared_exp ? eg * eg : exp_poly(-ag);
    const float w = g < 0.0f ? s : 1.0f;
    const float v = (mg * mu * w * scale) / ((2.0f + mg) * (1.0f + s) * (2.0f + mu));
    return sign_of(g, sign_of(u, v));
}

/* out[i] = SiTU(gate[i], up[i]) for i < n; out may alias gate. */
static inline void situ_rows(const float *gate, const float *up, float *out, int64_t n, float beta1, float beta2) {
    const float k1 = -2.0f / beta1, k2 = -2.0f / beta2, scale = beta1 * beta2;
    if (beta1 == 4.0f)
        for (int64_t i = 0; i < n; i++) out[i] = situ_one(gate[i], up[i], k1, k2, scale, 1);
    else
        for (int64_t i = 0; i < n; i++) out[i] = situ_one(gate[i], up[i], k1, k2, scale, 0);
}

#endif
