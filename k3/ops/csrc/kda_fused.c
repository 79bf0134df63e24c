/* The whole chunked KDA forward (two-half case) in one pass per (sequence, head): the inference prefill's
 * `chunk_kda` without autograd (k3/ops/kda/fused.py; the maths in chunk.py and halves.py).
 *
 * For each chunk of C tokens, with S [K][V] the state entering it (kept in `finals`, which ends as the
 * final state), everything stays in a few hundred KB of scratch (L2):
 *   prep        rows rq, rk, the column sets c0T [K][h], c1T [K][C], qg, X = [v beta | W], kdT [K][C]
 *               (the elementwise pass of kda_halves.c: token_rows, then the column and k_dec
 *               transposes the products want)
 *   A           Aq = rq cT, Ak = rk cT per row half (half 0 against its own h columns, half 1 against
 *               all C); Aq above the diagonal zeroed (those products may overflow: dropped, never used)
 *   solve       X <- (I + Ak)^-1 X, by row blocks of 6: X[blk] -= Ak[blk, :i0] X[:i0], then forward
 *               substitution inside the block
 *   state pass  V' = U - W S;  O = qg S + Aq V' (written into o);  S = exp(Γ_C) S + kdT V'
 * The products are small_gemm.h's (operands in L1 / L2; MKL would pack them first).
 *
 * Inputs q, k, g [B][T][H][K], v [B][T][H][V], beta [B][T][H] are strided (batch, token, head) with
 * channel stride 1, T a multiple of C (the caller pads). seg [n][3] lists each independent sequence as
 * (batch row, first token, number of chunks); tasks [task0, task1) are (sequence, head) pairs
 * (task = seq * H + head), so callers can split them across threads. h0 [n][H][K][V] or NULL (zeros);
 * o [B][T][H][V] strided like the inputs; finals [n][H][K][V]. Needs C in {32, 64, 128} (h a multiple of
 * 16) and K, V multiples of 16 (the caller checks); work: k3_kda_fused_scratch floats, 64-byte
 * aligned, one per concurrent caller. Denormals are flushed while it runs (as the torch path
 * runs), on x86.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ftz.h"
#include "kda_factors.h"
#include "lanes.h"
#include "small_gemm.h"
#include "transpose8.h"

typedef struct {
    int64_t b, t, h; /* strides (elements) of batch row, token, head; the channel stride is 1 */
} strides_bth;

typedef struct {
    float *gin, *vec, *rq, *rk, *qg, *kc, *kd, *c0T, *c1T, *kdT, *X, *Aq, *Ak;
} scratch;

#define N_BUFFERS 13

/* the scratch buffers' sizes in floats, in the order of `scratch`'s fields */
static void buffer_sizes(int64_t C, int64_t K, int64_t V, int64_t n[N_BUFFERS]) {
    const int64_t CK = C * K, sizes[N_BUFFERS] = {CK, 5 * K, CK, CK, CK, CK, CK, K * C / 2, K * C, K * C,
                                                   C * (V + K), C * C, C * C};
    memcpy(n, sizes, sizeof sizes);
}

static int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; } /* keeps every buffer 64-byte aligned */

/* floats of scratch one caller (thread) passes in, 64-byte aligned */
void k3_kda_fused_scratch(int64_t C, int64_t K, int64_t V, int64_t *floats) {
    int64_t n[N_BUFFERS], total = 0;
    buffer_sizes(C, K, V, n);
    for (int i = 0; i < N_BUFFERS; i++) total += round16(n[i]);
    *floats = total;
}

static void scratch_carve(scratch *s, float *next, int64_t C, int64_t K, int64_t V) {
    float **fields[N_BUFFERS] = {&s->gin, &s->vec, &s->rq, &s->rk, &s->qg, &s->kc, &s->kd,
                                 &s->c0T, &s->c1T, &s->kdT, &s->X, &s->Aq, &s->Ak};
    int64_t n[N_BUFFERS];
    buffer_sizes(C, K, V, n);
    for (int i = 0; i < N_BUFFERS; i++) {
        *fields[i] = next;
        next += round16(n[i]);
    }
}

/* dst [cols][rows] (ld ldd) = src [rows][cols] (ld lds) transposed; rows, cols multiples of 8 */
static void transpose(const float *restrict src, int64_t lds, float *restrict dst, int64_t ldd, int64_t rows,
                      int64_t cols) {
    for (int64_t i = 0; i < rows; i += 8)
        for (int64_t j = 0; j < cols; j += 8) transpose8(src + i * lds + j, lds, dst + j * ldd + i, ldd);
}

/* the elementwise pass of one chunk: fills rq, rk, qg, X, the transposed columns and k_dec, decay */
static void prep(const scratch *s, const float *q, int64_t sqt, const float *k, int64_t skt, const float *v,
                 int64_t svt, const float *g, int64_t sgt, const float *beta, int64_t sbt, int64_t C, int64_t K,
                 int64_t V, float scale, float eps) {
    const int64_t h = C / 2, W = V + K;
    float *e_half0 = s->vec, *e_half1 = s->vec + K, *e_mid1 = s->vec + 2 * K, *e_tail0 = s->vec + 3 * K;
    float *decay = s->vec + 4 * K;
    half_cumsum(g, sgt, s->gin, C, K);
    const float *tot0 = s->gin + (h - 1) * K, *tot1 = s->gin + (C - 1) * K;
    channel_factors(tot0, tot1, e_half0, e_half1, e_mid1, e_tail0, decay, K);
    for (int64_t t = 0; t < C; t++) {
        const int64_t a = t / h;
        const float *qt = q + t * sqt, *kt = k + t * skt, *vt = v + t * svt;
        const float *tot = a ? tot1 : tot0, *e_mid = a ? e_mid1 : e_half0, *e_tail = a ? e_half1 : e_tail0;
        const float bt = beta[t * sbt];
        const float iq = scale / sqrtf(sum_squares(qt, K) + eps);
        const float ik = 1.0f / sqrtf(sum_squares(kt, K) + eps);
        float *xt = s->X + t * W;
        token_rows(qt, kt, s->gin + t * K, tot, e_mid, e_tail, iq, ik, ik * bt, s->rq + t * K, s->rk + t * K,
                   s->kc + t * K, s->qg + t * K, xt + V, s->kd + t * K, K);
        for (int64_t c = 0; c < V; c++) xt[c] = vt[c] * bt;
    }
    /* the column sets and k_dec, transposed to [K][tokens] for the products */
    transpose(s->kd, K, s->kdT, C, C, K);
    transpose(s->kc, K, s->c0T, h, h, K);                 /* set 0: half 0 seen from mid_0 */
    transpose(s->kc + h * K, K, s->c1T + h, C, h, K);     /* set 1: half 1 seen from mid_1 */
    for (int64_t c = 0; c < K; c++) {                      /* and half 0 seen from mid_1 */
        const float *src = s->c0T + c * h;
        float *dst = s->c1T + c * C;
        for (int64_t t = 0; t < h; t++) dst[t] = src[t] * e_half0[c] * e_half1[c];
    }
}

/* Aq, Ak [C][C]: row half 0 against the first h columns, row half 1 against all C; Aq above the
 * diagonal set to 0 (Ak above the diagonal is never read) */
static void chunk_products(const scratch *s, int64_t C, int64_t K) {
    const int64_t h = C / 2;
    gemm_nn(h, h, K, s->rq, K, s->c0T, h, s->Aq, C, 0);
    gemm_nn(h, C, K, s->rq + h * K, K, s->c1T, C, s->Aq + h * C, C, 0);
    gemm_nn(h, h, K, s->rk, K, s->c0T, h, s->Ak, C, 0);
    gemm_nn(h, C, K, s->rk + h * K, K, s->c1T, C, s->Ak + h * C, C, 0);
    for (int64_t i = 0; i < C; i++) memset(s->Aq + i * C + i + 1, 0, sizeof(float) * (size_t)(C - 1 - i));
}

/* X [C][W] <- (I + A)^-1 X with A's strict lower triangle, by row blocks of 6 */
static void lower_solve(const float *A, float *X, int64_t C, int64_t W) {
    for (int64_t i0 = 0; i0 < C; i0 += 6) {
        const int64_t R = C - i0 < 6 ? C - i0 : 6;
        if (i0 > 0) gemm_nn(R, W, i0, A + i0 * C, C, X, W, X + i0 * W, W, -1);
        for (int64_t r = 1; r < R; r++) {
            float *xi = X + (i0 + r) * W;
            for (int64_t j = 0; j < r; j++) {
                const float a = A[(i0 + r) * C + i0 + j];
                const float *xj = X + (i0 + j) * W;
                for (int64_t c = 0; c < W; c++) xi[c] -= a * xj[c];
            }
        }
    }
}

/* one chunk's state pass: V' = U - W S (into X's U part), O = qg S + Aq V', S = exp(Γ_C) S + kdT V' */
static void state_pass(const scratch *s, float *S, float *o, int64_t sot, int64_t C, int64_t K, int64_t V) {
    const int64_t W = V + K;
    const float *decay = s->vec + 4 * K;
    gemm_nn(C, V, K, s->X + V, W, S, V, s->X, W, -1);
    gemm_nn(C, V, K, s->qg, K, S, V, o, sot, 0);
    gemm_nn_lower(C, V, s->Aq, C, s->X, W, o, sot, 1);
    for (int64_t c = 0; c < K; c++)
        for (int64_t j = 0; j < V; j++) S[c * V + j] *= decay[c];
    gemm_nn(K, V, C, s->kdT, C, s->X, W, S, V, 1);
}

void k3_kda_fused_forward(const float *q, strides_bth sq, const float *k, strides_bth sk, const float *v,
                          strides_bth sv, const float *g, strides_bth sg, const float *beta, strides_bth sb,
                          int64_t H, int64_t C, int64_t K, int64_t V, float scale, float eps, const int64_t *seg,
                          int64_t task0, int64_t task1, const float *h0, float *o, strides_bth so,
                          float *finals, float *work) {
    const unsigned mode = ftz_begin(); /* denormals as zero (ftz.h) */
    scratch s;
    scratch_carve(&s, work, C, K, V);
    for (int64_t task = task0; task < task1; task++) {
        const int64_t n = task / H, hd = task % H, b = seg[3 * n], first = seg[3 * n + 1], chunks = seg[3 * n + 2];
        float *S = finals + task * K * V;
        if (h0 != NULL)
            memcpy(S, h0 + task * K * V, sizeof(float) * (size_t)(K * V));
        else
            memset(S, 0, sizeof(float) * (size_t)(K * V));
        for (int64_t ci = 0; ci < chunks; ci++) {
            const int64_t t0 = first + ci * C;
#define AT(x, st) (x + b * st.b + t0 * st.t + hd * st.h)
            prep(&s, AT(q, sq), sq.t, AT(k, sk), sk.t, AT(v, sv), sv.t, AT(g, sg), sg.t, AT(beta, sb), sb.t, C, K, V,
                 scale, eps);
            chunk_products(&s, C, K);
            lower_solve(s.Ak, s.X, C, V + K);
            state_pass(&s, S, AT(o, so), so.t, C, K, V);
#undef AT
        }
    }
    ftz_end(mode);
}
