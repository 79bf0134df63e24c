/* One latent key block of streaming MLA attention in the expanded (per-head keys) form, tiled so that a
 * tile's scores, keys and values stay in L2 (k3/ops/mla.py, `mla_attention_over_blocks`, expand=True).
 *
 * Row b of the batch, block of s latents lat [s, R + Dr] = [c_kv | k_pe] at key positions s0 .. s0+s-1:
 *   kv [s, H (Dn + Dv)]  = c_kv W_kvb^T                      one SGEMM (W_kvb = kv_b_proj.weight)
 *   keys_h [s, Dn + Dr]  = [kv[:, h, :Dn] | k_pe]            copied per head (k_pe is shared)
 *   values_h [s, Dv]     = kv[:, h, Dn:]                     read in place (leading dim H (Dn + Dv))
 * then per head and per tile of at most `tile` queries (q [B, H, T, Dn + Dr], already scaled):
 *   scores [tq, s] = q_tile keys_h^T                          SGEMM
 *   online softmax step per row (softmax_row.h; row t sees keys j < limit_t = q_pos[t] - s0 + 1)
 *   acc_tile = acc_tile * corr + p values_h                   scale, then SGEMM with beta = 1
 * Running state m, l [B, H, T] and acc [B, H, T, Dv] carry across blocks; the caller divides by l at the
 * end. Tiles whose queries all precede the block are skipped. scratch: s H (Dn + Dv) + s (Dn + Dr) +
 * tile * s floats.
 */
#include <stdint.h>
#include <string.h>

#include "blas.h"
#include "softmax_row.h"

void k3_mla_block_expanded(void *sgemm_ptr, const float *q, const float *lat, const float *w_kvb,
                           const int64_t *q_pos, int64_t B, int64_t H, int64_t T, int64_t s, int64_t s0, int64_t R,
                           int64_t Dn, int64_t Dr, int64_t Dv, int64_t tile, float *m, float *l, float *acc,
                           float *scratch) {
    sgemm_fn sgemm = (sgemm_fn)sgemm_ptr;
    const int64_t Dq = Dn + Dr, W = H * (Dn + Dv), L = R + Dr;
    float *kv = scratch, *keys = kv + s * W, *scores = keys + s * Dq;
    for (int64_t b = 0; b < B; b++) {
        const float *lb = lat + b * s * L;
        const int64_t *pos = q_pos ? q_pos + b * T : NULL;
        gemm_abt(sgemm, lb, (int)L, w_kvb, (int)R, kv, (int)W, (int)s, (int)W, (int)R, 0.0f);
        for (int64_t h = 0; h < H; h++) {
            for (int64_t j = 0; j < s; j++) {
                memcpy(keys + j * Dq, kv + j * W + h * (Dn + Dv), (size_t)Dn * sizeof(float));
                memcpy(keys + j * Dq + Dn, lb + j * L + R, (size_t)Dr * sizeof(float));
            }
            const float *values = kv + h * (Dn + Dv) + Dn;
            const int64_t bh = b * H + h;
            for (int64_t t0 = 0; t0 < T; t0 += tile) {
                const int64_t tq = T - t0 < tile ? T - t0 : tile;
                if (pos && pos[t0 + tq - 1] < s0) continue; /* positions ascend: the whole tile precedes */
                const float *qt = q + (bh * T + t0) * Dq;
                float *at = acc + (bh * T + t0) * Dv, *mt = m + bh * T + t0, *lt = l + bh * T + t0;
                gemm_abt(sgemm, qt, (int)Dq, keys, (int)Dq, scores, (int)s, (int)tq, (int)s, (int)Dq, 0.0f);
                for (int64_t r = 0; r < tq; r++) {
                    int64_t n = s;
                    if (pos) {
                        const int64_t limit = pos[t0 + r] - s0 + 1;
                        n = limit < 0 ? 0 : (limit < s ? limit : s);
                    }
                    const float corr = softmax_row_step(scores + r * s, s, n, mt + r, lt + r);
                    float *restrict a = at + r * Dv;
                    for (int64_t d = 0; d < Dv; d++) a[d] *= corr;
                }
                gemm_ab(sgemm, scores, (int)s, values, (int)W, at, (int)Dv, (int)tq, (int)Dv, (int)s, 1.0f);
            }
        }
    }
}
