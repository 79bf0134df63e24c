"""Vision for K3: configs and presets, image decoding with limits, pre-processing, media placeholder
expansion, the synthetic image-text task and `--data` folders. The tower itself is `k3.model.vision`,
the VL model `k3.model.multimodal`. Importing this package loads nothing heavy (no torch, no Pillow).
"""
