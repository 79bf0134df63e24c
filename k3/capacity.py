"""Capacity planner (`k3 plan`): per-GPU memory of training and serving a K3 configuration.

Every number is a closed-form function of the config (parameter counts from k3.params, on the meta
device) and the layout; the formulas are in docs/distributed.md. Training layout = k3.parallel: G GPUs,
ep | G, dp = G / ep, dense weights FSDP-sharded over all G, experts split over ep and FSDP-sharded over
dp (so every weight is 1/G per GPU). Precision policy: the FSDP-sharded parameters are the fp32 master
weights; compute uses bf16 copies all-gathered one unit at a time (MixedPrecisionPolicy
param_dtype=bf16, reduce_dtype=fp32); sharded gradients fp32; Muon momentum fp32 (one state) for the
matrices, AdamW two fp32 moments for embeddings, lm_head, norms and vectors.

Activations are an estimate per token (bf16 tensors kept for backward, see `layer_activation_bytes`),
with full per-layer activation checkpointing ("full": only layer inputs + the AttnRes block stream
are kept, one layer is recomputed at a time) or none. Serving: bf16 dense weights + MXFP4 routed
experts (4 bits + one E8M0 scale per 32 = 4.25 bits) over G GPUs, the MLA latent cache (bf16) and the
KDA state (fp32 recurrent + bf16 conv) per sequence at the given context.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from k3.config import K3Config, load_config
from k3.params import expected_shapes

GiB = 2**30
BF16, FP32 = 2, 4
MXFP4_BYTES = 4.25 / 8  # per routed-expert parameter: E2M1 nibble + one 8-bit scale per 32 values


# ---- parameter split ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSplit:
    experts: int  # routed experts (MXFP4 when serving)
    dense: int  # everything else that is trained
    muon: int  # matrices optimised by Muon (experts included)
    adamw: int  # embeddings, lm_head, norms, vectors, conv weights, AttnRes queries
    buffers: int  # router biases (written by Quantile Balancing, not optimised)
    largest_unit: int  # parameters of the largest FSDP unit (one mixer / FFN / expert shard)


def _is_adamw(name: str, shape: tuple[int, ...]) -> bool:
    """The k3.train.param_groups rule, on names and shapes."""
    adamw_names = ("model.embed_tokens.weight", "lm_head.weight")
    return len(shape) < 2 or name in adamw_names or name.endswith(("_res_proj.weight", "conv1d.weight"))


def param_split(config: K3Config, ep: int = 1) -> ParamSplit:
    shapes = expected_shapes(config)
    experts = dense = muon = adamw = buffers = 0
    units: dict[str, int] = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        if name.endswith("e_score_correction_bias"):
            buffers += n
            continue
        is_expert = ".experts." in name
        experts, dense = experts + n * is_expert, dense + n * (not is_expert)
        if _is_adamw(name, shape):
            adamw += n
        else:
            muon += n
        unit = _unit_of(name)
        units[unit] = units.get(unit, 0) + (n // ep if is_expert else n)
    return ParamSplit(experts, dense, muon, adamw, buffers, max(units.values()))


def _unit_of(name: str) -> str:
    """FSDP unit of a parameter (k3.parallel.fsdp): mixer, FFN, experts, layer or root."""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return "root"
    sub = parts[3]
    if sub == "block_sparse_moe" and parts[4] == "experts":
        return ".".join(parts[:5])
    if sub in ("self_attn", "block_sparse_moe", "mlp"):
        return ".".join(parts[:4])
    return ".".join(parts[:3])


# ---- activations --------------------------------------------------------------------------------------
def layer_activation_bytes(config: K3Config, i: int, capacity_factor: float = 1.25) -> int:
    """Bytes per token kept for backward by layer i (mixer + FFN + norms) (docs/distributed.md)."""
    c, D = config, config.hidden_size
    if c.is_kda_layer(i):
        la = c.linear_attn_config
        HK, H = la.num_heads * la.head_dim, la.num_heads
        # x, q/k/v proj + conv outs, gate f, g, o, o_norm; fp32 chunk states [H, K, V] per 64 tokens
        mixer = BF16 * (D + 10 * HK + H) + FP32 * (HK + H * la.head_dim * la.head_dim // 64)
    else:
        H, n, r, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = (c.q_lora_rank or 0) + H * (n + r)
        mixer = BF16 * (D + q + c.kv_lora_rank + r + H * (n + v) + 3 * H * v) + FP32 * H
    if c.is_moe_layer(i):
        k, Dl, I = c.num_experts_per_token, c.expert_width, c.moe_intermediate_size
        slots = capacity_factor * k  # static EP buffers: C = cf * T * k / E rows per expert
        shared = 3 * I * c.num_shared_experts
        ffn = BF16 * (D + 3 * Dl + 2 * slots * Dl + slots * 3 * I + shared) + FP32 * c.num_experts
    else:
        ffn = BF16 * (D + 3 * c.intermediate_size)
    norms = BF16 * 6 * D  # two RMSNorms, two AttnRes mixes
    return int(mixer + ffn + norms)


def activation_bytes_per_token(
    config: K3Config, checkpointing: str = "full", capacity_factor: float = 1.25
) -> int:
    """Per-token activation bytes of a training micro-batch, logits included (6·V: bf16 + fp32 for CE)."""
    if checkpointing not in ("full", "none"):
        raise ValueError(f"checkpointing must be 'full' or 'none', got {checkpointing!r}")
    L = config.num_hidden_layers
    per_layer = [layer_activation_bytes(config, i, capacity_factor) for i in range(L)]
    logits = (BF16 + FP32) * config.vocab_size
    if checkpointing == "none":
        return sum(per_layer) + logits
    blocks = math.ceil(L / config.attn_res_block_size) + 1
    return BF16 * config.hidden_size * (L + blocks) + max(per_layer) + logits


# ---- the plan -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanRow:
    section: str
    item: str
    formula: str
    bytes: float


def training_rows(config: K3Config, gpus: int, ep: int, seq: int, micro_batch: int, checkpointing: str):
    s = param_split(config, ep)
    P, G = s.experts + s.dense, gpus
    tok = seq * micro_batch
    act = activation_bytes_per_token(config, checkpointing)
    return [
        PlanRow("train", "master weights (fp32, FSDP shard)", "4·P/G", FP32 * (P + s.buffers) / G),
        PlanRow("train", "gradients (fp32, FSDP shard)", "4·P/G", FP32 * P / G),
        PlanRow("train", "Muon momentum (fp32)", "4·P_muon/G", FP32 * s.muon / G),
        PlanRow("train", "AdamW moments (fp32 ×2)", "8·P_adamw/G", 2 * FP32 * s.adamw / G),
        PlanRow("train", "bf16 unit all-gather (+prefetch, +grad)", "3·2·P_unit", 3 * BF16 * s.largest_unit),
        PlanRow("train", f"activations (AC={checkpointing})", "S·B·a_tok", tok * act),
    ]


def serving_rows(config: K3Config, gpus: int, context: int):
    from k3.params import inference_state

    s, st = param_split(config), inference_state(config)
    mla = st["mla_latent_bf16_bytes_per_token"] * context
    return [
        PlanRow("serve", "dense weights (bf16)", "2·P_dense/G", BF16 * (s.dense + s.buffers) / gpus),
        PlanRow("serve", "routed experts (MXFP4)", "4.25/8·P_exp/G", MXFP4_BYTES * s.experts / gpus),
        PlanRow("serve", f"MLA latent cache, 1 seq @ {context:,}", "L·n_mla·(r+d_rope)·2", mla),
        PlanRow(
            "serve", "KDA state, 1 seq", "n_kda·(H·K·V·4 + 3·HK·(W-1)·2)", st["kda_state_bytes_per_sequence"]
        ),
    ]


@dataclass(frozen=True)
class Plan:
    name: str
    gpus: int
    ep: int
    gpu_mem_gb: float
    train: list[PlanRow]
    serve: list[PlanRow]

    @property
    def train_total(self) -> float:
        return sum(r.bytes for r in self.train)

    @property
    def serve_weights(self) -> float:
        return sum(r.bytes for r in self.serve[:2])

    @property
    def seq_bytes(self) -> float:
        return sum(r.bytes for r in self.serve[2:])

    @property
    def gpu_bytes(self) -> float:
        return self.gpu_mem_gb * 1e9

    def sequences_per_deployment(self) -> int:
        """Sequences at the serving context the G GPUs hold after weights (attention state anywhere)."""
        free = self.gpus * (self.gpu_bytes - self.serve_weights)
        return max(0, int(free // self.seq_bytes))

    def to_dict(self) -> dict:
        rows = lambda rs: [{"item": r.item, "formula": r.formula, "bytes_per_gpu": r.bytes} for r in rs]
        return {"config": self.name, "gpus": self.gpus, "ep": self.ep, "dp": self.gpus // self.ep,
                "gpu_mem_gb": self.gpu_mem_gb, "train": rows(self.train), "train_total": self.train_total,
                "train_fits": self.train_total <= self.gpu_bytes, "serve": rows(self.serve),
                "serve_weights_per_gpu": self.serve_weights,
                "sequences_per_deployment": self.sequences_per_deployment()}  # fmt: skip


def make_plan(
    config: K3Config,
    gpus: int,
    *,
    name: str = "",
    gpu_mem_gb: float = 141.0,
    ep: int | None = None,
    seq: int = 8192,
    micro_batch: int = 1,
    serve_context: int = 131072,
    checkpointing: str = "full",
) -> Plan:
    ep = math.gcd(gpus, config.num_experts) if ep is None else ep
    for key, v in (("gpus", gpus), ("ep", ep), ("seq", seq), ("micro_batch", micro_batch),
                   ("serve_context", serve_context)):  # fmt: skip
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive integer, got {v!r}")
    if gpus % ep or config.num_experts % ep:
        raise ValueError(f"ep={ep} must divide gpus={gpus} and num_experts={config.num_experts}")
    if gpu_mem_gb <= 0:
        raise ValueError(f"gpu_mem_gb must be > 0, got {gpu_mem_gb}")
    train = training_rows(config, gpus, ep, seq, micro_batch, checkpointing)
    return Plan(name, gpus, ep, gpu_mem_gb, train, serving_rows(config, gpus, serve_context))


def min_training_gpus(config: K3Config, *, max_gpus: int = 1 << 16, **kwargs) -> int | None:
    """Smallest power-of-two G (ep = gcd(G, E)) whose training total fits; None if none up to max_gpus."""
    g = 1
    while g <= max_gpus:
        plan = make_plan(config, g, **kwargs)
        if plan.train_total <= plan.gpu_bytes:
            return g
        g *= 2
    return None


def format_plan(p: Plan, min_gpus: int | None = None) -> str:
    w = max(len(r.item) for r in p.train + p.serve)
    f = max(len(r.formula) for r in p.train + p.serve)
    line = lambda r: f"  {r.item:<{w}}  {r.formula:<{f}}  {r.bytes / GiB:>10.2f} GiB"
    mem = p.gpu_bytes / GiB
    out = [f"{p.name or 'config'} on {p.gpus} GPUs ({p.gpu_mem_gb:g} GB = {mem:.1f} GiB each), "
           f"ep={p.ep}, dp={p.gpus // p.ep}", "training, per GPU:"]  # fmt: skip
    out += [line(r) for r in p.train]
    verdict = "fits" if p.train_total <= p.gpu_bytes else "does NOT fit"
    out += [f"  {'total':<{w}}  {'':<{f}}  {p.train_total / GiB:>10.2f} GiB  ({verdict})"]
    if min_gpus is not None:
        out += [f"  smallest power-of-two GPU count that fits training with these settings: {min_gpus}"]
    out += ["serving:"]
    out += [line(r) for r in p.serve]
    out += [f"  weights per GPU {p.serve_weights / GiB:.2f} GiB; one sequence {p.seq_bytes / GiB:.2f} GiB; "
            f"{p.sequences_per_deployment():,} sequences fit on the {p.gpus} GPUs"]  # fmt: skip
    return "\n".join(out)


def add_arguments(parser) -> None:
    parser.description = (
        "Per-GPU memory for training and serving a K3 configuration (formulas: docs/distributed.md)."
    )
    parser.add_argument("config", metavar="PRESET_OR_CONFIG_JSON")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-mem-gb", type=float, default=141.0, help="memory per GPU in GB (H200: 141)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all GPUs)")
    parser.add_argument("--seq", type=int, default=8192, help="training sequence length")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch")
    parser.add_argument("--serve-context", type=int, default=131072, help="serving context length")
    parser.add_argument("--checkpointing", choices=("full", "none"), default="full")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    plan = make_plan(load_config(args.config), args.gpus, name=args.config, gpu_mem_gb=args.gpu_mem_gb,
                     ep=args.ep, seq=args.seq, micro_batch=args.micro_batch,
                     serve_context=args.serve_context, checkpointing=args.checkpointing)  # fmt: skip
    kw = dict(gpu_mem_gb=args.gpu_mem_gb, seq=args.seq, micro_batch=args.micro_batch,
              serve_context=args.serve_context, checkpointing=args.checkpointing)  # fmt: skip
    min_gpus = min_training_gpus(load_config(args.config), **kw)
    if args.json:
        print(json.dumps(plan.to_dict() | {"min_training_gpus": min_gpus}, indent=2))
    else:
        print(format_plan(plan, min_gpus))
    return 0
