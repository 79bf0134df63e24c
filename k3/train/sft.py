"""`k3 sft RUN_OR_CHECKPOINT --out OUT`: supervised fine-tuning on conversations, QAT from the first step.

    k3 sft runs/demo --out runs/demo-sft                      # the embedded stdlib lookup task
    k3 sft runs/demo --data chats.jsonl --out runs/mine       # your own OpenAI fine-tuning JSONL
    k3 sft --resume runs/demo-sft                             # continue an interrupted run

`SFTTrainer` is the pretraining `Trainer` (k3.train.trainer: the loop, steps, schedule, checkpoints,
Ctrl-C, resume) with four pieces swapped: the model starts from the given checkpoint's weights (then
the model transforms: `qat-mx` by default, MXFP4 experts and MXFP8 activations fake-quantized from
step 0); the data are rendered conversations (k3.data.chats: the server's renderer, assistant-only
mask) packed by `PackedChats` (one segment per conversation); the evaluation is the mean loss over the
assistant tokens of held-out conversations; the end of the run saves, exports the run directory as a
loadable checkpoint and writes summary.json (no text samples).

Without `--data` the run writes the embedded task's training conversations (k3.agent.stdlib_task, the
modules outside the held-out split) to OUT/train.jsonl and a held-out set to OUT/heldout.jsonl (the
evaluation loss); with `--data`, `--val-data` gives the held-out file, else every 20th conversation is
held out. The SFT options live in the checkpoint's trainer state, so `--resume` needs nothing else.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from k3.train.config import TrainConfig
from k3.train.trainer import Trainer, initial_state

TASK_CONVERSATIONS = 4000  # the embedded task's training conversations (more than a default run visits)
HELDOUT_CONVERSATIONS = 16  # held-out conversations of the evaluation loss (~10k tokens, ~3 steps of time)
SFT_DEFAULTS = dict(  # TrainConfig fields of `k3 sft` (flags override them)
    minutes=8.0,
    seq_len=2048,
    batch_size=2,
    lr=0.004,
    adamw_lr=0.008,
    warmup_steps=10,
    schedule="wsd",
    decay_frac=0.3,
    save_every=100,
    eval_tokens=8192,
    sample_tokens=0,
    parse_samples=0,
    model_transforms=("qat-mx",),
)


@dataclass(frozen=True)
class SFTOptions:
    init: str  # the model directory the weights start from
    data: str  # training conversations (JSONL)
    val_data: str | None  # held-out conversations (None: every 20th of `data`)
    preserve_thinking: bool = True
    skip_bad: bool = False


class SFTTrainer(Trainer):
    """`Trainer` on conversations from a pretrained checkpoint (see the module doc)."""

    def __init__(self, tc: TrainConfig, sft: SFTOptions, resume: str | Path | None = None, **kw):
        self.sft = sft
        super().__init__(tc, resume=resume, **kw)

    # ---- setup: chats instead of a corpus, the checkpoint's tokenizer and weights ------------------
    def _setup(self) -> None:
        from k3.chat_format import ChatOptions
        from k3.data.chats import PackedChats, read_chats
        from k3.tokenizer import K3Tokenizer
        from k3.train.evaluate import token_byte_lengths
        from k3.train.metrics import MetricsLog
        from k3.train.step import MaxLogitMonitor

        tc, sft = self.tc, self.sft
        if tc.threads:
            torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        np.random.seed(tc.seed)
        self.config = tc.model_config()
        t0 = time.perf_counter()
        self.tokenizer = K3Tokenizer.from_dir(sft.init)
        opts = ChatOptions(preserve_thinking=sft.preserve_thinking)
        chats = read_chats(sft.data, self.tokenizer, tc.seq_len, opts, skip_bad=sft.skip_bad)
        if sft.val_data:
            self.train_chats = chats
            self.val_chats = read_chats(sft.val_data, self.tokenizer, tc.seq_len, opts, skip_bad=sft.skip_bad)
        else:
            self.train_chats, self.val_chats = _split_every(chats, 20)
        for name, cs in (("data", chats), ("val_data", self.val_chats if sft.val_data else None)):
            if cs is not None and cs.skipped:
                self._say(
                    f"{name}: skipped {len(cs.skipped)} bad line(s), first: line {cs.skipped[0][0]}: "
                    f"{cs.skipped[0][1]}"
                )
        self.data_seconds = time.perf_counter() - t0
        self.token_bytes = token_byte_lengths(self.tokenizer)
        self._token_bytes_t = torch.from_numpy(self.token_bytes)
        self.model = self.rt.prepare_model(self._build_model())
        from k3.train.param_groups import build_optimizers

        self.optimizers = build_optimizers(
            self.model, **tc.optimizer_options(), muon_class=self.rt.muon_class
        )
        pad = self.tokenizer.eos_id
        self.loader = PackedChats(self.train_chats, tc.seq_len, tc.batch_size, pad, seed=tc.seed)
        self.val_batches = (
            _val_batches(self.val_chats, tc.seq_len, tc.batch_size, pad) if self.val_chats is not None else []
        )
        self.monitor = MaxLogitMonitor(self.model)
        self.state = initial_state(tc)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = MetricsLog(self.out / "metrics.jsonl")
        if self.resume_from is not None:
            self._resume()
        (self.out / "train_config.json").write_text(tc.to_json() + "\n")
        (self.out / "sft_config.json").write_text(json.dumps(asdict(self.sft), indent=2) + "\n")
        self.baselines = {}
        self._say(
            f"sft: {len(self.train_chats)} training documents ({self.train_chats.num_supervised:,} of "
            f"{self.train_chats.num_tokens:,} tokens supervised), "
            f"{len(self.val_chats) if self.val_chats is not None else 0} held out"
        )

    def _build_model(self) -> torch.nn.Module:
        from k3.checkpoint import load_checkpoint
        from k3.model.transformer import K3ForCausalLM
        from k3.train.trainer import MODEL_TRANSFORMS

        with torch.device("meta"):
            model = K3ForCausalLM(self.config)
        model.to_empty(device="cpu")
        if self.resume_from is None:  # resuming loads the checkpoint's weights over these anyway
            load_checkpoint(self.sft.init, model=model)
        for name in self.tc.model_transforms:
            if name not in MODEL_TRANSFORMS:
                raise ValueError(
                    f"model_transforms: unknown {name!r}; registered: {sorted(MODEL_TRANSFORMS)}"
                )
            model = MODEL_TRANSFORMS[name](model, self.config)
        return model.train()

    def _trainer_state(self) -> dict:
        return {**super()._trainer_state(), "sft": asdict(self.sft)}

    # ---- evaluation: assistant-token loss of the held-out conversations -----------------------------
    def run_eval(self, final: bool = False) -> dict:
        t0 = time.perf_counter()
        res = assistant_loss(self.model, self.val_batches)
        res["seconds"] = time.perf_counter() - t0
        self.log.write("eval", step=self.state["step"], final=final, **res)
        self._say(f"step {self.state['step']}: held-out assistant loss {res['val_loss']:.4f}")
        return res

    def finish(self, interrupted: bool = False) -> dict:
        from k3.train.report import export_run_dir

        ev = self.run_eval(final=True)
        path = self.save()
        export_run_dir(path, self.out)
        s = self.state
        summary = {
            "out": str(self.out),
            "init": self.sft.init,
            "interrupted": interrupted,
            "steps": s["step"],
            "total_steps": s["total_steps"],
            "tokens": s["tokens"],
            "skipped_steps": s["skipped"],
            "train_seconds": s["train_seconds"],
            "loop_seconds": getattr(self, "loop_seconds", 0.0),
            "data_seconds": self.data_seconds,
            "val_loss": ev["val_loss"],
            "val_tokens": ev["tokens"],
            "qat": list(self.tc.model_transforms),
            "preserve_thinking": self.sft.preserve_thinking,
            "train_documents": len(self.train_chats),
            "checkpoint": str(path),
        }
        first = next((r for r in _read(self.log.path) if r.get("kind") == "eval"), None)
        if first is not None:
            summary["first_val_loss"] = first["val_loss"]
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not self.quiet:
            print(
                f"k3 sft: {s['step']} steps, {s['tokens']:,} tokens in {s['train_seconds']:.0f} s; "
                f"held-out assistant loss {ev['val_loss']:.4f}; model in {self.out}",
                flush=True,
            )
        return summary

    def run(self, measure_peak: bool = True) -> dict:
        if not self.resume_from and self.val_batches:
            self.run_eval()  # the starting point (step 0), for the summary's before / after
        return super().run(measure_peak)


def _read(path: Path) -> list[dict]:
    from k3.train.metrics import read_metrics

    return read_metrics(path)


def _split_every(chats, k: int):
    """(train, held out): every k-th document held out when there are at least k, else no held-out set."""
    from k3.data.chats import ChatSet

    if len(chats) < k:
        return chats, None
    parts = (ChatSet(), ChatSet())
    for i in range(len(chats)):
        part = parts[i % k == k - 1]
        part.ids.append(chats.ids[i])
        part.mask.append(chats.mask[i])
        part.lines.append(chats.lines[i])
    return parts


def _val_batches(chats, seq_len: int, batch_size: int, pad: int) -> list[dict]:
    """One pass over the held-out documents in stored order, as packed batches."""
    from k3.data.chats import PackedChats

    loader = PackedChats(chats, seq_len, batch_size, pad, shuffle=False)
    loader.single_pass = True
    out = []
    while not loader.exhausted:
        out.append(next(loader))
    return out


@torch.no_grad()
def assistant_loss(model: torch.nn.Module, batches: list[dict]) -> dict:
    """Mean next-token cross-entropy over the supervised (assistant) tokens of `batches`."""
    import torch.nn.functional as F

    training = model.training
    model.eval()
    total, n = 0.0, 0
    try:
        for b in batches:
            out = model(b["input_ids"], cu_seqlens=b["cu_seqlens"], doc_ids=b["doc_ids"])
            logits = out.logits if hasattr(out, "logits") else out[0]
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), b["labels"].flatten(), reduction="sum", ignore_index=-100
            )
            total += float(loss)
            n += int((b["labels"] != -100).sum())
    finally:
        model.train(training)
    return {"val_loss": total / n if n else math.nan, "tokens": n}


# ---- the command -------------------------------------------------------------------------------------

_FLAGS = {  # flag -> (TrainConfig field, type, help)
    "--minutes": ("minutes", float, "training-loop time budget (default 8)"),
    "--steps": ("steps", int, "optimizer steps (overrides --minutes)"),
    "--seed": ("seed", int, "seed of the data order and of the embedded task's conversations (default 0)"),
    "--seq-len": ("seq_len", int, "tokens per packed row; longer conversations are bad lines (default 2048)"),
    "--batch-size": ("batch_size", int, "rows per step (default 2)"),
    "--lr": ("lr", float, "Muon learning rate (default 0.004)"),
    "--adamw-lr": ("adamw_lr", float, "AdamW learning rate (default 0.008)"),
    "--warmup-steps": ("warmup_steps", int, "linear warm-up steps (default 10)"),
    "--save-every": ("save_every", int, "checkpoint every N steps (default 100)"),
    "--threads": ("threads", int, "torch intra-op threads"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Supervised fine-tuning on conversations (OpenAI fine-tuning JSONL), QAT from step 0."
    p.add_argument("init", nargs="?", metavar="RUN_OR_CHECKPOINT", help="the pretrained run or checkpoint")
    p.add_argument("--data", help="conversations, one JSON object a line (default: the embedded stdlib task)")
    p.add_argument("--val-data", help="held-out conversations (default: every 20th of --data)")
    p.add_argument("--out", help="run directory (default runs/sft-<timestamp>)")
    p.add_argument("--resume", metavar="DIR", help="continue an SFT run (its directory or one checkpoint)")
    p.add_argument(
        "--skip-bad", action="store_true", help="skip and count malformed lines instead of stopping"
    )
    p.add_argument(
        "--qat",
        choices=("mx", "none"),
        default="mx",
        help="mx (default): MXFP4 experts, MXFP8 activations from the first step; none: no QAT",
    )
    p.add_argument(
        "--no-preserve-thinking",
        action="store_true",
        help="render earlier assistant turns' thinking empty (as the server does for "
        "preserve_thinking=false)",
    )
    p.add_argument(
        "--conversations",
        type=int,
        default=TASK_CONVERSATIONS,
        help=f"embedded task: training conversations to generate (default {TASK_CONVERSATIONS})",
    )
    for flag, (_, typ, help_) in _FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=help_)


def _new_run(args) -> tuple[TrainConfig, SFTOptions]:
    from k3.agent import stdlib_task
    from k3.train.checkpointing import model_dir

    if not args.init:
        raise ValueError("init: give the pretrained run or checkpoint directory (or --resume DIR)")
    init = model_dir(args.init)
    if not (init / "config.json").exists() or not (init / "tokenizer.json").exists():
        raise ValueError(f"init: {args.init} holds no model with a tokenizer (config.json, tokenizer.json)")
    out = Path(args.out) if args.out else Path("runs") / f"sft-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    changes = {f: getattr(args, flag[2:].replace("-", "_")) for flag, (f, _, _) in _FLAGS.items()}
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.steps is not None:
        changes["minutes"] = None
    tc = TrainConfig(**{**SFT_DEFAULTS, **changes}).replace(
        preset=str(init / "config.json"),
        out=str(out),
        model_transforms=("qat-mx",) if args.qat == "mx" else (),
    )
    data, val = args.data, args.val_data
    if data is None:  # the embedded task, written out so that a resumed run reads the same conversations
        if args.conversations < 1:
            raise ValueError(f"conversations: must be >= 1, got {args.conversations}")
        data, val = str(out / "train.jsonl"), str(out / "heldout.jsonl")
        stdlib_task.write_jsonl(stdlib_task.conversations(args.conversations, "train", tc.seed), data)
        stdlib_task.write_jsonl(stdlib_task.conversations(HELDOUT_CONVERSATIONS, "heldout", tc.seed), val)
    tc = tc.replace(data=data)
    sft = SFTOptions(
        init=str(init),
        data=data,
        val_data=val,
        preserve_thinking=not args.no_preserve_thinking,
        skip_bad=args.skip_bad,
    )
    return tc, sft


def run(args: argparse.Namespace) -> int:
    from k3.train import checkpointing as ckpt
    from k3.train.trainer import TrainingStopped, resume_config

    if args.resume:
        state = ckpt.read_trainer_state(ckpt.resolve_checkpoint(args.resume))
        if "sft" not in state:
            raise ValueError(f"resume: {args.resume} is not an SFT run (use `k3 train --resume`)")
        over = {
            k: v
            for k, v in (("steps", args.steps), ("minutes", args.minutes), ("threads", args.threads))
            if v is not None
        }
        tc, sft = resume_config(args.resume, **over), SFTOptions(**state["sft"])
    else:
        tc, sft = _new_run(args)
    try:
        summary = SFTTrainer(tc, sft, resume=args.resume).run()
    except TrainingStopped as e:
        print(f"k3 sft: {e}", file=sys.stderr)
        return 1
    if summary["interrupted"]:
        print(f"interrupted; continue with `k3 sft --resume {summary['out']}`", file=sys.stderr)
        return 130
    return 0
