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
