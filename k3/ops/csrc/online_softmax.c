/* One key block of an online (streaming) softmax, in place: the inner step of
 * k3.ops.mla.mla_attention_over_blocks, which otherwise spends ~6 torch passes per block on it.
 *
 * scores [R][s] fp32 (row r at scores + r * ld); running max m [R] and denominator l [R]; limit [R] or
 * NULL: row r sees keys j < limit[r] of this block (the causal mask; <= 0: none, >= s: all). For each row:
 *   m_new = max(m, max visible score), m_safe = m_new or 0 while it is still -inf (nothing seen yet),
 *   p_j = exp(score_j - m_safe) for visible keys, 0 for the others (written over the scores),
 *   corr = exp(m - m_safe) (0 when m was -inf), l = l * corr + sum_j p_j, m = m_new.
 * The caller then rescales its accumulator by corr and adds p @ values.
 */
#include <math.h>
#include <stdint.h>

#include "exp_poly.h"

void k3_online_softmax_block(float *scores, int64_t R, int64_t s, int64_t ld, const int64_t *limit, float *m,
                             float *l, float *corr) {
    for (int64_t r = 0; r < R; r++) {
        float *restrict row = scores + r * ld;
        int64_t n = s;
        if (limit) n = limit[r] < 0 ? 0 : (limit[r] < s ? limit[r] : s);
        float top[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        int64_t j = 0;
        for (; j + 8 <= n; j += 8)  /* 8 partial maxima: a vectorisable reduction */
            for (int t = 0; t < 8; t++) top[t] = row[j + t] > top[t] ? row[j + t] : top[t];
        float mx = -INFINITY;
        for (; j < n; j++) mx = row[j] > mx ? row[j] : mx;
        for (int t = 0; t < 8; t++) mx = top[t] > mx ? top[t] : mx;
        const float m_new = m[r] > mx ? m[r] : mx;
        const float m_safe = isinf(m_new) ? 0.0f : m_new;
        float sum = 0.0f;
        float part[8] = {0};
        for (j = 0; j + 8 <= n; j += 8)
            for (int t = 0; t < 8; t++) {
                const float p = exp_poly(row[j + t] - m_safe);
                row[j + t] = p;
                part[t] += p;
            }
        for (; j < n; j++) {
            row[j] = exp_poly(row[j] - m_safe);
            sum += row[j];
        }
        for (int t = 0; t < 8; t++) sum += part[t];
        for (j = n; j < s; j++) row[j] = 0.0f;
        corr[r] = isinf(m[r]) ? 0.0f : exp_poly(m[r] - m_safe);
        l[r] = l[r] * corr[r] + sum;
        m[r] = m_new;
    }
}
