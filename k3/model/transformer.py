"""The K3 decoder: embedding -> 93 x (AttnRes -> KDA|MLA -> AttnRes -> dense|LatentMoE) -> AttnRes -> head.

docs/spec.md#attnres wiring with block AttnRes (block size `attn_res_block_size`, counted in decoder layers):

    P <- e, R <- []
    for l in layers:
        h  <- AttnRes([R..., P]; self_attention_res_*)   (h <- P while R is empty, i.e. layer 0)
        if l % block == 0: R.append(P); P <- empty
        P  <- P + Mixer_l(input_layernorm(h))
        h' <- AttnRes([R..., P]; mlp_res_*)
        P  <- P + FFN_l(post_attention_layernorm(h'))
    logits = lm_head(norm(AttnRes([R..., P]; output_attn_res_*)))

With `use_attn_res=False` (K2-style ablation) it is the plain pre-norm residual stream instead.

Per-layer inference state (KDA conv + recurrent state, MLA latent cache) is an argument the caller owns
(`k3.model.state`); the model holds no caches. Packed documents are described by `cu_seqlens` (KDA, flat
over B*T) and/or `doc_ids` (MLA block-diagonal mask); either is derived from the other when only one is
given. Labels are next-token targets already aligned with positions (labels[b, t] is the target of
position t; -100 is ignored), as produced by `k3.data.packing`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.attnres import AttnResKeyNorm, AttnResQuery, BlockStream, mix
from k3.model.documents import cu_seqlens_to_doc_ids, doc_ids_to_cu_seqlens
from k3.model.kda import KimiDeltaAttention
from k3.model.layers import Linear, RMSNorm
from k3.model.mla import MLAAttention
from k3.model.mlp import GLUMLP
from k3.model.moe import LatentMoE

IGNORE_INDEX = -100


@dataclass
class Context:
    """Per-forward side information shared by all layers."""

    cu_seqlens: torch.Tensor | None = None  # [N+1] int64, flat over B*T (KDA varlen)
    doc_ids: torch.Tensor | None = None  # [B, T] (MLA block-diagonal causal mask)
    positions: torch.Tensor | None = None  # [B, T] (RoPE ablation only; K3 is NoPE)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # scalar fp32 mean over non-ignored targets


class DecoderLayer(nn.Module):
    """One K3 decoder layer: two AttnRes mixtures, a KDA or MLA mixer, a dense or MoE FFN."""

    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.use_attn_res = config.use_attn_res
        self.block_start = layer_idx % config.attn_res_block_size == 0
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if self.use_attn_res:
            self.self_attention_res_norm = AttnResKeyNorm(d)
            self.self_attention_res_proj = AttnResQuery(d)
            self.mlp_res_norm = AttnResKeyNorm(d)
            self.mlp_res_proj = AttnResQuery(d)
        self.self_attn = (
            KimiDeltaAttention(config, layer_idx) if self.is_kda else MLAAttention(config, layer_idx)
        )
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(config)
        else:
            self.mlp = GLUMLP(d, config.intermediate_size, config)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def mixer(self, x: torch.Tensor, state, ctx: Context, keep: int | None = None) -> torch.Tensor:
        if self.is_kda:
            return self.self_attn(x, state=state, cu_seqlens=ctx.cu_seqlens, keep=keep)
        return self.self_attn(x, state=state, doc_ids=ctx.doc_ids, positions=ctx.positions, keep=keep)

    def forward(self, stream: BlockStream, state, ctx: Context, keep: int | None = None) -> None:
        """Advance the block stream by this layer (in place). `keep` (the last layer of an inference
        forward): the mixer still reads all T positions and updates `state` over them, but only the last
        `keep` positions go on: the stream is cut to them and the FFN runs on them alone (none for 0)."""
        if self.use_attn_res:
            h = (
                stream.partial
                if not stream.blocks
                else mix(
                    stream.blocks, stream.partial, self.self_attention_res_proj, self.self_attention_res_norm
                )
            )
            if self.block_start:
                stream.close_block()
        else:
            h = stream.partial
        y = self.mixer(self.input_layernorm(h), state, ctx, keep)
        if keep is not None:
            stream.keep_last(keep)
            if keep == 0:
                return
        stream.add(y)
        h = (
            mix(stream.blocks, stream.partial, self.mlp_res_proj, self.mlp_res_norm)
            if self.use_attn_res
            else stream.partial
        )
        stream.add(self.ffn(self.post_attention_layernorm(h)))


class K3Model(nn.Module):
    """Embedding + decoder layers + the output AttnRes; returns the pre-norm h_out [B, T, D]."""

    def __init__(self, config: K3Config):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.use_attn_res:
            self.output_attn_res_norm = AttnResKeyNorm(d)
            self.output_attn_res_proj = AttnResQuery(d)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        state=None,
        ctx: Context | None = None,
        keep: int | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] (or inputs_embeds [B, T, D]) -> h_out [B, T, D]; with `keep`, h_out of the last
        `keep` positions only, [B, keep, D] (inference: the last layer's mixer output and FFN, and the
        output AttnRes, run on those positions only; every layer's state still covers all T)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        ctx = ctx or Context()
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if keep is not None and not 0 <= keep <= x.shape[1]:
            raise ValueError(f"keep must be in [0, T={x.shape[1]}], got {keep}")
        stream = BlockStream(partial=x)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            layer(stream, None if state is None else state[i], ctx, keep if i == last else None)
        if keep == 0:
            return x.new_empty(x.shape[0], 0, x.shape[2])
        if not self.config.use_attn_res:
            return stream.partial
        return mix(stream.blocks, stream.partial, self.output_attn_res_proj, self.output_attn_res_norm)


class K3ForCausalLM(nn.Module):
    """K3 language model: `model` (K3Model) + untied `lm_head`. Parameter names follow the checkpoint."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        state=None,
        cu_seqlens: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        keep: int | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T] (or inputs_embeds [B, T, D]) -> logits [B, T, V] (+ loss given labels [B, T]);
        `keep`: logits of the last `keep` positions only, [B, keep, V] (inference; see K3Model.forward)."""
        ref = input_ids if input_ids is not None else inputs_embeds
        if keep is not None and (labels is not None or cu_seqlens is not None or doc_ids is not None):
            raise ValueError("keep is for inference on whole rows: no labels, cu_seqlens or doc_ids")
        ctx = make_context(ref.shape[0], ref.shape[1], cu_seqlens, doc_ids, positions)
        h = self.model(input_ids, inputs_embeds=inputs_embeds, state=state, ctx=ctx, keep=keep)
        logits = self.lm_head(self.model.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits, loss=loss)


def make_context(batch: int, seqlen: int, cu_seqlens, doc_ids, positions) -> Context:
    """Fill in whichever of cu_seqlens / doc_ids is missing so KDA and MLA see the same documents."""
    if cu_seqlens is not None and doc_ids is None:
        doc_ids = cu_seqlens_to_doc_ids(cu_seqlens, batch, seqlen)
    elif doc_ids is not None and cu_seqlens is None:
        cu_seqlens = doc_ids_to_cu_seqlens(doc_ids)
    return Context(cu_seqlens=cu_seqlens, doc_ids=doc_ids, positions=positions)
