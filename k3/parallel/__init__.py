"""Distributed training on torch.distributed: dp x ep DeviceMesh, static-shape expert parallelism,
histogram Quantile Balancing, FSDP2, Per-Head Muon on DTensors, DCP checkpoints (docs/distributed.md).

Order of application (apply.parallelize): EP -> histogram QB -> FSDP2. The model code stays single-device.
"""
