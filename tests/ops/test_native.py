"""Native C kernels (k3.ops.native): the build / cache / fallback machinery, each kernel against its
torch path (KDA's UT solve and chunk-local pass, MLA's online-softmax step; SiTU's in test_glu.py), and
chunk_kda end to end on the torch path (the suite's other tests run native wherever a compiler exists,
as on CI)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import k3.ops.kda.chunk as chunk_module
from k3.ops import native
from k3.ops.kda import chunk_kda, recurrent_kda_reference
from k3.ops.kda.halves import halves_local, halves_local_reference
from k3.ops.kda.scratch import Workspace
from k3.ops.kda.solve import unit_lower_solve_, unit_lower_solve_blocks_, unit_lower_solve_reference_
from k3.ops.mla import causal_mask, mla_attention_blockwise, mla_attention_reference, ragged_causal_mask


@pytest.fixture
def fresh_native(tmp_path, monkeypatch):
    """An empty kernel cache and no loaded libraries; restored afterwards."""
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path))
    native.reset()
    yield tmp_path
    native.reset()


def require(name: str):
    lib = native.library(name)
    if lib is None:
        pytest.skip("no C compiler on this machine: the native kernels cannot be built")
    return lib


def test_library_is_built_once_then_loaded_from_the_cache(fresh_native, monkeypatch):
    lib = require("unit_lower_solve")
    built = list(fresh_native.glob("native/*/libunit_lower_solve.so"))
    assert len(built) == 1
    assert native.library("unit_lower_solve") is lib  # cached in the process
    native.reset()

    def no_compiler(*args, **kwargs):
        raise AssertionError("the cached library must be loaded without compiling")

    monkeypatch.setattr(native.subprocess, "run", no_compiler)
    assert native.library("unit_lower_solve") is not None


def test_missing_compiler_warns_and_falls_back(fresh_native, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(UserWarning, match="no C compiler"):
        assert native.library("unit_lower_solve") is None
    # chunk_kda still runs (the torch path) and agrees with the reference
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 70, 2, 16, generator=gen) for _ in range(3))
    g = -5 * torch.sigmoid(torch.randn(1, 70, 2, 16, generator=gen))
    beta = torch.rand(1, 70, 2, generator=gen)
    with pytest.warns(UserWarning) as caught:
        o, _ = chunk_kda(q, k, v, g, beta)
    warned = " ".join(str(w.message) for w in caught)
    assert "'kda_fused' unavailable" in warned and "'kda_halves' unavailable" in warned
    o_ref, _ = recurrent_kda_reference(q, k, v, g, beta)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)


def test_failed_build_warns_naming_the_error(fresh_native, monkeypatch, tmp_path):
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine: nothing to fail")
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "broken.c").write_text("this is not C\n")
    monkeypatch.setattr(native, "CSRC", src)
    with pytest.warns(UserWarning, match="broken.*failed"):
        assert native.library("broken") is None
    assert not list(tmp_path.glob("native/*/*.so"))  # nothing half-written left in the cache


def test_unwritable_cache_warns_and_falls_back(fresh_native, monkeypatch, tmp_path):
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("K3_CACHE_DIR", str(blocker))
    with pytest.warns(UserWarning, match="cannot write the kernel cache"):
        assert native.library("unit_lower_solve") is None


def test_switched_off_by_the_environment(fresh_native, monkeypatch):
    monkeypatch.setenv("K3_NATIVE", "0")
    assert native.library("unit_lower_solve") is None
    assert not list(fresh_native.glob("native/*"))


def assert_as_accurate_as_lapack(got, A, R, transpose):
    """fp32 `got` is within 2x (+ a rounding floor) of fp32 LAPACK's distance to the float64 solution
    (random systems of size 128 amplify rounding: an absolute tolerance alone would not say much)."""
    want = unit_lower_solve_reference_(A.double(), R.double(), transpose)
    lapack = unit_lower_solve_reference_(A, R.clone(), transpose)
    err, err_lapack = ((t.double() - want).abs().amax().item() for t in (got, lapack))
    assert err <= 2 * err_lapack + 1e-6 * want.abs().amax().item(), (err, err_lapack)


@pytest.mark.parametrize("C, N", [(64, 128), (64, 64), (16, 5), (63, 70), (128, 200), (1, 3)])
@pytest.mark.parametrize("transpose", [False, True])
def test_native_solve_matches_lapack(C, N, transpose):
    require("unit_lower_solve")
    g = torch.Generator().manual_seed(C * 1000 + N)
    A = torch.randn(5, C, C, generator=g).tril(-1) * 0.3
    A = A + torch.triu(torch.full((C, C), float("inf")))  # never read: only the strictly lower part is
    R = torch.randn(5, C, N, generator=g)
    got = unit_lower_solve_(A, R.clone(), transpose)
    assert_as_accurate_as_lapack(got, A.tril(-1), R, transpose)
    # in place on a column slice of a wider buffer ([U | W] share one tensor in chunk_kda)
    buf = torch.randn(5, C, N + 9, generator=g)
    buf[..., 9:] = R
    unit_lower_solve_(A, buf[..., 9:], transpose)
    torch.testing.assert_close(buf[..., 9:], got)


@pytest.mark.parametrize("transpose", [False, True])
def test_native_solve_on_the_two_half_layout(transpose):
    """The blocks of halves.py: row halves of one matrix stored 2 h C apart (q rows interleaved)."""
    require("unit_lower_solve")
    M, h = 6, 32
    g = torch.Generator().manual_seed(1)
    buf = torch.randn(M, 2, 2, h, 2 * h, generator=g) * 0.3  # [M, half, q|k, h, C]
    A_k = buf[:, :, 1]
    full = torch.cat([A_k[:, 0], A_k[:, 1]], 1).tril(-1)  # the matrix the blocks describe
    for r in range(h):  # garbage on and above the diagonal of both diagonal blocks
        A_k[:, 0, r, r:] = float("inf")
        A_k[:, 1, r, h + r :] = float("inf")
    R = torch.randn(M, 2 * h, 100, generator=g)
    got = unit_lower_solve_blocks_(A_k[:, 0, :, :h], A_k[:, 1, :, :h], A_k[:, 1, :, h:], R.clone(), transpose)
    assert_as_accurate_as_lapack(got, full, R, transpose)


def chunked(x: torch.Tensor, C: int = 64) -> torch.Tensor:
    return chunk_module._to_chunks(x, C)


@pytest.mark.parametrize("batch, K, V, per_token", [(1, 64, 64, None), (2, 32, 48, None), (1, 16, 8, -4.3)])
def test_native_halves_prep_matches_the_torch_path(batch, K, V, per_token):
    """Every output of the two-half chunk-local maps, on the chunked views chunk_kda passes (strided
    for batch 1, copies otherwise), K != V, and gates at the path's decay limit (factors up to e^70)."""
    require("kda_halves")
    gen = torch.Generator().manual_seed(K + V)
    T, H = 256, 2
    q, k = torch.randn(batch, T, H, K, generator=gen), torch.randn(batch, T, H, K, generator=gen)
    v = torch.randn(batch, T, H, V, generator=gen)
    if per_token is None:
        g = -5 * torch.sigmoid(torch.randn(batch, T, H, K, generator=gen))
    else:
        g = per_token + 0.05 * torch.rand(batch, T, H, K, generator=gen)
    beta = torch.rand(batch, T, H, generator=gen)
    x = [chunked(t)[1:3] for t in (q, k, v, g, beta)]  # a group of 2 chunks
    M = 2 * batch * H
    outs = []
    for fn in (halves_local, halves_local_reference):
        A_qk, A_kk, X = torch.full((M, 64, 64), 7.0), torch.empty(M, 64, 64), torch.empty(M, 64, V + K)
        qg, k_dec, decay = fn(*x, 0.3, A_qk, A_kk, X, Workspace())
        outs.append((A_qk, A_kk.tril(-1), X, qg.clone(), k_dec.clone(), decay.clone()))
    for name, got, want in zip(("A_qk", "A_kk", "X", "qg", "k_dec", "decay"), *outs, strict=True):
        assert torch.isfinite(got).all(), name
        scale = want.abs().amax()
        assert (got - want).abs().amax() <= 1e-5 * scale, f"{name}: {((got - want).abs().amax() / scale):.2e}"


@pytest.mark.parametrize("T, gate", [(65, "safe"), (300, "safe"), (130, "harsh")])
def test_chunk_kda_torch_path_matches_naive(monkeypatch, T, gate):
    """With no native kernels (no compiler), forward and gradients against the token loop."""
    monkeypatch.setattr(native, "library", lambda name: None)
    gen = torch.Generator().manual_seed(T)
    B, H, K, V = 2, 2, 32, 48
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    z = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.sigmoid(z) if gate == "safe" else -20 * torch.sigmoid(z)
    beta, s0 = torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    grads = []
    for fn in (chunk_kda, recurrent_kda_reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
        o, _ = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        o.backward(do)
        grads.append([o.detach(), *(t.grad for t in leaves)])
    for name, got, want in zip(("o", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *grads, strict=True):
        err = (got - want).norm() / want.norm()
        assert err <= (1e-5 if name == "o" else 1e-4), f"{name}: relative error {err:.2e}"


def test_chunk_kda_native_equals_torch_path(monkeypatch):
    """The two paths of one call agree to float rounding (fp32, the bench shape at a smaller T)."""
    require("kda_halves")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 512, 4, 64, generator=gen) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, 512, 4, 64, generator=gen)) * 2
    beta = torch.rand(1, 512, 4, generator=gen)
    o_native, s_native = chunk_kda(q, k, v, g, beta, output_final_state=True)
    monkeypatch.setattr(native, "library", lambda name: None)
    o_torch, s_torch = chunk_kda(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(o_native, o_torch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_native, s_torch, rtol=1e-5, atol=1e-5)


FUSED_CASES = {  # B, T, H, K, V, chunk size, gate, initial state
    "bench shape": (1, 512, 4, 64, 64, 64, "safe", True),
    "batch 2, K != V, ragged tail": (2, 300, 2, 32, 48, 64, "safe", True),
    "chunk 32, no initial state": (1, 130, 2, 16, 32, 32, "safe", False),
    "chunk 128, gentle gate": (2, 200, 1, 32, 16, 128, "gentle", True),
    "at the two-half decay limit": (1, 192, 2, 64, 32, 64, "limit", True),
}


def _kda_case(B, T, H, K, V, gate, h0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    z = torch.randn(B, T, H, K, generator=gen)
    g = {"safe": -5 * torch.sigmoid(z), "gentle": F.logsigmoid(z) / 8, "limit": -4.35 + 0.02 * z.sigmoid()}[
        gate
    ]
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen) if h0 else None
    return (q, k, v, g, beta), s0


def _spy_fused(monkeypatch) -> list:
    """Record whether each chunk_kda call ran the fused native pass."""
    ran, real = [], chunk_module.fused_forward
    monkeypatch.setattr(chunk_module, "fused_forward", lambda *a: ran.append(real(*a)) or ran[-1])
    return ran


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("case", FUSED_CASES.values(), ids=FUSED_CASES.keys())
def test_fused_chunk_kda_matches_the_torch_path_and_naive(monkeypatch, case):
    """The fused pass (kda_fused.c) against chunk_kda's torch path (to fp32 rounding) and the token loop."""
    require("kda_fused")
    *shape, C, gate, h0 = case
    inputs, s0 = _kda_case(*shape, gate, h0)
    ran = _spy_fused(monkeypatch)
    o, s = chunk_kda(*inputs, initial_state=s0, output_final_state=True, chunk_size=C)
    assert len(ran) == 1 and ran[0] is not None, "the fused pass did not run"
    monkeypatch.setattr(chunk_module, "fused_forward", lambda *a: None)
    o_torch, s_torch = chunk_kda(*inputs, initial_state=s0, output_final_state=True, chunk_size=C)
    o_ref, s_ref = recurrent_kda_reference(*inputs, initial_state=s0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert _rel(o, o_torch) <= 1e-6 and _rel(s, s_torch) <= 1e-6, (_rel(o, o_torch), _rel(s, s_torch))
    assert _rel(o, o_ref) <= 1e-5 and _rel(s, s_ref) <= 1e-5, (_rel(o, o_ref), _rel(s, s_ref))


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_chunk_kda_documents_and_threads(monkeypatch, threads):
    """Packed documents (cu_seqlens, one initial state each) with the (document, head) pairs split across
    threads: each document equals the token loop over it alone."""
    require("kda_fused")
    cu = [0, 15, 100, 164, 300]
    inputs, _ = _kda_case(1, cu[-1], 2, 32, 48, "safe", False, seed=4)
    s0 = torch.randn(len(cu) - 1, 2, 32, 48, generator=torch.Generator().manual_seed(5))
    ran = _spy_fused(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, s = chunk_kda(*inputs, initial_state=s0, output_final_state=True, cu_seqlens=torch.tensor(cu))
    finally:
        torch.set_num_threads(before)
    assert ran[0] is not None
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        doc = [x[:, a:b] for x in inputs]
        o_ref, s_ref = recurrent_kda_reference(*doc, initial_state=s0[n : n + 1], output_final_state=True)
        assert _rel(o[:, a:b], o_ref) <= 1e-5 and _rel(s[n : n + 1], s_ref) <= 1e-5, n


def test_fused_chunk_kda_leaves_autograd_and_odd_shapes_to_the_torch_path(monkeypatch):
    """Inputs that need gradients, K not a multiple of 16, a chunk size of 16 and harsh gates (beyond the
    two-half range) never reach the fused pass."""
    require("kda_fused")
    ran = _spy_fused(monkeypatch)
    inputs, s0 = _kda_case(1, 100, 2, 32, 32, "safe", True)
    chunk_kda(*[x.clone().requires_grad_() for x in inputs], initial_state=s0)
    chunk_kda(*inputs, initial_state=s0, chunk_size=16)
    chunk_kda(*_kda_case(1, 100, 2, 24, 32, "safe", True)[0])
    harsh = list(inputs)
    harsh[3] = inputs[3] * 4
    chunk_kda(*harsh)
    assert ran == []
    chunk_kda(*inputs, initial_state=s0)
    assert len(ran) == 1 and ran[0] is not None


def _blockwise_case(mask: str, ragged_offsets: list[int], dims=(16, 8, 12, 10)):
    """2 rows of 37 queries over 300 keys, 3 heads (R, Dr, Dn, Dv = dims): (qn, qp, c, kp, wuk, wuv)
    and mla_attention_blockwise's mask arguments for `mask` in causal / ragged / none."""
    g = torch.Generator().manual_seed(0)
    (B, T, S, H), (R, Dr, Dn, Dv) = (2, 37, 300, 3), dims
    qn, qp = torch.randn(B, T, H, Dn, generator=g), torch.randn(B, T, H, Dr, generator=g)
    c, kp = torch.randn(B, S, R, generator=g), torch.randn(B, S, Dr, generator=g)
    wuk, wuv = torch.randn(H, Dn, R, generator=g) * 0.3, torch.randn(H, Dv, R, generator=g) * 0.3
    kw = {"causal": {}, "ragged": {"q_offsets": torch.tensor(ragged_offsets)}, "none": {"causal": False}}[
        mask
    ]
    return (qn, qp, c, kp, wuk, wuv), kw


def _dense_attention(qn, qp, c, kp, wuk, wuv, kw):
    """The same case as the dense naive attention (per-head keys and values materialized)."""
    T, S = qn.shape[1], c.shape[1]
    if "q_offsets" in kw:
        keep = ragged_causal_mask(kw["q_offsets"], T, S)
    else:
        keep = causal_mask(T, S) if kw.get("causal", True) else None
    k_nope = torch.einsum("bsr,hdr->bshd", c, wuk)
    v = torch.einsum("bsr,hvr->bshv", c, wuv)
    return mla_attention_reference(qn, qp, k_nope, kp, v, 0.3, keep)


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("mask", ["causal", "ragged", "none"])
def test_native_online_softmax_matches_the_torch_step(monkeypatch, expand, mask):
    """mla_attention_blockwise with the native block step == with the torch ops, both forms, causal
    (queries = the last T keys), ragged rows (row 0 sees 5..41 keys: most blocks fully masked for it)
    and unmasked; and both == the dense naive attention."""
    require("online_softmax")
    case, kw = _blockwise_case(mask, [5, 200])
    fast = mla_attention_blockwise(*case, 0.3, block_size=64, expand=expand, **kw)
    monkeypatch.setattr(native, "library", lambda name: None)
    ref = mla_attention_blockwise(*case, 0.3, block_size=64, expand=expand, **kw)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast, _dense_attention(*case, kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile, block", [(8, 64), (128, 64), (8, 300)])
@pytest.mark.parametrize("mask", ["causal", "ragged", "none"])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_expanded_blocks_match_the_torch_path(monkeypatch, tile, block, mask, threads):
    """The tiled native block step of the expanded form (`k3/ops/csrc/mla_stream.c`: per-block key
    expansion, per-head query tiles, tiles before the block skipped, the last block of 44 keys padded to
    48; one block of 300 keys taken as the kernel's steps of 256 + 44) == the torch path and the dense
    naive attention; several tiles per head with tile 8 (row 1's last tile, keys 252..256, straddles the
    block from key 256), ragged rows, no mask, bf16 latents; the (row, head) pairs on one thread or
    split over three."""
    require("mla_stream")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the kernel's team size
    import k3.ops.mla as mla_ops

    monkeypatch.setattr(mla_ops, "NATIVE_QUERY_TILE", tile)
    taken = []
    real = mla_ops._over_blocks_native
    monkeypatch.setattr(mla_ops, "_over_blocks_native", lambda *a: taken.append(1) or real(*a))
    case, kw = _blockwise_case(mask, [5, 220], dims=(24, 8, 16, 32))
    qn, qp, c, kp, wuk, wuv = case
    half_case = (qn, qp, c.bfloat16(), kp.bfloat16(), wuk, wuv)
    with torch.no_grad():
        fast = mla_attention_blockwise(*case, 0.3, block_size=block, expand=True, **kw)
        half = mla_attention_blockwise(*half_case, 0.3, block_size=block, expand=True, **kw)
        assert taken == [1, 1] and half.dtype == torch.bfloat16
        monkeypatch.setattr(mla_ops, "_native_expanded_block", lambda *a: None)
        ref = mla_attention_blockwise(*case, 0.3, block_size=block, expand=True, **kw)
        ref_half = mla_attention_blockwise(*half_case, 0.3, block_size=block, expand=True, **kw)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(half.float(), ref_half.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fast, _dense_attention(*case, kw), rtol=1e-5, atol=1e-5)


_POOL_PROBE = r"""
import os, sys, time, torch
from k3.ops import native
torch.set_num_threads(2)
a = torch.randn(512, 512)
def threads():
    return len(os.listdir("/proc/self/task"))
def settle(want):  # released workers exit on their own schedule
    for _ in range(200):
        if threads() == want:
            return True
        time.sleep(0.01)
    return False
torch.mm(a, a)  # this thread's pool: one worker beside it
with_pool = threads()
assert native.release_thread_pool() is True
assert settle(with_pool - 1), (with_pool, threads())
assert torch.allclose(torch.mm(a, a), a.double().mm(a.double()).float(), atol=1e-3)
assert settle(with_pool), (with_pool, threads())  # the next parallel op builds a pool again
print("ok")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_release_thread_pool_lets_the_callers_workers_exit():
    """The calling thread's OpenMP worker exits (one thread fewer), and its next parallel op works and
    builds a new pool. A fresh interpreter, so no other test's threads are counted."""
    require("omp_pool")
    run = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_async_engine_releases_the_constructing_threads_pool(monkeypatch):
    """AsyncEngine hands the engine to its own thread, so it releases the constructing thread's OpenMP
    pool first (a second pool makes the engine team's barriers sleep)."""
    from k3.infer import async_engine

    calls = []
    monkeypatch.setattr(async_engine.native, "release_thread_pool", lambda: calls.append(1) or True)
    engine = type("Idle", (), {"metrics": lambda self: {}, "has_unfinished": False})()
    aengine = async_engine.AsyncEngine(engine)
    aengine.shutdown()
    assert calls == [1]
