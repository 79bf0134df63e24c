"""Per-layer inference state, owned by the caller and passed into the layers
(CONTRIBUTING.md#the-engine-owns-the-caches).

Nothing here is a module buffer: a layer receives its state object, reads the history from it and writes
the updated history back into it (attribute assignment / `append`). The engine substitutes paged
variants: KDA's by gathering slots into a `KDAState`, MLA's by implementing `MLACache`.

Interface a layer relies on (B = sequences in the batch; with packed documents, i.e. `cu_seqlens` given to
a KDA layer, B is the number of documents N):

KDA layer (`KDAState`), C_q = C_k = H*K, C_v = H*V, W = short_conv_kernel_size:
    reads   conv_q, conv_k, conv_v   [B, C, W-1] model dtype, last W-1 pre-conv inputs; None = no history
            recurrent                [B, H, K, V] fp32 delta-rule state S;              None = zeros
    writes  the same four attributes after the call (new tensors; the old ones are not modified in place)
    optional: capture_at [B] positions inside the call -> captured (the four states after p tokens)

MLA layer: any `MLACache` (below: the dense `MLAState` here, the engine's paged states in
k3.infer.cache.paged_mla). The layer picks its path from the protocol's two attributes, never by probing.

The dense `MLAState` keeps all rows at one length; ragged batches are the paged engine's (k3.infer).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from k3.config import K3Config


@dataclass
class KDAState:
    """Conv histories [B, C, W-1] (model dtype) and recurrent state [B, H, K, V] (fp32); None = empty."""

    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None
    # set by the caller for the next call only: per row, a position p with 0 < p < T of that call's T
    # tokens (or -1); the layer then also leaves the state after exactly the first p tokens of that row
    # in `captured` and clears `capture_at`. The engine snapshots an aligned position inside a prefill
    # chunk this way instead of ending the chunk there (one forward instead of two).
    capture_at: list[int] | None = None
    captured: KDAState | None = None  # [B, ...] tensors; rows without a capture hold their final state

    @classmethod
    def zeros(cls, config: K3Config, batch_size: int, device=None, dtype=torch.bfloat16) -> KDAState:
        """An allocated all-zero state (equivalent to the empty one)."""
        la = config.linear_attn_config
        C, W = la.num_heads * la.head_dim, la.short_conv_kernel_size
        conv = lambda: torch.zeros(batch_size, C, W - 1, device=device, dtype=dtype)
        rec = torch.zeros(
            batch_size, la.num_heads, la.head_dim, la.head_dim, device=device, dtype=torch.float32
        )
        return cls(conv_q=conv(), conv_k=conv(), conv_v=conv(), recurrent=rec)


class MLACache:
    """The MLA state protocol, R = kv_lora_rank, Dr = qk_rope_head_dim, L = R + Dr (latent width); each
    latent row is [RMSNorm(c_kv) | k_pe] (k_pe rotated only in the RoPE ablation).

    Per forward of T tokens the layer calls exactly one of `append` (dense attention) or `write` then
    `blocks` (online softmax over key blocks, when the attention exceeds k3.model.mla.DENSE_MAX_SCORES);
    either advances `length` (and `lengths`) by T. A state with `attends_decode` takes one-token rows
    itself instead (`decode_attention`), which a compiled decode step traces without host reads."""

    # per-row cached lengths c_b, long [B] (a ragged batch): row b's query t is key c_b + t, `length` is
    # max(c_b) and `append` returns [B, max(c_b) + T, L], row b valid up to c_b + T. None: one length.
    lengths: torch.Tensor | None = None
    # True: with T == 1 the layer calls `decode_attention` instead of append / write
    attends_decode: bool = False

    @property
    def length(self) -> int:
        """Tokens already cached (the causal offset of the new queries)."""
        raise NotImplementedError

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """new [B, T, L] -> all latents [B, length + T, L]."""
        raise NotImplementedError(f"{type(self).__name__} has no dense append")

    def write(self, new: torch.Tensor) -> None:
        """Store new [B, T, L] without gathering (the streaming path's first half)."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming write")

    def blocks(self, block_size: int) -> Iterator[torch.Tensor]:
        """-> latents [B, <= block_size, L] over keys [0, length) in order, each read straight from
        storage: the online-softmax path never holds all keys at once."""
        raise NotImplementedError(f"{type(self).__name__} has no key blocks")

    def decode_attention(self, q_nope, q_pe, new, w_uk, w_uv, scale: float) -> torch.Tensor:
        """q_nope [B, 1, H, Dn], q_pe [B, 1, H, Dr], new [B, 1, L] -> o [B, 1, H, Dv]: store `new` as key
        c_b of row b and return the absorbed attention of the row's query over keys 0..c_b
        (k3.ops.mla.mla_attention_absorbed). Only where `attends_decode`."""
        raise NotImplementedError(f"{type(self).__name__} does not attend itself")


@dataclass
class MLAState(MLACache):
    """Cached latents [B, S, kv_lora_rank + qk_rope_head_dim] = [RMSNorm(c_kv) | k_pe] per token."""

    latent: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """new [B, T, R+Dr] -> the whole cache [B, S, R+Dr] after appending (S = length + T)."""
        if self.latent is not None and (
            new.shape[0] != self.latent.shape[0] or new.shape[2] != self.latent.shape[2]
        ):
            raise ValueError(
                f"new latents {tuple(new.shape)} do not match the cache {tuple(self.latent.shape)}"
            )
        self.latent = (
            new if self.latent is None else torch.cat([self.latent, new.to(self.latent.dtype)], dim=1)
        )
        return self.latent

    def write(self, new: torch.Tensor) -> None:
        """Append without returning the cache (the streaming half of the interface)."""
        self.append(new)

    def blocks(self, block_size: int):
        """-> cached latents [B, <= block_size, R+Dr] in key order (views, no copy)."""
        for s0 in range(0, self.length, block_size):
            yield self.latent[:, s0 : s0 + block_size]

    @classmethod
    def zeros(cls, config: K3Config, batch_size: int, device=None, dtype=torch.bfloat16) -> MLAState:
        """An allocated empty cache [B, 0, R+Dr]."""
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return cls(latent=torch.zeros(batch_size, 0, width, device=device, dtype=dtype))


class ModelState(list):
    """One state per decoder layer (KDAState or MLAState, by `config.is_kda_layer`)."""

    @classmethod
    def empty(cls, config: K3Config, batch_size: int | None = None, device=None, dtype=None) -> ModelState:
        """Lazy empty states (tensors None, filled by the first prefill), or zero-allocated ones when
        `batch_size` is given (dtype defaults to config.dtype)."""
        if batch_size is None:
            return cls(
                KDAState() if config.is_kda_layer(i) else MLAState() for i in range(config.num_hidden_layers)
            )
        dtype = dtype or getattr(torch, config.dtype)
        return cls(
            (KDAState if config.is_kda_layer(i) else MLAState).zeros(config, batch_size, device, dtype)
            for i in range(config.num_hidden_layers)
        )
