"""MoonViT-V2 vision tower and the patch-merger projector (docs/spec_vision.md#tower), at any `VisionConfig`
size.

    patches [N, 3, p, p] --patch_embed.proj (conv p x p, stride p)--> [N, D]
      + pos_emb: the learnable [H0, W0, D] table bilinearly resized to each image's (h, w) grid
      + (t > 1 only) a fixed 1-D sin/cos table over the frames
    L x pre-norm block:  x += wo(Attn(RMSNorm0(x)));  x += fc1(gelu_tanh(fc0(RMSNorm1(x))))
        Attn: wqkv -> q, k, v [N, H, K]; 2-D RoPE on q, k; softmax(q k^T / sqrt(K)) v bidirectionally
        within one image (several images packed, separated by cu_seqlens)
    final_layernorm -> merger: mean over the t frames, then each 2x2 neighbourhood concatenated in the order
        (0,0), (0,1), (1,0), (1,1) -> [(h/2)*(w/2), 4D] per image, tokens row-major
    mm_projector: proj.0 (4D -> 4D) -> GELU (exact) -> proj.2 (4D -> text D) -> post_norm (RMSNorm)

2-D RoPE: the K dims of a head are K/2 complex pairs (2j, 2j+1); pair 2f turns by x*theta_f and pair 2f+1
by y*theta_f, theta_f = base^(-4f/K), f = 0..K/4-1, with x the patch's column and y its row.

`varlen_attention` (one SDPA call per image) is the fast path; `varlen_attention_reference` (dense masked
softmax over the whole pack) is its reference. `apply_rope_2d` has `apply_rope_2d_reference` (complex
multiply).
Parameter names are the checkpoint's (docs/spec_vision.md#tensors) under `vision_tower.` / `mm_projector.`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.layers import Linear, RMSNorm
from k3.vision.config import VisionConfig

GridTHW = torch.Tensor | list[tuple[int, int, int]]


def _grids(grid_thw: GridTHW) -> list[tuple[int, int, int]]:
    """grid_thw [num_images, 3] (tensor or list) -> list of (t, h, w), checked."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    out = []
    for i, row in enumerate(rows):
        if len(row) != 3 or any(int(v) <= 0 for v in row):
            raise ValueError(f"grid_thw[{i}] must be three positive ints (t, h, w), got {row}")
        t, h, w = map(int, row)
        if h % 2 or w % 2:
            raise ValueError(f"grid_thw[{i}] = {row}: h and w must be even (2x2 merger)")
        out.append((t, h, w))
    if not out:
        raise ValueError("grid_thw must describe at least one image")
    return out


def cu_seqlens_from_grid(grid_thw: GridTHW) -> torch.Tensor:
    """[num_images + 1] int64 offsets of each image's t*h*w patches in the pack."""
    sizes = [t * h * w for t, h, w in _grids(grid_thw)]
    return torch.tensor([0] + sizes).cumsum(0)


# ---- 2-D RoPE ------------------------------------------------------------------------------------
def patch_positions(grid_thw: GridTHW) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) [N] float: column and row of every patch (frames of a video repeat the same positions)."""
    xs, ys = [], []
    for t, h, w in _grids(grid_thw):
        yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        xs.append(xx.flatten().repeat(t))
        ys.append(yy.flatten().repeat(t))
    return torch.cat(xs).float(), torch.cat(ys).float()


def rope_2d_angles(x: torch.Tensor, y: torch.Tensor, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """x, y [N] -> angles [N, head_dim/2]: pair 2f gets x*theta_f, pair 2f+1 gets y*theta_f."""
    f = torch.arange(head_dim // 4, dtype=torch.float64)
    theta = (base ** (-4.0 * f / head_dim)).float()  # [K/4]
    return torch.stack([x[:, None] * theta, y[:, None] * theta], dim=-1).flatten(1)  # [N, K/2]


def apply_rope_2d(q: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """q [N, H, K], angles [N, K/2] -> q rotated pairwise (dims 2j, 2j+1 by angles[:, j]), q's dtype."""
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    qf = q.float()
    a, b = qf[..., 0::2], qf[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(q.dtype)


def apply_rope_2d_reference(q: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Reference of `apply_rope_2d`: complex multiplication by exp(i * angle)."""
    z = torch.view_as_complex(q.double().reshape(*q.shape[:-1], -1, 2).contiguous())
    rot = torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())[:, None, :]
    return torch.view_as_real(z * rot).flatten(-2).to(q.dtype)


# ---- attention -----------------------------------------------------------------------------------
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """q, k, v [N, H, K] packed images -> [N, H, K]; bidirectional softmax attention within each segment."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, n, K]
        out[s:e] = F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1)
    return out


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Reference of `varlen_attention`: one dense fp32 softmax over the pack with a block-diagonal mask."""
    n = q.shape[0]
    seg = torch.bucketize(torch.arange(n), cu_seqlens[1:], right=True)  # segment of every patch
    scores = torch.einsum("nhk,mhk->hnm", q.float(), k.float()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(seg[:, None] != seg[None, :], float("-inf"))
    return torch.einsum("hnm,mhk->nhk", scores.softmax(-1), v.float()).to(q.dtype)


# ---- modules -------------------------------------------------------------------------------------
def _norm_eps(cfg: VisionConfig) -> float:
    return cfg.vt_norm_eps if cfg.vt_norm_eps is not None else torch.finfo(torch.float32).eps


def temporal_sincos(t: int, dim: int) -> torch.Tensor:
    """Fixed 1-D sin/cos table [t, dim] for frame indices 0..t-1 (first half sin, second half cos)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * omega[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=-1).float()


class PosEmb(nn.Module):
    """`pos_emb.weight` [H0, W0, D], bilinearly resized to each image's grid (the release: 64 x 64 x 1024)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.max_time = cfg.init_pos_emb_time
        self.weight = nn.Parameter(
            torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size)
        )

    def grid(self, h: int, w: int) -> torch.Tensor:
        """[h*w, D] row-major: the table itself at its own size, else bilinear (align_corners=False)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        table = self.weight.permute(2, 0, 1)[None]  # [1, D, H0, W0]
        out = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=False)
        return out[0].flatten(1).t().to(self.weight.dtype)

    def forward(self, grid_thw: GridTHW) -> torch.Tensor:
        """-> [N, D] for the packed patches of all images (frames: spatial table + temporal sin/cos)."""
        parts = []
        for t, h, w in _grids(grid_thw):
            pe = self.grid(h, w)
            if t > 1:
                if t > self.max_time:
                    raise ValueError(f"grid_thw t={t} exceeds init_pos_emb_time={self.max_time}")
                temporal = temporal_sincos(t, pe.shape[-1]).to(pe)
                pe = (pe[None] + temporal[:, None]).flatten(0, 1)
            parts.append(pe)
        return torch.cat(parts)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = PosEmb(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        """pixel_values [N, 3, p, p] -> [N, D]."""
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)
        return x + self.pos_emb(grid_thw)


class MLP2(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size)
        self.fc1 = Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm ViT block with fused `wqkv`, 2-D RoPE and per-image bidirectional attention."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, eps = cfg.vt_hidden_size, _norm_eps(cfg)
        self.num_heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = RMSNorm(d, eps)
        self.norm1 = RMSNorm(d, eps)
        self.wqkv = Linear(d, 3 * cfg.qkv_hidden_size)
        self.wo = Linear(cfg.qkv_hidden_size, d)
        self.mlp = MLP2(cfg)

    def attention(
        self, x: torch.Tensor, angles: torch.Tensor, cu_seqlens: torch.Tensor, attn_fn
    ) -> torch.Tensor:
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope_2d(q, angles), apply_rope_2d(k, angles)
        return self.wo(attn_fn(q, k, v, cu_seqlens).flatten(1))

    def forward(
        self, x: torch.Tensor, angles: torch.Tensor, cu_seqlens: torch.Tensor, attn_fn=None
    ) -> torch.Tensor:
        """x [N, D] -> [N, D]; angles [N, K/2] from `rope_2d_angles`."""
        x = x + self.attention(self.norm0(x), angles, cu_seqlens, attn_fn or varlen_attention)
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, _norm_eps(cfg))

    def forward(
        self, x: torch.Tensor, angles: torch.Tensor, cu_seqlens: torch.Tensor, attn_fn=None
    ) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, angles, cu_seqlens, attn_fn)
        return self.final_layernorm(x)


def merge_patches(x: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
    """'sd2_tpool': x [N, D] packed -> [sum (h/2)(w/2), 4D].

    Mean over the t frames, then each 2x2 group concatenated in the order (0,0), (0,1), (1,0), (1,1).
    """
    grids = _grids(grid_thw)
    n = sum(t * h * w for t, h, w in grids)
    if n != x.shape[0]:
        raise ValueError(f"grid_thw describes {n} patches but the features hold {x.shape[0]}")
    out, start = [], 0
    for t, h, w in grids:
        xi = x[start : start + t * h * w].view(t, h, w, -1).mean(0)  # [h, w, D]
        start += t * h * w
        xi = xi.view(h // 2, 2, w // 2, 2, -1).permute(0, 2, 1, 3, 4)  # [h/2, w/2, dy, dx, D]
        out.append(xi.reshape((h // 2) * (w // 2), -1))
    return torch.cat(out)


class MoonViT(nn.Module):
    """`vision_tower`: patches [N, 3, p, p] + grid_thw -> merged features [sum (h/2)(w/2), 4D]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW, attn_fn=None) -> torch.Tensor:
        grids = _grids(grid_thw)
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.ndim != 4 or pixel_values.shape[0] != n:
            raise ValueError(
                f"pixel_values must be [{n}, 3, p, p] for grid_thw {grids}, got {list(pixel_values.shape)}"
            )
        x = self.patch_embed(pixel_values, grids)
        px, py = patch_positions(grids)
        angles = rope_2d_angles(px, py, self.config.head_dim, self.config.rope_theta).to(x.device)
        x = self.encoder(x, angles, cu_seqlens_from_grid(grids), attn_fn)
        return merge_patches(x, grids)


class PatchMergerProjector(nn.Module):
    """`mm_projector` ('patchmergerv2'): [M, 4D] -> proj.0 -> GELU -> proj.2 -> post_norm -> [M, text D]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d4 = 4 * cfg.mm_hidden_size
        self.proj = nn.Sequential(Linear(d4, d4), nn.GELU(), Linear(d4, cfg.text_hidden_size))
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))


@torch.no_grad()
def init_vision_weights(module: nn.Module, std: float = 0.02) -> None:
    """normal(0, std) for linear/conv weights and the position table; ones for norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Conv2d):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
        elif isinstance(m, PosEmb):
            nn.init.normal_(m.weight, 0.0, std)
