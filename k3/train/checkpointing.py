"""Training checkpoints: everything needed to continue a run bit for bit, written atomically.

A run directory holds ``checkpoints/step-<N>/``, each a loadable K3 checkpoint plus training state:

    config.json, model.safetensors   k3.checkpoint.save_checkpoint: official names, incl. the QB router
                                     biases (`e_score_correction_bias` buffers live in the state_dict)
    tokenizer.json, tokenizer_config.json
    train_state.safetensors          every optimizer state tensor (Muon momentum, AdamW moments, steps)
                                     and the torch RNG state
    train_state.json                 the optimizers' structure (param groups, with tensors replaced by
                                     their safetensors keys), trainer counters, data-loader position,
                                     Python / NumPy RNG, the TrainConfig
Nothing is pickled and nothing is read with torch.load.

Atomicity: a checkpoint is built in ``checkpoints/.tmp-step-<N>-<id>/``, every file fsynced, then the
directory is renamed to ``step-<N>`` and the parent fsynced. A crash (even SIGKILL) mid-save leaves a
``.tmp-*`` directory, which the next save deletes, and the previous ``step-*`` untouched. Only the
last ``keep`` step directories are kept. ``K3_TEST_SAVE_DELAY`` (seconds) sleeps inside the temporary
directory before the rename -- a test hook to kill a process mid-save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3.checkpoint import load_checkpoint, save_checkpoint
from k3.checkpoint.io import fsync_path, step_dirs
from k3.config import K3Config

STATE_JSON = "train_state.json"
STATE_TENSORS = "train_state.safetensors"
FORMAT_VERSION = 1


# ---- JSON encoding of optimizer state (tensors -> safetensors keys) --------------------------------


def _encode(obj, prefix: str, tensors: dict[str, torch.Tensor]):
    """JSON-able copy of obj; tensors go to `tensors` under `prefix`-derived keys."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, dict):
        return {
            "__dict__": [
                [_encode(k, f"{prefix}.k{i}", tensors), _encode(v, f"{prefix}.{k}", tensors)]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise ValueError(f"cannot store {type(obj).__name__} at {prefix} in a training checkpoint")


def _decode(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}


def _rng_state() -> tuple[dict, torch.Tensor]:
    np_state = np.random.get_state()
    py = random.getstate()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }, torch.get_rng_state()


def _set_rng_state(state: dict, torch_state: torch.Tensor) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch_state)


# ---- save ------------------------------------------------------------------------------------------


def save_training_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    config: K3Config,
    optimizers: list[torch.optim.Optimizer],
    trainer_state: dict,
    *,
    tokenizer=None,
    keep: int = 2,
) -> Path:
    """Write ``<run_dir>/checkpoints/step-<step>`` atomically; prune to the last `keep`. Returns its path."""
    bad = [n for n, p in model.state_dict().items() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"refusing to save non-finite weights: {bad[:5]}")
    ck = Path(run_dir) / "checkpoints"
    final = ck / f"step-{step:08d}"
    if final.exists():
        return final
    ck.mkdir(parents=True, exist_ok=True)
    for stale in ck.glob(".tmp-*"):  # left by a crashed save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = ck / f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}"
    try:
        _write_contents(tmp, model, config, optimizers, trainer_state, tokenizer)
        if delay := float(os.environ.get("K3_TEST_SAVE_DELAY", "0") or 0):
            time.sleep(delay)
        fsync_path(tmp)
        os.rename(tmp, final)
        fsync_path(ck)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in step_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_contents(tmp: Path, model, config, optimizers, trainer_state, tokenizer) -> None:
    save_checkpoint(model, config, tmp)  # config.json + model.safetensors, fsynced
    if tokenizer is not None:
        tokenizer.save(tmp)
    tensors: dict[str, torch.Tensor] = {}
    opt_json = [_encode(opt.state_dict(), f"opt{i}", tensors) for i, opt in enumerate(optimizers)]
    rng, torch_rng = _rng_state()
    tensors["rng.torch"] = torch_rng
    save_file(tensors, str(tmp / STATE_TENSORS))
    state = {"format_version": FORMAT_VERSION, "optimizers": opt_json, "rng": rng, "trainer": trainer_state}
    (tmp / STATE_JSON).write_text(json.dumps(state, indent=1, allow_nan=True))
    for f in tmp.iterdir():
        fsync_path(f)


# ---- load ------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """A training checkpoint directory, or a run directory (its latest complete checkpoint)."""
    p = Path(path)
    if (p / STATE_JSON).exists():
        return p
    dirs = step_dirs(p)
    if not dirs:
        raise ValueError(f"resume: {p} is neither a training checkpoint nor a run with checkpoints/step-*")
    return dirs[-1]


def model_dir(path: str | Path) -> Path:
    """Where to load a model from (`k3 eval`, `k3 sample`, `k3 serve`): a checkpoint directory as given;
    a run directory -> its newest model: the latest complete ``checkpoints/step-N``, or the run's own
    files when they are newer (a finished run writes them after its last checkpoint). A run killed
    before it finished has only its checkpoints."""
    p = Path(path)
    dirs = step_dirs(p)
    own = p / "model.safetensors"
    if not dirs or (own.exists() and own.stat().st_mtime >= (dirs[-1] / "model.safetensors").stat().st_mtime):
        return p
    return dirs[-1]


def read_trainer_state(ckpt_dir: str | Path) -> dict:
    """The trainer part of train_state.json (counters, data position, TrainConfig)."""
    return json.loads((Path(ckpt_dir) / STATE_JSON).read_text())["trainer"]


def load_training_checkpoint(
    ckpt_dir: str | Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> dict:
    """Restore model (weights + router biases), optimizers and RNG in place; return the trainer state."""
    ckpt_dir = Path(ckpt_dir)
    state = json.loads((ckpt_dir / STATE_JSON).read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{ckpt_dir}: unsupported training checkpoint format {state.get('format_version')}")
    load_checkpoint(ckpt_dir, model=model)
    with safe_open(str(ckpt_dir / STATE_TENSORS), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if len(state["optimizers"]) != len(optimizers):
        raise ValueError(
            f"{ckpt_dir}: holds {len(state['optimizers'])} optimizers, the run has {len(optimizers)}"
        )
    for opt, enc in zip(optimizers, state["optimizers"], strict=True):
        sd = _decode(enc, tensors)
        sd["state"] = {int(k): v for k, v in sd["state"].items()}
        opt.load_state_dict(sd)
    _set_rng_state(state["rng"], tensors["rng.torch"])
    return state["trainer"]
