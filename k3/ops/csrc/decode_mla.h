/* The decode step's MLA layer (decode_step.c): the new latent into its page, then the absorbed attention
 * of each row over its paged latents, MLA_GROUP heads per pass over them. */
#ifndef K3_DECODE_MLA_H
#define K3_DECODE_MLA_H

#include "decode_common.h"

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
        wjob(d, d->Q ? l->wqa : l->wqb, 0, qrows, D, s->xn, D, B, d->Q ? qa : q, big),
        wjob(d, l->wkva, 0, RD, D, s->xn, D, B, kva, big),
        wjob(d, l->mg, 0, HM * Dv, D, s->xn, D, B, gate, big),
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
        Job jq = wjob(d, l->wqb, 0, HM * Dh, d->Q, qa, big, B, q, big);
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
            per_head[HM + h] = wjob(d, l->wkvb, (h * (Dn + Dv) + Dn) * R, Dv, R, ol + h * R, big, B, o + h * Dv, big);
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
    Job jo = wjob(d, l->mo, 0, D, HM * Dv, o, big, B, s->y, D);
    run_jobs(&jo, 1, t, nt);
}

#endif
