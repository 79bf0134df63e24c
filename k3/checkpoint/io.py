"""Save and load K3 checkpoints in the official layout: config.json + safetensors (docs/spec.md#tensors).

A checkpoint directory holds `config.json` (exactly `config.to_hf()`) and either `model.safetensors` or,
when the tensors exceed `max_shard_bytes`, `model-00001-of-0000N.safetensors` shards plus
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`, the
Hugging Face convention). Tensor names and layouts are official (`k3.checkpoint.adapter`).

Safety rules:
* safetensors only: nothing here unpickles (no `torch.load`), so a checkpoint cannot run code;
* atomic save: everything is written and fsynced into a temporary sibling directory, which is renamed
  onto `out_dir` only when complete; an existing checkpoint there is swapped out and deleted afterwards,
  so a crash leaves either the old or the new checkpoint under the final name, never a partial one.
  A non-empty directory that does not look like a checkpoint is never replaced;
* provenance (CONTRIBUTING.md#provenance): each shard's metadata records the k3 version and, if known, the git
  SHA.
"""

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import k3
from k3.checkpoint.adapter import from_official, is_f32_tensor, short_list, to_official
from k3.config import K3Config

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # 5 GB, as the HF convention
# a training run keeps its checkpoints as RUN/checkpoints/step-<N>/ (local or DCP, k3.train.checkpointing and
# k3.parallel.dcp); a directory being written is named .tmp-step-<N>-<id> and never matches
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---- save -----------------------------------------------------------------------------------------
def save_checkpoint(
    model_or_state_dict,
    config: K3Config,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str | bytes | Path] | None = None,
) -> Path:
    """Write `model_or_state_dict` (an nn.Module or our state_dict) as an official checkpoint in `out_dir`.

    dtype: None keeps every tensor's dtype; otherwise floating tensors are cast to it, except the F32
    tensors of the release (conv1d weights, A_log, dt_bias, o_norm, router bias), which are written FP32.
    extra_files: {file name: text, bytes, or a path to copy} written beside the weights (tokenizer, ...).
    Multimodal tensors (`vision_tower.*`, `mm_projector.*`) in the state_dict are written unchanged.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    state = (
        model_or_state_dict.state_dict()
        if isinstance(model_or_state_dict, torch.nn.Module)
        else model_or_state_dict
    )
    tensors = to_official(state, config)
    meta = [n for n, t in tensors.items() if t.is_meta]
    if meta:
        raise ValueError(f"cannot save tensors on the meta device: {short_list(meta)}")
    shards = plan_shards({n: _nbytes(n, t, dtype) for n, t in tensors.items()}, max_shard_bytes)
    config = config.replace(dtype=stored_dtype_name(tensors, dtype, config.dtype))
    out_dir = Path(out_dir)
    with _atomic_dir(out_dir) as tmp:
        _write_text(tmp / CONFIG_NAME, json.dumps(config.to_hf(), indent=2, sort_keys=True) + "\n")
        metadata = _provenance()
        for file, names in shards.items():
            shard = {n: _prepare(n, tensors[n], dtype) for n in names}
            save_file(shard, str(tmp / file), metadata=metadata)
            fsync_path(tmp / file)
        if len(shards) > 1:
            total = sum(_nbytes(n, t, dtype) for n, t in tensors.items())
            index = {
                "metadata": {"total_size": total},
                "weight_map": {n: f for f, names in shards.items() for n in sorted(names)},
            }
            index["weight_map"] = dict(sorted(index["weight_map"].items()))
            _write_text(tmp / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        for name, content in (extra_files or {}).items():
            _write_extra(tmp, name, content)
    return out_dir


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> dict[str, list[str]]:
    """Greedy, in order: {file name: tensor names}; a tensor bigger than the limit gets a shard of its own."""
    groups, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    groups.append(current)
    if len(groups) == 1:
        return {SINGLE_NAME: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def stored_dtype_name(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, default: str) -> str:
    """config.json's `dtype`: what the weights are stored as (the release's F32 tensors aside).

    The most common floating dtype (by element count) among the tensors that follow the checkpoint
    dtype, so an FP32 run says "float32" and a BF16 export "bfloat16" (MXFP4 experts, uint8, do not count).
    """
    counts: dict[torch.dtype, int] = {}
    for name, t in tensors.items():
        target = _target_dtype(name, t, dtype)
        if target.is_floating_point and not is_f32_tensor(name):
            counts[target] = counts.get(target, 0) + t.numel()
    if not counts:
        return default
    return _DTYPE_NAMES.get(max(counts, key=counts.get), default)


def _target_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is None or not t.is_floating_point():
        return t.dtype
    return torch.float32 if is_f32_tensor(name) else dtype


def _nbytes(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * _target_dtype(name, t, dtype).itemsize


def _prepare(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Detached, on the CPU, in the target dtype, contiguous (safetensors stores dense row-major bytes)."""
    return t.detach().to(device="cpu", dtype=_target_dtype(name, t, dtype)).contiguous()


def _provenance() -> dict[str, str]:
    meta = {"format": "pt", "k3_version": k3.__version__}
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(k3.__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if sha.returncode == 0:
            meta["k3_git_sha"] = sha.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return meta


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)
    fsync_path(path)


def _write_extra(tmp: Path, name: str, content: str | bytes | Path) -> None:
    if Path(name).name != name or name in (CONFIG_NAME, INDEX_NAME) or name.endswith(".safetensors"):
        raise ValueError(f"extra_files: {name!r} must be a plain file name that is not a checkpoint file")
    dest = tmp / name
    if isinstance(content, Path):
        shutil.copyfile(content, dest)
    elif isinstance(content, bytes):
        dest.write_bytes(content)
    elif isinstance(content, str):
        dest.write_text(content)
    else:
        raise ValueError(f"extra_files[{name!r}]: expected str, bytes or Path, got {type(content).__name__}")
    fsync_path(dest)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _looks_replaceable(path: Path) -> bool:
    """An existing out_dir may be replaced only if it is empty or already a checkpoint."""
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    entries = list(path.iterdir())
    return not entries or (path / CONFIG_NAME).exists() or any(p.suffix == ".safetensors" for p in entries)


@contextmanager
def _atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a fresh temporary sibling of out_dir; on success move it onto out_dir atomically."""
    if not _looks_replaceable(out_dir):
        raise ValueError(
            f"out_dir {out_dir} exists and is not a checkpoint directory; refusing to replace it"
        )
    parent = out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    tmp = parent / f".{out_dir.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_path(tmp)
        _swap_into_place(tmp, parent / out_dir.name, parent / f".{out_dir.name}.old-{tag}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, final: Path, old: Path) -> None:
    if final.exists():
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)
            raise
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(final.parent)


# ---- load -----------------------------------------------------------------------------------------
def checkpoint_files(ckpt_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the index if there is one, else model.safetensors,
    else every *.safetensors in the directory."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ValueError(f"checkpoint directory not found: {d}")
    if (d / INDEX_NAME).exists():
        index = _read_index(d / INDEX_NAME)
        files = sorted(set(index.values()))
        absent = [f for f in files if not (d / f).exists()]
        if absent:
            raise ValueError(f"{d / INDEX_NAME} names missing shard files: {short_list(absent)}")
        return [d / f for f in files]
    if (d / SINGLE_NAME).exists():
        return [d / SINGLE_NAME]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors file ({SINGLE_NAME} or {INDEX_NAME}) in checkpoint directory {d}")
    return files


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a valid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path}: weight_map must be an object")
    for name in weight_map.values():
        # a shard is a plain file name in the checkpoint directory: no folder, no "..", no absolute path
        # (a shard that is a symbolic link, as in a hub cache's snapshot folders, is the owner's choice)
        plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
        if not plain or "\0" in name:
            raise ValueError(f"{path} names shard {name!r}: not a file name inside the checkpoint directory")
    return weight_map


def load_official_tensors(
    ckpt_dir: str | Path, *, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its official name (multimodal ones included), as stored."""
    files = checkpoint_files(ckpt_dir)
    index_path = Path(ckpt_dir) / INDEX_NAME
    index = _read_index(index_path) if index_path.exists() else None
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        for name, t in _read_safetensors(path, device).items():
            if name in tensors:
                raise ValueError(f"tensor {name} appears in more than one file (second: {path})")
            if index is not None and index.get(name) != path.name:
                raise ValueError(f"{path} holds {name}, which {INDEX_NAME} maps to {index.get(name)!r}")
            tensors[name] = t
    if index is not None:
        lost = sorted(set(index) - set(tensors))
        if lost:
            raise ValueError(f"{INDEX_NAME} lists tensors absent from the shards: {short_list(lost)}")
    return tensors


def _read_safetensors(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for bad files
        raise ValueError(f"cannot read safetensors file {path}: {e}") from None


def load_state_dict_from_dir(ckpt_dir: str | Path, *, device: str | torch.device = "cpu") -> dict:
    """Our state_dict (in-memory names and layouts) from a checkpoint dir; multimodal tensors dropped."""
    config = _load_config(ckpt_dir)
    return from_official(load_official_tensors(ckpt_dir, device=device), config)


def _load_config(ckpt_dir: str | Path) -> K3Config:
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ValueError(f"checkpoint directory not found: {d}")
    if not (d / CONFIG_NAME).exists():
        raise ValueError(f"no {CONFIG_NAME} in checkpoint directory {d}")
    return K3Config.load(d / CONFIG_NAME)


def load_checkpoint(
    ckpt_dir: str | Path,
    model: torch.nn.Module | None = None,
    *,
    device: str | torch.device = "cpu",
    strict: bool = True,
):
    """Load a checkpoint directory -> (model, config).

    Without `model`, builds `K3ForCausalLM(config)` on the meta device and assigns the loaded tensors, so
    every tensor keeps its stored dtype and nothing is initialized twice. With `model`, copies into it
    (the model's dtypes win). Raises ValueError naming missing, unexpected (strict only) and wrongly
    shaped tensors.
    """
    config = _load_config(ckpt_dir)
    state = from_official(load_official_tensors(ckpt_dir, device=device), config)
    if model is not None:
        check_state_dict(_shapes(model), state, strict=strict, source=ckpt_dir)
        model.load_state_dict(state, strict=strict)
        return model, config
    return _build_and_assign(config, state, device, strict, ckpt_dir), config


def _build_and_assign(config: K3Config, state: dict, device, strict: bool, source) -> torch.nn.Module:
    from k3.model.init import init_weights  # lazy: loading the model code is the caller's cost
    from k3.model.transformer import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    check_state_dict(_shapes(model), state, strict=strict, source=source)
    if _on_meta_after_load(model, state):  # non-persistent buffers or (strict=False) absent tensors
        with torch.device(device):
            model = K3ForCausalLM(config)
        init_weights(model, config.initializer_range, config.num_hidden_layers)  # for what the file lacks
    model.load_state_dict(state, strict=strict, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _on_meta_after_load(model: torch.nn.Module, state: dict) -> bool:
    loaded = set(state)
    persistent = set(model.state_dict())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return any(name not in loaded or name not in persistent for name, _ in named)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def check_state_dict(
    expected: dict[str, tuple[int, ...]],
    state: dict[str, torch.Tensor],
    *,
    strict: bool = True,
    source: str | Path = "checkpoint",
) -> None:
    """Raise ValueError listing missing / unexpected (if strict) and wrongly shaped tensors (our names)."""
    missing = sorted(set(expected) - set(state)) if strict else []
    unexpected = sorted(set(state) - set(expected)) if strict else []
    wrong = [
        f"{n} (checkpoint {list(state[n].shape)}, model {list(expected[n])})"
        for n in sorted(set(expected) & set(state))
        if tuple(state[n].shape) != expected[n]
    ]
    problems = [
        f"{what} {len(names)}: {short_list(names)}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if names
    ]
    if problems:
        raise ValueError(f"{source} does not match the model: " + "; ".join(problems))


def assign_meta_model(model: torch.nn.Module, state: dict, config: K3Config, source) -> torch.nn.Module:
    """Load `state` into a model built on the meta device (its tensors taken as they are, `assign`),
    after checking names and shapes; tie the head if the config says so. Raises ValueError naming
    `source` when a tensor is missing, misshaped, or still on the meta device afterwards."""
    check_state_dict({n: tuple(t.shape) for n, t in model.state_dict().items()}, state, source=source)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{source}: tensors not in the checkpoint and not persistent: {short_list(left)}")
    return model


def step_dirs(run_dir: str | Path) -> list[Path]:
    """Complete training checkpoints of a run directory, oldest first."""
    ck = Path(run_dir) / "checkpoints"
    if not ck.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ck.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]
