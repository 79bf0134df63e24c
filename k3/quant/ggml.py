"""GGML tensor encodings that k3 reads from a GGUF file, decoded in torch.

    TYPES                                   the GGML type names k3 decodes, by GGML type id
    decode(raw, type_name, shape)           stored bytes -> float32 tensor of `shape` (torch order)
    mxfp4_to_packed(raw, shape)             MXFP4 blocks -> k3's (weight_packed, weight_scale), no decode

`raw` is the tensor's bytes as the file stores them: uint8 [N * row_bytes] for a tensor whose torch shape
is `shape` = [..., n] (ggml's ne0, the fastest dimension, is the last torch dimension n). Each row of n
elements is stored as n / B blocks of B elements:

    F32, F16, BF16   one element per 4 / 2 / 2 bytes (BF16: the upper half of an fp32)
    Q8_0   34 bytes / 32 elements: fp16 scale d, 32 int8 q           value = d * q
    Q4_0   18 bytes / 32 elements: fp16 scale d, 16 bytes of nibbles value = d * (q - 8)
    MXFP4  17 bytes / 32 elements: E8M0 scale byte e, 16 bytes of E2M1 nibbles; value = 2^(e-127) * fp4(q)

In the nibble formats element j of a block is the low nibble of byte j and element j + 16 its high
nibble. k3's own MXFP4 layout (`k3.ops.mx`) packs elements 2j / 2j+1 into byte j and keeps the scales
apart, so `mxfp4_to_packed` only moves nibbles. Every decode is exact in fp32: a product of an 8-bit
integer (or an FP4 value) and an fp16 scale (or a power of two) fits in fp32's 24-bit significand. The
one departure from ggml: an MXFP4 scale byte of 255 (which no quantizer writes for finite weights)
decodes to NaN, as `k3.ops.mx` defines it.
"""

import torch

from k3.ops.mx import dequantize_mx

BLOCK = 32
# GGML type id -> name, for the types k3 decodes
TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 39: "MXFP4"}
# name -> (elements per block, bytes per block)
BLOCK_SIZES = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (BLOCK, 2 + BLOCK),
    "Q4_0": (BLOCK, 2 + BLOCK // 2),
    "MXFP4": (BLOCK, 1 + BLOCK // 2),
}


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of one stored row of n elements; ValueError if n is not a whole number of blocks."""
    per, size = BLOCK_SIZES[type_name]
    if n % per:
        raise ValueError(f"a {type_name} row holds whole blocks of {per} elements, got a row of {n}")
    return n // per * size


def _blocks(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw uint8 -> [..., n / B, block bytes], checking the byte count against `shape`."""
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw must be uint8 bytes, got {raw.dtype}")
    per, size = BLOCK_SIZES[type_name]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    want = rows * row_bytes(type_name, shape[-1])
    if raw.numel() != want:
        raise ValueError(f"{type_name} {list(shape)} needs {want} bytes, got {raw.numel()}")
    return raw.reshape(*shape[:-1], shape[-1] // per, size)


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] (little-endian fp16) -> fp32 [...]."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] -> [..., 32]: low nibbles (elements 0..15) then high nibbles (16..31)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def decode(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Stored bytes of a `type_name` tensor -> float32 [*shape] (a new tensor; `raw` is not kept)."""
    if type_name not in BLOCK_SIZES:
        raise ValueError(f"GGML type {type_name} is not one k3 decodes ({', '.join(BLOCK_SIZES)})")
    shape = tuple(int(s) for s in shape)
    b = _blocks(raw, type_name, shape)
    if type_name == "F32":
        return b.contiguous().view(torch.float32).reshape(shape).clone()
    if type_name == "F16":
        return b.contiguous().view(torch.float16).reshape(shape).float()
    if type_name == "BF16":
        return b.contiguous().view(torch.bfloat16).reshape(shape).float()
    if type_name == "Q8_0":
        d = _fp16(b[..., :2])
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * d.unsqueeze(-1)).reshape(shape)
    if type_name == "Q4_0":
        d = _fp16(b[..., :2])
        q = _nibbles(b[..., 2:]).float() - 8
        return (q * d.unsqueeze(-1)).reshape(shape)
    packed, scales = mxfp4_to_packed(raw, shape)
    return dequantize_mx(packed, scales, "mxfp4", torch.float32)


def q8_0_blocks(raw: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks of a [..., n] tensor -> (codes int8 [..., n], scales fp32 [..., n/32]), undecoded: the
    layout of k3.quant.q8.Q8Linear (value = code * scale, exact in fp32)."""
    shape = tuple(int(s) for s in shape)
    b = _blocks(raw, "Q8_0", shape)
    d = _fp16(b[..., :2])
    q = b[..., 2:].contiguous().view(torch.int8)
    return q.reshape(shape).clone(), d.reshape(*shape[:-1], shape[-1] // BLOCK).float().contiguous()


def mxfp4_to_packed(raw: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks of a [..., n] tensor -> (weight_packed uint8 [..., n/2], weight_scale uint8 [..., n/32]),
    the layout of `k3.ops.mx.quantize_mx` and of k3's packed experts; the codes are not decoded."""
    shape = tuple(int(s) for s in shape)
    b = _blocks(raw, "MXFP4", shape)
    scales = b[..., 0].contiguous()
    codes = _nibbles(b[..., 1:])  # [..., nb, 32], element order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2j low, 2j+1 high
    return packed.reshape(*shape[:-1], shape[-1] // 2).contiguous(), scales
