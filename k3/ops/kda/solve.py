"""The UT transform's unit-triangular solve, in place, as two half-size solves and one matmul.

Chunked KDA solves (I + A) X = R for every chunk, A [M, C, C] strictly lower triangular (A_kk). On CPU,
LAPACK's batched triangular solve on 64 x 64 systems runs well below matmul speed; cutting the system
into 2 x 2 blocks of C/2,

    X_0 = (I + A_00)^-1 R_0,    X_1 = (I + A_11)^-1 (R_1 - A_10 X_0),

moves half of the multiply-adds into one batched matmul and makes each solve a quarter the size
(a few % faster than one solve; LAPACK copies each half-block in and out, since the halves are
not batch-contiguous). The backward needs the transposed system (I + A)^T Y = D, solved bottom block first:

    Y_1 = (I + A_11)^-T D_1,    Y_0 = (I + A_00)^-T (D_0 - A_10^T Y_1).

Where a C compiler is available both run instead as one native forward / backward substitution
(`k3/ops/csrc/unit_lower_solve.c`, built by `k3.ops.native`): ~2.5x faster than LAPACK's trsm on
64 x 64 systems, whose time goes mostly to per-call overhead and packing at this size.
`unit_lower_solve_reference_` is the plain one-call LAPACK solve with the same signature (tests compare them).
"""

import ctypes

import torch

from k3.ops import native


def unit_lower_solve_(A: torch.Tensor, X: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """A [M, C, C] (strictly lower part used, unit diagonal implied); X [M, C, N], overwritten with
    (I + A)^-1 X, or (I + A)^-T X when transpose; returns X. C odd or < 16: the one-call solve."""
    C = A.shape[-1]
    if _native(A, A, 0, C, X, transpose):
        return X
    if C % 2 or C < 16:
        return unit_lower_solve_reference_(A, X, transpose)
    h = C // 2
    return unit_lower_solve_blocks_(A[:, :h, :h], A[:, h:, :h], A[:, h:, h:], X, transpose)


def unit_lower_solve_blocks_(A00, A10, A11, X: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """`unit_lower_solve_` given the blocks of A [M, h, h] (any strides; of A00 and A11 only the strictly
    lower triangle is read, so whatever lies above it, even inf, never matters); X [M, 2h, N]."""
    h = A00.shape[-1]
    if _one_matrix(A00, A10, A11) and _native(A00, A10, A10.data_ptr() - A00.data_ptr(), h, X, transpose):
        return X
    X0, X1 = X[:, :h], X[:, h:]
    if transpose:
        _solve_half(A11, X1, transpose=True)
        X0.baddbmm_(A10.mT, X1, alpha=-1)
        _solve_half(A00, X0, transpose=True)
    else:
        _solve_half(A00, X0, transpose=False)
        X1.baddbmm_(A10, X0, alpha=-1)
        _solve_half(A11, X1, transpose=False)
    return X


def _solve_half(A: torch.Tensor, X: torch.Tensor, transpose: bool) -> None:
    # right-hand solves on X^T: no copy for a whole contiguous X; a half-block X is copied by LAPACK
    if transpose:  # X^T (I + A) = D^T
        torch.linalg.solve_triangular(A, X.mT, upper=False, left=False, unitriangular=True, out=X.mT)
    else:  # X^T (I + A)^T = R^T
        torch.linalg.solve_triangular(A.mT, X.mT, upper=True, left=False, unitriangular=True, out=X.mT)


def unit_lower_solve_reference_(A: torch.Tensor, X: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """The reference: one LAPACK solve over the whole C x C system (same contract as the fast path)."""
    _solve_half(A, X, transpose)
    return X


def _one_matrix(A00, A10, A11) -> bool:
    """Whether A10 and A11 are the two halves of the same rows (A11 starts h columns after A10) and the
    three blocks share their batch and row strides: then the blocks are one matrix to the native kernel."""
    h = A00.shape[-1]
    same_strides = A00.stride()[:2] == A10.stride()[:2] == A11.stride()[:2]
    return same_strides and A11.data_ptr() == A10.data_ptr() + h * A10.element_size()


# k3_unit_lower_solve(A, a_batch, a_half, a_row, h, X, x_batch, x_row, M, C, N, transpose)
_SOLVE_ARGS = [native.PTR, *[native.I64] * 4, native.PTR, *[native.I64] * 5, ctypes.c_int]


def _native(A, A_lo, half_bytes: int, h: int, X, transpose: bool) -> bool:
    """Run the native kernel if it is built and the layout fits: fp32 CPU, unit column strides. `A` holds
    rows [0, h) of each system, `A_lo` the rows from h on, `half_bytes` apart. -> whether it ran."""
    layout = X.dim() == 3 and A.stride(-1) == 1 and X.stride(-1) == 1 and half_bytes % 4 == 0
    fn = native.function("unit_lower_solve", "k3_unit_lower_solve", _SOLVE_ARGS) if layout else None
    if fn is None or not native.fp32_cpu(A, A_lo, X):
        return False
    M, C, N = X.shape
    fn(A.data_ptr(), A.stride(0), half_bytes // 4, A.stride(1), h,
       X.data_ptr(), X.stride(0), X.stride(1), M, C, N, int(transpose))  # fmt: skip
    return True
