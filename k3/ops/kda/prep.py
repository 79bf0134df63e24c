"""Input checks and fp32 preparation shared by every KDA path (naive, recurrent, chunk).

All KDA maths runs in fp32 whatever the input dtype: q and k are L2-normalised over K as
x / sqrt(sum x^2 + 1e-6) (the fla in-kernel norm), then q is multiplied by `scale` (K**-0.5 by default).
"""

import torch

L2NORM_EPS = 1e-6
CHUNK_SIZES = (16, 32, 64, 128)


def _fail(name: str, msg: str):
    raise ValueError(f"{name}: {msg}")


def check_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None, chunk_size=None):
    """Validate shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
    initial_state [B, H, K, V] (or [N, H, K, V] with cu_seqlens [N+1], which needs B == 1)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            _fail(name, "must be a floating-point tensor")
    if q.dim() != 4:
        _fail("q", f"expected [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T < 1:
        _fail("q", "needs at least one token (T >= 1)")
    if k.shape != q.shape:
        _fail("k", f"expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        _fail("g", f"expected the shape of q {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        _fail("v", f"expected [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        _fail("beta", f"expected [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        _fail("chunk_size", f"must be one of {CHUNK_SIZES}, got {chunk_size}")
    n_states = B
    if cu_seqlens is not None:
        n_states = _check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        want = (n_states, H, K, v.shape[-1])
        if not isinstance(initial_state, torch.Tensor):
            _fail("initial_state", f"must be a tensor of shape {want}")
        if tuple(initial_state.shape) != want:
            _fail("initial_state", f"expected shape {want}, got {tuple(initial_state.shape)}")


def _check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """Return the number of documents N."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        _fail("cu_seqlens", "must be a 1-D integer tensor [N+1]")
    if B != 1:
        _fail("cu_seqlens", f"packed documents need batch size 1, got B={B}")
    if cu_seqlens.numel() < 2:
        _fail("cu_seqlens", "needs at least one document ([0, T])")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T:
        _fail("cu_seqlens", f"must start at 0 and end at T={T}, got {cu[0]}..{cu[-1]}")
    if any(b <= a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        _fail("cu_seqlens", "must be strictly increasing (no empty documents)")
    return len(cu) - 1


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum_K x^2 + 1e-6) over the last dim."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def prepare(q, k, v, g, beta, scale, use_qk_l2norm: bool):
    """Cast to fp32, L2-normalise q, k (optional) and scale q. Returns (q, k, v, g, beta) in fp32."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def doc_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens [N+1] -> the N document lengths."""
    cu = cu_seqlens.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
