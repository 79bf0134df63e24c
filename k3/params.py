"""Parameter counts of a K3 configuration, total and active per token, by component (`k3 params`).

Counted on the meta device from the real model (`with torch.device("meta"): K3ForCausalLM(config)`), over
its state_dict (so the router's `e_score_correction_bias` buffer counts, as in docs/spec.md#parameter-counts).
`A_log` counts its in-memory [H] values; the official file pads it to 128 (docs/spec.md#tensors), which is
storage, not parameters: the 443,740,384 per KDA layer of docs/spec.md#parameter-counts is reproduced with
96, not 128.

Active per token = everything except the routed experts + top_k / E of them (num_experts_per_token
experts in every MoE layer); reported with and without the input embedding (a lookup, not a matmul).
With tied embeddings the one matrix is counted once (as "embedding") and is active either way.

`expected_shapes(config)` is the same model written down analytically (our state_dict contract); tests
check it against the real model for every preset, and against docs/spec.md#parameter-counts for k3-full.
"""

import json
import math
from dataclasses import dataclass, field

import torch

from k3.config import K3Config, load_config

COMPONENTS = (
    "embedding",
    "lm_head",
    "kda_mixers",
    "mla_mixers",
    "attn_res",
    "layer_norms",
    "dense_ffn",
    "moe_router",
    "shared_experts",
    "latent_projections",
    "routed_experts",
    "other",
)
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN_RES = ("self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj")


# ---- the state_dict contract, analytically ----------------------------------------------------------
def expected_shapes(config: K3Config) -> dict[str, tuple[int, ...]]:
    """{name: shape} of K3ForCausalLM(config).state_dict(), from the config alone (docs/spec.md#tensors,
    in-memory)."""
    c, d = config, config.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + n + ".weight": (d,) for n in _LAYER_NORMS}
        if c.use_attn_res:
            shapes |= {p + n + ".weight": (1, d) if n.endswith("proj") else (d,) for n in _ATTN_RES}
        mixer = _kda_shapes(c) if c.is_kda_layer(i) else _mla_shapes(c)
        shapes |= {p + "self_attn." + n: s for n, s in mixer.items()}
        ffn = _moe_shapes(c) if c.is_moe_layer(i) else _glu_shapes(d, c.intermediate_size, "mlp.")
        shapes |= {p + n: s for n, s in ffn.items()}
    shapes["model.norm.weight"] = (d,)
    if c.use_attn_res:
        shapes |= {"model.output_attn_res_norm.weight": (d,), "model.output_attn_res_proj.weight": (1, d)}
    shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


def _kda_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    la, d = c.linear_attn_config, c.hidden_size
    h, k, hk, w = la.num_heads, la.head_dim, la.num_heads * la.head_dim, la.short_conv_kernel_size
    s = {f"{x}_proj.weight": (hk, d) for x in "qkv"} | {f"{x}_conv1d.weight": (hk, 1, w) for x in "qkv"}
    s |= {
        "f_a_proj.weight": (k, d),
        "f_b_proj.weight": (hk, k),
        "dt_bias": (hk,),
        "A_log": (h,),
        "b_proj.weight": (h, d),
    }
    if la.use_full_rank_gate:
        s["g_proj.weight"] = (hk, d)
    else:
        s |= {"g_a_proj.weight": (k, d), "g_b_proj.weight": (hk, k)}
    return s | {"o_norm.weight": (k,), "o_proj.weight": (d, hk)}


def _mla_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    d, h, r = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
    if c.q_lora_rank is None:
        s = {"q_proj.weight": (h * c.qk_head_dim, d)}
    else:
        s = {
            "q_a_proj.weight": (c.q_lora_rank, d),
            "q_a_layernorm.weight": (c.q_lora_rank,),
            "q_b_proj.weight": (h * c.qk_head_dim, c.q_lora_rank),
        }
    s |= {
        "kv_a_proj_with_mqa.weight": (r + c.qk_rope_head_dim, d),
        "kv_a_layernorm.weight": (r,),
        "kv_b_proj.weight": (h * (c.qk_nope_head_dim + c.v_head_dim), r),
    }
    if c.mla_use_output_gate:
        s["g_proj.weight"] = (h * c.v_head_dim, d)
    return s | {"o_proj.weight": (d, h * c.v_head_dim)}


def _glu_shapes(d: int, inter: int, prefix: str) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, d),
        prefix + "up_proj.weight": (inter, d),
        prefix + "down_proj.weight": (d, inter),
    }


def _moe_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    d, e, i, w, p = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.expert_width, "block_sparse_moe."
    s = {p + "gate.weight": (e, d), p + "gate.e_score_correction_bias": (e,)}
    if c.num_shared_experts > 0:
        s |= _glu_shapes(d, i * c.num_shared_experts, p + "shared_experts.")
    if c.use_latent_moe:
        s[p + "routed_expert_down_proj.weight"] = (w, d)
        if c.latent_moe_use_norm:
            s[p + "routed_expert_norm.weight"] = (w,)
        s[p + "routed_expert_up_proj.weight"] = (d, w)
    return s | {p + "experts.w1": (e, i, w), p + "experts.w3": (e, i, w), p + "experts.w2": (e, w, i)}


def model_shapes(config: K3Config) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the real model's state_dict, built on the meta device (no memory, no init)."""
    from k3.model.transformer import K3ForCausalLM  # lazy: only `k3 params` pays for the model import

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


# ---- counting ---------------------------------------------------------------------------------------
def component_of(name: str, config: K3Config) -> str:
    """Which COMPONENTS bucket a state_dict name belongs to."""
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if name == "model.norm.weight":
        return "layer_norms"
    if name.startswith("model.output_attn_res_"):
        return "attn_res"
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return "other"
    layer, sub = int(parts[2]), parts[3]
    if sub == "self_attn":
        return "kda_mixers" if config.is_kda_layer(layer) else "mla_mixers"
    if sub in _ATTN_RES:
        return "attn_res"
    if sub in _LAYER_NORMS:
        return "layer_norms"
    if sub == "mlp":
        return "dense_ffn"
    if sub == "block_sparse_moe" and len(parts) > 4:
        return {
            "gate": "moe_router",
            "shared_experts": "shared_experts",
            "experts": "routed_experts",
            "routed_expert_down_proj": "latent_projections",
            "routed_expert_norm": "latent_projections",
            "routed_expert_up_proj": "latent_projections",
        }.get(parts[4], "other")
    return "other"


@dataclass
class ParamReport:
    """Parameter counts of one configuration (ints), plus per-sequence / per-token inference state."""

    name: str
    total: dict[str, int]  # component -> parameters
    active: dict[str, int]  # component -> parameters used per token
    state: dict[str, float] = field(default_factory=dict)

    @property
    def total_params(self) -> int:
        return sum(self.total.values())

    @property
    def active_incl_embedding(self) -> int:
        return sum(self.active.values())

    @property
    def active_excl_embedding(self) -> int:
        return self.active_incl_embedding - self.active["embedding"]

    def to_dict(self) -> dict:
        return {
            "config": self.name,
            "total": self.total_params,
            "active_incl_embedding": self.active_incl_embedding,
            "active_excl_embedding": self.active_excl_embedding,
            "components": {k: {"total": self.total[k], "active": self.active[k]} for k in COMPONENTS},
            "inference_state": self.state,
        }


def count_parameters(
    config: K3Config, name: str = "", shapes: dict[str, tuple[int, ...]] | None = None
) -> ParamReport:
    """Count `shapes` (default: the real model's, on the meta device) by component."""
    shapes = model_shapes(config) if shapes is None else shapes
    total = dict.fromkeys(COMPONENTS, 0)
    for n, s in shapes.items():
        if n == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the same matrix as the embedding
        total[component_of(n, config)] += math.prod(s)
    active = dict(total)
    if total["routed_experts"] % config.num_experts:
        raise ValueError(
            f"routed expert parameters ({total['routed_experts']}) not a multiple of num_experts"
        )
    active["routed_experts"] = total["routed_experts"] // config.num_experts * config.num_experts_per_token
    if config.tie_word_embeddings:
        active["embedding"] = 0  # used as lm_head anyway, so it is active without the input lookup too
        active["lm_head"] = total["embedding"]
    return ParamReport(name=name, total=total, active=active, state=inference_state(config))


def inference_state(config: K3Config) -> dict[str, float]:
    """KDA state per sequence (fp32 recurrent + bf16 conv) and MLA latent cache per token (docs/spec.md#kda,
    docs/spec.md#mla)."""
    la = config.linear_attn_config
    n_kda = sum(config.is_kda_layer(i) for i in range(config.num_hidden_layers))
    n_mla = config.num_hidden_layers - n_kda
    hk = la.num_heads * la.head_dim
    recurrent = la.num_heads * la.head_dim * la.head_dim * 4
    conv = 3 * hk * (la.short_conv_kernel_size - 1) * 2
    latent = n_mla * (config.kv_lora_rank + config.qk_rope_head_dim)
    return {
        "kda_layers": n_kda,
        "mla_layers": n_mla,
        "kda_state_bytes_per_sequence": n_kda * (recurrent + conv),
        "kda_state_mib_per_sequence": n_kda * (recurrent + conv) / 2**20,
        "mla_latent_elements_per_token": latent,
        "mla_latent_bf16_bytes_per_token": 2 * latent,
    }


# ---- printing and the CLI ---------------------------------------------------------------------------
def format_table(r: ParamReport) -> str:
    """An aligned, human-readable table: exact counts with thousands separators, and B (or M) units."""
    unit, scale = ("B", 1e9) if r.total_params >= 1e9 else ("M", 1e6)
    rows = [(k, r.total[k], r.active[k]) for k in COMPONENTS if r.total[k] or k != "other"]
    rows += [
        None,
        ("total", r.total_params, r.active_incl_embedding),
        ("active excl. input embedding", None, r.active_excl_embedding),
    ]
    w = max(len(k) for k, *_ in filter(None, rows))
    cell = lambda n: "" if n is None else f"{n:>19,} {n / scale:>10.3f}{unit}"
    lines = [
        f"parameters of {r.name or 'config'}",
        f"{'component':<{w}}  {'total':>31}  {'active/token':>31}",
    ]
    for row in rows:
        lines.append(
            "-" * (w + 66) if row is None else f"{row[0]:<{w}}  {cell(row[1]):>31}  {cell(row[2]):>31}"
        )
    s = r.state
    lines += [
        "",
        f"KDA state per sequence: {s['kda_state_bytes_per_sequence']:,} B "
        f"({_mib(s['kda_state_bytes_per_sequence'])}, {s['kda_layers']} KDA layers)",
        f"MLA latent cache per token: {s['mla_latent_elements_per_token']:,} elements "
        f"({s['mla_latent_bf16_bytes_per_token']:,} B in BF16, {s['mla_layers']} MLA layers)",
    ]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def add_arguments(parser) -> None:
    parser.description = "Count total and active-per-token parameters of a K3 configuration by component."
    parser.add_argument(
        "config",
        metavar="NAME_OR_CONFIG_JSON",
        help="a preset (k3-nano, k3-tiny, k3-small, k3-full), a config.json or a checkpoint directory",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    report = count_parameters(load_config(args.config), name=args.config)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_table(report))
    return 0
