"""Kimi Delta Attention (KDA) ops: fast chunked form, decode recurrence, and the token-loop reference.

Shapes (fla / transformers conventions): q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [B, H, K, V] fp32 (one per document, [N, H, K, V], with cu_seqlens).
"""

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.recurrent import recurrent_kda
from k3.ops.kda.reference import recurrent_kda_reference

__all__ = ["chunk_kda", "recurrent_kda_reference", "recurrent_kda"]
