"""Quantization: OCP MX block formats (MXFP4 / MXFP8) used for K3's routed experts and QAT.

`k3.quant.mx` is the fast path; `k3.quant.mx_reference` the per-block reference it is tested against.
"""

from k3.quant.mx import (
    BLOCK_SIZE,
    FORMATS,
    MXFormat,
    dequantize_mx,
    e8m0_to_float,
    fake_quant_mx,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)

__all__ = [
    "BLOCK_SIZE",
    "FORMATS",
    "MXFormat",
    "dequantize_mx",
    "e8m0_to_float",
    "fake_quant_mx",
    "pack_fp4",
    "quantize_mx",
    "unpack_fp4",
]
