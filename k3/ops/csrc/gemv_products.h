/* The weight products of gemv.h for one weight element type. gemv.h includes this file once per type,
 * with WT (the stored element), LOADW(p) (16 of them from p as fp32 lanes), WAT(p, j) (element j as a
 * float) and NAME(f) (the function's name for the type) defined. The weights are turned into fp32
 * exactly before they are multiplied, so every type sums an output in the same order, and a bf16
 * matrix gives the bits of its fp32 copy. */

/* w . x: one 16-lane accumulation over i, hsum16, then the scalar tail (every product path sums a row
 * this way, so a result does not depend on the path). Prefetches GEMV_PREFETCH_BYTES past each cache
 * line of `w` it reads: at batch 1 the rows are read one after another, so this runs one stream ahead */
static inline float NAME(dot)(const WT *restrict w, const float *restrict x, int64_t n) {
    lanes16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __builtin_prefetch((const char *)(w + i) + GEMV_PREFETCH_BYTES);
        acc += LOADW(w + i) * load16(x + i);
    }
    float s = hsum16(acc);
    for (; i < n; i++) s += WAT(w, i) * x[i];
    return s;
}

/* rows o0..o1 of Y = W X^T: W [O, I] (row stride I), X [B, ldx], Y [B, ldy] */
static void NAME(gemv_rows)(const WT *restrict W, int64_t I, const float *restrict X, int64_t ldx, int64_t B,
                      float *restrict Y, int64_t ldy, int64_t o0, int64_t o1) {
    int64_t o = o0;
    if (B == 1) { /* one row after another: a single sequential stream per thread */
        for (; o < o1; o++) Y[o] = NAME(dot)(W + o * I, X, I);
        return;
    }
    /* four weight rows x four inputs per pass: 16 accumulators, 8 loads per 16 FMAs (one row at a time
     * would need 5 loads per 4), reduced together (hsum16x16); the last 1-3 inputs run the same block
     * with the block's first input standing in for the missing ones (their sums are dropped). Each
     * output is still one 16-lane accumulation over i, hsum16, then the scalar tail, exactly as in the
     * other paths, so a row's result does not depend on B */
    const int64_t passes = (B + 3) / 4; /* over the block's rows, one per four inputs */
    for (; o + 4 <= o1 && B >= 2; o += 4) {
        const WT *ws[4] = {W + o * I, W + (o + 1) * I, W + (o + 2) * I, W + (o + 3) * I};
        for (int64_t b = 0; b < B; b += 4) {
            const int64_t nb = B - b < 4 ? B - b : 4, pass = b / 4;
            const float *xs[4];
            for (int c = 0; c < 4; c++) xs[c] = X + (b + (c < nb ? c : 0)) * ldx;
            lanes16 acc[16] = {{0}};
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                /* the prefetches of the rows ahead are spread over the passes (pass p takes rows p, p +
                 * passes, ...; from the fifth pass on none): all four rows in the first pass would
                 * outnumber the core's line fill buffers and stall its loads while the later passes,
                 * which find the block in L1, issue none (k3-small, 1,024 x 1,024 at 16 inputs on two
                 * threads: 194 -> 223 GFLOP/s) */
                for (int64_t r = pass; r < 4; r += passes) __builtin_prefetch(ws[r] + GEMV_PREFETCH_ROWS * I + i);
                const lanes16 wv[4] = {LOADW(ws[0] + i), LOADW(ws[1] + i), LOADW(ws[2] + i), LOADW(ws[3] + i)};
                const lanes16 xv[4] = {load16(xs[0] + i), load16(xs[1] + i), load16(xs[2] + i), load16(xs[3] + i)};
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 4; c++) acc[4 * r + c] += wv[r] * xv[c];
            }
            const lanes16 sums = hsum16x16(acc);
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < nb; c++) {
                    float sum = sums[4 * r + c];
                    for (int64_t j = i; j < I; j++) sum += WAT(ws[r], j) * xs[c][j];
                    Y[(b + c) * ldy + o + r] = sum;
                }
        }
    }
    for (; o < o1; o++) {
        const WT *w = W + o * I;
        int64_t b = 0;
        for (; b + 4 <= B; b += 4) {
            const float *x0 = X + b * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            lanes16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                const lanes16 wv = LOADW(w + i);
                a0 += wv * load16(x0 + i);
                a1 += wv * load16(x1 + i);
                a2 += wv * load16(x2 + i);
                a3 += wv * load16(x3 + i);
            }
            float s0 = hsum16(a0), s1 = hsum16(a1), s2 = hsum16(a2), s3 = hsum16(a3);
            for (; i < I; i++) {
                s0 += WAT(w, i) * x0[i];
                s1 += WAT(w, i) * x1[i];
                s2 += WAT(w, i) * x2[i];
                s3 += WAT(w, i) * x3[i];
            }
            Y[b * ldy + o] = s0, Y[(b + 1) * ldy + o] = s1, Y[(b + 2) * ldy + o] = s2, Y[(b + 3) * ldy + o] = s3;
        }
        for (; b < B; b++) Y[b * ldy + o] = NAME(dot)(w, X + b * ldx, I);
    }
}
