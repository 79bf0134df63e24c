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

from k3.checkpoint.io import fsync_path, step_dirs
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


# ---- training checkpoints (the Trainer's, through k3.train.distributed) --------------------------
STATE_JSON = "train_state.json"  # the name k3.train.checkpointing resolves a checkpoint by
FORMAT = "dcp"


def is_dcp_checkpoint(path: str | Path) -> bool:
    """A DCP training checkpoint directory (train_state.json says so and the DCP metadata is there)."""
    import json

    p = Path(path)
    if not (p / STATE_JSON).exists() or not (p / ".metadata").exists():
        return False
    return json.loads((p / STATE_JSON).read_text()).get("format") == FORMAT


def save_training_dcp(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizers: list,
    config: K3Config,
    trainer_state: dict,
    *,
    tokenizer=None,
    keep: int = 2,
    layout: dict | None = None,
) -> Path:
    """Collective: ``<run_dir>/checkpoints/step-<step>`` as a DCP checkpoint + config.json,
    train_state.json (format "dcp", the trainer state, the layout it was saved with) and the tokenizer.

    Atomic like k3.train.checkpointing: every rank writes its shards into ``.tmp-step-<N>`` (DCP fsyncs
    them), rank 0 adds the small files, fsyncs, renames it to ``step-<N>`` and prunes to `keep`.
    The directory must be on a file system every rank sees (one node, or a shared one)."""
    import json
    import os
    import shutil

    main = not dist.is_initialized() or dist.get_rank() == 0
    ck = Path(run_dir) / "checkpoints"
    final, tmp = ck / f"step-{step:08d}", ck / f".tmp-step-{step:08d}"
    flags = torch.tensor([final.exists() if main else 0, 0], dtype=torch.long, device=_comm_device())
    bad = [n for n, t in model.state_dict().items() if t.is_floating_point() and not _finite(t)]
    flags[1] = len(bad) > 0
    if dist.is_initialized():
        dist.broadcast(flags[:1], 0)  # rank 0 decides whether it exists
        dist.all_reduce(flags[1:], op=dist.ReduceOp.MAX)
    if flags[1]:
        raise RuntimeError(f"refusing to save non-finite weights{f': {bad[:5]}' if bad else ' (other rank)'}")
    if flags[0]:
        return final
    if main:
        ck.mkdir(parents=True, exist_ok=True)
        for stale in ck.glob(".tmp-*"):  # left by a crashed save
            shutil.rmtree(stale, ignore_errors=True)
    save_dcp(tmp, model, optimizers, step, config)  # collective; config.json by rank 0; ends in a barrier
    if main:
        if tokenizer is not None:
            tokenizer.save(tmp)
        state = {"format_version": 1, "format": FORMAT, "layout": layout or {}, "trainer": trainer_state}
        (tmp / STATE_JSON).write_text(json.dumps(state, indent=1, allow_nan=True))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        os.rename(tmp, final)
        fsync_path(ck)
        for old in step_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_training_dcp(path: str | Path, model: nn.Module, optimizers: list) -> dict:
    """Collective: restore model + optimizers from a save_training_dcp checkpoint (any layout);
    returns its trainer state (counters, data position, TrainConfig)."""
    import json

    step = load_dcp(path, model, optimizers)
    trainer = json.loads((Path(path) / STATE_JSON).read_text())["trainer"]
    if trainer["counters"]["step"] != step:
        raise ValueError(
            f"checkpoint {path}: DCP step {step} != train_state step {trainer['counters']['step']}"
        )
    return trainer


def _finite(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return bool(torch.isfinite(local).all())


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
