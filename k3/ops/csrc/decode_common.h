/* The decode step's shared parts (decode_step.c includes them once, in this order, with the KDA, MLA and
 * FFN parts after them): the structs Python mirrors with ctypes (k3/infer/decode/native_step.py; their
 * sizes and offsets are checked at load, decode_step.c's layout table), the weight-product jobs split
 * over the team, the per-row RMSNorm and AttnRes, and the scratch layout.
 *
 * The norms are scalar loops, not the 8-lane ones of rms_norm.c / attn_res.c: their sums run in another
 * order, so taking those would change the step's logits in the last bits (the torch step, its
 * reference, matches either to rounding; the engine's output would no longer be the same bits). */
#ifndef K3_DECODE_COMMON_H
#define K3_DECODE_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "gemv.h"

#define MLA_GROUP 8 /* MLA heads of one row that share each pass over its latents */

typedef struct {
    int64_t D, V, L;
    int64_t H, K, W;               /* KDA heads, head dim, conv width */
    int64_t HM, Dn, Dr, Dv, R, Q;  /* MLA heads, nope / rope / value dims, latent rank, q_lora (0: none) */
    int64_t E, topk, I, Dl, Is, Id; /* experts, top-k, expert width, latent width, shared width (0: none), dense width */
    int64_t dense_layers, block, page_size, pages, safe_gate, latent_norm, renorm;
    int64_t typed; /* the weight matrices (wjob's bases) are WDesc, each fp32, bf16 or Q8_0; else all fp32 */
    float rms_eps, latent_eps, res_eps, l2_eps, lower_bound, beta1, beta2, scaling, mla_scale, kda_scale;
} Dims;

typedef struct {
    int64_t mla, moe, mx; /* mx: the routed experts are MXFP4 (w*q codes, w*s scales), not w1 / w2 / w3 */
    const float *attn_norm, *ffn_norm, *attn_res, *ffn_res; /* [D]; res: key-norm gain * pseudo-query */
    /* KDA */
    const float *wq, *wk, *wv, *conv_q, *conv_k, *conv_v, *wfa, *wfb, *dt_bias, *a_exp, *wb, *wg, *o_norm, *wo;
    float *pool_conv_q, *pool_conv_k, *pool_conv_v, *pool_rec; /* [slots, C, W-1] x 3, [slots, H, K, K] */
    /* MLA (wqb is q_proj when Q == 0) */
    const float *wqa, *qa_norm, *wqb, *wkva, *kva_norm, *wkvb, *wkbt, *mg, *mo; /* wkbt: [HM, R, Dn] */
    float *pool_lat; /* [rows, R + Dr] */
    /* FFN: the dense GLU, or the shared experts of an MoE layer */
    const float *w_gate, *w_up, *w_down;
    const float *router, *router_bias, *lat_down, *lat_norm, *lat_up, *w1, *w2, *w3;
    const uint8_t *w1q, *w1s, *w2q, *w2s, *w3q, *w3s; /* [E, out, in/2], [E, out, in/32] */
} Layer;

/* one weight matrix of a typed model (Dims.typed): how it is stored */
enum { W_F32 = 0, W_BF16 = 1, W_Q8_0 = 2 };
typedef struct {
    int64_t type;
    const void *data;    /* [rows, cols] elements of the type (Q8_0: int8 codes) */
    const float *scales; /* Q8_0: [rows, cols / 32]; else NULL */
} WDesc;

typedef struct {
    const float *w, *x;
    int64_t rows, cols, ldx, B, ldy;
    float *y;
    const uint8_t *mxq, *mxs; /* an MXFP4 W instead of w (x then split by mx_split_input) */
    const uint16_t *wb;       /* a bf16 W instead of w */
    const int8_t *q8;         /* a Q8_0 W instead of w: codes, with q8s its scales */
    const float *q8s;
} Job;

/* inputs of `cols` floats per block of a product with more than 64 inputs (never a decode batch): 256 KB
 * of them, a multiple of four (gemv_rows' 4 x 4 tiles), at least 4 */
static inline int64_t input_block(int64_t cols) {
    const int64_t n = (65536 / (cols > 0 ? cols : 1)) / 4 * 4;
    return n < 4 ? 4 : n;
}

/* this thread's share of the rows of several products (each Job: Y = W X^T for its own X), split by
 * weights read (rows x cols) rather than rows, so that products of different widths in one phase keep
 * the threads equally busy: row r of a job goes to the thread whose share holds the row's first weight */
static void run_jobs(const Job *jobs, int n, int t, int nt) {
    int64_t total = 0;
    for (int j = 0; j < n; j++) total += jobs[j].rows * jobs[j].cols;
    const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
    int64_t base = 0;
    for (int j = 0; j < n; j++) {
        const Job *q = &jobs[j];
        const int64_t size = q->rows * q->cols;
        if (base < hi && lo < base + size) {
            int64_t r0 = lo > base ? (lo - base + q->cols - 1) / q->cols : 0;
            int64_t r1 = hi < base + size ? (hi - base + q->cols - 1) / q->cols : q->rows;
            r1 = r1 < q->rows ? r1 : q->rows;
            /* many inputs (a prompt chunk): blocks of them that stay in L2 while the thread's weight rows
             * pass over them, rather than every input once per four weight rows. A block is computed
             * like any other batch of that size, and a row's sums do not depend on its batch (gemv.h) */
            const int64_t chunk = q->B > 64 ? input_block(q->cols) : q->B; /* decode: one pass */
            for (int64_t b0 = 0; r0 < r1 && b0 < q->B; b0 += chunk) {
                const int64_t nb = q->B - b0 < chunk ? q->B - b0 : chunk;
                /* fp32 rows take the eight-row tile past a decode batch; bf16 and MXFP4 rows are widened
                 * into an fp32 block first once 16 inputs share it (a prompt chunk's expert) */
                const int wide = q->cols <= GEMV_WIDE_MAX_I && q->B > (q->w ? 64 : 15);
                if (q->mxq && wide)
                    gemv_rows_staged(widen_mx, q->mxq, q->mxs, q->cols, q->x + b0 * q->cols, q->cols, nb,
                                     q->y + b0 * q->ldy, q->ldy, r0, r1);
                else if (q->mxq)
                    gemv_rows_mx(q->mxq, q->mxs, q->cols, q->x + b0 * q->cols, nb, q->y + b0 * q->ldy, q->ldy,
                                 r0, r1);
                else if (q->q8 && wide)
                    gemv_rows_staged(widen_q8, q->q8, q->q8s, q->cols, q->x + b0 * q->ldx, q->ldx, nb,
                                     q->y + b0 * q->ldy, q->ldy, r0, r1);
                else if (q->q8)
                    gemv_rows_q8(q->q8, q->q8s, q->cols, q->x + b0 * q->ldx, q->ldx, nb, q->y + b0 * q->ldy,
                                 q->ldy, r0, r1);
                else if (q->wb && wide)
                    gemv_rows_staged(widen_bf16, q->wb, NULL, q->cols, q->x + b0 * q->ldx, q->ldx, nb,
                                     q->y + b0 * q->ldy, q->ldy, r0, r1);
                else if (q->wb)
                    gemv_rows_bf16(q->wb, q->cols, q->x + b0 * q->ldx, q->ldx, nb, q->y + b0 * q->ldy, q->ldy,
                                   r0, r1);
                else if (wide)
                    gemv_rows_wide(q->w, q->cols, q->x + b0 * q->ldx, q->ldx, nb, q->y + b0 * q->ldy, q->ldy, r0,
                                   r1);
                else
                    gemv_rows(q->w, q->cols, q->x + b0 * q->ldx, q->ldx, nb, q->y + b0 * q->ldy, q->ldy, r0, r1);
            }
        }
        base += size;
    }
}

static inline Job job(const float *w, int64_t rows, int64_t cols, const float *x, int64_t ldx, int64_t B,
                      float *y, int64_t ldy) {
    Job j = {w, x, rows, cols, ldx, B, ldy, y, NULL, NULL, NULL, NULL, NULL};
    return j;
}

/* a product with one of the model's weight matrices, `base` + `offset` elements: fp32, or (Dims.typed)
 * the matrix its WDesc describes */
static inline Job wjob(const Dims *d, const void *base, int64_t offset, int64_t rows, int64_t cols,
                       const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy) {
    if (!d->typed || !base) /* (a missing matrix, such as absent shared experts: a job never run) */
        return job(base ? (const float *)base + offset : NULL, rows, cols, x, ldx, B, y, ldy);
    const WDesc *w = (const WDesc *)base;
    Job j = job(NULL, rows, cols, x, ldx, B, y, ldy);
    if (w->type == W_BF16)
        j.wb = (const uint16_t *)w->data + offset;
    else if (w->type == W_Q8_0)
        j.q8 = (const int8_t *)w->data + offset, j.q8s = w->scales + offset / 32;
    else
        j.w = (const float *)w->data + offset;
    return j;
}

/* expert e's MXFP4 matrix [rows, cols] of a stacked packed weight */
static inline Job mx_job(const uint8_t *q, const uint8_t *sc, int64_t e, int64_t rows, int64_t cols,
                         const float *xs, int64_t B, float *y, int64_t ldy) {
    Job j = {NULL, xs, rows, cols, cols, B, ldy, y, q + e * rows * (cols / 2), sc + e * rows * (cols / 32), NULL,
             NULL, NULL};
    return j;
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* out = x / sqrt(mean(x^2) + eps) * w */
static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* AttnRes over sources src[0..n-1] (each [D]): softmax over the RMS-normed scores with query qk */
static void attn_res(const float *const *src, int n, const float *qk, float *out, int64_t D, float eps) {
    if (n == 1) {
        memcpy(out, src[0], D * sizeof(float));
        return;
    }
    float s[64], m = -INFINITY, z = 0.0f;
    for (int i = 0; i < n; i++) {
        float ss = 0.0f, d = 0.0f;
        for (int64_t c = 0; c < D; c++) ss += src[i][c] * src[i][c], d += src[i][c] * qk[c];
        s[i] = d / sqrtf(ss / (float)D + eps);
        m = s[i] > m ? s[i] : m;
    }
    for (int i = 0; i < n; i++) s[i] = expf(s[i] - m), z += s[i];
    for (int64_t c = 0; c < D; c++) {
        float acc = 0.0f;
        for (int i = 0; i < n; i++) acc += s[i] * src[i][c];
        out[c] = acc / z;
    }
}

/* ---- scratch -------------------------------------------------------------------------------------- */
typedef struct {
    float *buf, *h, *xn, *y, *y2;          /* stream buffers ([nbuf][B, D]) and per-layer [B, D] */
    float *a, *b, *c, *d, *e, *f;          /* per-mixer / FFN temporaries, each [B, big] */
    float *scores;                          /* [nt, S] MLA softmax rows */
    int64_t *slot_rows, *slot_expert;       /* MoE: the row and the expert of each (row, choice) slot */
    int64_t *run_start;                     /* KDA: first row of each run of rows in one slot, then B */
    float *slot_weight;
    Job *jobs; /* MoE: w1 + w3 per expert in use, then w2 per expert; MLA: two products per head */
    int64_t big, n_slots, n_up, n_down, n_runs;
} Scratch;

static int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

/* thread t's contiguous share [*lo, *hi) of n elementwise items (interleaved shares would have the
 * threads write the same cache lines) */
static inline void share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt, *hi = n * (t + 1) / nt;
}

static int64_t big_width(const Dims *d) {
    const int64_t C = d->H * d->K;
    int64_t w = imax(3 * C, d->Id);
    w = imax(w, d->Is);
    w = imax(w, d->HM * (d->Dn + d->Dr) + d->R + d->Dr);
    w = imax(w, d->HM * imax(d->Dv, d->R + d->Dr));
    w = imax(w, d->E + d->Dl);
    return imax(w, d->topk * imax(d->I, d->Dl));
}

static Scratch carve(const Dims *d, int64_t B, float *p) {
    Scratch s;
    const int64_t nbuf = d->L / d->block + 3, BD = B * d->D;
    s.big = big_width(d);
    s.buf = p, p += nbuf * BD;
    s.h = p, p += BD;
    s.xn = p, p += BD;
    s.y = p, p += BD;
    s.y2 = p, p += BD;
    float **bufs[6] = {&s.a, &s.b, &s.c, &s.d, &s.e, &s.f};
    for (int i = 0; i < 6; i++) *bufs[i] = p, p += B * s.big;
    const int64_t slots = B * d->topk;
    s.slot_rows = (int64_t *)p, p += slots * 2 * 2;   /* int64: two floats each; [2 * slots] */
    s.slot_expert = (int64_t *)p, p += slots * 2;     /* [slots] */
    s.slot_weight = p, p += slots * 2;                /* [2 * slots] */
    s.run_start = (int64_t *)p, p += (B + 1) * 2;     /* [B + 1] */
    s.jobs = (Job *)p, p += (3 * slots + 2 * d->HM) * (int64_t)(sizeof(Job) / sizeof(float));
    s.n_slots = s.n_up = s.n_down = s.n_runs = 0;
    s.scores = p;
    return s;
}

#endif
