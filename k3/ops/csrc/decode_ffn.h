/* The decode step's FFN (decode_step.c): the dense SiTU GLU, and the LatentMoE (routing, the routed
 * experts in the latent width, fp32 or MXFP4, and the shared experts). */
#ifndef K3_DECODE_FFN_H
#define K3_DECODE_FFN_H

#include "decode_common.h"
#include "situ.h"

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
    Job jobs[2] = {wjob(d, l->w_gate, 0, I, D, s->xn, D, B, s->a, big), wjob(d, l->w_up, 0, I, D, s->xn, D, B, s->b, big)};
    run_jobs(jobs, 2, t, nt);
#pragma omp barrier
    situ_split(s->a, s->b, B, I, big, d, t, nt);
#pragma omp barrier
    Job jd = wjob(d, l->w_down, 0, D, I, s->a, big, B, s->y, D);
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
        job(l->router, E, D, s->xn, D, B, logits, big), wjob(d, l->lat_down, 0, Dl, D, s->xn, D, B, z, big),
        wjob(d, l->w_gate, 0, Is, D, s->xn, D, B, sg, big), wjob(d, l->w_up, 0, Is, D, s->xn, D, B, su, big),
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
                up[s->n_up++] = wjob(d, l->w1, e * I * Dl, I, Dl, zs + i * Dl, Dl, m, gs + i * I, I);
                up[s->n_up++] = wjob(d, l->w3, e * I * Dl, I, Dl, zs + i * Dl, Dl, m, us + i * I, I);
                down[s->n_down++] = wjob(d, l->w2, e * Dl * I, Dl, I, gs + i * I, I, m, ys + i * Dl, Dl);
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
    Job out[2] = {wjob(d, l->lat_up, 0, D, Dl, ul, big, B, s->y, D), wjob(d, l->w_down, 0, D, Is, sg, big, B, s->y2, D)};
    run_jobs(out, Is ? 2 : 1, t, nt);
#pragma omp barrier
    if (Is) {
        int64_t lo, hi;
        share(B * D, t, nt, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) s->y[i] += s->y2[i];
    }
}

#endif
