/* One SiTU-GLU element, shared by the kernels that apply it (situ_glu.c, moe_experts.c); the derivation
 * is in situ_glu.c. */
#ifndef K3_SITU_H
#define K3_SITU_H

#include <stdint.h>
#include <string.h>

#include "exp_poly.h"

/* One element; `shared_exp` (b1 = 4) is a compile-time constant in each loop below, so neither
 * vectorised loop carries the other's branch. Both exponentials' arguments are <= 0 (k1, k2 < 0), and the
 * result's sign, sign(g) sign(u), is set with one xor of the sign bits. */
static inline float situ_one(float g, float u, float k1, float k2, float scale, int shared_exp) {
    const float ag = __builtin_fabsf(g), au = __builtin_fabsf(u);
    float mg, mu;
    const float eg = exp_expm1_nonpositive(k1 * ag, &mg);
    (void)exp_expm1_nonpositive(k2 * au, &mu);
    const float s = shared_exp ? eg * eg : exp_poly(-ag);
    const float w = g < 0.0f ? s : 1.0f;
    const float v = (mg * mu * w * scale) / ((2.0f + mg) * (1.0f + s) * (2.0f + mu));
    int32_t bg, bu, bv;
    memcpy(&bg, &g, sizeof bg);
    memcpy(&bu, &u, sizeof bu);
    memcpy(&bv, &v, sizeof bv);
    bv ^= (bg ^ bu) & (int32_t)0x80000000;
    float out;
    memcpy(&out, &bv, sizeof out);
    return out;
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
