"""What `k3 export` reads: a checkpoint, a run folder, or a DCP training checkpoint, resolved to weights.

Accepted inputs, tried in this order:

* a checkpoint directory: `config.json` + `model.safetensors` (or shards + index) — a finished run
  folder, a training checkpoint `checkpoints/step-N/`, a `k3 quantize` output, a release folder;
* a run folder without top-level weights (stopped or killed before the end): its latest complete
  `checkpoints/step-N/`;
* a DCP checkpoint written by distributed training (`k3 train --nproc N`).

The tokenizer is taken from the resolved checkpoint, else from the run folder above it.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from k3.checkpoint.io import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, load_checkpoint
from k3.config import K3Config

_TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")


@dataclass
class Source:
    model: torch.nn.Module  # K3ForCausalLM, weights as stored (MXFP4 experts decoded exactly)
    config: K3Config
    checkpoint: Path  # the directory the weights came from
    tokenizer_dir: Path | None  # where tokenizer.json / tiktoken.model live, if anywhere


def has_weights(path: Path) -> bool:
    return (path / CONFIG_NAME).exists() and ((path / SINGLE_NAME).exists() or (path / INDEX_NAME).exists())


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The directory holding the weights that `path` names (see the module docstring)."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p} is not a directory (expected a checkpoint, a run folder or a DCP checkpoint)")
    if has_weights(p) or _is_dcp(p):
        return p
    steps = sorted(
        (int(d.name.split("-")[1]), d)
        for d in (p / "checkpoints").glob("step-*")
        if d.name.split("-")[1].isdigit() and has_weights(d)
    )
    if steps:
        return steps[-1][1]
    raise ValueError(
        f"{p} holds no checkpoint: no {CONFIG_NAME} + {SINGLE_NAME} (or {INDEX_NAME}), no "
        "checkpoints/step-N/ of a run, and no DCP checkpoint"
    )


def load_source(path: str | Path) -> Source:
    """Resolve `path` and load its model on the CPU."""
    ckpt = resolve_checkpoint_dir(path)
    if _is_dcp(ckpt):
        from k3.parallel.dcp import load_model_no_dist

        model, config, _ = load_model_no_dist(ckpt)
    else:
        model, config = load_checkpoint(ckpt)
    return Source(model.eval(), config, ckpt, _tokenizer_dir(ckpt, Path(path)))


def _is_dcp(path: Path) -> bool:
    from k3.parallel.dcp import is_dcp_checkpoint

    return is_dcp_checkpoint(path)


def _tokenizer_dir(ckpt: Path, given: Path) -> Path | None:
    for d in (ckpt, given, *ckpt.parents[:3]):
        if any((d / f).exists() for f in _TOKENIZER_FILES):
            return d
    return None
