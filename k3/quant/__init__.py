"""Quantization on top of the MX block formats (the formats' maths is `k3.ops.mx`, with its per-block
reference `k3.ops.mx_reference`): QAT by module swap (`k3.quant.qat`), packed MXFP4 experts for inference
(`k3.quant.packed`), MXFP4 checkpoints (`k3.quant.checkpoint`) and GGML's MXFP4 layout (`k3.quant.ggml`).
"""
