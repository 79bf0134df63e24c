"""OCP Microscaling (MX v1.0) block formats: MXFP4 (E2M1), MXFP8 (E4M3, E5M2).

A tensor is cut into blocks of 32 consecutive elements along its last dim. Each block stores one E8M0
scale byte (a bare power of two, 2^(byte - 127), byte 255 = NaN) and 32 element codes. Quantization
(the OCP rule; see docs/mx_formats.md for the full contract):

    shared_exp = clamp(floor(log2(amax_block)) - emax_elem, -127, 127)      scale byte = shared_exp + 127
    code_i     = RNE(clamp(x_i / 2^shared_exp, -max_elem, max_elem))       (saturating, ties to even)

with emax_elem / max_elem = 2 / 6.0 (E2M1), 8 / 448 (E4M3), 15 / 57344 (E5M2). Special blocks: all zero
-> byte 0 with (signed) zero codes; any NaN or Inf in the block -> byte 255 with zero codes, which
decodes to all NaN.

MXFP4 codes are packed two per byte, element 2j in the low nibble and 2j+1 in the high one; so a
[rows, cols] weight gives `weight_packed` [rows, cols/2] and `weight_scale` [rows, cols/32], exactly
the compressed-tensors checkpoint layout (docs/spec.md#mxfp4).

This is the fast (vectorized torch) path; `k3.ops.mx_reference` holds the per-block reference with the
same signatures. All arithmetic is fp32; every scaling step multiplies by an exact power of two.
"""

from dataclasses import dataclass

import torch

BLOCK_SIZE = 32


@dataclass(frozen=True)
class MXFormat:
    """An MX element format: a sign bit plus `ebits` exponent and `mbits` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest normal value
    max_normal: float
    torch_dtype: torch.dtype | None  # float8 dtype with the same bit layout, if torch has one

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (also the exponent of the subnormal binade)."""
        return 1 - self.bias

    @property
    def codes_per_byte(self) -> int:
        return 8 // (1 + self.ebits + self.mbits)


FORMATS = {
    "mxfp4": MXFormat("mxfp4", 2, 1, 1, 2, 6.0, None),
    "mxfp8_e4m3": MXFormat("mxfp8_e4m3", 4, 3, 7, 8, 448.0, torch.float8_e4m3fn),
    "mxfp8_e5m2": MXFormat("mxfp8_e5m2", 5, 2, 15, 15, 57344.0, torch.float8_e5m2),
}

# Magnitudes of the 8 non-negative E2M1 codes (bits 0-2 of a nibble); bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def get_format(fmt: str) -> MXFormat:
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} is not an MX format; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact 2^k in fp32 for integer k in [-149, 127], built from its bit pattern (no exp2 rounding anywhere).

    Normal powers have biased exponent field k + 127; 2^-127 .. 2^-149 are subnormals, mantissa bit k + 149.
    """
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) as int32 for finite a > 0, exact also for fp32 subnormals.

    frexp writes a = m * 2^e with m in [0.5, 1), so floor(log2(a)) = e - 1 with no log2 rounding.
    """
    return torch.frexp(a)[1] - 1


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale bytes: 2^(byte - 127) in fp32, byte 255 -> NaN. scales: uint8 [...] -> fp32 [...].

    Note byte 0 is 2^-127 (an fp32 subnormal), not 0, so "put the byte in the fp32 exponent field" is
    only right for bytes 1..254.
    """
    if scales.dtype != torch.uint8:
        raise ValueError(f"scales must be uint8, got dtype {scales.dtype}")
    value = _pow2(scales.clamp(max=254).to(torch.int32) - 127)
    return torch.where(scales == 255, torch.nan, value)


def _check_input(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"x has shape {tuple(x.shape)}: MX quantization needs the last dim to be a positive multiple "
            f"of {BLOCK_SIZE}"
        )


def _block_scales(xb: torch.Tensor, f: MXFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared exponents of blocks xb: fp32 [..., nb, 32].

    Returns (scale bytes uint8 [..., nb], shared exponent int32 [..., nb], bad bool [..., nb]) where bad
    marks blocks holding a NaN or an Inf.
    """
    amax = xb.abs().amax(dim=-1)  # NaN propagates
    bad = ~torch.isfinite(amax)
    zero = amax == 0
    safe = torch.where(bad | zero, 1.0, amax)
    shared_exp = (_floor_log2(safe) - f.emax).clamp(-127, 127)
    shared_exp = torch.where(zero, -127, shared_exp)
    byte = torch.where(bad, 255, shared_exp + 127).to(torch.uint8)
    return byte, shared_exp, bad


def _encode_fp4(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 y to E2M1 (saturating at 6, RNE) and return its nibbles as uint8 (one per element).

    The magnitude code is the number of midpoints between neighbouring grid values that |y| lies above;
    a value exactly on a midpoint goes to the even code, i.e. counts the midpoint iff the lower code is odd.
    """
    a = y.abs()
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for k, (lo, hi) in enumerate(zip(FP4_E2M1_VALUES[:-1], FP4_E2M1_VALUES[1:], strict=True)):
        mid = (lo + hi) / 2
        mag += (a >= mid) if k % 2 == 1 else (a > mid)
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def _encode_elements(y: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """Element codes of fp32 y (already divided by the block scale), one uint8 per element."""
    if f.torch_dtype is None:
        return _encode_fp4(y)
    # torch's fp32 -> float8 cast is RNE but does not saturate the way MX wants (E5M2 overflows to inf),
    # so clamp first.
    return y.clamp(-f.max_normal, f.max_normal).to(f.torch_dtype).view(torch.uint8)


def pack_fp4(codes4: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte: uint8 [..., n] (values < 16, n even) -> uint8 [..., n/2].

    Element 2j goes to the low nibble of byte j, element 2j+1 to the high nibble.
    """
    if codes4.dtype != torch.uint8:
        raise ValueError(f"codes4 must be uint8, got dtype {codes4.dtype}")
    if codes4.ndim == 0 or codes4.shape[-1] % 2 != 0:
        raise ValueError(f"codes4 has shape {tuple(codes4.shape)}: the last dim must be even")
    if bool((codes4 > 15).any()):
        raise ValueError("codes4 holds values above 15, which do not fit in a nibble")
    return _pack_nibbles(codes4)


def _pack_nibbles(codes4: torch.Tensor) -> torch.Tensor:
    """pack_fp4 without the checks (they would cost a device sync inside quantize_mx)."""
    return codes4[..., 0::2] | (codes4[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: uint8 [..., m] -> uint8 [..., 2m]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got dtype {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dim")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _quantize_unpacked(x: torch.Tensor, f: MXFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float [..., n] -> (one uint8 code per element [..., n], scale bytes uint8 [..., n/32])."""
    _check_input(x)
    xb = x.float().unflatten(-1, (-1, BLOCK_SIZE))  # [..., nb, 32]
    byte, shared_exp, bad = _block_scales(xb, f)
    y = xb * _pow2(-shared_exp).unsqueeze(-1)  # exact: a power-of-two rescale
    y = torch.where(bad.unsqueeze(-1), 0.0, y)
    return _encode_elements(y, f).flatten(-2), byte


def quantize_mx(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x: float [..., n] (n a positive multiple of 32) to MX.

    Returns (codes, scales): codes uint8 [..., n/2] for mxfp4 (packed nibbles) or [..., n] for mxfp8
    (OCP E4M3FN / E5M2 bit patterns), scales uint8 [..., n/32] (E8M0 bytes).
    """
    f = get_format(fmt)
    codes, scales = _quantize_unpacked(x, f)
    return (_pack_nibbles(codes) if f.codes_per_byte == 2 else codes), scales


def _check_codes(codes: torch.Tensor, scales: torch.Tensor, f: MXFormat) -> None:
    for name, t in (("codes", codes), ("scales", scales)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got dtype {t.dtype}")
        if t.ndim == 0:
            raise ValueError(f"{name} must have at least one dim")
    n = codes.shape[-1] * f.codes_per_byte
    if codes.shape[:-1] != scales.shape[:-1] or n != scales.shape[-1] * BLOCK_SIZE:
        raise ValueError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match for {f.name} "
            f"(expected scales [..., {n // BLOCK_SIZE}] for {n} elements)"
        )


def _decode_elements(codes: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """Element values (unscaled) in fp32: uint8 codes [..., n] (one per element) -> fp32 [..., n]."""
    if f.torch_dtype is not None:
        return codes.view(f.torch_dtype).float()
    mags = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([mags, -mags])  # nibble 8 is -0.0
    return table[codes.long()]


def dequantize_mx(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode MX: codes uint8 [..., n/2] (mxfp4) or [..., n] (mxfp8), scales uint8 [..., n/32] -> [..., n].

    Value = element(code) * 2^(scale - 127), computed in fp32 then cast to dtype; a block with scale 255
    decodes to NaN. (Arbitrary bytes can overflow fp32, e.g. 6 * 2^127 -> inf; quantize_mx never makes them.)
    """
    f = get_format(fmt)
    _check_codes(codes, scales, f)
    if f.codes_per_byte == 2:
        codes = unpack_fp4(codes)
    return _dequantize_unpacked(codes, scales, f).to(dtype)


def _dequantize_unpacked(codes: torch.Tensor, scales: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """One uint8 code per element [..., n] and scale bytes [..., n/32] -> fp32 [..., n]."""
    values = _decode_elements(codes, f).unflatten(-1, (-1, BLOCK_SIZE))
    return (values * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2)


class _FakeQuantMX(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, f: MXFormat) -> torch.Tensor:
        codes, scales = _quantize_unpacked(x, f)  # no nibble packing on the QAT path
        return _dequantize_unpacked(codes, scales, f).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_out, None  # straight-through estimator


def fake_quant_mx(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize_mx(quantize_mx(x)) in x's dtype, identity (straight-through) gradient. x: [..., n]."""
    return _FakeQuantMX.apply(x, get_format(fmt))
