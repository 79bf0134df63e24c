"""KDA ops: chunk_kda and recurrent_kda against the token-loop reference, forward and backward.

Metric: relative error ||a - b|| / ||b|| (plus a tiny absolute floor for tensors that are ~0).
Gates are the K3 safe gate -5 * sigmoid(z) in (-5, 0), a saturated version near -5 per token (the
strongest the model can produce: -320 over a 64-token chunk), and small Kimi-style gates.
"""

import pytest
import torch
import torch.nn.functional as F

import k3.ops.kda.recurrent as recurrent_module
from k3.ops.kda import chunk_kda, recurrent_kda, recurrent_kda_reference
from k3.ops.kda.decay import pick_sub_chunk
from k3.ops.kda.halves import MAX_HALF_DECAY, halves_fit
from k3.ops.kda.solve import unit_lower_solve_, unit_lower_solve_reference_

B, H, K, V = 2, 2, 32, 48
FWD_TOL, GRAD_TOL = 1e-5, 1e-4


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float, atol: float = 1e-6):
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    assert err <= tol * scale + atol, f"{name}: relative error {err / max(scale, 1e-30):.2e} > {tol:.0e}"


def make_gate(kind: str, shape, gen) -> torch.Tensor:
    z = torch.randn(shape, generator=gen)
    return {
        "safe": -5 * torch.sigmoid(z),
        "saturated": -5 * torch.sigmoid(3 * z + 4),
        "small": F.logsigmoid(z) / 16,
        "harsh": -20 * torch.sigmoid(z),  # beyond the safe gate: exercises the smaller sub-chunks
    }[kind]


def make_inputs(T, gate="safe", batch=B, n_states=None, seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, T, H, K, generator=gen)
    k = torch.randn(batch, T, H, K, generator=gen)
    v = torch.randn(batch, T, H, V, generator=gen)
    g = make_gate(gate, (batch, T, H, K), gen)
    beta = torch.rand(batch, T, H, generator=gen)
    s0 = torch.randn(n_states or batch, H, K, V, generator=gen) if h0 else None
    return (q, k, v, g, beta), s0


def run(fn, inputs, s0, **kw):
    return fn(*inputs, initial_state=s0, output_final_state=True, **kw)


FWD_CASES = [(T, gate, True) for T in (1, 63, 64, 65, 300) for gate in ("safe", "saturated", "small")]
FWD_CASES += [(T, "safe", False) for T in (1, 63, 64, 65, 300)]


@pytest.mark.parametrize("T, gate, h0", FWD_CASES, ids=lambda x: str(x))
def test_forward_matches_naive(T, gate, h0):
    inputs, s0 = make_inputs(T, gate, h0=h0)
    o_ref, s_ref = run(recurrent_kda_reference, inputs, s0)
    for name, (o, s) in {
        "chunk64": run(chunk_kda, inputs, s0),
        "chunk32": run(chunk_kda, inputs, s0, chunk_size=32),
        "recurrent": run(recurrent_kda, inputs, s0),
    }.items():
        assert_close(f"{name} o", o, o_ref, FWD_TOL)
        assert_close(f"{name} state", s, s_ref, FWD_TOL)


@pytest.mark.parametrize("chunk_size", [16, 128])
def test_other_chunk_sizes(chunk_size):
    inputs, s0 = make_inputs(200, "safe")
    o_ref, s_ref = run(recurrent_kda_reference, inputs, s0)
    o, s = run(chunk_kda, inputs, s0, chunk_size=chunk_size)
    assert_close("o", o, o_ref, FWD_TOL)
    assert_close("state", s, s_ref, FWD_TOL)


def test_harsh_and_clamped_gates_stay_finite_and_exact():
    inputs, s0 = make_inputs(150, "harsh")
    assert pick_sub_chunk(inputs[3].transpose(1, 2)[..., :64, :]) < 16  # the fallback is exercised
    for g in (inputs[3], torch.full_like(inputs[3], -5.0), torch.full_like(inputs[3], -100.0)):
        x = (*inputs[:3], g, inputs[4])
        o_ref, s_ref = run(recurrent_kda_reference, x, s0)
        o, s = run(chunk_kda, x, s0)
        assert_close("o", o, o_ref, FWD_TOL)
        assert_close("state", s, s_ref, FWD_TOL)


def test_halves_forward_path_near_its_decay_limit():
    """The two-half forward (safe gates) against the sub-chunk fallback (harsher ones), around the limit."""
    inputs, s0 = make_inputs(130, "safe")
    chunked = lambda g: g.transpose(1, 2).unflatten(2, (-1, 64))  # noqa: E731  [B, H, NC, 64, K]
    assert halves_fit(chunked(F.pad(inputs[3], (0, 0, 0, 0, 0, 62))), True, K**-0.5)
    assert not halves_fit(chunked(F.pad(inputs[3], (0, 0, 0, 0, 0, 62))), False, K**-0.5)
    for per_token in (-4.3, -4.4):  # half-chunk decays 137.6 (two halves) and 140.8 (fallback)
        assert halves_fit(torch.full((1, 64, K), per_token), True, 1.0) == (32 * -per_token <= MAX_HALF_DECAY)
        g = torch.full_like(inputs[3], per_token) + 0.05 * torch.rand_like(inputs[3])
        x = (*inputs[:3], g, inputs[4])
        o_ref, s_ref = run(recurrent_kda_reference, x, s0)
        o, s = run(chunk_kda, x, s0)
        assert_close("o", o, o_ref, FWD_TOL)
        assert_close("state", s, s_ref, FWD_TOL)


def test_final_state_is_optional():
    inputs, s0 = make_inputs(70)
    for fn in (chunk_kda, recurrent_kda, recurrent_kda_reference):
        o, s = fn(*inputs, initial_state=s0)
        assert s is None and o.shape == (B, 70, H, V)


CU = [0, 15, 100, 164, 300]


@pytest.mark.parametrize("h0", [True, False])
@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda, recurrent_kda_reference], ids=lambda f: f.__name__)
def test_varlen_equals_documents_alone(fn, h0):
    inputs, s0 = make_inputs(CU[-1], batch=1, n_states=len(CU) - 1, h0=h0)
    o, s = run(fn, inputs, s0, cu_seqlens=torch.tensor(CU))
    assert s.shape == (len(CU) - 1, H, K, V)
    for n, (a, b) in enumerate(zip(CU[:-1], CU[1:], strict=True)):
        doc = [x[:, a:b] for x in inputs]
        o_ref, s_ref = run(recurrent_kda_reference, doc, None if s0 is None else s0[n : n + 1])
        assert_close(f"doc {n} o", o[:, a:b], o_ref, FWD_TOL)
        assert_close(f"doc {n} state", s[n : n + 1], s_ref, FWD_TOL)


def grads_of(fn, inputs, s0, do, ds, **kw):
    leaves = [x.clone().requires_grad_() for x in (*inputs, *([] if s0 is None else [s0]))]
    o, s = fn(*leaves[:5], initial_state=leaves[5] if s0 is not None else None, output_final_state=True, **kw)
    ((o * do).sum() + (s * ds).sum()).backward()
    return [x.grad for x in leaves]


GRAD_CASES = {
    "T130-safe": dict(T=130, gate="safe"),
    "T130-saturated": dict(T=130, gate="saturated"),
    "T100-small-C32": dict(T=100, gate="small", chunk_size=32),
    "T77-harsh-C16": dict(T=77, gate="harsh", chunk_size=16),
    "T1-no-h0": dict(T=1, gate="safe", h0=False),
    "T65-no-l2norm": dict(T=65, gate="safe", use_qk_l2norm=False, scale=0.1),
}


@pytest.mark.parametrize("case", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_chunk_gradients_match_naive(case):
    case = dict(case)
    T, gate, h0 = case.pop("T"), case.pop("gate"), case.pop("h0", True)
    inputs, s0 = make_inputs(T, gate, h0=h0, seed=1)
    gen = torch.Generator().manual_seed(2)
    do, ds = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    naive_kw = {k: case[k] for k in ("use_qk_l2norm", "scale") if k in case}
    ref = grads_of(recurrent_kda_reference, inputs, s0, do, ds, **naive_kw)
    got = grads_of(chunk_kda, inputs, s0, do, ds, **case)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0")[: len(ref)], got, ref, strict=True):
        assert_close(name, a, b, GRAD_TOL)


def test_varlen_gradients_match_naive():
    cu = torch.tensor(CU)
    inputs, s0 = make_inputs(CU[-1], batch=1, n_states=len(CU) - 1, seed=3)
    gen = torch.Generator().manual_seed(4)
    do, ds = torch.randn(1, CU[-1], H, V, generator=gen), torch.randn(len(CU) - 1, H, K, V, generator=gen)
    ref = grads_of(recurrent_kda_reference, inputs, s0, do, ds, cu_seqlens=cu)
    for fn in (chunk_kda, recurrent_kda):
        got = grads_of(fn, inputs, s0, do, ds, cu_seqlens=cu)
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, ref, strict=True):
            assert_close(f"{fn.__name__} {name}", a, b, GRAD_TOL)


def test_only_final_state_or_only_output_used():
    inputs, s0 = make_inputs(90, seed=5)
    ds = torch.randn(B, H, K, V)
    leaves = [x.clone().requires_grad_() for x in inputs]
    _, s = chunk_kda(*leaves, initial_state=s0, output_final_state=True)
    (s * ds).sum().backward()
    ref = [x.clone().requires_grad_() for x in inputs]
    _, s_ref = recurrent_kda_reference(*ref, initial_state=s0, output_final_state=True)
    (s_ref * ds).sum().backward()
    assert ref[0].grad is None and not leaves[0].grad.any()  # q does not reach the state
    for name, a, b in zip(("dk", "dv", "dg", "dbeta"), leaves[1:], ref[1:], strict=True):
        assert_close(name, a.grad, b.grad, GRAD_TOL)


def test_no_l2norm_and_custom_scale_forward():
    inputs, s0 = make_inputs(80)
    inputs = (inputs[0] * 0.2, inputs[1] * 0.2, *inputs[2:])
    for kw in (dict(use_qk_l2norm=False), dict(scale=0.37), dict(use_qk_l2norm=False, scale=1.0)):
        o_ref, s_ref = run(recurrent_kda_reference, inputs, s0, **kw)
        for fn in (chunk_kda, recurrent_kda):
            o, s = run(fn, inputs, s0, **kw)
            assert_close(f"{fn.__name__} o {kw}", o, o_ref, FWD_TOL)
            assert_close(f"{fn.__name__} state {kw}", s, s_ref, FWD_TOL)


def test_bf16_inputs_give_bf16_outputs():
    inputs, s0 = make_inputs(100)
    low = [x.bfloat16() for x in inputs]
    o_ref, s_ref = run(recurrent_kda_reference, [x.float() for x in low], s0)
    for fn in (chunk_kda, recurrent_kda):
        o, s = run(fn, low, s0)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert_close(f"{fn.__name__} o", o.float(), o_ref, 1e-2)
        assert_close(f"{fn.__name__} state", s, s_ref, FWD_TOL)


def test_no_grad_path_equals_grad_path():
    """Without autograd chunk_kda may take the fused native pass (fused.py); with it, the torch path
    that keeps what the backward needs: the same values to fp32 rounding."""
    inputs, s0 = make_inputs(200)
    with torch.no_grad():
        o1, s1 = run(chunk_kda, inputs, s0)
    o2, s2 = run(chunk_kda, [x.clone().requires_grad_() for x in inputs], s0)
    assert_close("o", o1, o2.detach(), 1e-6, atol=0)
    assert_close("state", s1, s2.detach(), 1e-6, atol=0)


def test_recurrent_large_state_path():
    """States of >= MATVEC_BMM_MIN elements take the batched-matmul mat-vecs."""
    gen = torch.Generator().manual_seed(8)
    x = [torch.randn(1, 20, 4, 128, generator=gen) for _ in range(3)]
    g = -5 * torch.sigmoid(torch.randn(1, 20, 4, 128, generator=gen))
    beta = torch.rand(1, 20, 4, generator=gen)
    s0 = torch.randn(1, 4, 128, 128, generator=gen)
    assert s0.numel() >= recurrent_module.MATVEC_BMM_MIN
    o_ref, s_ref = run(recurrent_kda_reference, (*x, g, beta), s0)
    o, s = run(recurrent_kda, (*x, g, beta), s0)
    assert_close("o", o, o_ref, FWD_TOL)
    assert_close("state", s, s_ref, FWD_TOL)


def test_recurrent_decode_steps_equal_one_call():
    inputs, s0 = make_inputs(12)
    o_ref, s_ref = run(recurrent_kda, inputs, s0)
    state, outs = s0, []
    for t in range(12):
        o, state = run(recurrent_kda, [x[:, t : t + 1] for x in inputs], state)
        outs.append(o)
    assert_close("o", torch.cat(outs, 1), o_ref, FWD_TOL)
    assert_close("state", state, s_ref, FWD_TOL)


def test_bad_inputs_raise_value_error_naming_the_argument():
    (q, k, v, g, beta), s0 = make_inputs(20)
    cases = [
        ("q", dict(q=q[0])),
        ("k", dict(k=k[:, :10])),
        ("v", dict(v=v[:, :, :1])),
        ("g", dict(g=g[..., :5])),
        ("beta", dict(beta=beta[..., None])),
        ("initial_state", dict(initial_state=s0[:1])),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 20]))),  # B = 2
        ("chunk_size", dict(chunk_size=48)),
    ]
    for arg, bad in cases:
        kw = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, **{})
        kw.update(bad)
        pos = [kw.pop(n) for n in ("q", "k", "v", "g", "beta")]
        with pytest.raises(ValueError, match=arg):
            chunk_kda(*pos, **kw)
    one = [x[:1] for x in (q, k, v, g, beta)]
    for cu in ([0, 10, 19], [0, 12, 12, 20], [1, 20]):
        for fn in (chunk_kda, recurrent_kda, recurrent_kda_reference):
            with pytest.raises(ValueError, match="cu_seqlens"):
                fn(*one, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(*one, cu_seqlens=torch.tensor([0, 10, 20]), initial_state=s0[:1])


def test_many_small_groups_match(monkeypatch):
    """Small chunk groups (the unit of batched chunk-local work) whose boundaries cut across documents."""
    import k3.ops.kda.chunk as chunk_module

    cu = torch.tensor(CU)
    inputs, s0 = make_inputs(CU[-1], batch=1, n_states=len(CU) - 1, seed=6)
    gen = torch.Generator().manual_seed(7)
    do, ds = torch.randn(1, CU[-1], H, V, generator=gen), torch.randn(len(CU) - 1, H, K, V, generator=gen)
    ref = grads_of(chunk_kda, inputs, s0, do, ds, cu_seqlens=cu, chunk_size=32)
    monkeypatch.setattr(chunk_module, "GROUP_MATRICES", 4)  # 2 chunks per group, 6 groups over 4 documents
    got = grads_of(chunk_kda, inputs, s0, do, ds, cu_seqlens=cu, chunk_size=32)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, ref, strict=True):
        assert_close(name, a, b, 1e-6)


@pytest.mark.parametrize("C", [16, 64, 128, 15])
@pytest.mark.parametrize("transpose", [False, True])
def test_blocked_unit_lower_solve_matches_the_one_call_solve(C, transpose):
    g = torch.Generator().manual_seed(C)
    A = torch.randn(6, C, C, generator=g, dtype=torch.float64).tril(-1) * 0.3
    A = A + torch.randn(6, C, C, generator=g, dtype=torch.float64).triu() * 9  # must be ignored
    R = torch.randn(6, C, 40, generator=g, dtype=torch.float64)
    I_A = torch.eye(C, dtype=torch.float64) + A.tril(-1)
    want = torch.linalg.solve(I_A.mT if transpose else I_A, R)
    X = unit_lower_solve_(A, R.clone(), transpose)
    torch.testing.assert_close(X, want, rtol=1e-10, atol=1e-10)
    ref = unit_lower_solve_reference_(A, R.clone(), transpose)
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)
    # in place on a column slice of a wider buffer, as chunk_kda calls it ([U | W] share one tensor)
    buf = torch.randn(6, C, 50, generator=g, dtype=torch.float64)
    buf[..., 10:] = R
    unit_lower_solve_(A, buf[..., 10:], transpose)
    torch.testing.assert_close(buf[..., 10:], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("packed", [True, False], ids=["docs", "rows"])
def test_native_state_pass_equals_the_torch_loop(monkeypatch, packed):
    """The chunks' sequential state passes, forward and backward, as one native call per group of chunks
    (csrc/kda_state.c) against the torch loops beside them: outputs, final states and every gradient,
    with an initial state, documents that start and end inside a group and more chunks than one group
    holds (the state carried from group to group)."""
    import k3.ops.kda.chunk as chunk_module

    g = torch.Generator().manual_seed(7)
    T = 1200 if packed else 600
    rows = 1 if packed else 2
    cu = torch.tensor([0, 17, 700, 1200]) if packed else None
    n_seq = 3 if packed else rows
    q, k = (torch.randn(rows, T, H, K, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(rows, T, H, 64, generator=g).requires_grad_()
    gate = make_gate("safe", (rows, T, H, K), g).requires_grad_()
    beta = torch.rand(rows, T, H, generator=g).requires_grad_()
    h0 = torch.randn(n_seq, H, K, 64, generator=g).requires_grad_()
    results, taken = {}, []
    original = chunk_module._state_kernel
    monkeypatch.setattr(
        chunk_module, "_state_kernel", lambda *a: taken.append(original(*a) is not None) or original(*a)
    )
    dy, dfin = torch.randn(rows, T, H, 64, generator=g), torch.randn(n_seq, H, K, 64, generator=g)
    for native in (True, False):
        monkeypatch.setattr(chunk_module, "NATIVE_STATE_PASS", native)
        o, final = chunk_kda(q, k, v, gate, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        grads = torch.autograd.grad((o * dy).sum() + (final * dfin).sum(), (q, k, v, gate, beta, h0))
        results[native] = (o, final, *grads)
    if not taken[0]:
        pytest.skip("no C compiler: the native state pass cannot be built")
    names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for name, a, b in zip(names, results[True], results[False], strict=True):
        assert_close(name, a, b, 1e-6)
