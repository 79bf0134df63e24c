"""End of a run: final eval, checkpoint, export, sample, MFU and the summary table (summary.json too).

Export: the run directory itself becomes a loadable K3 checkpoint -- config.json and model.safetensors
of the final training checkpoint (written by k3.checkpoint) plus tokenizer.json / tokenizer_config.json
are copied next to metrics.jsonl and loss.png, each file replaced atomically (temp name + rename).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from k3.train.evaluate import sample_text
from k3.train.metrics import flops_per_token, format_duration, plot_losses, summary_table

EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def export_run_dir(ckpt_dir: Path, run_dir: Path) -> None:
    """Copy the checkpoint's model, config and tokenizer files into `run_dir` (one atomic rename each)."""
    for name in EXPORT_FILES:
        src = Path(ckpt_dir) / name
        if not src.exists():
            continue
        tmp = Path(run_dir) / f".{name}.tmp{os.getpid()}"
        shutil.copyfile(src, tmp)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, Path(run_dir) / name)


def _mfu(trainer) -> dict:
    s, tc = trainer.state, trainer.tc
    tok_s = s["tokens"] / s["train_seconds"] if s["train_seconds"] else 0.0
    flops = flops_per_token(trainer.model, trainer.config, tc.seq_len)
    return {
        "tok_per_s": tok_s,
        "flops_per_token": flops["total"],
        "flops_terms": flops,
        "peak_flops": trainer.peak,
        "mfu": flops["total"] * tok_s / trainer.peak if trainer.peak else 0.0,
    }


def finish_run(trainer, interrupted: bool) -> dict:
    """Final eval + save + export + sample; prints the summary table; returns the summary dict."""
    tc, s = trainer.tc, trainer.state
    ev = trainer.run_eval()
    path = trainer.save()
    export_run_dir(path, trainer.out)
    sample = (
        sample_text(trainer.model, trainer.tokenizer, tc.sample_prompt, tc.sample_tokens, seed=tc.seed)
        if tc.sample_tokens
        else ""
    )
    perf = _mfu(trainer)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    summary = {
        "preset": tc.preset,
        "out": str(trainer.out),
        "interrupted": interrupted,
        "steps": s["step"],
        "total_steps": s["total_steps"],
        "tokens": s["tokens"],
        "skipped_steps": s["skipped"],
        "params": n_params,
        "train_seconds": s["train_seconds"],
        "loop_seconds": getattr(trainer, "loop_seconds", 0.0),
        "data_seconds": trainer.data_seconds,
        "val_loss": ev["val_loss"],
        "val_bpb": ev["val_bpb"],
        "val_tokens": ev["tokens"],
        "bytes_per_token": ev["bytes"] / max(ev["tokens"], 1),
        "unigram_bpb": ev["unigram_bpb"],
        "sample": sample,
        "checkpoint": str(path),
        **perf,
    }
    (trainer.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_losses(trainer.log.path, trainer.out / "loss.png", title=f"{tc.preset} ({trainer.out.name})")
    if not trainer.quiet:
        _print_report(summary)
    return summary


def _print_report(sm: dict) -> None:
    rows = [
        ("preset", sm["preset"]),
        ("parameters", f"{sm['params'] / 1e6:.2f} M"),
        ("steps", f"{sm['steps']} / {sm['total_steps']}" + (" (interrupted)" if sm["interrupted"] else "")),
        ("tokens", f"{sm['tokens']:,}"),
        (
            "train time",
            format_duration(sm["train_seconds"]) + f" (loop {format_duration(sm['loop_seconds'])})",
        ),
        ("tokens / s", f"{sm['tok_per_s']:,.0f}"),
        ("FLOPs / token", f"{sm['flops_per_token'] / 1e6:.1f} M"),
        ("matmul peak", f"{sm['peak_flops'] / 1e9:.1f} GFLOP/s (measured)"),
        ("MFU", f"{100 * sm['mfu']:.1f} %"),
        ("val loss", f"{sm['val_loss']:.4f} nats/token"),
        ("val bits / byte", f"{sm['val_bpb']:.4f}"),
        ("unigram bits / byte", f"{sm['unigram_bpb']:.4f}"),
        ("bytes / token", f"{sm['bytes_per_token']:.2f}"),
        ("skipped steps", str(sm["skipped_steps"])),
        ("output", sm["out"]),
    ]
    out = sys.stdout
    if sm["sample"]:
        out.write("\n--- sample " + "-" * 60 + "\n" + sm["sample"] + "\n" + "-" * 71 + "\n\n")
    out.write(summary_table(rows, title="k3 train") + "\n")
    out.flush()
