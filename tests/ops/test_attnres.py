"""AttnRes: fast stacked path == per-source reference, forward and backward; docs/spec.md#attnres
properties."""

import pytest
import torch

from k3.ops import attnres, native
from k3.ops.attnres import attn_res, attn_res_native, attn_res_reference


def _inputs(n, shape=(2, 5, 16), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True) for _ in range(n)]
    q = torch.randn(shape[-1], generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(shape[-1], generator=g, dtype=dtype, requires_grad=True)
    return srcs, q, w


@pytest.mark.parametrize("shape", [(2, 5, 16), (2, 1100, 64)], ids=["stacked", "streamed"])
@pytest.mark.parametrize("n", [1, 2, 9])
def test_fast_matches_reference_fwd_bwd(n, shape):
    srcs, q, w = _inputs(n, shape)
    a = attn_res(srcs, q, w)
    b = attn_res_reference(srcs, q, w)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # both compute in fp32
    if n == 1:
        return
    do = torch.randn_like(a)
    ga = torch.autograd.grad(a, [*srcs, q, w], do)
    gb = torch.autograd.grad(b, [*srcs, q, w], do)
    for x, y in zip(ga, gb, strict=True):  # q, w grads sum over every position: scale atol to them
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * max(1.0, y.abs().max().item()))


def test_single_source_is_identity_and_zero_query_is_mean():
    srcs, q, w = _inputs(3, dtype=torch.float32)
    assert attn_res(srcs[:1], q, w) is srcs[0]
    out = attn_res(srcs, torch.zeros_like(q), w)
    torch.testing.assert_close(out, sum(srcs) / 3)


def test_keys_normalized_values_raw():
    # scaling a source leaves its score unchanged (keys are RMS-normalized) but scales its value
    srcs, q, w = _inputs(2, dtype=torch.float64)
    scaled = [srcs[0] * 7.0, srcs[1]]
    a = attn_res(srcs, q, w)
    b = attn_res(scaled, q, w)
    # with alpha fixed, b - a = alpha_0 * 6 * v_0; recover alpha_0 and check it is a valid weight
    alpha0 = ((b - a) / (6.0 * srcs[0])).detach()
    assert torch.all((alpha0 > 0) & (alpha0 < 1))
    torch.testing.assert_close(alpha0, alpha0[..., :1].expand_as(alpha0), rtol=1e-3, atol=1e-4)


def test_bf16_output_dtype():
    srcs, q, w = _inputs(3, dtype=torch.bfloat16)
    assert attn_res(srcs, q, w).dtype == torch.bfloat16


def test_streamed_no_grad_equals_reference():
    srcs, q, w = _inputs(3, (1, 1100, 64), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(attn_res(srcs, q, w), attn_res_reference(srcs, q, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "shape"), [(2, (1, 7, 13)), (5, (2, 300, 256)), (9, (3, 64))])
def test_native_matches_reference_without_autograd(n, shape):
    """The one-pass C kernel (fp32, no autograd: the inference path) == the per-source reference; D not a
    multiple of 8, large-magnitude rows (the RMS key norm matters), uneven scores; on 1 and 3 threads."""
    if native.library("attn_res") is None:
        pytest.skip("no C compiler: the native kernel cannot be built")
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(*shape, generator=g) * (10.0 ** (i % 3)) for i in range(n)]
    q, w = torch.randn(shape[-1], generator=g), torch.randn(shape[-1], generator=g)
    with torch.no_grad():
        qk = (w * q).reshape(-1)
        got = attn_res_native(srcs, qk, attnres.ATTN_RES_EPS)
        assert got is not None and got.shape == srcs[0].shape
        ref = attn_res_reference([s.double() for s in srcs], q.double(), w.double())
        torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        torch.testing.assert_close(attn_res(srcs, q, w), got)  # the fast path takes it
        before = torch.get_num_threads()
        try:  # large calls split their rows over the threads: the same bits on any team
            for threads in (1, 3):
                torch.set_num_threads(threads)
                assert torch.equal(attn_res_native(srcs, qk, attnres.ATTN_RES_EPS), got)
        finally:
            torch.set_num_threads(before)
        # declined (None): autograd, float64, strided sources, too many sources
        assert attn_res_native([s.double() for s in srcs], qk.double(), 1e-5) is None
        assert attn_res_native([srcs[0].mT.contiguous().mT, *srcs[1:]], qk, 1e-5) is None
        assert attn_res_native(srcs * (attnres.NATIVE_MAX_SOURCES // n + 1), qk, 1e-5) is None
    assert attn_res_native([srcs[0].requires_grad_(), *srcs[1:]], qk, 1e-5) is None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("n", "shape"), [(2, (1, 7, 13)), (3, (2, 300, 256)), (9, (3, 64))])
def test_train_path_matches_float64_reference_fwd_bwd(n, shape, threads):
    """The training path (native forward and backward, fp32 with a gradient) against the reference in
    float64: the mixture, every source's gradient and the query / key-norm gradients (summed over rows
    by a thread team), with large-magnitude rows and D not a multiple of 8."""
    if native.library("attn_res") is None:
        pytest.skip("no C compiler: the native kernel cannot be built")
    g = torch.Generator().manual_seed(2)
    srcs = [(torch.randn(*shape, generator=g) * (10.0 ** (i % 3))).requires_grad_() for i in range(n)]
    q, w = (torch.randn(shape[-1], generator=g).requires_grad_() for _ in range(2))
    do = torch.randn(shape, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attn_res(srcs, q, w)
        assert "AttnRes" in type(got.grad_fn).__name__  # the native training path was taken
        got_g = torch.autograd.grad(got, [*srcs, q, w], do)
    finally:
        torch.set_num_threads(before)
    d = [x.detach().double().requires_grad_() for x in (*srcs, q, w)]
    ref = attn_res_reference(d[:n], d[n], d[n + 1])
    ref_g = torch.autograd.grad(ref, d, do.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for x, y in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(x.double(), y, rtol=1e-4, atol=2e-5 * y.abs().max().item())
