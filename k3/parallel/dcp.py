"""Training checkpoints through torch.distributed.checkpoint (DCP), and `k3 export` to the official layout.

A DCP checkpoint directory holds the model and optimizer state as DTensor shards with their global
shapes (dense weights, the [E, I, Dl] expert stacks, Muon momentum and AdamW moments), plus `step`, and
`config.json` written by rank 0. DCP reshards on load, so a run saved on N ranks resumes on M ranks (any
dp x ep layout whose ep divides E) -- or on a plain single-device model (`load_model_no_dist`).

`k3 export DCP_DIR --out DIR` loads the weights into an unsharded model on the CPU (no process group)
and writes the official safetensors checkpoint via k3.checkpoint (optionally in bf16).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from k3.config import K3Config

CONFIG_NAME = "config.json"


def save_dcp(path: str | Path, model: nn.Module, optimizers: list, step: int, config: K3Config) -> Path:
    """Collective: every rank writes its shards of model + optimizers + step into `path`."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        config.save(path / CONFIG_NAME)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_dcp(path: str | Path, model: nn.Module, optimizers: list) -> int:
    """Collective: load a DCP checkpoint into the (already parallelized) model and optimizers, resharding
    to this run's layout; returns the saved step."""
    model_sd, optim_sd = get_state_dict(model, optimizers)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = sorted(f"model.{k}" for k in model_sd if f"model.{k}" not in saved)
    if missing:
        raise ValueError(f"checkpoint {path} lacks model tensors {missing[:5]}")
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    # Partial: parameters that never had a gradient (layer 0's unused AttnRes query) have no saved
    # optimizer state; they keep the freshly initialised (zero) one.
    dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def load_model_no_dist(path: str | Path, device: str = "cpu") -> tuple[nn.Module, K3Config, int]:
    """The unsharded K3ForCausalLM (weights only) of a DCP checkpoint, without a process group."""
    from k3.model.transformer import K3ForCausalLM

    config = K3Config.load(Path(path) / CONFIG_NAME)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.to_empty(device=device)
    state = {"model": model.state_dict(), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
    return model, config, int(state["step"])


# ---- k3 export ----------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.description = "Consolidate a DCP training checkpoint into the official safetensors layout."
    parser.add_argument("checkpoint", help="a DCP checkpoint directory written by k3.parallel")
    parser.add_argument("--out", required=True, help="output directory (official config.json + safetensors)")
    parser.add_argument("--dtype", choices=("keep", "bf16"), default="keep")


def run(args) -> int:
    from k3.checkpoint.io import save_checkpoint

    if not (Path(args.checkpoint) / CONFIG_NAME).exists():
        raise ValueError(f"checkpoint: {args.checkpoint} has no {CONFIG_NAME}; not a k3 DCP checkpoint")
    model, config, step = load_model_no_dist(args.checkpoint)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    out = save_checkpoint(model, config, args.out, dtype=dtype)
    print(f"exported step {step} to {out}")
    return 0
