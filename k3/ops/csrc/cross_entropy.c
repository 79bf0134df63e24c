/* Softmax cross-entropy of a block of logit rows, turned into its gradient in place (k3/train/loss.py,
 * `chunked_linear_cross_entropy`; the torch ops beside it are the reference):
 *
 *   loss[r]     = lse(x_r) - x_r[label_r]                      (0 for an ignored row, label < 0)
 *   x_r        <- scale (softmax(x_r) - onehot(label_r))       (0 for an ignored row)
 *
 * Per row one pass finds the maximum, one stores e = exp(x - max) while summing it, and one scales e by
 * scale / sum and subtracts scale at the label: exp runs once per logit (the torch form runs it twice,
 * in logsumexp and again for the softmax, and makes five passes over the [rows, V] block). Sums are fp32
 * in 16 lanes (lanes.h). Rows are split over torch's threads (OpenMP); denormals are zero meanwhile (ftz.h).
 */
#include <math.h>
#include <stdint.h>

#include "exp_poly.h"
#include "ftz.h"
#include "lanes.h"

#define MIN_PARALLEL_ELEMENTS (1 << 15)

void k3_softmax_xent_grad(float *x, const int64_t *labels, float *loss, int64_t rows, int64_t V, float scale) {
#pragma omp parallel if (rows * V >= MIN_PARALLEL_ELEMENTS)
    {
        const unsigned mode = ftz_begin();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *restrict xr = x + r * V;
            const int64_t label = labels[r];
            if (label < 0) {
                loss[r] = 0.0f;
                for (int64_t c = 0; c < V; c++) xr[c] = 0.0f;
                continue;
            }
            float m[16], top = -INFINITY; /* the maximum in 16 lanes: gcc vectorises this form */
            for (int j = 0; j < 16; j++) m[j] = -INFINITY;
            int64_t i = 0;
            for (; i + 16 <= V; i += 16)
                for (int j = 0; j < 16; j++) m[j] = xr[i + j] > m[j] ? xr[i + j] : m[j];
            for (int j = 0; j < 16; j++) top = m[j] > top ? m[j] : top;
            for (; i < V; i++) top = xr[i] > top ? xr[i] : top;
            const float target = xr[label];
            for (int64_t c = 0; c < V; c++) xr[c] = exp_nonpositive(xr[c] - top);
            lanes16 acc = {0}; /* the row is in L1 now: summing it in a second loop costs little */
            int64_t c = 0;
            for (; c + 16 <= V; c += 16) acc += load16(xr + c);
            float total = 0.0f;
            for (int j = 0; j < 16; j++) total += acc[j];
            for (; c < V; c++) total += xr[c];
            loss[r] = (top + logf(total)) - target;
            const float k = scale / total;
            for (int64_t j = 0; j < V; j++) xr[j] *= k;
            xr[label] -= scale;
        }
        ftz_end(mode);
    }
}
