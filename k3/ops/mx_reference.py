"""Plain reference for k3.ops.mx: one block at a time, written for clarity, not speed.

Independent of the fast path in how it computes: element values come from decoding the bit fields
(sign / exponent / mantissa) of every code, rounding is an exhaustive nearest-grid-value search with
ties going to the even code, scales come from Python's math.frexp, and the arithmetic is float64.
Only the format constants (bit widths, bias, emax, max) are shared with k3.ops.mx.
"""

import math

import torch

from k3.ops.mx import BLOCK_SIZE, MXFormat, get_format


def decode_code(code: int, f: MXFormat) -> float:
    """The value of one element code (an int holding 1 + ebits + mbits bits), following OCP MX v1.0."""
    sign = -1.0 if (code >> (f.ebits + f.mbits)) & 1 else 1.0
    field = (code >> f.mbits) & ((1 << f.ebits) - 1)
    mant = code & ((1 << f.mbits) - 1)
    top = (1 << f.ebits) - 1
    if f.name == "mxfp8_e4m3" and field == top and mant == (1 << f.mbits) - 1:
        return math.nan  # E4M3FN: S.1111.111 is NaN, there is no inf
    if f.name == "mxfp8_e5m2" and field == top:
        return sign * math.inf if mant == 0 else math.nan  # IEEE-like special exponent
    if field == 0:  # subnormal: 0.mant * 2^emin
        return sign * math.ldexp(mant, f.emin - f.mbits)
    return sign * math.ldexp((1 << f.mbits) + mant, field - f.bias - f.mbits)


def _grid(f: MXFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """All finite non-negative element values up to max_normal and their codes: float64 [G], int64 [G]."""
    pairs = [(decode_code(c, f), c) for c in range(1 << (f.ebits + f.mbits))]
    pairs = [(v, c) for v, c in pairs if math.isfinite(v) and v <= f.max_normal]
    return torch.tensor([v for v, _ in pairs], dtype=torch.float64), torch.tensor([c for _, c in pairs])


def _round_to_code(y: float, values: torch.Tensor, codes: torch.Tensor, f: MXFormat) -> int:
    """Code of the representable value nearest to y (after saturating), ties to the even code."""
    a = min(abs(y), f.max_normal)
    dist = (values - a).abs()
    candidates = codes[dist == dist.min()].tolist()
    mag = next((c for c in candidates if c % 2 == 0), candidates[0])
    negative = math.copysign(1.0, y) < 0  # -0.0 and tiny negatives keep their sign bit
    return mag | (int(negative) << (f.ebits + f.mbits))


def _quantize_block(block: list[float], f: MXFormat, grid) -> tuple[list[int], int]:
    """One block of 32 floats -> (32 element codes, scale byte)."""
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return [0] * BLOCK_SIZE, 255
    amax = max(abs(v) for v in block)
    if amax == 0:
        return [_round_to_code(v, *grid, f) for v in block], 0
    _, e = math.frexp(amax)  # amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1
    shared_exp = min(max(e - 1 - f.emax, -127), 127)
    codes = [_round_to_code(math.ldexp(v, -shared_exp), *grid, f) for v in block]
    return codes, shared_exp + 127


def quantize_mx(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of k3.ops.mx.quantize_mx: float [..., n] -> (codes uint8, scales uint8 [..., n/32])."""
    f = get_format(fmt)
    if not x.is_floating_point() or x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(f"x has shape {tuple(x.shape)} / dtype {x.dtype}: need float, last dim % 32 == 0")
    blocks = x.float().reshape(-1, BLOCK_SIZE).double().tolist()
    grid = _grid(f)
    all_codes, all_scales = [], []
    for block in blocks:
        codes, scale = _quantize_block(block, f, grid)
        if f.codes_per_byte == 2:
            codes = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(BLOCK_SIZE // 2)]
        all_codes.append(codes)
        all_scales.append(scale)
    lead = tuple(x.shape[:-1])
    codes_t = torch.tensor(all_codes, dtype=torch.uint8).reshape(*lead, -1)
    scales_t = torch.tensor(all_scales, dtype=torch.uint8).reshape(*lead, -1)
    return codes_t, scales_t


def dequantize_mx(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reference of k3.ops.mx.dequantize_mx: value = decode(code) * 2^(scale - 127); scale 255 -> NaN."""
    f = get_format(fmt)
    flat_codes = codes.reshape(-1, codes.shape[-1]).tolist()
    flat_scales = scales.reshape(-1, scales.shape[-1]).tolist()
    rows = []
    for row_codes, row_scales in zip(flat_codes, flat_scales, strict=True):
        if f.codes_per_byte == 2:
            row_codes = [nib for byte in row_codes for nib in (byte & 0xF, byte >> 4)]
        row = []
        for i, code in enumerate(row_codes):
            s = row_scales[i // BLOCK_SIZE]
            row.append(math.nan if s == 255 else decode_code(code, f) * math.ldexp(1.0, s - 127))
        rows.append(row)
    out = torch.tensor(rows, dtype=torch.float64).float()  # the fast path multiplies in fp32
    return out.reshape(*codes.shape[:-1], -1).to(dtype)
