"""`k3 train`, `k3 eval`, `k3 sample`, `k3 ablate`: thin argparse layers over k3.train.

All four are registered in k3/cli.py with this module; `parser.prog` ("k3 <name>") tells
`add_arguments` which command it is building. Flags override fields of the TrainConfig recipe
(k3/train/config.py); see docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from k3.train.config import TrainConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    name = parser.prog.split()[-1]
    parser.set_defaults(_command=name)
    {"train": _train_args, "eval": _eval_args, "sample": _sample_args, "ablate": _ablate_args}[name](parser)


def run(args: argparse.Namespace) -> int | None:
    return {"train": run_train, "eval": run_eval, "sample": run_sample, "ablate": run_ablate}[args._command](
        args
    )


# ---- train -----------------------------------------------------------------------------------------

_TRAIN_FLAGS = {  # flag -> (TrainConfig field, type, help)
    "--preset": ("preset", str, "preset name or config.json (default k3-mini)"),
    "--data": ("data", str, "directory of text files, .jsonl with 'text', or .parquet (default: the stdlib)"),
    "--out": ("out", str, "run directory (default runs/<preset>-<timestamp>)"),
    "--minutes": ("minutes", float, "training-loop time budget (default 10)"),
    "--steps": ("steps", int, "number of optimizer steps (overrides --minutes)"),
    "--seed": ("seed", int, "seed for init, data order and sampling (default 0)"),
    "--batch-size": ("batch_size", int, "sequences per micro-batch"),
    "--seq-len": ("seq_len", int, "tokens per sequence"),
    "--grad-accum": ("grad_accum", int, "micro-batches per optimizer step"),
    "--lr": ("lr", float, "Muon learning rate (AdamW-matched units)"),
    "--adamw-lr": ("adamw_lr", float, "AdamW learning rate (embeddings, head, norms, scalars)"),
    "--weight-decay": ("weight_decay", float, "decoupled weight decay"),
    "--warmup-steps": ("warmup_steps", int, "linear warm-up steps"),
    "--grad-clip": ("grad_clip", float, "global grad-norm clip (0: off)"),
    "--eval-every": ("eval_every", int, "evaluate every N steps (0: only at the end)"),
    "--eval-tokens": ("eval_tokens", int, "validation tokens per evaluation during training"),
    "--final-eval-tokens": (
        "final_eval_tokens",
        int,
        "validation tokens of the final evaluation (default: the whole split, or for a short --steps run "
        "max(--eval-tokens, 3 x its training tokens); 0: no final evaluation)",
    ),
    "--save-every": ("save_every", int, "checkpoint every N steps (0: only at the end)"),
    "--keep": ("keep", int, "training checkpoints to keep"),
    "--log-every": ("log_every", int, "progress line every N steps when stderr is not a terminal"),
    "--optimizer": ("optimizer", str, "muon (Muon + AdamW) or adamw (AdamW only)"),
    "--schedule": ("schedule", str, "cosine (warm-up + cosine) or wsd (warm-up, stable, decay)"),
    "--decay-frac": ("decay_frac", float, "wsd: fraction of the steps in the final linear decay to 0"),
    "--qk-clip-tau": ("qk_clip_tau", float, "QK-Clip threshold on MLA max logits (default 100)"),
    "--vocab-size": ("vocab_size", int, "tokenizer / model vocabulary (default: the preset's)"),
    "--threads": ("threads", int, "torch intra-op threads"),
    "--capacity-factor": (
        "capacity_factor",
        float,
        "distributed: expert slots per (expert, rank) = ceil(CF*tokens*k/E) (default 1.25; E/k: no drops)",
    ),
    "--max-bad-steps": ("max_bad_steps", int, "consecutive non-finite steps that stop the run (default 5)"),
    "--prompt": ("sample_prompt", str, "prompt of the sample printed at the end"),
    "--sample-tokens": ("sample_tokens", int, "tokens of that sample (0: none)"),
}


def _train_args(p: argparse.ArgumentParser) -> None:
    p.description = "Train a K3 model (default: k3-mini on the Python stdlib for 10 minutes on CPU)."
    for flag, (_, typ, help_) in _TRAIN_FLAGS.items():
        choices = {"--optimizer": ("muon", "adamw"), "--schedule": ("cosine", "wsd")}.get(flag)
        p.add_argument(flag, type=typ, default=None, help=help_, choices=choices)
    p.add_argument("--resume", metavar="DIR", help="continue a run (its directory or one checkpoint)")
    p.add_argument(
        "--task",
        choices=("text", "vision"),
        default=None,
        help="vision: the image-text task on a VL preset (k3-tiny-vl; k3.train.vl, docs/vision.md)",
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        default=None,
        help="skip and count bad records of --data (a line that is not JSON, no string 'text') "
        "instead of stopping at the first one",
    )
    p.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast for the forward")
    p.add_argument("--no-per-head", action="store_true", help="whole-matrix Muon (no per-head split)")
    p.add_argument("--no-qk-clip", action="store_true", help="disable QK-Clip")
    p.add_argument(
        "--qat",
        choices=("mx",),
        help="quantization-aware training: MXFP4 experts, MXFP8 activations (k3.quant.qat)",
    )
    p.add_argument(
        "--qat-from-step",
        type=int,
        default=None,
        metavar="N",
        help="with --qat: high precision for steps 0..N-1, QAT from optimizer step N on (default 0)",
    )
    dist = p.add_argument_group("distributed (docs/distributed.md)")
    dist.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="N processes on this machine via torchrun (gloo on CPU, NCCL on CUDA); "
        "--batch-size stays the global micro-batch",
    )
    dist.add_argument("--ep", type=int, metavar="E", help="expert-parallel size (default 1; dp = N / E)")
    p.set_defaults(_parser=p)


def _explicit_changes(args: argparse.Namespace) -> dict:
    """TrainConfig fields the command line sets explicitly."""
    changes = {
        field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in _TRAIN_FLAGS.items()
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.steps is not None:
        changes["minutes"] = None
    if args.bf16:
        changes["bf16"] = True
    if args.skip_bad:
        changes["skip_bad"] = True
    if args.no_per_head:
        changes["per_head"] = False
    if args.no_qk_clip:
        changes["qk_clip_tau"] = None
    if args.qat:
        changes["model_transforms"] = (f"qat-{args.qat}",)
    if args.qat_from_step is not None:
        changes["qat_from_step"] = args.qat_from_step
    return changes


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The demo recipe with the flags applied, or (--resume) the saved config with bookkeeping flags."""
    from k3.train.trainer import resume_config

    changes = _explicit_changes(args)
    if args.resume:
        return resume_config(args.resume, **changes)
    return TrainConfig().replace(**changes)


def _argv_of(args: argparse.Namespace, drop: tuple[str, ...] = ("nproc",)) -> list[str]:
    """The command line that parses back to `args` (minus `drop`): what the torchrun workers get."""
    argv = []
    for action in args._parser._actions:
        if not action.option_strings or action.dest in (*drop, "help"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False:
            continue
        flag = (
            action.option_strings[-1]
            if action.option_strings[-1].startswith("--")
            else action.option_strings[0]
        )
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return argv


def _parallel_options(args: argparse.Namespace):
    """ParallelOptions from --ep; None without it (then torchrun, --nproc or a DCP checkpoint to resume
    makes the run distributed, with ep = 1)."""
    if args.ep is None and args.nproc is None:
        return None
    from k3.train.distributed import ParallelOptions

    return ParallelOptions(ep=args.ep if args.ep is not None else 1)


def run_train(args: argparse.Namespace) -> int:
    if args.task == "vision":
        from k3.train.vl import run_from_train_cli

        return run_from_train_cli(args)
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"nproc: must be >= 1, got {args.nproc}")
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:  # not yet under torchrun: launch it
        from k3.parallel.launch import relaunch

        return relaunch(args.nproc, _argv_of(args))
    from k3.train.trainer import Trainer, TrainingStopped

    tc = train_config_from_args(args)
    try:
        trainer = Trainer(tc, resume=args.resume, parallel=_parallel_options(args))
    except KeyboardInterrupt:  # during data preparation: nothing to save yet
        print("interrupted before training started", file=sys.stderr)
        return 130
    try:
        summary = trainer.run()
    except TrainingStopped as e:
        print(f"k3 train: {e}", file=sys.stderr)
        return 1
    if summary["interrupted"]:
        print(
            f"interrupted: saved {summary['checkpoint']}; continue with `k3 train --resume {summary['out']}`",
            file=sys.stderr,
        )
        return 130
    return 0


# ---- eval / sample ---------------------------------------------------------------------------------


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.description = "Validation loss and bits per byte of a checkpoint directory."
    p.add_argument("dir", help="checkpoint directory (a run directory or checkpoints/step-N) or .gguf file")
    p.add_argument("--data", help="corpus whose validation split to use (default: the run's, else stdlib)")
    p.add_argument("--seq-len", type=int, help="default: the run's (else 256)")
    p.add_argument(
        "--batch-size", type=int, help="rows per forward (default: the run's final evaluation's, ~8k tokens)"
    )
    p.add_argument("--tokens", type=int, help="validation tokens to score (default: all of the split)")
    p.add_argument(
        "--parse",
        type=int,
        default=0,
        metavar="N",
        help="also sample N continuations per prompt and report the share of top-level blocks that parse",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _sample_args(p: argparse.ArgumentParser) -> None:
    p.description = "Sample a continuation from a checkpoint directory."
    p.add_argument("dir", help="checkpoint directory (a run directory or checkpoints/step-N) or .gguf file")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def _load(dir_: str):
    """(model, config, tokenizer, run TrainConfig or None) from a checkpoint directory."""
    from k3.checkpoint import load_checkpoint
    from k3.export.gguf_read import is_gguf, load_gguf
    from k3.tokenizer import K3Tokenizer
    from k3.train.checkpointing import model_dir

    if is_gguf(dir_):  # a kimi-k3 GGUF file: its model and tokenizer, no run settings
        gguf = load_gguf(dir_)
        return gguf.model.float().eval(), gguf.config, gguf.tokenizer, None
    d = model_dir(dir_)  # a run directory: its newest model (a killed run has only checkpoints)
    if not (d / "config.json").exists():
        raise ValueError(f"dir: {d} holds no config.json (not a checkpoint directory)")
    model, config = load_checkpoint(d)
    tok_dir = next((p for p in (d, d.parent.parent) if (p / "tokenizer_config.json").exists()), None)
    if tok_dir is None:
        raise ValueError(f"dir: no tokenizer files in {d}")
    tc_path = next(
        (p / "train_config.json" for p in (d, d.parent.parent) if (p / "train_config.json").exists()), None
    )
    tc = TrainConfig.from_json(tc_path.read_text()) if tc_path else None
    return model.float().eval(), config, K3Tokenizer.from_dir(tok_dir), tc


def run_eval(args: argparse.Namespace) -> int:
    from k3.data import load_corpus, tokenize_documents
    from k3.train.evaluate import evaluate, token_byte_lengths

    model, _, tok, tc = _load(args.dir)
    data = args.data if args.data is not None else (tc.data if tc else None)
    val_percent = tc.val_percent if tc else 2.0
    docs = tokenize_documents(tok, load_corpus(data, "val", val_percent).documents)
    if docs.num_docs == 0:
        raise ValueError(f"data: the validation split of {data or 'the stdlib'} is empty")
    from k3.data.eval_set import build_eval_set
    from k3.train.evaluate import eval_batch_rows

    run = tc or TrainConfig()  # with the run's settings the numbers equal its final evaluation
    seq_len = args.seq_len or run.seq_len
    es = build_eval_set(docs, seq_len, tok.eos_id)
    rows = es.rows if not args.tokens else min(es.rows, -(-args.tokens // seq_len))
    batch = args.batch_size or eval_batch_rows(seq_len, run.batch_size, 1, rows)  # the final one's batches
    res = evaluate(
        model,
        es,
        token_byte_lengths(tok),
        tok.eos_id,
        seq_len=seq_len,
        batch_size=batch,
        max_tokens=args.tokens,  # None: the whole split, as the run's final evaluation
        bf16=run.bf16,
        inference=True,
    )
    res["data"] = data or "stdlib"
    if not args.tokens:  # the whole split: the compressors on exactly the scored bytes
        from k3.train.baselines import compressor_bpb, eval_set_bytes

        order = es.order
        res["baselines_bpb"] = compressor_bpb(eval_set_bytes(docs, order, tok, token_byte_lengths(tok)))
    if args.parse:
        from k3.train import samples as smp

        texts = smp.sample_texts(
            model, tok, smp.PARSE_PROMPTS, args.parse, smp.PARSE_TOKENS, run.sample_temperature, smp.TOP_K,
            run.seed,
        )  # fmt: skip
        res["parse_fraction"], res["parsed_blocks"], res["sampled_blocks"] = smp.parse_fraction(texts)
    if args.json:
        print(json.dumps(res))
        return 0
    print(
        f"val loss {res['val_loss']:.4f} nats/token | val bpb {res['val_bpb']:.4f} | "
        f"{res['tokens']:,} tokens ({res['bytes']:,} bytes) of {res['data']}"
    )
    if "baselines_bpb" in res:
        print("same bytes: " + " | ".join(f"{k} {v:.4f}" for k, v in res["baselines_bpb"].items()))
    if args.parse:
        print(
            f"sampled top-level blocks that parse: {res['parsed_blocks']} of {res['sampled_blocks']} "
            f"({100 * res['parse_fraction']:.0f} %)"
        )
    return 0


def run_sample(args: argparse.Namespace) -> int:
    from k3.train.evaluate import sample_text

    model, _, tok, _ = _load(args.dir)
    print(
        sample_text(model, tok, args.prompt, args.max_tokens, args.temperature, args.top_k or None, args.seed)
    )
    return 0


# ---- ablate ----------------------------------------------------------------------------------------


def _ablate_args(p: argparse.ArgumentParser) -> None:
    from k3.train.ablate import add_ablate_arguments

    add_ablate_arguments(p)


def run_ablate(args: argparse.Namespace) -> int:
    from k3.train.ablate import run_from_args

    return run_from_args(args)
