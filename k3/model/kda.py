"""Kimi Delta Attention (KDA), the linear-attention token mixer of 69 of K3's 93 layers (docs/spec.md#kda).

Paper: "Kimi Linear: An Expressive, Efficient Attention Architecture" (arXiv 2510.26692), §3-4.
Per token x [D] (the normed AttnRes output), H heads, K = V = head_dim:

    q, k, v = SiLU(ShortConv_{q,k,v}(x W_{q,k,v}^T))            depthwise causal conv, kernel 4, fp32 weights
    q, k   <- q / ||q||, k / ||k||  (eps 1e-6, per head);  q <- q * K^-1/2      (inside the KDA op)
    beta    = sigmoid(x W_b^T)                       [H]      write strength, fp32
    g       = gate(x W_fa^T W_fb^T)                  [H, K]   log-decay (k3.ops.gate: safe gate in (-5, 0))
    S_t     = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
    y       = o_proj( RMSNorm_{o_norm}(o_t,h) * sigmoid(x W_g^T)_h )  per head, normalize-then-gate

Parameter names are the checkpoint's (docs/spec.md#tensors). Prefill/training use the chunk-parallel kernel
(`chunk_kda`); a call with a state and at most `RECURRENT_MAX_T` tokens per row (decode) uses the
token-by-token recurrence (`recurrent_kda`).

Inference state: the caller passes a `KDAState` (k3.model.state); the layer reads the conv histories and the
recurrent state from it and writes the new ones back. With `cu_seqlens` the batch is a set of packed
documents: the input is flattened to one row so that neither the convs nor the recurrence cross a document
boundary, and state tensors are per document ([N, ...]).

Parameters per layer at K3 size: 4 x 12288 x 7168 (q, k, v, g) + 12288 x 7168 (o) + 128 x 7168 + 12288 x 128
(f_a, f_b) + 96 x 7168 (b) + 3 x 12288 x 4 (convs) + 12288 (dt_bias) + 96 (A_log) + 128 (o_norm)
= 443,740,384 (docs/spec.md#parameter-counts; the checkpoint pads A_log to 128 entries).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.layers import Linear
from k3.model.state import KDAState
from k3.ops.conv import causal_conv1d, causal_conv1d_update, conv_state_after
from k3.ops.gate import kda_gate
from k3.ops.gated_norm import gated_rms_norm
from k3.ops.kda import chunk_kda, recurrent_kda
from k3.ops.kda.prep import L2NORM_EPS

# With a state, rows this short run the recurrence instead of the chunked kernel. The recurrence costs
# per token, the chunked kernel per 64-token chunk; measured crossover (k3-tiny heads, 1 thread, fp32
# CPU): ~16-20 tokens at B=1, ~26 at B=4, ~40 at B=32 (T=64: 4.1 vs 1.2 ms at B=1, 36 vs 21 at B=32)
RECURRENT_MAX_T = 16


class ShortConv(nn.Module):
    """Depthwise causal conv + SiLU with an fp32 `weight` [C, 1, W] (state_dict key `<name>.weight`)."""

    def __init__(self, channels: int, kernel_size: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(W)): kaiming-uniform(a=sqrt(5)) with fan_in = W, as torch's Conv1d default."""
        if self.weight.is_meta:
            return
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(
        self, u: torch.Tensor, state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """u [B, T, C], state [B (or N), C, W-1] | None -> (y [B, T, C], new_state [B (or N), C, W-1])."""
        if u.shape[1] == 1 and state is not None and cu_seqlens is None:
            return causal_conv1d_update(u, self.weight, state)
        return causal_conv1d(u, self.weight, state, cu_seqlens)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, kernel_size={self.weight.shape[-1]}"


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm with an fp32 `weight` [V] shared by heads, then * sigmoid(gate)."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate [..., V] -> [..., V] in o's dtype."""
        return gated_rms_norm(o, gate, self.weight, self.eps)


def _history_at(pre: torch.Tensor, hist: torch.Tensor | None, capture: list[int], final: torch.Tensor):
    """The conv state after the first p_b tokens of each row: the last W-1 pre-conv inputs before p_b
    (history included), [B, C, W-1] like `final` (the state after all T, kept for rows without one)."""
    W = final.shape[-1] + 1
    return torch.stack(
        [
            conv_state_after(pre[r : r + 1], None if hist is None else hist[r : r + 1], p, W)[0]
            if p > 0
            else final[r]
            for r, p in enumerate(capture)
        ]
    )


def _split_recurrence(heads, initial: torch.Tensor | None, capture: list[int]):
    """The delta rule over each row in two calls, split at the row's capture position p: heads (q, k, v,
    g, beta) [B, T, ...], initial [B, H, K, V] or None -> o, the final state and the state after p tokens
    ([B, H, K, V] fp32; a row without a capture (-1) gets its final state there). Rows that share p run
    together."""
    B, T = heads[0].shape[:2]
    o, final, at_p = [None] * B, [None] * B, [None] * B
    for p in sorted(set(capture)):
        rows = [r for r in range(B) if capture[r] == p]
        part, state = heads, initial
        if len(rows) < B:  # (one row, the engine's usual case, needs no copies)
            sel = torch.tensor(rows, device=heads[0].device)
            part = [h.index_select(0, sel) for h in heads]
            state = None if initial is None else initial.index_select(0, sel)
        mid = state
        outs = []
        for lo, hi in ((0, p), (p, T)) if p > 0 else ((0, T),):
            op = recurrent_kda if hi - lo <= RECURRENT_MAX_T else chunk_kda
            out, state = op(
                *(h[:, lo:hi] for h in part), initial_state=state, output_final_state=True,
                use_qk_l2norm=True,
            )  # fmt: skip
            outs.append(out)
            mid = state if hi == p else mid
        o_rows = torch.cat(outs, 1)
        for i, r in enumerate(rows):
            o[r], final[r], at_p[r] = o_rows[i], state[i], (mid if p > 0 else state)[i]
    return torch.stack(o), torch.stack(final), torch.stack(at_p)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """cu_seqlens [N+1] over the flattened B*T tokens; every row boundary must be a document boundary."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    rows = torch.arange(0, B * T + 1, T, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    if not bool(torch.isin(rows, cu_seqlens).all()):
        raise ValueError(f"cu_seqlens must contain every row boundary (multiples of T={T} up to {B * T})")
    return cu_seqlens


class KimiDeltaAttention(nn.Module):
    """KDA token mixer for decoder layer `layer_idx`: x [B, T, D] -> [B, T, D]."""

    fast_decode = True  # one-token steps take `decode_step` (False: always `forward_chunked`)

    def __init__(self, config: K3Config, layer_idx: int, device=None, dtype=None):
        super().__init__()
        la = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = H, K = la.num_heads, la.head_dim
        self.lower_bound = la.gate_lower_bound
        D, W, HK = config.hidden_size, la.short_conv_kernel_size, la.num_heads * la.head_dim
        lin = lambda i, o: Linear(i, o, device=device, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj = lin(D, HK), lin(D, HK), lin(D, HK)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(HK, W, device) for _ in range(3))
        self.f_a_proj, self.f_b_proj = lin(D, K), lin(K, HK)
        self.dt_bias = nn.Parameter(torch.empty(HK, device=device, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, device=device, dtype=torch.float32))
        self.b_proj = lin(D, H)
        if la.use_full_rank_gate:
            self.g_proj = lin(D, HK)
        else:  # Kimi-Linear's low-rank output gate
            self.g_a_proj, self.g_b_proj = lin(D, K), lin(K, HK)
        self.o_norm = GatedRMSNorm(K, config.rms_norm_eps, device)
        self.o_proj = lin(HK, D)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """K3 init of the parameters this module owns directly (Linear weights are the model init's job):

        A_log    log(U(1, 16)) per head                      (decay rates spread over ~[1, 16])
        dt_bias  softplus^-1(dt), dt = exp(U(log 1e-3, log 0.1)) clamped >= 1e-4   (Mamba's dt init)
        convs    U(+-1/sqrt(W));  o_norm  ones
        A no-op on the meta device (materialize with `to_empty`, then call it).
        """
        if self.A_log.is_meta:
            return
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(
            1e-4
        )
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.reset_parameters()
        self.o_norm.reset_parameters()

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))

    def forward(
        self,
        x: torch.Tensor,
        state: KDAState | None = None,
        cu_seqlens: torch.Tensor | None = None,
        keep: int | None = None,
    ) -> torch.Tensor:
        """x [B, T, D]; state: read and updated in place (per row, or per document with cu_seqlens);
        cu_seqlens [N+1] document offsets over the flattened B*T tokens; keep: output only the last `keep`
        positions of each row (0 <= keep <= T, no cu_seqlens; the state still advances over all T; a
        model's last layer) -> y [B, keep or T, D].

        A one-token step with a full state and no autograd (decode) takes `decode_step`, the same maths
        in fewer ops; everything else (and `fast_decode = False`) takes `forward_chunked`."""
        if (
            self.fast_decode
            and cu_seqlens is None
            and x.shape[1] == 1
            and state is not None
            and state.recurrent is not None
            and state.conv_q is not None
            and state.conv_k is not None
            and state.conv_v is not None
            and not (torch.is_grad_enabled() and x.requires_grad)
            and keep in (None, 1)
        ):
            return self.decode_step(x, state)
        return self.forward_chunked(x, state, cu_seqlens, keep)

    def forward_chunked(
        self,
        x: torch.Tensor,
        state: KDAState | None = None,
        cu_seqlens: torch.Tensor | None = None,
        keep: int | None = None,
    ) -> torch.Tensor:
        """The general path (chunked kernel, or the recurrence for short rows with a state); same
        signature as `forward`."""
        B, T, D = x.shape
        H, K = self.num_heads, self.head_dim
        Tq = T if keep is None else keep
        if not 0 <= Tq <= T or (keep is not None and cu_seqlens is not None):
            raise ValueError(f"keep must be in [0, T={T}] and without cu_seqlens, got {keep}")
        if cu_seqlens is not None:
            cu_seqlens = _check_cu_seqlens(cu_seqlens, B, T)
            x = x.reshape(1, B * T, D)
        b, t = x.shape[:2]
        st = state if state is not None else KDAState()
        capture = st.capture_at if st.capture_at is not None and any(p >= 0 for p in st.capture_at) else None
        if capture is not None and (
            cu_seqlens is not None or len(capture) != B or any(not (p == -1 or 0 < p < T) for p in capture)
        ):
            raise ValueError(
                f"capture_at needs one position per row ({B}), each -1 or in (0, T={T}), and no "
                f"cu_seqlens; got {capture}"
            )
        pre = [proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)]  # pre-conv inputs [b, t, C]
        q, conv_q = self.q_conv1d(pre[0], st.conv_q, cu_seqlens)
        k, conv_k = self.k_conv1d(pre[1], st.conv_k, cu_seqlens)
        v, conv_v = self.v_conv1d(pre[2], st.conv_v, cu_seqlens)
        g = kda_gate(
            self.f_b_proj(self.f_a_proj(x)).view(b, t, H, K), self.A_log, self.dt_bias, self.lower_bound
        )
        beta = torch.sigmoid(self.b_proj(x).float())  # [b, t, H]
        heads = (q.view(b, t, H, K), k.view(b, t, H, K), v.view(b, t, H, K), g, beta)
        if capture is None:
            op = recurrent_kda if state is not None and T <= RECURRENT_MAX_T else chunk_kda
            o, recurrent = op(
                *heads, initial_state=st.recurrent, output_final_state=state is not None,
                use_qk_l2norm=True, cu_seqlens=cu_seqlens,
            )  # fmt: skip
        else:
            o, recurrent, at_p = _split_recurrence(heads, st.recurrent, capture)
            hists, finals = (st.conv_q, st.conv_k, st.conv_v), (conv_q, conv_k, conv_v)
            convs = [_history_at(u, h, capture, f) for u, h, f in zip(pre, hists, finals, strict=True)]
            state.captured, state.capture_at = KDAState(*convs, recurrent=at_p), None  # one call only
        if state is not None:
            state.conv_q, state.conv_k, state.conv_v, state.recurrent = conv_q, conv_k, conv_v, recurrent
        if Tq < T:  # only the kept positions go on (b, t == B, T: no cu_seqlens)
            o, x, t = o[:, T - Tq :], x[:, T - Tq :], Tq
        o = self.o_norm(o, self._output_gate(x).view(b, t, H, K))
        return self.o_proj(o.reshape(B, Tq, H * K))

    def decode_step(self, x: torch.Tensor, state: KDAState) -> torch.Tensor:
        """One token per row: x [B, 1, D], a full `state` (updated in place) -> y [B, 1, D].

        The three short convs run as one over the concatenated q|k|v channels, and the delta-rule step
        works on [B, H, K, V] directly (no per-token unbinding). Matches `forward_chunked` to rounding.
        """
        B, _, D = x.shape
        H, K = self.num_heads, self.head_dim
        C, dtype = H * K, x.dtype
        xt = x[:, 0]
        u = torch.cat([self.q_proj(xt), self.k_proj(xt), self.v_proj(xt)], -1)  # [B, 3C]
        window = torch.cat(
            [torch.cat([state.conv_q, state.conv_k, state.conv_v], 1).to(dtype), u[:, :, None]], 2
        )  # [B, 3C, W]: the conv history, then this token
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]  # [3C, W]
        qkv = F.silu((window.float() * w.float()).sum(-1))  # [B, 3C] fp32 (the model casts; we keep fp32)
        qkv = qkv.to(dtype).float()  # the reference rounds the conv outputs to the model dtype
        qk, v = qkv.view(B, 3, H, K).split([2, 1], 1)  # q|k [B, 2, H, K], v [B, 1, H, K]
        state.conv_q, state.conv_k, state.conv_v = (window[:, i * C : (i + 1) * C, 1:] for i in range(3))
        g = kda_gate(
            self.f_b_proj(self.f_a_proj(xt)).view(B, 1, H, K), self.A_log, self.dt_bias, self.lower_bound
        )
        beta = torch.sigmoid(self.b_proj(xt).float())  # [B, H]
        q, k = (qk / torch.sqrt(qk.square().sum(-1, keepdim=True) + L2NORM_EPS)).unbind(1)  # [B, H, K]
        q, v = q * K**-0.5, v[:, 0]
        S = state.recurrent.float() * g[:, 0].exp()[..., None]  # [B, H, K, V]
        delta = beta[..., None] * (v - (k[..., None] * S).sum(-2))  # [B, H, V]
        S = S.addcmul(k[..., None], delta[:, :, None, :])
        o = (q[..., None] * S).sum(-2)  # [B, H, V]
        state.recurrent = S
        gate = self._output_gate(xt).view(B, H, K)
        if type(self.o_norm) is GatedRMSNorm:  # the same normalize-then-gate as one fused norm call
            w_o = self.o_norm.weight.float()
            o = F.rms_norm(o.to(dtype).float(), (K,), w_o, self.o_norm.eps) * torch.sigmoid(gate.float())
            o = o.to(dtype)
        else:
            o = self.o_norm(o.to(dtype), gate)
        return self.o_proj(o.reshape(B, 1, C))
