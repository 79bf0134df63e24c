/* The decode step's KDA layer (decode_step.c): per (row, head) the short conv, the gate, one delta-rule
 * step on the slot's recurrent state and the gated RMSNorm, around the layer's projections. */
#ifndef K3_DECODE_KDA_H
#define K3_DECODE_KDA_H

#include "decode_common.h"
#include "exp_poly.h"

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
        wjob(d, l->wq, 0, C, D, s->xn, D, B, u, big), wjob(d, l->wk, 0, C, D, s->xn, D, B, u + C, big),
        wjob(d, l->wv, 0, C, D, s->xn, D, B, u + 2 * C, big), wjob(d, l->wg, 0, C, D, s->xn, D, B, gate, big),
        wjob(d, l->wfa, 0, K, D, s->xn, D, B, fa, big), wjob(d, l->wb, 0, H, D, s->xn, D, B, braw, big),
    };
    run_jobs(jobs, 6, t, nt);
#pragma omp barrier
    Job jb = wjob(d, l->wfb, 0, C, K, fa, big, B, z, big);
    run_jobs(&jb, 1, t, nt);
#pragma omp barrier
    /* one work item per (run of rows in one slot, head): a prefill chunk's rows share a slot, in position
     * order, and each step reads the state (and conv history) the one before it wrote, so one thread takes
     * the run's rows in order; decode rows are runs of one. Any split of the items gives the same bits */
    float q[512], k[512], v[512], g[512];
    const int64_t *run = s->run_start, n_runs = s->n_runs;
    for (int64_t p = t; p < n_runs * H; p += nt) {
        const int64_t r = p / H, h = p % H, pn = p + nt;
        const float *next = pn < n_runs * H ? l->pool_rec + (slots[run[pn / H]] * H + pn % H) * K * K : NULL;
        for (int64_t b = run[r]; b < run[r + 1]; b++)
            kda_head(d, l, u + b * big, z + b * big, braw + b * big, gate + b * big, o + b * big, slots[b], h,
                     q, k, v, g, b + 1 == run[r + 1] ? next : NULL);
    }
#pragma omp barrier
    Job jo = wjob(d, l->wo, 0, D, C, o, big, B, s->y, D);
    run_jobs(&jo, 1, t, nt);
}

#endif
