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
#include <stdint.h>
#include <string.h>

#include "exp_poly.h"
#include "ftz.h"
#include "gemv.h"
#include "situ.h"

#define MLA_GROUP 8 /* MLA heads of one row that share each pass over its latents */

typedef struct {
    int64_t D, V, L;
    int64_t H, K, W;               /* KDA heads, head dim, conv width */
    int64_t HM, Dn, Dr, Dv, R, Q;  /* MLA heads, nope / rope / value dims, latent rank, q_lora (0: none) */
    int64_t E, topk, I, Dl, Is, Id; /* experts, top-k, expert width, latent width, shared width (0: none), dense width */
    int64_t dense_layers, block, page_size, pages, safe_gate, latent_norm, renorm, pad;
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

typedef struct {
    const float *w, *x;
    int64_t rows, cols, ldx, B, ldy;
    float *y;
    const uint8_t *mxq, *mxs; /* an MXFP4 W instead of w (x then split by mx_split_input) */
} Job;

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
            if (r0 < r1 && q->mxq)
                gemv_rows_mx(q->mxq, q->mxs, q->cols, q->x, q->B, q->y, q->ldy, r0, r1);
            else if (r0 < r1)
                gemv_rows(q->w, q->cols, q->x, q->ldx, q->B, q->y, q->ldy, r0, r1);
        }
        base += size;
    }
}

static inline Job job(const float *w, int64_t rows, int64_t cols, const float *x, int64_t ldx, int64_t B,
                      float *y, int64_t ldy) {
    Job j = {w, x, rows, cols, ldx, B, ldy, y, NULL, NULL};
    return j;
}

/* expert e's MXFP4 matrix [rows, cols] of a stacked packed weight */
static inline Job mx_job(const uint8_t *q, const uint8_t *sc, int64_t e, int64_t rows, int64_t cols,
                         const float *xs, int64_t B, float *y, int64_t ldy) {
    Job j = {NULL, xs, rows, cols, cols, B, ldy, y, q + e * rows * (cols / 2), sc + e * rows * (cols / 32)};
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
    float *slot_weight;
    Job *jobs; /* MoE: w1 + w3 per expert in use, then w2 per expert; MLA: two products per head */
    int64_t big, n_slots, n_up, n_down;
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

int64_t k3_decode_scratch_floats(const Dims *d, int64_t B, int64_t S, int64_t nt) {
    const int64_t nbuf = d->L / d->block + 3;
    const int64_t slots = B * d->topk, job_floats = (3 * slots + 2 * d->HM) * (int64_t)(sizeof(Job) / sizeof(float));
    return nbuf * B * d->D + 4 * B * d->D + 6 * B * big_width(d) + nt * S * MLA_GROUP + 6 * slots + job_floats + 64;
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
    s.jobs = (Job *)p, p += (3 * slots + 2 * d->HM) * (int64_t)(sizeof(Job) / sizeof(float));
    s.n_slots = s.n_up = s.n_down = 0;
    s.scores = p;
    return s;
}

/* ---- KDA -------------------------------------------------------------------------------------------- */
/* the short conv + SiLU of channels [c0, c0 + n) of one row into out[0 .. n): hist [C, W-1] updated */
static void conv_silu(float *hist, const float *w, const float *u, float *out, int64_t c0, int64_t n, int64_t W) {
    for (int64_t c = c0; c < c0 + n; c++) {
        float *h = hist + c * (W - 1);
        const float *wc = w + c * W;
        float acc = wc[W - 1] * u[c];
        for (int64_t j = 0; j < W - 1; j++) acc += wc[j] * h[j];
        for (int64_t j = 0; j + 1 < W - 1; j++) h[j] = h[j + 1];
        h[W - 2] = u[c];
        out[c - c0] = acc;
    }
    for (int64_t i = 0; i < n; i++) out[i] *= sigmoid_poly(out[i]); /* SiLU in its own loop: vectorised */
}

static void l2_normalize(float *x, int64_t n, float eps, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = scale / sqrtf(ss + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= r;
}

/* one (row, head): conv, gate, delta-rule step on the slot's state, gated RMSNorm of the output.
 * `next`: the state this thread updates after this one (or NULL), fetched into L2 during the second pass
 * over this one, so that the first pass over it does not wait on memory (a state is K x K fp32, 64 KB
 * at K = 128: read, scaled, read again and written back by each step, with little arithmetic per byte) */
static void kda_head(const Dims *d, const Layer *l, const float *u, const float *z, const float *beta_raw,
                     const float *gate, float *o, int64_t slot, int64_t h, float *q, float *k, float *v,
                     float *g, const float *next) {
    const int64_t H = d->H, K = d->K, C = H * K, W = d->W, hist = C * (W - 1);
    const int64_t c0 = h * K;
    conv_silu(l->pool_conv_q + slot * hist, l->conv_q, u, q, c0, K, W);
    conv_silu(l->pool_conv_k + slot * hist, l->conv_k, u + C, k, c0, K, W);
    conv_silu(l->pool_conv_v + slot * hist, l->conv_v, u + 2 * C, v, c0, K, W);
    const float a = l->a_exp[h];
    if (d->safe_gate) /* vectorised: exp_poly.h's exp and sigmoid */
        for (int64_t i = 0; i < K; i++)
            g[i] = exp_poly(d->lower_bound * sigmoid_poly(a * (z[c0 + i] + l->dt_bias[c0 + i])));
    else
        for (int64_t i = 0; i < K; i++) {
            const float x = z[c0 + i] + l->dt_bias[c0 + i];
            g[i] = exp_poly(-a * (x > 20.0f ? x : log1pf(expf(x))));
        }
    const float beta = sigmoidf(beta_raw[h]);
    l2_normalize(q, K, d->l2_eps, d->kda_scale);
    l2_normalize(k, K, d->l2_eps, 1.0f);
    float *S = l->pool_rec + (slot * H + h) * K * K; /* [K (key), K (value)] */
    float kS[512], oh[512];
    for (int64_t j = 0; j < K; j++) kS[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        float *row = S + i * K;
        const float gi = g[i], ki = k[i];
        for (int64_t j = 0; j < K; j++) row[j] *= gi, kS[j] += ki * row[j];
    }
    for (int64_t j = 0; j < K; j++) kS[j] = beta * (v[j] - kS[j]); /* delta */
    for (int64_t j = 0; j < K; j++) oh[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        float *row = S + i * K;
        const float ki = k[i], qi = q[i];
        if (next)
            for (int64_t j = 0; j < K; j += 16) __builtin_prefetch(next + i * K + j, 0, 2);
        for (int64_t j = 0; j < K; j++) row[j] += ki * kS[j], oh[j] += qi * row[j];
    }
    float ss = 0.0f;
    for (int64_t j = 0; j < K; j++) ss += oh[j] * oh[j];
    const float r = 1.0f / sqrtf(ss / (float)K + d->rms_eps);
    for (int64_t j = 0; j < K; j++) o[c0 + j] = oh[j] * r * l->o_norm[j] * sigmoidf(gate[c0 + j]);
}

static void kda(const Dims *d, const Layer *l, Scratch *s, int64_t B, const int64_t *slots, int t, int nt) {
    const int64_t D = d->D, H = d->H, K = d->K, C = H * K, big = s->big;
    float *u = s->a, *gate = s->b, *fa = s->c, *z = s->d, *o = s->e, *braw = s->f;
    const Job jobs[6] = {
        job(l->wq, C, D, s->xn, D, B, u, big), job(l->wk, C, D, s->xn, D, B, u + C, big),
        job(l->wv, C, D, s->xn, D, B, u + 2 * C, big), job(l->wg, C, D, s->xn, D, B, gate, big),
        job(l->wfa, K, D, s->xn, D, B, fa, big), job(l->wb, H, D, s->xn, D, B, braw, big),
    };
    run_jobs(jobs, 6, t, nt);
#pragma omp barrier
    Job jb = job(l->wfb, C, K, fa, big, B, z, big);
    run_jobs(&jb, 1, t, nt);
#pragma omp barrier
    float q[512], k[512], v[512], g[512];
    for (int64_t p = t; p < B * H; p += nt) {
        const int64_t b = p / H, h = p % H, pn = p + nt;
        const float *next = pn < B * H ? l->pool_rec + (slots[pn / H] * H + pn % H) * K * K : NULL;
        kda_head(d, l, u + b * big, z + b * big, braw + b * big, gate + b * big, o + b * big, slots[b], h,
                 q, k, v, g, next);
    }
#pragma omp barrier
    Job jo = job(l->wo, D, C, o, big, B, s->y, D);
    run_jobs(&jo, 1, t, nt);
}

/* ---- MLA -------------------------------------------------------------------------------------------- */
static float *latent_row(const Dims *d, const Layer *l, const int64_t *table, int64_t pos) {
    const int64_t page = table[pos / d->page_size];
    return l->pool_lat + (page * d->page_size + pos % d->page_size) * (d->R + d->Dr);
}

/* x[e * MLA_GROUP + g] = the 16-lane part of dot(qs[g], lat[e]) (`dot`'s accumulation and hsum16, before
 * the scalar tail past RD / 16 * 16) for two latents and MLA_GROUP heads at once, prefetching the two
 * latents `next` (NULL: none). Each query load serves both latents and the 16 independent accumulations
 * keep both FMA units busy: alone (latents in L2) 3.3x faster than one latent's four heads at a time, which
 * waited on each accumulator's FMA latency; with the prefetch the pass reads the latents from memory ~2x
 * faster (a row's latents, ~0.7 MB at 300 tokens, are read once per step and never cached) */
_Static_assert(2 * MLA_GROUP == 16, "mla_scores2 reduces its accumulators with hsum16x16");
static inline void mla_scores2(const float *const lat[2], const float *const next[2],
                               const float *const qs[MLA_GROUP], int64_t RD, float *x) {
    lanes16 acc[2 * MLA_GROUP] = {{0}};
    for (int64_t i = 0; i + 16 <= RD; i += 16) {
        for (int e = 0; e < 2; e++)
            if (next[e]) __builtin_prefetch(next[e] + i);
        const lanes16 a = load16(lat[0] + i), b = load16(lat[1] + i);
        for (int g = 0; g < MLA_GROUP; g++) {
            const lanes16 q = load16(qs[g] + i);
            acc[g] += q * a;
            acc[MLA_GROUP + g] += q * b;
        }
    }
    const lanes16 sums = hsum16x16(acc);
    memcpy(x, &sums, sizeof sums);
}

/* heads [h0, h1) (at most MLA_GROUP) of one row's absorbed attention over its S = len + 1 latents, in
 * one pass over the latents for the scores and one for the values (each latent row is read once for all
 * the group's heads, not once per head). Each head's sums run exactly as they would on its own, so the
 * grouping does not change a bit. ql: the row's [HM, R + Dr] absorbed queries (the nope part filled,
 * the rope part copied in here); ol: the row's [HM, R] attention-weighted latents (out); scores:
 * [MLA_GROUP, S] */
static void mla_heads(const Dims *d, const Layer *l, const float *q, float *ql_row, float *ol_row,
                      const int64_t *table, int64_t S, int64_t h0, int64_t h1, float *scores) {
    const int64_t R = d->R, Dr = d->Dr, Dh = d->Dn + Dr, RD = R + Dr, G = h1 - h0;
    const float *ql[MLA_GROUP];
    float *ol[MLA_GROUP], m[MLA_GROUP], z[MLA_GROUP];
    for (int64_t g = 0; g < G; g++) {
        float *qg = ql_row + (h0 + g) * RD;
        memcpy(qg + R, q + (h0 + g) * Dh + d->Dn, Dr * sizeof(float));
        ql[g] = qg, ol[g] = ol_row + (h0 + g) * R;
        m[g] = -INFINITY, z[g] = 0.0f;
    }
    const float *qs[MLA_GROUP]; /* heads past G repeat the first (their sums are dropped) */
    for (int g = 0; g < MLA_GROUP; g++) qs[g] = ql[g < G ? g : 0];
    /* two latents per pass (an odd last one twice); each pass's `next` is the following pass's pair */
    const float *next[2] = {latent_row(d, l, table, 0), S > 1 ? latent_row(d, l, table, 1) : NULL};
    for (int64_t s = 0; s < S; s += 2) {
        const float *lat[2] = {next[0], next[1] ? next[1] : next[0]};
        next[0] = s + 2 < S ? latent_row(d, l, table, s + 2) : NULL;
        next[1] = s + 3 < S ? latent_row(d, l, table, s + 3) : NULL;
        float x[2 * MLA_GROUP];
        mla_scores2(lat, next, qs, RD, x);
        for (int64_t e = 0; e < 2 && s + e < S; e++)
            for (int64_t g = 0; g < G; g++) {
                float v = x[e * MLA_GROUP + g];
                for (int64_t j = RD / 16 * 16; j < RD; j++) v += ql[g][j] * lat[e][j];
                v *= d->mla_scale;
                scores[g * S + s + e] = v;
                m[g] = v > m[g] ? v : m[g];
            }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sc = scores + g * S;
        for (int64_t s = 0; s < S; s++) sc[s] = exp_nonpositive(sc[s] - m[g]); /* vectorised */
        for (int64_t s = 0; s < S; s++) z[g] += sc[s];
        for (int64_t s = 0; s < S; s++) sc[s] /= z[g]; /* the softmax weights */
        for (int64_t r = 0; r < R; r++) ol[g][r] = 0.0f;
    }
    const int64_t P = d->page_size;
    /* ol[g] = sum_s p[g][s] lat[s][:R], s in order: by 64 columns x 4 heads held in registers across all
     * the latents (the same sums, in the same order, as one head and one column at a time) */
    for (int64_t r0 = 0; r0 + 64 <= R; r0 += 64)
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t n = G - g0 < 4 ? G - g0 : 4;
            const float *ps[4];
            for (int g = 0; g < 4; g++) ps[g] = scores + (g0 + (g < n ? g : 0)) * S;
            lanes16 acc[4][4] = {{{0}}};
            for (int64_t s0 = 0; s0 < S; s0 += P) {
                const float *page = l->pool_lat + table[s0 / P] * P * RD + r0;
                for (int64_t s = s0; s < S && s < s0 + P; s++) {
                    const float *lat = page + (s - s0) * RD;
                    const lanes16 lv[4] = {load16(lat), load16(lat + 16), load16(lat + 32), load16(lat + 48)};
                    for (int g = 0; g < 4; g++)
                        for (int v = 0; v < 4; v++) acc[g][v] += ps[g][s] * lv[v];
                }
            }
            for (int64_t g = 0; g < n; g++)
                for (int v = 0; v < 4; v++) memcpy(ol[g0 + g] + r0 + 16 * v, &acc[g][v], sizeof(lanes16));
        }
    for (int64_t r = R / 64 * 64; r < R; r++) /* columns past the last 64 */
        for (int64_t s = 0; s < S; s++)
            for (int64_t g = 0; g < G; g++)
                ol[g][r] += scores[g * S + s] * latent_row(d, l, table, s)[r];
}

/* Absorbed MLA decode. The query absorption (ql = W_uk^T q_nope per head) and the value up-projection
 * (W_uv ol per head) run as products over all B rows at once, so each head's kv_b rows stream from
 * memory once per step rather than once per row; only the latent passes are per (row, head group). */
static void mla(const Dims *d, const Layer *l, Scratch *s, int64_t B, const int64_t *tables,
                const int64_t *lengths, int64_t S_max, int t, int nt) {
    const int64_t D = d->D, HM = d->HM, Dn = d->Dn, Dv = d->Dv, R = d->R, Dh = Dn + d->Dr, RD = R + d->Dr;
    const int64_t big = s->big;
    float *qa = s->a, *kva = s->b, *gate = s->c, *q = s->d, *o = s->e, *ql = s->a, *ol = s->f;
    const int64_t qrows = d->Q ? d->Q : HM * Dh;
    Job jobs[3] = {
        job(d->Q ? l->wqa : l->wqb, qrows, D, s->xn, D, B, d->Q ? qa : q, big),
        job(l->wkva, RD, D, s->xn, D, B, kva, big),
        job(l->mg, HM * Dv, D, s->xn, D, B, gate, big),
    };
    run_jobs(jobs, 3, t, nt);
#pragma omp barrier
    for (int64_t b = t; b < B; b += nt) { /* norms; the new latent goes into its page */
        if (d->Q) rms_norm(qa + b * big, l->qa_norm, qa + b * big, d->Q, d->latent_eps);
        float *lat = latent_row(d, l, tables + b * d->pages, lengths[b]);
        rms_norm(kva + b * big, l->kva_norm, lat, d->R, d->latent_eps);
        memcpy(lat + d->R, kva + b * big + d->R, d->Dr * sizeof(float));
    }
#pragma omp barrier
    if (d->Q) {
        Job jq = job(l->wqb, HM * Dh, d->Q, qa, big, B, q, big);
        run_jobs(&jq, 1, t, nt);
#pragma omp barrier
    }
    Job *per_head = s->jobs; /* the MoE's job list is free until the FFN */
    if (t == 0)
        for (int64_t h = 0; h < HM; h++) /* ql[b, h, :R] = W_uk[h]^T q_nope[b, h] (wkbt: [HM, R, Dn]) */
            per_head[h] = job(l->wkbt + h * R * Dn, R, Dn, q + h * Dh, big, B, ql + h * RD, big);
#pragma omp barrier
    run_jobs(per_head, (int)HM, t, nt);
#pragma omp barrier
    /* work items: a row's heads in groups of G (up to MLA_GROUP), each group one pass over the row's
     * latents; a row splits into the fewest groups that give every thread the same number of items, or
     * at least four each (one row on two threads: two groups of HM / 2 heads) */
    float *scores = s->scores + t * S_max * MLA_GROUP;
    int64_t per_row = 1;
    while (per_row < HM && (B * per_row) % nt != 0 && B * per_row < 4 * nt) per_row++;
    int64_t G = (HM + per_row - 1) / per_row;
    G = G < MLA_GROUP ? G : MLA_GROUP;
    per_row = (HM + G - 1) / G;
    for (int64_t p = t; p < B * per_row; p += nt) {
        const int64_t b = p / per_row, h0 = (p % per_row) * G, h1 = h0 + G < HM ? h0 + G : HM;
        mla_heads(d, l, q + b * big, ql + b * big, ol + b * big, tables + b * d->pages, lengths[b] + 1, h0, h1,
                  scores);
    }
    if (t == 0)
        for (int64_t h = 0; h < HM; h++) /* o[b, h, :] = W_uv[h] ol[b, h] (kv_b's value rows of head h) */
            per_head[HM + h] = job(l->wkvb + (h * (Dn + Dv) + Dn) * R, Dv, R, ol + h * R, big, B, o + h * Dv, big);
#pragma omp barrier
    run_jobs(per_head + HM, (int)HM, t, nt);
#pragma omp barrier
    int64_t lo, hi;
    share(B * HM * Dv, t, nt, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) { /* the output gate */
        const int64_t b = i / (HM * Dv), j = i % (HM * Dv);
        o[b * big + j] *= sigmoid_poly(gate[b * big + j]);
    }
#pragma omp barrier
    Job jo = job(l->mo, D, HM * Dv, o, big, B, s->y, D);
    run_jobs(&jo, 1, t, nt);
}

/* ---- FFN -------------------------------------------------------------------------------------------- */
static void situ_split(float *g, const float *u, int64_t rows, int64_t n, int64_t ld, const Dims *d, int t, int nt) {
    const int64_t total = rows * n, lo = total * t / nt, hi = total * (t + 1) / nt;
    for (int64_t i = lo; i < hi;) { /* in place: g <- SiTU(g, u), row by row of the [rows, ld] buffers */
        const int64_t r = i / n, c = i % n, m = (hi - i) < (n - c) ? (hi - i) : (n - c);
        situ_rows(g + r * ld + c, u + r * ld + c, g + r * ld + c, m, d->beta1, d->beta2);
        i += m;
    }
}

static void dense(const Dims *d, const Layer *l, Scratch *s, int64_t B, int t, int nt) {
    const int64_t D = d->D, I = d->Id, big = s->big;
    Job jobs[2] = {job(l->w_gate, I, D, s->xn, D, B, s->a, big), job(l->w_up, I, D, s->xn, D, B, s->b, big)};
    run_jobs(jobs, 2, t, nt);
#pragma omp barrier
    situ_split(s->a, s->b, B, I, big, d, t, nt);
#pragma omp barrier
    Job jd = job(l->w_down, D, I, s->a, big, B, s->y, D);
    run_jobs(&jd, 1, t, nt);
}

/* top-k routing of every row into slots grouped by expert (one thread; E <= 1024) */
static int64_t route(const Dims *d, const Layer *l, float *logits, int64_t ld, int64_t B, Scratch *s) {
    const int64_t E = d->E, k = d->topk;
    int64_t *chosen = s->slot_rows + B * k; /* [B, k] expert ids, before grouping */
    float *w = s->slot_weight;
    unsigned char taken[1024];
    for (int64_t b = 0; b < B; b++) {
        float *sc = logits + b * ld; /* sigmoid scores, in place */
        for (int64_t e = 0; e < E; e++) sc[e] = sigmoidf(sc[e]), taken[e] = 0;
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) { /* the j-th largest score + bias; ties to the lower index */
            int64_t best = -1;
            float bv = -INFINITY;
            for (int64_t e = 0; e < E; e++) {
                const float v = sc[e] + l->router_bias[e];
                if (!taken[e] && (best < 0 || v > bv)) best = e, bv = v;
            }
            taken[best] = 1;
            chosen[b * k + j] = best;
            w[b * k + j] = sc[best];
            sum += sc[best];
        }
        for (int64_t j = 0; j < k; j++) {
            if (d->renorm) w[b * k + j] /= sum + 1e-20f;
            w[b * k + j] *= d->scaling;
        }
    }
    /* slots sorted by expert, then row: slot_expert[n], slot_rows[n], weights[n] */
    float *ws = s->slot_weight + B * k;
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < k; j++)
                if (chosen[b * k + j] == e) s->slot_expert[n] = e, s->slot_rows[n] = b, ws[n] = w[b * k + j], n++;
    return n;
}

static void moe(const Dims *d, const Layer *l, Scratch *s, int64_t B, int t, int nt) {
    const int64_t D = d->D, E = d->E, I = d->I, Dl = d->Dl, Is = d->Is, big = s->big, k = d->topk;
    float *logits = s->a, *z = s->a + E; /* [B, E | Dl] */
    float *sg = s->b, *su = s->c;       /* shared experts' gate / up [B, Is] */
    Job jobs[4] = {
        job(l->router, E, D, s->xn, D, B, logits, big), job(l->lat_down, Dl, D, s->xn, D, B, z, big),
        job(l->w_gate, Is, D, s->xn, D, B, sg, big), job(l->w_up, Is, D, s->xn, D, B, su, big),
    };
    run_jobs(jobs, Is ? 4 : 2, t, nt);
#pragma omp barrier
    float *zs = s->d, *gs = s->e, *us = s->f; /* per slot: z [n, Dl], gate / up [n, I] (contiguous by slot) */
    float *ys = zs;                           /* then the experts' outputs [n, Dl] (z is spent by then) */
    Job *up = s->jobs, *down = s->jobs + 2 * B * k;
    if (t == 0) { /* s is shared by the team: the barrier below publishes the slots and job lists */
        const int64_t n = s->n_slots = route(d, l, logits, big, B, s);
        s->n_up = s->n_down = 0;
        for (int64_t i = 0; i < n;) { /* one job per expert and matrix, over that expert's slots */
            int64_t m = 1;
            while (i + m < n && s->slot_expert[i + m] == s->slot_expert[i]) m++;
            const int64_t e = s->slot_expert[i];
            for (int64_t r = 0; r < m; r++) {
                const float *zr = z + s->slot_rows[i + r] * big;
                if (l->mx)
                    mx_split_input(zr, Dl, 1, Dl, zs + (i + r) * Dl);
                else
                    memcpy(zs + (i + r) * Dl, zr, Dl * sizeof(float));
            }
            if (l->mx) { /* w2 reads the activations split, from us (free once SiTU has run) */
                up[s->n_up++] = mx_job(l->w1q, l->w1s, e, I, Dl, zs + i * Dl, m, gs + i * I, I);
                up[s->n_up++] = mx_job(l->w3q, l->w3s, e, I, Dl, zs + i * Dl, m, us + i * I, I);
                down[s->n_down++] = mx_job(l->w2q, l->w2s, e, Dl, I, us + i * I, m, ys + i * Dl, Dl);
            } else {
                up[s->n_up++] = job(l->w1 + e * I * Dl, I, Dl, zs + i * Dl, Dl, m, gs + i * I, I);
                up[s->n_up++] = job(l->w3 + e * I * Dl, I, Dl, zs + i * Dl, Dl, m, us + i * I, I);
                down[s->n_down++] = job(l->w2 + e * Dl * I, Dl, I, gs + i * I, I, m, ys + i * Dl, Dl);
            }
            i += m;
        }
    }
    if (Is) situ_split(sg, su, B, Is, big, d, t, nt);
#pragma omp barrier
    const int64_t n = s->n_slots;
    run_jobs(up, (int)s->n_up, t, nt);
#pragma omp barrier
    situ_split(gs, us, n, I, I, d, t, nt);
#pragma omp barrier
    if (l->mx) {
        for (int64_t i = t; i < n; i += nt) mx_split_input(gs + i * I, I, 1, I, us + i * I);
#pragma omp barrier
    }
    run_jobs(down, (int)s->n_down, t, nt);
#pragma omp barrier
    float *ul = s->a; /* the routed mixture [B, Dl], then its norm (logits and z are spent) */
    const float *ws = s->slot_weight + B * k;
    for (int64_t b = t; b < B; b += nt) {
        float *u = ul + b * big;
        for (int64_t r = 0; r < Dl; r++) u[r] = 0.0f;
        for (int64_t i = 0; i < n; i++)
            if (s->slot_rows[i] == b)
                for (int64_t r = 0; r < Dl; r++) u[r] += ws[i] * ys[i * Dl + r];
        if (d->latent_norm) rms_norm(u, l->lat_norm, u, Dl, d->rms_eps);
    }
#pragma omp barrier
    Job out[2] = {job(l->lat_up, D, Dl, ul, big, B, s->y, D), job(l->w_down, D, Is, sg, big, B, s->y2, D)};
    run_jobs(out, Is ? 2 : 1, t, nt);
#pragma omp barrier
    if (Is) {
        int64_t lo, hi;
        share(B * D, t, nt, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) s->y[i] += s->y2[i];
    }
}

/* ---- the step ---------------------------------------------------------------------------------------- */
typedef struct {
    const float *embed, *norm, *out_res, *lm_head;
} Ends;

/* logits [B, V] for ids [B] at lengths [B] (cached tokens before this one), slots [B], block tables
 * [B, pages]; scratch of k3_decode_scratch_floats(d, B, max(lengths) + 1, threads) floats */
void k3_decode_step(const Dims *d, const Layer *layers, const Ends *ends, int64_t B, const int64_t *ids,
                    const int64_t *slots, const int64_t *tables, const int64_t *lengths, float *logits,
                    float *scratch, int64_t threads) {
    int64_t S_max = 1;
    for (int64_t b = 0; b < B; b++) S_max = lengths[b] + 1 > S_max ? lengths[b] + 1 : S_max;
    Scratch s = carve(d, B, scratch);
    const int64_t D = d->D, BD = B * D;
    for (int64_t b = 0; b < B; b++) memcpy(s.buf + b * D, ends->embed + ids[b] * D, D * sizeof(float));
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
        for (int64_t b = t; b < B; b += nt) {
            for (int64_t i = 0; i <= nb; i++) src[i] = s.buf + i * BD + b * D;
            attn_res(src, (int)nb + 1, ends->out_res, s.h + b * D, D, d->res_eps);
            rms_norm(s.h + b * D, ends->norm, s.xn + b * D, D, d->rms_eps);
        }
#pragma omp barrier
        Job jh = job(ends->lm_head, d->V, D, s.xn, D, B, logits, d->V);
        run_jobs(&jh, 1, t, nt);
        ftz_end(mode);
    }
}
