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

#include "situ.h"

void k3_situ_glu(const float *restrict gate, const float *restrict up, float *restrict out, int64_t n,
                 float beta1, float beta2) {
    situ_rows(gate, up, out, n, beta1, beta2);
}

/* The same forward split over torch's threads (OpenMP) when there are many elements: the training path,
 * where one call covers a whole micro-batch's [T, I] activations. Elements are independent, so the
 * result does not depend on the team's size. */
#define MIN_PARALLEL_ELEMENTS (1 << 15)
#define CHUNK 4096

void k3_situ_glu_team(const float *restrict gate, const float *restrict up, float *restrict out, int64_t n,
                      float beta1, float beta2) {
#pragma omp parallel for schedule(static) if (n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t lo = 0; lo < n; lo += CHUNK) {
        const int64_t m = n - lo < CHUNK ? n - lo : CHUNK;
        situ_rows(gate + lo, up + lo, out + lo, m, beta1, beta2);
    }
}

/* The gradients of out = A(g) B(u), A(g) = b1 tanh(g / b1) sigma(g), B(u) = b2 tanh(u / b2):
 *   dg = dout B(u) A'(g),  A'(g) = sigma(g) [sech^2(g / b1) + b1 tanh(g / b1) (1 - sigma(g))]
 *   du = dout A(g) sech^2(u / b2)
 * from the same |g|, |u| forms as the forward: with m = expm1(-2|y|), tanh|y| = -m / (2 + m) and
 * sech^2 y = 4 (1 + m) / (2 + m)^2 (no 1 - tanh^2 cancellation); with s = exp(-|g|), sigma(g) and
 * 1 - sigma(g) are {1, s} / (1 + s) by the sign of g. */
static inline void situ_grad_one(float g, float u, float d, float k1, float k2, float beta1, float beta2,
                                 int shared_exp, float *dg, float *du) {
    const float ag = __builtin_fabsf(g), au = __builtin_fabsf(u);
    float mg, mu;
    const float eg = exp_expm1_nonpositive(k1 * ag, &mg);
    (void)exp_expm1_nonpositive(k2 * au, &mu);
    const float s = shared_exp ? eg * eg : exp_poly(-ag);
    const float ig = 1.0f / (2.0f + mg), iu = 1.0f / (2.0f + mu), is = 1.0f / (1.0f + s);
    const float tg_abs = -mg * ig, tu_abs = -mu * iu;
    const float tg = g < 0.0f ? -tg_abs : tg_abs, tu = u < 0.0f ? -tu_abs : tu_abs;
    const float sig = (g < 0.0f ? s : 1.0f) * is, one_minus = (g < 0.0f ? 1.0f : s) * is;
    const float sech_g = 4.0f * (1.0f + mg) * ig * ig, sech_u = 4.0f * (1.0f + mu) * iu * iu;
    const float a = beta1 * tg * sig, b = beta2 * tu;
    const float da = sig * (sech_g + beta1 * tg * one_minus);
    *dg = d * b * da;
    *du = d * a * sech_u;
}

/* dgate, dup [n] from gate, up, dout [n] (no output may alias an input). */
void k3_situ_glu_backward(const float *restrict gate, const float *restrict up, const float *restrict dout,
                          float *restrict dgate, float *restrict dup, int64_t n, float beta1, float beta2) {
    const float k1 = -2.0f / beta1, k2 = -2.0f / beta2;
    const int shared = beta1 == 4.0f;
#pragma omp parallel for schedule(static) if (n >= MIN_PARALLEL_ELEMENTS)
    for (int64_t lo = 0; lo < n; lo += CHUNK) {
        const int64_t hi = n - lo < CHUNK ? n : lo + CHUNK;
        if (shared)
            for (int64_t i = lo; i < hi; i++)
                situ_grad_one(gate[i], up[i], dout[i], k1, k2, beta1, beta2, 1, dgate + i, dup + i);
        else
            for (int64_t i = lo; i < hi; i++)
                situ_grad_one(gate[i], up[i], dout[i], k1, k2, beta1, beta2, 0, dgate + i, dup + i);
    }
}
