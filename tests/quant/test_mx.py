"""Tests for the MX formats (k3.ops.mx) against hand-made vectors and the per-block reference."""

import math

import pytest
import torch

from k3.ops import mx
from k3.ops import mx_reference as ref
from k3.ops.mx import (
    FORMATS,
    dequantize_mx,
    e8m0_to_float,
    fake_quant_mx,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)

IMPLS = {"fast": mx, "ref": ref}
FMTS = sorted(FORMATS)
NAN, INF = math.nan, math.inf


def assert_same(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Exact equality (any NaN == any NaN, but -0.0 != 0.0), reporting the first mismatch."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    if actual.is_floating_point():
        same = (actual == expected) & (actual.signbit() == expected.signbit())
        same |= actual.isnan() & expected.isnan()
    else:
        same = actual == expected
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(
            f"{name}: {int((~same).sum())} mismatches, first at {i}: "
            f"{actual[tuple(i)]} vs {expected[tuple(i)]}"
        )


def block(*values: float, fill: float = 0.0) -> torch.Tensor:
    """A [32] fp32 block starting with values, padded with fill."""
    return torch.tensor(list(values) + [fill] * (32 - len(values)), dtype=torch.float32)


def fp4_codes(x: torch.Tensor, impl=mx) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = impl.quantize_mx(x, "mxfp4")
    return unpack_fp4(codes), scales


# ---------------------------------------------------------------- MXFP4 hand-made vectors


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_every_nibble_decodes(impl):
    nibbles = torch.arange(32, dtype=torch.uint8) % 16
    out = IMPLS[impl].dequantize_mx(pack_fp4(nibbles), torch.tensor([127], dtype=torch.uint8), "mxfp4")
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = torch.tensor((mags + [-m for m in mags]) * 2)
    assert_same(out, expected, "fp4 decode")
    assert out[8].item() == 0.0 and out[8].signbit()  # nibble 8 is -0


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_round_to_nearest_ties_to_even(impl):
    # amax 6 -> shared exponent floor(log2 6) - 2 = 0, scale byte 127: values are their own element values.
    inputs = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 2.6, 4.9, 5.1, -0.25, -1.25, -5.0, 6.0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 3.0, 4.0, 6.0, -0.0, -1.0, -4.0, 6.0]
    codes, scales = IMPLS[impl].quantize_mx(block(*inputs), "mxfp4")
    assert scales.tolist() == [127]
    assert_same(dequantize_mx(codes, scales, "mxfp4")[:16], torch.tensor(expect), "fp4 RNE")
    assert unpack_fp4(codes)[:7].tolist() == [0, 2, 2, 4, 4, 6, 6]


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_saturates_and_uses_block_scale(impl):
    # amax 7.9 has floor(log2) = 2 -> exponent 0: 7.9 is above 6 * scale and clamps to 6 (code 7).
    for k in (0, 10, -20):
        x = block(7.9, -7.9, 1.0, 3.0).mul(2.0**k)
        codes, scales = fp4_codes(x, IMPLS[impl])
        assert scales.tolist() == [127 + k]
        assert codes[:4].tolist() == [7, 15, 2, 5]
        assert dequantize_mx(pack_fp4(codes), scales, "mxfp4")[:2].tolist() == [6 * 2.0**k, -6 * 2.0**k]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
def test_all_zero_block(impl, fmt):
    x = torch.cat([block(), block(1.0)])
    codes, scales = IMPLS[impl].quantize_mx(x, fmt)
    assert scales.tolist()[0] == 0
    assert bool((codes[: codes.shape[-1] // 2] == 0).all())
    assert_same(dequantize_mx(codes, scales, fmt)[:32], torch.zeros(32), "zero block")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("special", [NAN, INF, -INF])
def test_nan_and_inf_blocks_become_nan(impl, fmt, special):
    # Documented rule: a NaN or an Inf anywhere in a block makes the whole block NaN (scale byte 255).
    x = torch.stack([block(1.0, special, 2.0), block(3.0, 1.0)])
    codes, scales = IMPLS[impl].quantize_mx(x, fmt)
    assert scales[:, 0].tolist() == [255, 127 + math.floor(math.log2(3.0)) - FORMATS[fmt].emax]
    assert bool((codes[0] == 0).all())
    out = dequantize_mx(codes, scales, fmt)
    assert bool(out[0].isnan().all())
    assert out[1, :2].tolist() == [3.0, 1.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_tiny_scales(impl):
    q = IMPLS[impl].quantize_mx
    # amax 2^-125: exponent -127 exactly (byte 0), no clamping; the element is 4.
    codes, scales = q(block(2.0**-125, 2.0**-127), "mxfp4")
    assert scales.tolist() == [0] and unpack_fp4(codes)[:2].tolist() == [6, 2]
    # amax 1e-38: floor(log2) - 2 = -129 clamps to -127; 1e-38 * 2^127 = 1.70 rounds to 1.5.
    codes, scales = q(block(1e-38, -1e-38), "mxfp4")
    assert scales.tolist() == [0] and unpack_fp4(codes)[:2].tolist() == [3, 11]
    assert dequantize_mx(codes, scales, "mxfp4")[0].item() == 1.5 * 2.0**-127  # an fp32 subnormal
    # fp32 subnormal inputs: clamped exponent, elements round to (signed) zero.
    codes, scales = q(block(1e-45, -1e-40, 2.0**-149), "mxfp4")
    assert scales.tolist() == [0] and unpack_fp4(codes)[:3].tolist() == [0, 8, 0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
def test_tiny_and_subnormal_scales_all_formats(impl, fmt):
    f = FORMATS[fmt]
    x = torch.stack([block(2.0 ** (f.emax - 127), 2.0**-149), block(1e-44, 3e-41, -1e-39)])
    codes, scales = IMPLS[impl].quantize_mx(x, fmt)
    assert scales[:, 0].tolist() == [0, 0]
    out = dequantize_mx(codes, scales, fmt)
    assert out[0, 0].item() == 2.0 ** (f.emax - 127)
    # RNE error bound: half the subnormal step (2^(emin-mbits) * 2^-127), or half an ulp of the element
    step = 2.0 ** (f.emin - f.mbits - 127)
    bound = torch.maximum(torch.tensor(step / 2), x[1].abs() * 2.0 ** -(f.mbits + 1))
    assert bool(((out[1] - x[1]).abs() <= bound).all())
    assert bool((out[1] != 0).any()) == (fmt != "mxfp4")  # FP8 keeps these; FP4's 0.5 * 2^-127 is too coarse


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
def test_huge_scales(impl, fmt):
    f = FORMATS[fmt]
    fmax = torch.finfo(torch.float32).max
    x = torch.stack([block(3e38, -1e38, 1.0), block(fmax, -fmax)])
    codes, scales = IMPLS[impl].quantize_mx(x, fmt)
    assert scales[:, 0].tolist() == [127 + 127 - f.emax] * 2
    out = dequantize_mx(codes, scales, fmt)
    assert bool(out.isfinite().all())
    assert out[1, 0].item() == f.max_normal * 2.0 ** (127 - f.emax)  # saturated
    assert abs(out[0, 0].item() - 3e38) <= 3e38 * 2.0 ** -(f.mbits + 1) + 1e30


# ---------------------------------------------------------------- MXFP8 hand-made vectors


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_fp8_decode_matches_torch_bit_layout(fmt):
    """All 256 codes: the reference's bit-field decode == torch's float8 dtype == the fast dequantize."""
    f = FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.uint8)
    expected = torch.tensor([ref.decode_code(c, f) for c in range(256)], dtype=torch.float32)
    assert_same(codes.view(f.torch_dtype).float(), expected, f"{fmt} torch decode")
    scales = torch.full((8,), 127, dtype=torch.uint8)
    assert_same(dequantize_mx(codes, scales, fmt), expected, f"{fmt} dequantize")


E4M3_CASES = [  # (input with scale byte 127, expected code)
    (448.0, 0x7E),
    (-448.0, 0xFE),
    (470.0, 0x7E),  # saturates (480 does not exist in E4M3FN)
    (500.0, 0x7E),
    (2.0**-9, 0x01),  # smallest subnormal
    (2.0**-10, 0x00),  # tie between 0 and 2^-9 -> even (0)
    (3 * 2.0**-10, 0x02),  # tie between 1 and 2 (x 2^-9) -> even
    (7 * 2.0**-9, 0x07),  # largest subnormal
    (15 * 2.0**-10, 0x08),  # tie between the largest subnormal and the smallest normal -> even
    (2.0**-6, 0x08),
    (1.0625, 0x38),  # tie between 1.0 and 1.125 -> 1.0
    (1.1875, 0x3A),  # tie between 1.125 and 1.25 -> 1.25
    (-0.0, 0x80),
]

E5M2_CASES = [
    (57344.0, 0x7B),
    (60000.0, 0x7B),  # saturates instead of overflowing to inf
    (-61440.0, 0xFB),
    (2.0**-16, 0x01),
    (2.0**-17, 0x00),
    (3 * 2.0**-17, 0x02),
    (2.0**-14, 0x04),
    (1.125, 0x3C),
    (1.375, 0x3E),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "fmt,cases,amax", [("mxfp8_e4m3", E4M3_CASES, 448.0), ("mxfp8_e5m2", E5M2_CASES, 57344.0)]
)
def test_fp8_vectors(impl, fmt, cases, amax):
    # Each case sits in a block whose amax (448 / 57344, or the case itself) gives exponent 0.
    x = torch.stack([block(v, amax) for v, _ in cases])
    codes, scales = IMPLS[impl].quantize_mx(x, fmt)
    assert scales[:, 0].tolist() == [127] * len(cases)
    assert codes[:, 0].tolist() == [c for _, c in cases]


# ---------------------------------------------------------------- properties


def grid_ties(fmt: str) -> torch.Tensor:
    """Midpoints between consecutive non-negative element values below 2^emax (exact RNE ties): fp32 [M]."""
    f = FORMATS[fmt]
    values = sorted({ref.decode_code(c, f) for c in range(1 << (f.ebits + f.mbits))} - {NAN})
    values = [v for v in values if 0 <= v < 2.0**f.emax]
    return torch.tensor([(a + b) / 2 for a, b in zip(values[:-1], values[1:], strict=True)])


def random_blocks(shape, fmt: str, seed: int, special: bool) -> torch.Tensor:
    """Random fp32 [*shape]: per-block magnitudes over 2^-60..2^60, ~20% of elements on exact element-grid
    ties (kept below the block amax so the scale is unchanged), and optionally an all-zero block, NaN and
    -Inf blocks, and a block of fp32 subnormals and -0.0."""
    g = torch.Generator().manual_seed(seed)
    nb = shape[-1] // 32
    x = torch.randn((*shape[:-1], nb, 32), generator=g)
    x = x * torch.exp2(torch.randint(-60, 61, (*shape[:-1], nb, 1), generator=g).float())
    shared_exp = torch.frexp(x.abs().amax(-1, keepdim=True))[1] - 1 - FORMATS[fmt].emax
    ties = grid_ties(fmt)
    tie = ties[torch.randint(0, len(ties), x.shape, generator=g)] * torch.exp2(shared_exp.float())
    tie = torch.where(torch.rand(x.shape, generator=g) < 0.5, -tie, tie)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.2, tie, x)
    if special:
        flat = x.reshape(-1, 32)
        flat[0] = 0.0
        flat[-1, 3] = NAN
        if flat.shape[0] > 2:
            flat[1, 5] = -INF
            flat[2] = torch.tensor([1e-45, -1e-42, -0.0, 2e-39] * 8)
        x = flat.reshape(x.shape)
    return x.flatten(-2)


SHAPES = [(32,), (3, 64), (2, 3, 96), (4, 256)]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("special", [False, True], ids=["plain", "special"])
def test_fast_matches_reference(fmt, shape, special):
    x = random_blocks(shape, fmt, seed=len(shape) * 100 + shape[-1], special=special)
    codes, scales = mx.quantize_mx(x, fmt)
    ref_codes, ref_scales = ref.quantize_mx(x, fmt)
    assert_same(codes, ref_codes, f"{fmt} codes")
    assert_same(scales, ref_scales, f"{fmt} scales")
    per_byte = FORMATS[fmt].codes_per_byte
    assert codes.shape == (*shape[:-1], shape[-1] // per_byte) and scales.shape == (
        *shape[:-1],
        shape[-1] // 32,
    )
    assert_same(mx.dequantize_mx(codes, scales, fmt), ref.dequantize_mx(codes, scales, fmt), f"{fmt} dequant")


@pytest.mark.parametrize("fmt", FMTS)
def test_fast_dequantize_matches_reference_on_arbitrary_bytes(fmt):
    g = torch.Generator().manual_seed(7)
    per_byte = FORMATS[fmt].codes_per_byte
    codes = torch.randint(0, 256, (6, 128 // per_byte), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (6, 4), generator=g, dtype=torch.uint8)
    scales[0] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)
    assert_same(mx.dequantize_mx(codes, scales, fmt), ref.dequantize_mx(codes, scales, fmt), f"{fmt} dequant")


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_dequantize_idempotent(fmt):
    x = random_blocks((8, 128), fmt, seed=3, special=True)
    codes, scales = quantize_mx(x, fmt)
    codes2, scales2 = quantize_mx(dequantize_mx(codes, scales, fmt), fmt)
    assert_same(codes2, codes, "codes")
    assert_same(scales2, scales, "scales")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quant_forward_and_straight_through_gradient(fmt, dtype):
    x = (torch.randn(4, 64) * 3).to(dtype).requires_grad_()
    y = fake_quant_mx(x, fmt)
    assert y.dtype == dtype
    assert_same(y.detach(), dequantize_mx(*quantize_mx(x.detach(), fmt), fmt, dtype=dtype), "fake quant")
    assert not torch.equal(y.detach(), x.detach())  # it does quantize
    grad = torch.randn(4, 64).to(dtype)
    y.backward(grad)
    assert_same(x.grad, grad, "STE grad")


def test_pack_unpack_round_trip_and_layout():
    assert pack_fp4(torch.tensor([0x1, 0x2, 0xF, 0x8], dtype=torch.uint8)).tolist() == [0x21, 0x8F]
    assert unpack_fp4(torch.tensor([0x21, 0x8F], dtype=torch.uint8)).tolist() == [0x1, 0x2, 0xF, 0x8]
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 16), generator=g, dtype=torch.uint8)
    assert_same(pack_fp4(unpack_fp4(packed)), packed, "pack(unpack)")
    nibbles = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    assert_same(unpack_fp4(pack_fp4(nibbles)), nibbles, "unpack(pack)")


def test_checkpoint_layout_matches_spec_decode_rule():
    """A [rows, cols] weight gives weight_packed [rows, cols/2] and weight_scale [rows, cols/32]
    (docs/spec.md#mxfp4), and W[r, c] = ±mag(nibble) * 2^(scale[r, c // 32] - 127) with nibble from packed[r,
    c // 2]."""
    w = torch.randn(24, 96) * 0.02
    packed, scale = quantize_mx(w, "mxfp4")
    assert packed.shape == (24, 48) and scale.shape == (24, 3)
    assert packed.dtype == scale.dtype == torch.uint8
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    deq = dequantize_mx(packed, scale, "mxfp4")
    for r, c in [(0, 0), (0, 1), (5, 33), (23, 95), (11, 64), (11, 63)]:
        byte = int(packed[r, c // 2])
        nib = byte & 0xF if c % 2 == 0 else byte >> 4
        value = (-1.0 if nib & 8 else 1.0) * mags[nib & 7] * 2.0 ** (int(scale[r, c // 32]) - 127)
        assert deq[r, c].item() == value


def test_e8m0_decode():
    b = torch.arange(256, dtype=torch.uint8)
    out = e8m0_to_float(b)
    assert out.dtype == torch.float32
    assert out[:255].tolist() == [math.ldexp(1.0, i - 127) for i in range(255)]
    assert out[0].item() == 2.0**-127 and out[127].item() == 1.0 and out[254].item() == 2.0**127
    assert math.isnan(out[255].item())


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_raise(impl):
    q = IMPLS[impl].quantize_mx
    with pytest.raises(ValueError, match="mxfp6"):
        q(torch.zeros(32), "mxfp6")
    with pytest.raises(ValueError, match="nvfp4"):
        IMPLS[impl].dequantize_mx(
            torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), "nvfp4"
        )
    with pytest.raises(ValueError, match=r"\(4, 33\)"):
        q(torch.zeros(4, 33), "mxfp4")
    with pytest.raises(ValueError, match=r"\(2, 0\)"):
        q(torch.zeros(2, 0), "mxfp8_e4m3")
    with pytest.raises(ValueError):
        q(torch.tensor(1.0), "mxfp4")
    with pytest.raises(ValueError, match="fmt"):
        fake_quant_mx(torch.zeros(32), "fp4")


def test_bad_codes_raise():
    u8 = torch.uint8
    with pytest.raises(ValueError, match="scales"):
        dequantize_mx(torch.zeros(4, 16, dtype=u8), torch.zeros(4, 2, dtype=u8), "mxfp4")
    with pytest.raises(ValueError, match="codes"):
        dequantize_mx(torch.zeros(4, 32), torch.zeros(4, 1, dtype=u8), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="codes4"):
        pack_fp4(torch.zeros(31, dtype=u8))
    with pytest.raises(ValueError, match="15"):
        pack_fp4(torch.full((2,), 16, dtype=u8))
    with pytest.raises(ValueError, match="uint8"):
        e8m0_to_float(torch.zeros(3))
