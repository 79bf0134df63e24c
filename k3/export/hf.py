"""`k3 export --format hf`: any checkpoint k3 reads -> a folder in the release layout (docs/spec.md#config,
docs/spec.md#tensors).

The output is what the released Kimi K3 ships, at this model's size: config.json with the
`KimiK3ForConditionalGeneration` wrapper around `text_config`, safetensors under the official names,
MXFP4 experts in the compressed-tensors layout when the source is quantized (with its
`quantization_config` inside `text_config`), and the tokenizer files with the chat template. Loading the
old bare layout and exporting it is how a pre-release run folder is brought up to date.
"""

from pathlib import Path

import torch

from k3.checkpoint.io import save_checkpoint
from k3.export.source import Source
from k3.tokenizer import K3Tokenizer

DTYPES = {"keep": None, "bf16": torch.bfloat16, "f32": torch.float32}
# files beside the weights that travel with a checkpoint unchanged
_PASSENGERS = ("preprocessor_config.json", "generation_config.json")


def export_hf(source: Source, out_dir: str | Path, dtype: str = "keep") -> Path:
    """Write `source` to `out_dir` in the release layout; returns the directory (written atomically)."""
    from k3.quant.checkpoint import is_mxfp4_config, save_mxfp4_checkpoint

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source.config.check_release("export")
    extra = {n: source.checkpoint / n for n in _PASSENGERS if (source.checkpoint / n).exists()}
    if is_mxfp4_config(source.config):
        out = save_mxfp4_checkpoint(
            source.model, source.config, out_dir, dtype=DTYPES[dtype], extra_files=extra
        )
    else:
        out = save_checkpoint(source.model, source.config, out_dir, dtype=DTYPES[dtype], extra_files=extra)
    if source.tokenizer_dir is not None:
        K3Tokenizer.from_dir(source.tokenizer_dir).save(out)
    return Path(out)
