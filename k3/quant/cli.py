"""`k3 quantize IN_DIR OUT_DIR`: post-training MXFP4 quantization of a checkpoint's routed experts.

Reads a high-precision checkpoint (config.json + safetensors, official layout), writes the release's layout:
routed experts as MXFP4 `weight_packed` / `weight_scale` (docs/spec.md#mxfp4), `quantization_config` added to
the config, every other tensor in `--dtype` (BF16 by default, as the release; the F32 tensors stay F32), and
the other files of IN_DIR (tokenizer, generation config, chat template, ...) copied along.
"""

import argparse
from pathlib import Path

import torch

from k3.checkpoint.adapter import from_official, split_multimodal
from k3.checkpoint.io import CONFIG_NAME, INDEX_NAME, load_official_tensors
from k3.config import K3Config
from k3.quant.checkpoint import is_mxfp4_config, save_mxfp4_checkpoint

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "keep": None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[1]
    parser.add_argument("in_dir", metavar="IN_DIR", type=Path, help="high-precision checkpoint directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="where to write the MXFP4 checkpoint")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="dtype of the non-expert tensors (default: bfloat16; keep = as stored)",
    )
    parser.add_argument("--max-shard-bytes", type=int, default=None, help="shard size limit (default 5 GB)")


# not carried over: the weights themselves and a training checkpoint's optimizer / loader state
SKIPPED_FILES = (CONFIG_NAME, INDEX_NAME, "train_state.json")


def side_files(ckpt_dir: Path) -> dict[str, Path]:
    """Top-level regular files of a checkpoint other than its config, weights and training state
    (tokenizer files, generation config, a run's train_config.json, ...)."""
    return {
        p.name: p
        for p in sorted(ckpt_dir.iterdir())
        if p.is_file()
        and p.name not in SKIPPED_FILES
        and not p.name.endswith(".safetensors")
        and not p.name.startswith(".")
    }


def quantize_checkpoint(
    in_dir: Path,
    out_dir: Path,
    dtype: torch.dtype | None = torch.bfloat16,
    max_shard_bytes: int | None = None,
) -> dict:
    """Convert in_dir to an MXFP4 checkpoint in out_dir; returns a summary dict."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if not in_dir.is_dir():
        raise ValueError(f"IN_DIR {in_dir} is not a directory")
    if in_dir.resolve() == out_dir.resolve():
        raise ValueError(f"OUT_DIR must differ from IN_DIR ({in_dir})")
    config = K3Config.load(in_dir)
    if is_mxfp4_config(config):
        raise ValueError(f"IN_DIR {in_dir} is already MXFP4-quantized (its config has quantization_config)")
    tensors = load_official_tensors(in_dir)
    _, multimodal = split_multimodal(tensors)
    state = from_official(tensors, config) | multimodal
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    files = side_files(in_dir)
    save_mxfp4_checkpoint(state, config, out_dir, dtype=dtype, extra_files=files, **kw)
    expert = [t for n, t in state.items() if n.endswith(("experts.w1", "experts.w2", "experts.w3"))]
    weights = sum(t.numel() for t in expert)
    return {
        "expert_matrices": sum(t.shape[0] for t in expert),
        "expert_bytes_before": sum(t.nbytes for t in expert),
        "expert_bytes_after": weights // 2 + weights // 32,
        "copied_files": sorted(files),
    }


def run(args: argparse.Namespace) -> int:
    s = quantize_checkpoint(args.in_dir, args.out_dir, DTYPES[args.dtype], args.max_shard_bytes)
    print(
        f"quantized {s['expert_matrices']} routed-expert matrices to MXFP4: "
        f"{s['expert_bytes_before']:,} -> {s['expert_bytes_after']:,} bytes"
    )
    if s["copied_files"]:
        print(f"copied {', '.join(s['copied_files'])}")
    print(f"wrote {args.out_dir}")
    return 0
