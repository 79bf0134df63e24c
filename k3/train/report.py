"""End of a run: final eval, checkpoint, export, samples, MFU and the summary table (summary.json too).

The table puts the model's bits per byte on the whole validation split next to gzip -9, bz2 -9, xz -9e
and the unigram model on the same bytes (k3.train.baselines), then continuations of a few prompts and the
share of sampled top-level blocks that `ast.parse` accepts (k3.train.samples), and the largest ratio of
a training loss after warm-up to the lowest loss before it (a spike check: 1.0 means it never rose).

Export: the run directory itself becomes a loadable K3 checkpoint -- config.json and model.safetensors
of the final training checkpoint (written by k3.checkpoint) plus tokenizer.json / tokenizer_config.json
are copied next to metrics.jsonl and loss.png, each file replaced atomically (temp name + rename).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from k3.train import samples as smp
from k3.train.metrics import (
    flops_per_token,
    format_duration,
    read_metrics,
    spike_ratio,
    summary_table,
)

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


def _samples(trainer) -> dict:
    """Printed continuations and the parse fraction of more of them, all at `sample_temperature` (greedy
    decoding of a model this small loops on one line; k3.train.samples, through the inference engine)."""
    tc = trainer.tc
    out = {"samples": [], "parse_fraction": None, "parsed_blocks": 0, "sampled_blocks": 0, "sampled_texts": 0}
    if not tc.sample_tokens:
        return out
    prompts = smp.PROMPTS if tc.sample_prompt is None else (tc.sample_prompt,)
    shown = smp.sample_texts(
        trainer.model, trainer.tokenizer, prompts, 1, tc.sample_tokens, tc.sample_temperature, smp.TOP_K,
        tc.seed,
    )  # fmt: skip
    out["samples"] = [text for text, _ in shown]
    if tc.parse_samples:
        sampled = smp.sample_texts(
            trainer.model, trainer.tokenizer, smp.PARSE_PROMPTS, tc.parse_samples, smp.PARSE_TOKENS,
            tc.sample_temperature, smp.TOP_K, tc.seed,
        )  # fmt: skip
        out["parse_fraction"], out["parsed_blocks"], out["sampled_blocks"] = smp.parse_fraction(sampled)
        out["sampled_texts"] = len(sampled)
    return out


def finish_run(trainer, interrupted: bool) -> dict:
    """Final eval + save + export + samples; prints the summary table; returns the summary dict."""
    tc, s = trainer.tc, trainer.state
    ev = trainer.run_eval(final=True) or {}  # {}: no final evaluation (final_eval_tokens 0)
    with trainer.phase("checkpoint") as note:
        path = trainer.save()
        export_run_dir(path, trainer.out)
        note.append(str(path))
    with trainer.phase("samples") as note:
        sampled = _samples(trainer)
        note.append(f"{len(sampled['samples'])} shown + {sampled['sampled_texts']} parse-checked, engine")
    perf = _mfu(trainer)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    train = [r for r in read_metrics(trainer.log.path) if r["kind"] == "train"]
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
        "eval_seconds": ev.get("seconds", 0.0),
        "sample_seconds": trainer.phases["samples"],
        "val_loss": ev.get("val_loss"),
        "val_bpb": ev.get("val_bpb"),
        "val_tokens": ev.get("tokens", 0),
        "val_bytes": ev.get("bytes", 0),
        "val_tokens_total": int((trainer.eval_set.labels >= 0).sum()),  # the whole split's targets
        "bytes_per_token": ev["bytes"] / max(ev["tokens"], 1) if ev else None,
        "unigram_bpb": ev.get("unigram_bpb"),
        "baselines_bpb": dict(trainer.baselines),
        "spike_ratio": spike_ratio([r["loss"] for r in train], tc.warmup_steps),
        "sample": "\n\n".join(sampled["samples"]),
        **sampled,
        "checkpoint": str(path),
        **perf,
    }
    trainer.plot()
    summary["phases"] = dict(trainer.phases)  # fixed costs, seconds (k3.train.trainer)
    summary["native_build_seconds"] = trainer.native_build_seconds  # within the phases
    summary["wall_seconds"] = time.perf_counter() - trainer.started
    (trainer.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not trainer.quiet:
        _print_report(summary)
    return summary


def _eval_rows(sm: dict) -> list[tuple[str, str]]:
    """The final evaluation's rows of the table: bits per byte beside the baselines on the same bytes."""
    if sm["val_bpb"] is None:
        return [("val bits / byte", "-- (no final evaluation: --final-eval-tokens 0)")]
    base = sm["baselines_bpb"]
    best = min((v, k) for k, v in base.items() if k != "unigram")
    verdict = "beats" if sm["val_bpb"] < best[0] else "does not beat"
    whole = sm["val_tokens"] == sm["val_tokens_total"]
    return [
        ("val loss", f"{sm['val_loss']:.4f} nats/token"),
        ("val bits / byte", f"{sm['val_bpb']:.4f} ({verdict} {best[1]})"),
        *((f"  {name} bits / byte", f"{v:.4f}") for name, v in base.items()),
        (
            "val bytes",
            f"{sm['val_bytes']:,} "
            + (
                "(every validation file, never trained on)"
                if whole
                else f"(the first {sm['val_tokens']:,} tokens: --final-eval-tokens)"
            ),
        ),
        ("bytes / token", f"{sm['bytes_per_token']:.2f}"),
    ]


def _print_report(sm: dict) -> None:
    parse = (
        f"{100 * sm['parse_fraction']:.0f} % ({sm['parsed_blocks']} of {sm['sampled_blocks']} blocks)"
        if sm["parse_fraction"] is not None
        else "--"
    )
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
        *_eval_rows(sm),
        ("samples that parse", parse),
        ("max loss / running min", f"{sm['spike_ratio']:.2f} (after warm-up)"),
        ("skipped steps", str(sm["skipped_steps"])),
        ("wall time", format_duration(sm["wall_seconds"]) + " (set-up to summary; fixed costs below)"),
        *((f"  {name}", f"{sec:.1f} s") for name, sec in sm["phases"].items()),
        *(
            [("  of which kernel builds", f"{sm['native_build_seconds']:.1f} s (first use on this machine)")]
            if sm["native_build_seconds"] >= 0.05
            else []
        ),
        ("output", sm["out"]),
    ]
    out = sys.stdout
    for text in sm["samples"]:
        out.write("\n--- sample " + "-" * 60 + "\n" + text + "\n")
    if sm["samples"]:
        out.write("-" * 71 + "\n\n")
    out.write(summary_table(rows, title="k3 train") + "\n")
    out.flush()
