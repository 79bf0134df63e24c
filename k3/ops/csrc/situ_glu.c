/* SiTU-GLU without autograd (k3/ops/glu.py): out = b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2), fp32,
 * one vectorised pass with two (b1 = 4) or three exponentials and a single division per element.
 *
 * Everything is written in terms of |g| and |u|, so no intermediate can overflow:
 *   tanh(y)  = sign(y) * (-m) / (2 + m),          m = expm1(-2|y|) in (-1, 0]
 *   sigma(g) = w / (1 + s),  s = exp(-|g|),      w = 1 for g >= 0, s for g < 0
 * and the three factors share one denominator (2 + m_g)(1 + s)(2 + m_u), which lies in [1, 8]. expm1
 * keeps tanh's relative accuracy near 0 (no series needed), and for |g|, |u| -> inf every factor goes to
 * its exact limit (m -> -1, s -> 0). With b1 = 4, exp(-|g|) = exp(-|g| / 2)^2, and exp(-|g| / 2) comes
 * from m_g's own range reduction: that saves the third exponential.
 */
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

void k3_situ_glu(const float *restrict gate, const float *restrict up, float *restrict out, int64_t n,
                 float beta1, float beta2) {
    const float k1 = -2.0f / beta1, k2 = -2.0f / beta2, scale = beta1 * beta2;
    if (beta1 == 4.0f)
        for (int64_t i = 0; i < n; i++) out[i] = situ_one(gate[i], up[i], k1, k2, scale, 1);
    else
        for (int64_t i = 0; i < n; i++) out[i] = situ_one(gate[i], up[i], k1, k2, scale, 0);
}
