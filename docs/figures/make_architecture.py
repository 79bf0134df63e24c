"""Draw docs/figures/architecture.png: the K3 block diagram (docs/spec.md#forward) with matplotlib.

    python docs/figures/make_architecture.py            # writes architecture.png next to this file

Left: a token's path through the trunk (embedding -> 93 decoder layers -> output AttnRes -> norm ->
head) with the block-AttnRes stream R / P beside it. Top right: the layer pattern (KDA x3 then gated
MLA, 12-layer AttnRes blocks). Right: the three sub-layers in detail -- KDA, gated NoPE MLA, LatentMoE.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

COLORS = {
    "embed": "#e8e8e8",
    "attnres": "#ffe3b3",
    "norm": "#f2f2f2",
    "kda": "#c6e2ff",
    "mla": "#d9c6ff",
    "moe": "#c9f0c9",
    "router": "#fff4a8",
    "head": "#e8e8e8",
    "stream": "#fff8ea",
}


def box(ax, x, y, w, h, text, color, fontsize=8.0, bold=False, style="round,pad=0.02,rounding_size=0.6"):
    """A rounded box with its lower-left corner at (x, y); returns its centre-top and centre-bottom."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, fc=color, ec="#444444", lw=0.9))
    ax.text(
        x + w / 2,
        y + h / 2,
        text,
        ha="center",
        va="center",
        fontsize=fontsize,
        weight="bold" if bold else "normal",
        linespacing=1.25,
    )
    return (x + w / 2, y + h), (x + w / 2, y)


def arrow(ax, a, b, color="#333333", style="-|>", lw=1.0, ls="-", rad=0.0):
    ax.add_patch(
        FancyArrowPatch(
            a,
            b,
            arrowstyle=style,
            mutation_scale=9,
            color=color,
            lw=lw,
            ls=ls,
            connectionstyle=f"arc3,rad={rad}",
            shrinkA=1,
            shrinkB=1,
        )
    )


def trunk(ax):
    """The token's path, bottom to top, x in [2, 38]."""
    x, w = 4, 30
    _, _ = box(ax, x, 1, w, 3, "token ids  [T]", COLORS["embed"])
    arrow(ax, (x + w / 2, 4), (x + w / 2, 5.5))
    box(
        ax,
        x,
        5.5,
        w,
        3.5,
        "embed_tokens:  e = E[ids]   [T, 7168]\n(no positional embedding)",
        COLORS["embed"],
    )
    arrow(ax, (x + w / 2, 9), (x + w / 2, 11))
    # the decoder layer frame
    ax.add_patch(
        FancyBboxPatch(
            (2, 11),
            34,
            38,
            boxstyle="round,pad=0.02,rounding_size=1.2",
            fc="white",
            ec="#222222",
            lw=1.4,
            ls="--",
        )
    )
    ax.text(3, 47.8, "decoder layer l = 0 ... 92   (x93 in k3-full)", fontsize=9, weight="bold", va="center")
    steps = [
        (
            12.5,
            4.0,
            "AttnRes  h = mix([R..., P]; self_attention_res_*)\nsoftmax over depth of the block sums",
            COLORS["attnres"],
        ),
        (
            17.6,
            3.0,
            "block boundary, every 12th layer (l % 12 == 0):\nR.append(P);  P <- empty",
            COLORS["stream"],
        ),
        (21.6, 2.4, "RMSNorm (input_layernorm)", COLORS["norm"]),
        (
            25.0,
            5.2,
            "token mixer\nKDA (69 layers)  or  gated MLA, NoPE (24 layers)\n"
            "a = Mixer_l(norm(h));   P <- P + a",
            None,
        ),
        (31.2, 3.4, "AttnRes  h' = mix([R..., P]; mlp_res_*)", COLORS["attnres"]),
        (35.6, 2.4, "RMSNorm (post_attention_layernorm)", COLORS["norm"]),
        (
            39.0,
            6.6,
            "FFN\nlayer 0: dense SiTU-GLU (33792)\nlayers 1-92: Stable LatentMoE\n"
            "m = FFN_l(norm(h'));   P <- P + m",
            COLORS["moe"],
        ),
    ]
    prev = None
    for y, h, text, color in steps:
        if color is None:  # the mixer box: half KDA, half MLA colour
            ax.add_patch(
                FancyBboxPatch(
                    (x, y), w / 2, h, boxstyle="round,pad=0.02,rounding_size=0.6", fc=COLORS["kda"], ec="none"
                )
            )
            ax.add_patch(
                FancyBboxPatch(
                    (x + w / 2, y),
                    w / 2,
                    h,
                    boxstyle="round,pad=0.02,rounding_size=0.6",
                    fc=COLORS["mla"],
                    ec="none",
                )
            )
            box(ax, x, y, w, h, text, "none", fontsize=8)
        else:
            box(ax, x, y, w, h, text, color, fontsize=8)
        if prev is not None:
            arrow(ax, (x + w / 2, prev), (x + w / 2, y))
        prev = y + h
    arrow(ax, (x + w - 4, 45.6), (x + w - 4, 51))  # clear of the frame's title
    ax.text(x + w - 4.6, 49.9, "R, P after layer 92", fontsize=7, style="italic", color="#555555", ha="right")
    box(ax, x, 51, w, 3.2, "output AttnRes  mix([R..., P]; output_attn_res_*)", COLORS["attnres"])
    arrow(ax, (x + w / 2, 54.2), (x + w / 2, 56.2))
    box(ax, x, 56.2, w, 3.4, "final RMSNorm (model.norm) -> lm_head -> logits [T, 163840]", COLORS["head"])
    # the stream R / P on the left margin
    ax.text(
        0.6,
        30,
        "block stream:  R = completed block sums [e, S(0-11), S(12-23), ...],"
        "  P = partial sum of the current block",
        rotation=90,
        va="center",
        ha="center",
        fontsize=7.5,
        color="#8a5a00",
    )


def layer_pattern(ax, x0=41, y0=62.5):
    """93 squares coloured by mixer type, grouped in AttnRes blocks of 12 layers."""
    ax.text(
        x0,
        y0 + 4.3,
        "layer pattern (k3-full): KDA KDA KDA MLA, repeated; layer 92 is also MLA;"
        " AttnRes blocks of 12 layers",
        fontsize=8.5,
        weight="bold",
    )
    s = 0.58
    for layer in range(93):
        is_mla = (layer + 1) % 4 == 0 or layer == 92
        xx = x0 + layer * s + (layer // 12) * 0.45
        ax.add_patch(
            plt.Rectangle(
                (xx, y0), s * 0.92, 2.2, fc=COLORS["mla" if is_mla else "kda"], ec="#555555", lw=0.4
            )
        )
        if layer % 12 == 0:
            ax.text(xx, y0 - 1.1, str(layer), fontsize=6.5)
    ax.add_patch(plt.Rectangle((x0, y0 + 2.9), 1.2, 0.9, fc=COLORS["kda"], ec="#555555", lw=0.4))
    ax.text(x0 + 1.6, y0 + 3.35, "KDA (69)", fontsize=7, va="center")
    ax.add_patch(plt.Rectangle((x0 + 8, y0 + 2.9), 1.2, 0.9, fc=COLORS["mla"], ec="#555555", lw=0.4))
    ax.text(x0 + 9.6, y0 + 3.35, "gated MLA, NoPE (24)", fontsize=7, va="center")


def kda_panel(ax, x=41, y=40.5, w=28, h=19):
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=1", fc="#f3f9ff", ec="#3a78c2", lw=1.2
        )
    )
    ax.text(x + 0.8, y + h - 1.2, "Kimi Delta Attention (KDA)", fontsize=9, weight="bold", color="#1d4f8f")
    b = COLORS["kda"]
    box(
        ax,
        x + 1,
        y + 12.2,
        w - 2,
        3.6,
        "q, k, v = SiLU(ShortConv_k=4(x W_{q,k,v}))\nq, k: L2-normalised per head;  q *= K^-1/2",
        b,
        7.5,
    )
    box(
        ax,
        x + 1,
        y + 7.4,
        w - 2,
        4.2,
        "gate  g = -5 sigmoid(e^A_log (x W_fa W_fb + dt_bias))\n"
        "write strength  beta = sigmoid(x W_b)  [per head]",
        b,
        7.5,
    )
    box(
        ax,
        x + 1,
        y + 3.2,
        w - 2,
        3.6,
        "S_t = (I - b k k^T) Diag(e^g) S_{t-1} + b k v^T\no_t = S_t^T q_t       state S: [H, K, V] fp32",
        b,
        7.5,
    )
    box(ax, x + 1, y + 0.6, w - 2, 2.0, "y = o_proj(RMSNorm(o) * sigmoid(x W_g))", b, 7.5)
    for y1, y2 in ((12.2, 11.6), (7.4, 6.8), (3.2, 2.6)):
        arrow(ax, (x + w / 2, y + y1), (x + w / 2, y + y2))


def mla_panel(ax, x=70.5, y=40.5, w=28, h=19):
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=1", fc="#f8f3ff", ec="#6a3fc2", lw=1.2
        )
    )
    ax.text(x + 0.8, y + h - 1.2, "gated MLA, NoPE", fontsize=9, weight="bold", color="#4a2590")
    b = COLORS["mla"]
    box(
        ax,
        x + 1,
        y + 12.2,
        w - 2,
        3.6,
        "q = W_qb RMSNorm(W_qa x)  -> q_nope | q_pe\n[c_kv | k_pe] = W_kva x   (k_pe shared by heads)",
        b,
        7.5,
    )
    box(
        ax,
        x + 1,
        y + 7.4,
        w - 2,
        4.2,
        "cache per token: latent [RMSNorm(c_kv) | k_pe]\n= 512 + 64 = 576 values;  k_nope | v = W_kvb c_kv",
        b,
        7.5,
    )
    box(
        ax,
        x + 1,
        y + 3.2,
        w - 2,
        3.6,
        "o = softmax((q_nope k_nope + q_pe k_pe) / sqrt(192))  v\ncausal, no rotary embedding anywhere",
        b,
        7.5,
    )
    box(ax, x + 1, y + 0.6, w - 2, 2.0, "y = o_proj(o * sigmoid(x W_g))", b, 7.5)
    for y1, y2 in ((12.2, 11.6), (7.4, 6.8), (3.2, 2.6)):
        arrow(ax, (x + w / 2, y + y1), (x + w / 2, y + y2))


def moe_panel(ax, x=41, y=11, w=57.5, h=27.5):
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=1", fc="#f3fcf3", ec="#2e8b2e", lw=1.2
        )
    )
    ax.text(
        x + 0.8, y + h - 1.3, "Stable LatentMoE (layers 1-92)", fontsize=9, weight="bold", color="#1f6b1f"
    )
    g = COLORS["moe"]
    top, _ = box(ax, x + 19, y + 21.2, 19, 2.6, "h = RMSNorm(h')   [T, 7168]", COLORS["norm"], 7.5)
    # router
    box(
        ax,
        x + 1,
        y + 13.4,
        17,
        6.4,
        "router (fp32)\ns = sigmoid(h W_gate)  [T, 896]\nselect top-16 of s + b\np = s / sum(s over the 16)",
        COLORS["router"],
        7.5,
    )
    box(
        ax,
        x + 1,
        y + 1.4,
        17,
        10.6,
        "Quantile Balancing\n(once per optimizer step,\nno aux loss):\n"
        "b_j = -quantile_{1-k/n} of\nexpert j's margins s - cutoff,\n"
        "re-centred; frozen at\ninference (e_score_correction_bias)",
        COLORS["router"],
        7.2,
    )
    arrow(ax, (x + 9.5, y + 12.0), (x + 9.5, y + 13.4), color="#8a7a00")
    # routed path
    box(
        ax, x + 20, y + 15.2, 17, 4.4, "routed_expert_down_proj\nz = h W_down   7168 -> 3584 (latent)", g, 7.5
    )
    box(
        ax,
        x + 20,
        y + 8.0,
        17,
        6.0,
        "16 of 896 routed experts\nE_i(z) = W2_i SiTU-GLU(W1_i z, W3_i z)\n"
        "3584 -> 3072 -> 3584\nu = sum_i p_i E_i(z)  (fp32)",
        g,
        7.5,
    )
    box(ax, x + 20, y + 2.4, 17, 4.4, "RMSNorm (routed_expert_norm)\nup_proj 3584 -> 7168", g, 7.5)
    arrow(ax, (x + 28.5, y + 15.2), (x + 28.5, y + 14.0))
    arrow(ax, (x + 28.5, y + 8.0), (x + 28.5, y + 6.8))
    arrow(ax, (x + 18, y + 16.6), (x + 20, y + 11.0), color="#8a7a00", ls="--")  # p, idx to the experts
    ax.text(x + 18.2, y + 13.0, "p, idx", fontsize=7, color="#8a7a00")
    # shared path
    box(
        ax,
        x + 39,
        y + 8.0,
        17.5,
        6.0,
        "2 shared experts on h\n(one fused SiTU-GLU,\nintermediate 6144)",
        g,
        7.5,
    )
    box(ax, x + 39, y + 1.0, 17.5, 3.2, "y = routed + shared", COLORS["norm"], 8, bold=True)
    arrow(ax, (x + 33, y + 21.2), (x + 28.5, y + 19.6))
    arrow(ax, (x + 24, y + 21.2), (x + 12, y + 19.8))
    arrow(ax, (x + 36, y + 21.2), (x + 47.5, y + 14.0))
    arrow(ax, (x + 47.5, y + 8.0), (x + 47.5, y + 4.2))
    arrow(ax, (x + 37, y + 4.6), (x + 39, y + 2.6))
    ax.text(
        x + 39.5,
        y + 25.6,
        "SiTU(g, u) = 4 tanh(g/4) sigmoid(g)\n             x 25 tanh(u/25)   (|.| < 100)",
        fontsize=7,
        family="monospace",
        va="center",
    )
    del top


def main(out: Path | None = None) -> Path:
    out = out or Path(__file__).with_name("architecture.png")
    fig = plt.figure(figsize=(15, 10.5), dpi=110)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(-1, 100)
    ax.set_ylim(0, 70)
    ax.axis("off")
    trunk(ax)
    layer_pattern(ax)
    kda_panel(ax)
    mla_panel(ax)
    moe_panel(ax)
    ax.text(
        41,
        7.5,
        "Kimi K3 (k3-full: d = 7168, 93 layers, 96 heads, 896 routed experts, 16 active + 2 shared; "
        "2.78T total / 104B active parameters)",
        fontsize=8.5,
    )
    ax.text(
        41,
        5.2,
        "Equations: docs/architecture.md and docs/spec.md#forward; "
        "code: k3/model/{transformer,attnres,kda,mla,moe}.py",
        fontsize=8,
        color="#444444",
    )
    # the sub-layer boxes of the trunk point at their detail panels (colours match)
    arrow(ax, (34, 28.5), (41, 46), color="#3a78c2", ls=":", rad=-0.1)
    arrow(ax, (34, 42.5), (41, 30), color="#2e8b2e", ls=":", rad=0.1)
    fig.savefig(out)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main())
