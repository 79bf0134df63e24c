"""K3 checkpoints: the official safetensors layout (docs/spec.md#tensors) <-> our in-memory state_dict.

`adapter` holds the pure name/layout conversion (`to_official`, `from_official`); `io` reads and writes
checkpoint directories (config.json + safetensors shards, atomically, never via pickle). See
docs/interop.md.
"""

from k3.checkpoint.adapter import from_official, is_f32_tensor, split_multimodal, to_official
from k3.checkpoint.io import (
    check_state_dict,
    load_checkpoint,
    load_official_tensors,
    load_state_dict_from_dir,
    save_checkpoint,
)

__all__ = [
    "check_state_dict",
    "from_official",
    "is_f32_tensor",
    "load_checkpoint",
    "load_official_tensors",
    "load_state_dict_from_dir",
    "save_checkpoint",
    "split_multimodal",
    "to_official",
]
