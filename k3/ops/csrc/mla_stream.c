/* One latent key block of streaming MLA attention in the expanded (per-head keys) form, tiled so that a
 * tile's scores, keys and values stay in L2 (k3/ops/mla.py, `mla_attention_over_blocks`, expand=True).
 *
 * Row b of the batch, block of s latents lat [s, R + Dr] = [c_kv | k_pe] at key positions s0 .. s0+s-1,
 * taken SUB_BLOCK keys at a time, each step padded to sp = its keys rounded up to 16 (the padding keys
 * score 0 and are masked; their values are 0). Per head h:
 *   kv_h [sp, Dn + Dv]    = c_kv W_kvb[h]^T                   (w_kvbT = W_kvb^T [R, H (Dn + Dv)])
 *   keysT_h [Dn + Dr, sp] = [kv_h[:, :Dn] | k_pe]^T           (k_pe is shared by the heads)
 *   values_h [sp, Dv]     = kv_h[:, Dn:]                     read in place
 * then per tile of at most `tile` queries (q [B, H, T, Dn + Dr], already scaled):
 *   scores [tq, sp] = q_tile keysT_h
 *   online softmax step per row (softmax_row.h; row t sees keys j < limit_t = q_pos[t] - s0 + 1, and
 *   never the padding)
 *   acc_tile = acc_tile * corr + p values_h
 * The products are small_gemm.h's panel-blocked ones (no packing: every operand is already in L2).
 * Running state m, l [B, H, T] and acc [B, H, T, Dv] carry across blocks; the caller divides by l at the
 * end. Tiles whose queries all precede the block are skipped. Needs Dn + Dv and Dv multiples of 16 (the
 * caller checks). scratch per thread: sp (Dn + Dv + Dn + Dr + tile + R + Dr) floats, sp = min(s, SUB_BLOCK) rounded up
 * to 16.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "small_gemm.h"
#include "softmax_row.h"
#include "transpose8.h"

#define SUB_BLOCK 256 /* keys per step: one head's keys, values and a tile's scores stay in L2 together */

/* keysT [Dq][sp] = per-head keys [kv[:, h, :Dn] | k_pe]^T (8 x 8 blocks; Dn, Dr multiples of 8) */
static void head_keys(const float *kv, int64_t W, const float *lat, int64_t L, int64_t R, int64_t Dn, int64_t Dr,
                      int64_t sp, float *keysT) {
    for (int64_t j = 0; j < sp; j += 8) {
        for (int64_t d = 0; d < Dn; d += 8) transpose8(kv + j * W + d, W, keysT + d * sp + j, sp);
        for (int64_t d = 0; d < Dr; d += 8) transpose8(lat + j * L + R + d, L, keysT + (Dn + d) * sp + j, sp);
    }
}

/* one (row, head) of the block step over keys [s0, s0 + s) */
static void head_step(const float *q, const float *lb, const float *w_kvbT, const int64_t *pos, int64_t H,
                      int64_t T, int64_t s, int64_t s0, int64_t R, int64_t Dn, int64_t Dr, int64_t Dv, int64_t tile,
                      int64_t b, int64_t h, float *m, float *l, float *acc, float *scratch) {
    const int64_t Dq = Dn + Dr, W = H * (Dn + Dv), L = R + Dr, sp = (s + 15) / 16 * 16;
    float *kv = scratch, *keysT = kv + sp * (Dn + Dv), *scores = keysT + sp * Dq, *lat_p = scores + tile * sp;
    if (sp != s) { /* the padded copy of a short block: zero latents give zero keys and values */
        memcpy(lat_p, lb, sizeof(float) * (size_t)(s * L));
        memset(lat_p + s * L, 0, sizeof(float) * (size_t)((sp - s) * L));
        lb = lat_p;
    }
    /* this head's keys and values only: they stay in L2 */
    gemm_nn_panels(sp, Dn + Dv, R, lb, L, w_kvbT + h * (Dn + Dv), W, kv, Dn + Dv, 0);
    head_keys(kv, Dn + Dv, lb, L, R, Dn, Dr, sp, keysT);
    const float *values = kv + Dn;
    const int64_t bh = b * H + h;
    for (int64_t t0 = 0; t0 < T; t0 += tile) {
        const int64_t tq = T - t0 < tile ? T - t0 : tile;
        if (pos && pos[t0 + tq - 1] < s0) continue; /* positions ascend: the whole tile precedes */
        const float *qt = q + (bh * T + t0) * Dq;
        float *at = acc + (bh * T + t0) * Dv, *mt = m + bh * T + t0, *lt = l + bh * T + t0;
        gemm_nn_panels(tq, sp, Dq, qt, Dq, keysT, sp, scores, sp, 0);
        for (int64_t r = 0; r < tq; r++) {
            int64_t n = s;
            if (pos) {
                const int64_t limit = pos[t0 + r] - s0 + 1;
                n = limit < 0 ? 0 : (limit < s ? limit : s);
            }
            const float corr = softmax_row_step(scores + r * sp, sp, n, mt + r, lt + r);
            float *restrict a = at + r * Dv;
            for (int64_t d = 0; d < Dv; d++) a[d] *= corr;
        }
        gemm_nn_panels(tq, Dv, sp, scores, sp, values, Dn + Dv, at, Dv, 1);
    }
}

/* Every (row, head) pair carries its own running state, so the pairs are split over `threads` threads
 * (an OpenMP team, torch's runtime), each with its own `scratch_per_thread` floats: results are the same
 * for any thread count. */
void k3_mla_block_expanded(const float *q, const float *lat, const float *w_kvbT, const int64_t *q_pos, int64_t B,
                           int64_t H, int64_t T, int64_t s, int64_t s0, int64_t R, int64_t Dn, int64_t Dr, int64_t Dv,
                           int64_t tile, float *m, float *l, float *acc, float *scratch, int64_t threads,
                           int64_t scratch_per_thread) {
    const int64_t L = R + Dr;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const int64_t *pos = q_pos ? q_pos + b * T : NULL;
        float *mine = scratch + omp_get_thread_num() * scratch_per_thread;
        for (int64_t k0 = 0; k0 < s; k0 += SUB_BLOCK) { /* SUB_BLOCK keys per step */
            const int64_t n = s - k0 < SUB_BLOCK ? s - k0 : SUB_BLOCK;
            head_step(q, lat + b * s * L + k0 * L, w_kvbT, pos, H, T, n, s0 + k0, R, Dn, Dr, Dv, tile, b, h, m, l,
                      acc, mine);
        }
    }
}
