/* One decode step of a whole K3 model for B rows of one token each, fp32, in one call.
 *
 * The same maths as the engine's torch step (k3.infer.decode.torch_step.TorchDecodeStep.step, the reference the
 * tests compare this with): embedding -> per layer AttnRes -> KDA | MLA -> AttnRes -> dense | LatentMoE
 * -> output AttnRes -> norm -> head, reading and writing the engine's pools in place (KDA conv and
 * recurrent states by slot, MLA latents by page). What it saves over the torch step is everything that
 * is not reading weights: ~1,800 op dispatches, the state gathers and scatters, and the intermediate
 * tensors; every weight is streamed once per step for all B rows (gemv.h).
 *
 * Threads: one OpenMP team for the whole step. A phase splits its work (the weight rows of its products,
 * or the (row, head) pairs of a recurrence) statically over the team, and a barrier ends it, so the
 * sums are the same for any thread count. */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "exp_poly.h"
#include "ftz.h"
#include "gemv.h"
#include "situ.h"

#include "decode_common.h" /* structs, product jobs, norms, scratch */
#include "decode_kda.h"    /* the KDA layer */
#include "decode_mla.h"    /* the MLA layer */
#include "decode_ffn.h"    /* dense GLU and LatentMoE */

/* ---- the step ---------------------------------------------------------------------------------------- */
/* the embedding row of token `id` as fp32 (a typed model's table is a WDesc) */
static void embed_row(const Dims *d, const void *table, int64_t id, float *out) {
    const int64_t D = d->D;
    const WDesc *w = (const WDesc *)table;
    if (!d->typed || w->type == W_F32) {
        memcpy(out, (const float *)(d->typed ? w->data : table) + id * D, D * sizeof(float));
    } else if (w->type == W_BF16) {
        for (int64_t i = 0; i < D; i++) out[i] = bf16_at((const uint16_t *)w->data + id * D, i);
    } else {
        const int8_t *q = (const int8_t *)w->data + id * D;
        for (int64_t i = 0; i < D; i++) out[i] = (float)q[i] * w->scales[(id * D + i) / 32];
    }
}

typedef struct {
    const float *embed, *norm, *out_res, *lm_head; /* embed and lm_head WDesc when Dims.typed */
} Ends;

/* logits [n_out, V] of rows out_rows [n_out] (ascending) for ids [B] at lengths [B] (cached tokens before
 * this one), slots [B], block tables [B, pages]; scratch of k3_decode_scratch_floats(d, B, max(lengths) +
 * 1, threads) floats.
 *
 * Rows of one slot may follow each other at consecutive lengths (a prompt chunk): each then sees the
 * latents and the state its predecessors wrote, exactly as if it were decoded after them, so a prompt
 * fed in any split, beside any other rows, gives every row the bits decode would give it. */
void k3_decode_step(const Dims *d, const Layer *layers, const Ends *ends, int64_t B, const int64_t *ids,
                    const int64_t *slots, const int64_t *tables, const int64_t *lengths, const int64_t *out_rows,
                    int64_t n_out, float *logits, float *scratch, int64_t threads) {
    int64_t S_max = 1;
    for (int64_t b = 0; b < B; b++) S_max = lengths[b] + 1 > S_max ? lengths[b] + 1 : S_max;
    Scratch s = carve(d, B, scratch);
    for (int64_t b = 0; b < B; b++) /* runs of rows in one slot (the KDA phase's work items) */
        if (b == 0 || slots[b] != slots[b - 1]) s.run_start[s.n_runs++] = b;
    s.run_start[s.n_runs] = B;
    const int64_t D = d->D, BD = B * D;
    for (int64_t b = 0; b < B; b++) embed_row(d, ends->embed, ids[b], s.buf + b * D);
    int64_t nb = 0; /* completed blocks: buf[0 .. nb-1]; the partial sum is buf[nb] */
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const unsigned mode = ftz_begin(); /* the whole step: denormals are zero (ftz.h) */
        const float *src[64];
        for (int64_t li = 0; li < d->L; li++) {
            const Layer *l = layers + li;
            const int64_t n_blocks = nb; /* read by every thread before thread 0 may move it */
            for (int64_t b = t; b < B; b += nt) {
                for (int64_t i = 0; i <= n_blocks; i++) src[i] = s.buf + i * BD + b * D;
                attn_res(src, (int)n_blocks + 1, l->attn_res, s.h + b * D, D, d->res_eps);
                rms_norm(s.h + b * D, l->attn_norm, s.xn + b * D, D, d->rms_eps);
            }
#pragma omp barrier
            const int closes = li % d->block == 0;
            if (l->mla)
                mla(d, l, &s, B, tables, lengths, S_max, t, nt);
            else
                kda(d, l, &s, B, slots, t, nt);
#pragma omp barrier
            float *P = s.buf + (n_blocks + closes) * BD; /* a closed block starts an empty partial sum */
            int64_t lo, hi;
            share(BD, t, nt, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) P[i] = closes ? s.y[i] : P[i] + s.y[i];
#pragma omp barrier
            for (int64_t b = t; b < B; b += nt) {
                for (int64_t i = 0; i <= n_blocks + closes; i++) src[i] = s.buf + i * BD + b * D;
                attn_res(src, (int)(n_blocks + closes) + 1, l->ffn_res, s.h + b * D, D, d->res_eps);
                rms_norm(s.h + b * D, l->ffn_norm, s.xn + b * D, D, d->rms_eps);
            }
#pragma omp barrier
            if (l->moe)
                moe(d, l, &s, B, t, nt);
            else
                dense(d, l, &s, B, t, nt);
#pragma omp barrier
            for (int64_t i = lo; i < hi; i++) P[i] += s.y[i];
            if (t == 0) nb = n_blocks + closes;
#pragma omp barrier
        }
        for (int64_t j = t; j < n_out; j += nt) { /* only the rows whose logits are wanted, packed */
            const int64_t b = out_rows[j];
            for (int64_t i = 0; i <= nb; i++) src[i] = s.buf + i * BD + b * D;
            attn_res(src, (int)nb + 1, ends->out_res, s.h + j * D, D, d->res_eps);
            rms_norm(s.h + j * D, ends->norm, s.xn + j * D, D, d->rms_eps);
        }
#pragma omp barrier
        Job jh = wjob(d, ends->lm_head, 0, d->V, D, s.xn, D, n_out, logits, d->V);
        run_jobs(&jh, 1, t, nt);
        ftz_end(mode);
    }
}

int64_t k3_decode_scratch_floats(const Dims *d, int64_t B, int64_t S, int64_t nt) {
    const int64_t nbuf = d->L / d->block + 3;
    const int64_t slots = B * d->topk, job_floats = (3 * slots + 2 * d->HM) * (int64_t)(sizeof(Job) / sizeof(float));
    return nbuf * B * d->D + 4 * B * d->D + 6 * B * big_width(d) + nt * S * MLA_GROUP + 6 * slots + 2 * (B + 1) +
           job_floats + 64;
}

/* ---- the layout Python mirrors -------------------------------------------------------------------------- */
/* k3/infer/decode/native_step.py declares Dims, Layer and Ends again with ctypes; at load it compares its
 * sizes and field offsets with this table (the compiler's), and refuses to run on any difference. */
typedef struct {
    const char *type, *field; /* field "": the struct's size */
    int64_t value;
} LayoutEntry;

#define SIZE(S) {#S, "", (int64_t)sizeof(S)}
#define AT(S, f) {#S, #f, (int64_t)offsetof(S, f)}
static const LayoutEntry LAYOUT[] = {
    SIZE(Dims),
    AT(Dims, D), AT(Dims, V), AT(Dims, L), AT(Dims, H), AT(Dims, K), AT(Dims, W), AT(Dims, HM),
    AT(Dims, Dn), AT(Dims, Dr), AT(Dims, Dv), AT(Dims, R), AT(Dims, Q), AT(Dims, E), AT(Dims, topk),
    AT(Dims, I), AT(Dims, Dl), AT(Dims, Is), AT(Dims, Id), AT(Dims, dense_layers), AT(Dims, block),
    AT(Dims, page_size), AT(Dims, pages), AT(Dims, safe_gate), AT(Dims, latent_norm), AT(Dims, renorm),
    AT(Dims, typed), AT(Dims, rms_eps), AT(Dims, latent_eps), AT(Dims, res_eps), AT(Dims, l2_eps),
    AT(Dims, lower_bound), AT(Dims, beta1), AT(Dims, beta2), AT(Dims, scaling), AT(Dims, mla_scale),
    AT(Dims, kda_scale),
    SIZE(Layer),
    AT(Layer, mla), AT(Layer, moe), AT(Layer, mx), AT(Layer, attn_norm), AT(Layer, ffn_norm),
    AT(Layer, attn_res), AT(Layer, ffn_res), AT(Layer, wq), AT(Layer, wk), AT(Layer, wv), AT(Layer, conv_q),
    AT(Layer, conv_k), AT(Layer, conv_v), AT(Layer, wfa), AT(Layer, wfb), AT(Layer, dt_bias),
    AT(Layer, a_exp), AT(Layer, wb), AT(Layer, wg), AT(Layer, o_norm), AT(Layer, wo),
    AT(Layer, pool_conv_q), AT(Layer, pool_conv_k), AT(Layer, pool_conv_v), AT(Layer, pool_rec),
    AT(Layer, wqa), AT(Layer, qa_norm), AT(Layer, wqb), AT(Layer, wkva), AT(Layer, kva_norm),
    AT(Layer, wkvb), AT(Layer, wkbt), AT(Layer, mg), AT(Layer, mo), AT(Layer, pool_lat), AT(Layer, w_gate),
    AT(Layer, w_up), AT(Layer, w_down), AT(Layer, router), AT(Layer, router_bias), AT(Layer, lat_down),
    AT(Layer, lat_norm), AT(Layer, lat_up), AT(Layer, w1), AT(Layer, w2), AT(Layer, w3), AT(Layer, w1q),
    AT(Layer, w1s), AT(Layer, w2q), AT(Layer, w2s), AT(Layer, w3q), AT(Layer, w3s),
    SIZE(WDesc), AT(WDesc, type), AT(WDesc, data), AT(WDesc, scales),
    SIZE(Ends),
    AT(Ends, embed), AT(Ends, norm), AT(Ends, out_res), AT(Ends, lm_head),
};

int64_t k3_decode_layout(const LayoutEntry **entries) {
    *entries = LAYOUT;
    return (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]));
}
