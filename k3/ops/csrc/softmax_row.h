/* One row of an online (streaming) softmax block step, shared by online_softmax.c and mla_stream.c (the
 * contract is in online_softmax.c). */
#ifndef K3_SOFTMAX_ROW_H
#define K3_SOFTMAX_ROW_H

#include <math.h>
#include <stdint.h>

#include "exp_poly.h"

/* row [s] scores -> probabilities in place (0 past the first n); m, l: this row's running max and
 * denominator (updated); returns corr = exp(m_old - m_safe). Every exponent is <= 0 (m_safe is at least
 * the row's maximum and the old one), so the exponentials clamp only below. */
static inline float softmax_row_step(float *restrict row, int64_t s, int64_t n, float *m_io, float *l_io) {
    float top[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)  /* 8 partial maxima: a vectorisable reduction */
        for (int t = 0; t < 8; t++) top[t] = row[j + t] > top[t] ? row[j + t] : top[t];
    float mx = -INFINITY;
    for (; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    for (int t = 0; t < 8; t++) mx = top[t] > mx ? top[t] : mx;
    const float m_new = (*m_io) > mx ? (*m_io) : mx;
    const float m_safe = isinf(m_new) ? 0.0f : m_new;
    float sum = 0.0f;
    float part[8] = {0};
    for (j = 0; j + 8 <= n; j += 8)
        for (int t = 0; t < 8; t++) {
            const float p = exp_nonpositive(row[j + t] - m_safe);
            row[j + t] = p;
            part[t] += p;
        }
    for (; j < n; j++) {
        row[j] = exp_nonpositive(row[j] - m_safe);
        sum += row[j];
    }
    for (int t = 0; t < 8; t++) sum += part[t];
    for (j = n; j < s; j++) row[j] = 0.0f;
    const float corr = isinf(*m_io) ? 0.0f : exp_nonpositive(*m_io - m_safe);
    *l_io = *l_io * corr + sum;
    *m_io = m_new;
    return corr;
}

#endif
