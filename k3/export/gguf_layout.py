"""Our state_dict -> the tensors of llama.cpp's `kimi-k3` GGUF: names, layouts and fusions. Pure torch.

The contract is llama.cpp's loader for the arch (`src/models/kimi-k3.cpp`, `load_arch_tensors`) and the
transformations its converter applies (`conversion/kimi_k3.py`); docs/gguf.md lists them. Every
tensor is yielded in torch layout ([out, in] for a matrix, [E, out, in] for stacked experts): GGUF
writes the dimensions reversed, so ggml's `ne0` is the last torch dimension, the input width.

Five tensors are not a plain rename:

* AttnRes scores: llama.cpp uses only `res_norm.weight * res_proj.weight` (the RMSNorm's gain times the
  scoring projection, both [D]), so each pair is fused into one `*_res_score.weight` [D];
* `A_log` [H] -> `ssm_a` = -exp(A_log) [H] (the decay's sign and exponential folded in);
* the KDA convs [C, 1, W] -> [1, C, 1, W] (a reshape: the window index varies fastest in both);
* MLA `kv_b_proj` [H (Dn + Dv), R] -> `attn_k_b` [H, R, Dn] (each head's key block transposed, for the
  absorbed query) and `attn_v_b` [H, Dv, R];
* `g_proj` is the full-rank KDA output gate (`ssm_g`) on KDA layers and the MLA output gate
  (`attn_gate`) on MLA layers.

The routed experts are already stacked in our state_dict ([E, out, in]); w1 / w3 / w2 are ggml's
gate / up / down.

`state_from_gguf` inverts all of it for the reader (k3.export.gguf_read). Every step is exact on f32
values: an AttnRes score comes back as a key-norm gain of ones and the score as the pseudo-query (our
mixture multiplies the two in f32 before use, so the product is the stored score bit for bit); `A_log`
is the float whose -exp gives `ssm_a` back (searched around log(-ssm_a)); the convs and kv_b are
reshapes and transposes.
"""

import re
from collections.abc import Iterator

import torch

from k3.config import K3Config

# our name after `model.layers.{i}.` -> GGUF name after `blk.{i}.`
_LAYER_RENAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    # KDA
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.dt_bias": "ssm_dt.bias",
    # MLA (q_proj / o_proj above serve MLA layers too)
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    # dense FFN
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # LatentMoE
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.routed_expert_down_proj.weight": "ffn_routed_down.weight",
    "block_sparse_moe.routed_expert_norm.weight": "ffn_routed_norm.weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "ffn_routed_up.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "block_sparse_moe.experts.w1": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.w3": "ffn_up_exps.weight",
    "block_sparse_moe.experts.w2": "ffn_down_exps.weight",
}
_TOP_RENAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# AttnRes pairs: our prefix -> GGUF score name (per layer, or model-level for the output mixture)
_RES_PAIRS = {"self_attention_res": "attn_res_score.weight", "mlp_res": "ffn_res_score.weight"}
_OUTPUT_RES = "model.output_attn_res"
_CONVS = {"q_conv1d": "ssm_conv1d_q", "k_conv1d": "ssm_conv1d_k", "v_conv1d": "ssm_conv1d_v"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")

ROUTED_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
ROUTER = "ffn_gate_inp.weight"


def gguf_tensors(state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """{GGUF name: float tensor in torch layout} for every tensor llama.cpp's kimi-k3 loads.

    state: our state_dict (stacked experts [E, out, in], A_log [H]). A tied head is written out as
    `output.weight` (llama.cpp requires it). Raises ValueError naming a tensor that is missing or that
    has no place in the GGUF, and for configs the release format cannot express.
    """
    config.check_release("write a GGUF of")
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"state_dict lacks {name}, which the kimi-k3 GGUF needs")
        used.add(name)
        return state[name].detach()

    out: dict[str, torch.Tensor] = {}
    tied = config.tie_word_embeddings
    for ours, theirs in _TOP_RENAMES.items():
        out[theirs] = take("model.embed_tokens.weight" if ours == "lm_head.weight" and tied else ours)
    out["output_res_score.weight"] = _res_score(take, _OUTPUT_RES)
    for i in range(config.num_hidden_layers):
        out.update(_layer_tensors(take, state, config, i))
    unused = sorted(set(state) - used - {"lm_head.weight"})
    if unused:
        raise ValueError(f"tensors with no place in the kimi-k3 GGUF: {', '.join(unused[:5])}")
    missing = sorted(required_names(config) - set(out))
    if missing:
        raise ValueError(f"state_dict lacks what the kimi-k3 GGUF needs: {', '.join(missing[:5])}")
    return out


def required_names(config: K3Config) -> set[str]:
    """The GGUF tensor names llama.cpp's kimi-k3 loader requires for `config`."""
    c = config
    names = {"token_embd.weight", "output.weight", "output_norm.weight", "output_res_score.weight"}
    for i in range(c.num_hidden_layers):
        layer = ["attn_norm.weight", "ffn_norm.weight", "attn_res_score.weight", "ffn_res_score.weight"]
        if c.is_kda_layer(i):
            layer += ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ssm_a"]
            layer += [f"{conv}.weight" for conv in _CONVS.values()]
            layer += ["ssm_f_a.weight", "ssm_f_b.weight", "ssm_beta.weight", "ssm_dt.bias"]
            layer += ["ssm_g.weight", "ssm_norm.weight"]
        else:
            q = (
                ["attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"]
                if c.q_lora_rank
                else ["attn_q.weight"]
            )
            layer += q + [
                "attn_kv_a_mqa.weight",
                "attn_kv_a_norm.weight",
                "attn_k_b.weight",
                "attn_v_b.weight",
            ]
            layer += ["attn_gate.weight", "attn_output.weight"]
        if i < c.first_k_dense_replace:
            layer += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        else:
            layer += [
                ROUTER,
                "exp_probs_b.bias",
                *ROUTED_EXPERTS,
                "ffn_routed_down.weight",
                "ffn_routed_up.weight",
            ]
            layer += ["ffn_routed_norm.weight"] if c.latent_moe_use_norm else []
            if c.num_shared_experts:
                layer += ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]
        names.update(f"blk.{i}.{n}" for n in layer)
    return names


def _res_score(take, prefix: str) -> torch.Tensor:
    """The fused AttnRes scoring vector [D]: RMSNorm gain times the [1, D] scoring projection."""
    return take(f"{prefix}_norm.weight").float().flatten() * take(f"{prefix}_proj.weight").float().flatten()


def _layer_tensors(take, state: dict, config: K3Config, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    p, blk = f"model.layers.{i}.", f"blk.{i}."
    kda = config.is_kda_layer(i)
    for ours, theirs in _RES_PAIRS.items():
        yield blk + theirs, _res_score(take, p + ours)
    for name in [n for n in state if n.startswith(p)]:
        rest = name[len(p) :]
        if rest.startswith(tuple(_RES_PAIRS)):
            continue  # fused above
        if rest == "self_attn.A_log":
            yield blk + "ssm_a", -torch.exp(take(name).float())
        elif (conv := rest.removeprefix("self_attn.").removesuffix(".weight")) in _CONVS:
            w = take(name)  # [C, 1, W]
            yield blk + _CONVS[conv] + ".weight", w.reshape(1, w.shape[0], 1, w.shape[-1])
        elif rest == "self_attn.g_proj.weight":
            yield blk + ("ssm_g.weight" if kda else "attn_gate.weight"), take(name)
        elif rest == "self_attn.kv_b_proj.weight":
            yield from _split_kv_b(take(name), config, blk)
        elif rest in _LAYER_RENAMES:
            yield blk + _LAYER_RENAMES[rest], take(name)


def _split_kv_b(kv_b: torch.Tensor, config: K3Config, blk: str) -> Iterator[tuple[str, torch.Tensor]]:
    """kv_b_proj [H (Dn + Dv), R] -> attn_k_b [H, R, Dn] (keys transposed) and attn_v_b [H, Dv, R]."""
    h, dn, dv = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    if kv_b.shape[0] != h * (dn + dv):
        raise ValueError(f"{blk}kv_b_proj: expected {h * (dn + dv)} rows, got {kv_b.shape[0]}")
    per_head = kv_b.reshape(h, dn + dv, kv_b.shape[-1])
    yield blk + "attn_k_b.weight", per_head[:, :dn].transpose(1, 2).contiguous()
    yield blk + "attn_v_b.weight", per_head[:, dn:].contiguous()


# ---- the inverse: GGUF tensors -> our state_dict ------------------------------------------------------
_LAYER_INVERSE = {theirs: ours for ours, theirs in _LAYER_RENAMES.items()}
_CONV_INVERSE = {f"{theirs}.weight": f"self_attn.{ours}.weight" for ours, theirs in _CONVS.items()}
_RES_INVERSE = {theirs: ours for ours, theirs in _RES_PAIRS.items()}
_EXPERT_PARTS = ("weight_packed", "weight_scale")


def state_from_gguf(tensors: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """Inverse of `gguf_tensors`: {GGUF name: tensor in torch layout} -> our state_dict.

    Values are float tensors, except that a routed-expert matrix may instead be given as its k3-packed
    MXFP4 parts under `NAME:weight_packed` / `NAME:weight_scale` (`blk.1.ffn_up_exps.weight:weight_scale`),
    which become `...experts.w3.weight_packed` / `.weight_scale` (PackedRoutedExperts' names). With
    `config.tie_word_embeddings`, `lm_head.weight` is the embedding and `output.weight` is not read. Raises
    ValueError naming the tensors that are missing or that have no place in a K3 model.
    """
    present = {n.split(":")[0] for n in tensors}
    if config.tie_word_embeddings:
        present.add("output.weight")
    missing = sorted(required_names(config) - present)
    if missing:
        raise ValueError(f"the GGUF lacks tensors its kimi-k3 metadata needs: {', '.join(missing[:5])}")
    top = {theirs: ours for ours, theirs in _TOP_RENAMES.items()}
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    kv_b: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        base, _, part = name.partition(":")
        if name == "output.weight" and config.tie_word_embeddings:
            continue
        if name in top:
            out[top[name]] = t
        elif name == "output_res_score.weight":
            out.update(_res_pair(_OUTPUT_RES, t))
        elif m := _BLK.match(base):
            i, rest, p = int(m[1]), m[2], f"model.layers.{m[1]}."
            if part and (rest not in ROUTED_EXPERTS or part not in _EXPERT_PARTS):
                unknown.append(name)
            elif part:
                out[p + _LAYER_INVERSE[rest] + "." + part] = t
            elif rest in _RES_INVERSE:
                out.update(_res_pair(p + _RES_INVERSE[rest], t))
            elif rest == "ssm_a":
                out[p + "self_attn.A_log"] = a_log_from_ssm_a(t)
            elif rest in _CONV_INVERSE:
                out[p + _CONV_INVERSE[rest]] = t.reshape(t.shape[-3], 1, t.shape[-1])
            elif rest in ("ssm_g.weight", "attn_gate.weight"):
                out[p + "self_attn.g_proj.weight"] = t
            elif rest in ("attn_k_b.weight", "attn_v_b.weight"):
                kv_b.setdefault(i, {})[rest] = t
            elif rest in _LAYER_INVERSE:
                out[p + _LAYER_INVERSE[rest]] = t
            else:
                unknown.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"GGUF tensors with no place in a K3 model: {', '.join(sorted(unknown)[:5])}")
    for i, parts in kv_b.items():
        out[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = _join_kv_b(parts, config, i)
    if config.tie_word_embeddings:  # our state_dict lists the shared head under both names
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _res_pair(prefix: str, score: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused AttnRes score [D] -> key-norm gain (ones) and pseudo-query [1, D] with the same product."""
    return {f"{prefix}_norm.weight": torch.ones_like(score), f"{prefix}_proj.weight": score.reshape(1, -1)}


def a_log_from_ssm_a(ssm_a: torch.Tensor) -> torch.Tensor:
    """The f32 `A_log` [H] whose -exp(A_log) equals `ssm_a` [H] bit for bit where such a float lies within
    a few ulps of log(-ssm_a) (always, for a file `gguf_tensors` wrote); elsewhere log(-ssm_a)."""
    target = ssm_a.float()
    best = torch.log(-target)
    found = -torch.exp(best) == target
    up = down = best
    for _ in range(4):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        for cand in (up, down):
            hit = ~found & (-torch.exp(cand) == target)
            best, found = torch.where(hit, cand, best), found | hit
    return best


def _join_kv_b(parts: dict[str, torch.Tensor], config: K3Config, i: int) -> torch.Tensor:
    """attn_k_b [H, R, Dn] + attn_v_b [H, Dv, R] -> kv_b_proj [H (Dn + Dv), R]."""
    h, dn, dv, r = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    k_b, v_b = parts.get("attn_k_b.weight"), parts.get("attn_v_b.weight")
    if k_b is None or v_b is None or tuple(k_b.shape) != (h, r, dn) or tuple(v_b.shape) != (h, dv, r):
        got = {n: list(t.shape) for n, t in parts.items()}
        raise ValueError(f"blk.{i}: expected attn_k_b [{h}, {r}, {dn}], attn_v_b [{h}, {dv}, {r}]; got {got}")
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(h * (dn + dv), r).contiguous()
