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
#include <stdint.h>

#include "softmax_row.h"

void k3_online_softmax_block(float *scores, int64_t R, int64_t s, int64_t ld, const int64_t *limit, float *m,
                             float *l, float *corr) {
    for (int64_t r = 0; r < R; r++) {
        int64_t n = s;
        if (limit) n = limit[r] < 0 ? 0 : (limit[r] < s ? limit[r] : s);
        corr[r] = softmax_row_step(scores + r * ld, s, n, m + r, l + r);
    }
}
