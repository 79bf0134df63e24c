"""k3: the Kimi K3 architecture, training recipe, MX quantization and inference in PyTorch."""

__version__ = "0.1.0"
