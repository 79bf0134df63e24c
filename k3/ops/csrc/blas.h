/* The BLAS single-precision product the kernels run their matrix products through: the Fortran-ABI
 * `sgemm_` that torch itself links, passed in by address (k3.ops.native.blas_sgemm), so the products are
 * the kernels torch.mm runs. Used by moe_experts.c. */
#ifndef K3_BLAS_H
#define K3_BLAS_H

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

/* Row-major C [rows, n] (ld ldc) = beta C + A [rows, k] (ld lda) B^T, B row-major [n, k] (ld ldb): in
 * column-major terms C^T = B^T' A^T, i.e. sgemm('T', 'N', n, rows, k, B, A, C). */
static inline void gemm_abt(sgemm_fn sgemm, const float *a, int lda, const float *b, int ldb, float *c, int ldc,
                            int rows, int n, int k, float beta) {
    const float one = 1.0f;
    sgemm("T", "N", &n, &rows, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

/* Row-major C [rows, n] (ld ldc) = beta C + A [rows, k] (ld lda) B, B row-major [k, n] (ld ldb). */
static inline void gemm_ab(sgemm_fn sgemm, const float *a, int lda, const float *b, int ldb, float *c, int ldc,
                           int rows, int n, int k, float beta) {
    const float one = 1.0f;
    sgemm("N", "N", &n, &rows, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

#endif
