"""Image inputs for K3, below the model: configs and presets, image decoding with limits, pre-processing,
media placeholder expansion, the synthetic image-text task and `--data` folders. The tower is
`k3.model.vision`, the VL model `k3.model.multimodal`; VL checkpoints are `k3.checkpoint.vl`, VL training
`k3.train.vl`, the engine's vision front end `k3.infer.vision`, the through-the-server accuracy check
`k3.serve.vl_eval`. Importing this package loads nothing heavy (no torch, no Pillow).
"""
