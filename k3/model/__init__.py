"""Single-device K3 model math (no torch.distributed, no caches-as-buffers)."""
