# Long file: one Trainer whose phases share its state and which SFTTrainer subclasses; they split together.
"""The training loop: setup, steps, eval / checkpoint cadence, time budget, Ctrl-C, final report.

    setup     seeds -> data + tokenizer (cached) -> model (meta, then init_weights) -> model transforms
              -> optimizers (param_groups) -> packed loader -> QK logit monitor -> resume (optional)
    loop      lr(step) -> train_step -> NaN streak check -> metrics / progress -> eval -> save
    finish    final eval, checkpoint, export (run dir = loadable checkpoint + tokenizer), sample, summary

Fixed costs: every phase outside the steps (data, baselines, model, matmul peak, evals during the loop,
final eval, checkpoint, samples, plots) is timed into `Trainer.phases` {name: seconds}, printed as it
ends and listed in the summary, with the part of them spent compiling C kernels on their first use
(`native_build_seconds`; once per machine, they are cached). Builds inside a step count as train time.

Length: `steps`, or `minutes` of training loop (periodic evals included): the step count is fixed
once the first `warmup` steps have been timed, so the schedule is a pure function of the step and a
resumed run continues to the same total. Learning rates are `base_lr * schedule(step)` set on every
group before each step; the schedule itself holds no state (the checkpoint stores the step and total).

Determinism: one seed drives init, data order and sampling. On CPU a run resumed from a checkpoint
produces the same losses bit for bit as the uninterrupted run (tests/train/test_resume.py).

Parallelism: the same loop runs on one process or on a torch.distributed dp x ep mesh (`k3 train
--nproc N`, torchrun). Everything that differs is a method of `self.rt` (k3.train.runtime.LocalRuntime,
or k3.train.distributed.DistributedRuntime: parallelize, DistMuon, all-reduces, DCP checkpoints). Under
it `batch_size` is the global micro-batch (each rank reads its batch_size / world_size rows), so a run
gives the same losses on any world size; rank 0 alone prints, logs and writes the run directory files.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from k3.config import K3Config
from k3.data import ShuffledRows, describe_data, prepare_data
from k3.data.eval_set import IGNORE_INDEX, build_eval_set
from k3.model.init import init_weights
from k3.model.transformer import K3ForCausalLM
from k3.ops import native
from k3.optim import warmup_cosine, wsd
from k3.quant.qat import maybe_enable_qat
from k3.train import checkpointing as ckpt
from k3.train.baselines import compressor_bpb, eval_rows_bytes, eval_set_bytes
from k3.train.config import TrainConfig
from k3.train.evaluate import eval_batch_rows, evaluate, token_byte_lengths, unigram_log_probs
from k3.train.metrics import (
    MetricsLog,
    ProgressBar,
    measure_matmul_peak,
    plot_losses,
    read_metrics,
)
from k3.train.param_groups import build_optimizers
from k3.train.runtime import LocalRuntime
from k3.train.step import MaxLogitMonitor, train_step


def _qat_mx(model: torch.nn.Module, config: K3Config) -> torch.nn.Module:
    from k3.quant.qat import convert_qat  # MXFP4 experts / MXFP8 activations, fake-quantized

    return convert_qat(model, "mx", enabled=False)  # switched on by maybe_enable_qat at qat_from_step


# name -> fn(model, model_config) returning the model to train; applied after init, before the optimizers
MODEL_TRANSFORMS: dict[str, Callable[[torch.nn.Module, K3Config], torch.nn.Module]] = {"qat-mx": _qat_mx}
CALIBRATION_STEPS = 8  # steps timed before a --minutes run fixes its step count
# a --minutes WSD run times its steps again here: the first steps run slower than the rest (allocator,
# caches), so the first estimate leaves ~15 % of the budget unused; moving the end is free while the lr
# still holds at its peak
RETIME_STEPS = (32, 128)
AUTO_EVALS = 4  # evaluations during a run with eval_every=None, evenly spaced


def eval_steps(total: int, n: int = AUTO_EVALS) -> set[int]:
    """Steps after which a run of `total` steps evaluates when eval_every is None: n evenly spaced
    points strictly inside the run (the final evaluation comes after the last step)."""
    return {round(total * i / (n + 1)) for i in range(1, n + 1)} - {0, total}


def register_model_transform(name: str, fn: Callable[[torch.nn.Module, K3Config], torch.nn.Module]) -> None:
    MODEL_TRANSFORMS[name] = fn


class TrainingStopped(RuntimeError):
    """Too many consecutive non-finite losses (the weights on disk stay finite)."""


def default_out_dir(preset: str, when: float | None = None) -> Path:
    name = Path(preset).stem if preset.endswith(".json") else preset
    stamp = datetime.fromtimestamp(when) if when is not None else datetime.now()
    return Path("runs") / f"{name}-{stamp.strftime('%Y%m%d-%H%M%S')}"


RESUME_OVERRIDABLE = (
    "steps",
    "minutes",
    "eval_every",
    "final_eval_tokens",
    "save_every",
    "keep",
    "log_every",
    "out",
    "threads",
    "sample_prompt",
    "sample_tokens",
)


def resume_config(resume: str | Path, **overrides) -> TrainConfig:
    """The TrainConfig saved in a run / checkpoint, with only bookkeeping fields (RESUME_OVERRIDABLE)
    changed -- anything else would make the continuation differ from the uninterrupted run."""
    bad = sorted(set(overrides) - set(RESUME_OVERRIDABLE))
    if bad:
        raise ValueError(f"resume: cannot change {bad} of a run; only {list(RESUME_OVERRIDABLE)}")
    saved = TrainConfig.from_json(ckpt.read_trainer_state(ckpt.resolve_checkpoint(resume))["train_config"])
    if overrides.get("steps") is not None:
        overrides.setdefault("minutes", None)
    return saved.replace(**overrides)


def lr_multiplier(tc: TrainConfig, step: int, total: int | None) -> float:
    """Schedule factor at `step` (0-based); warm-up only while `total` is not fixed yet."""
    warmup = min(tc.warmup_steps, total) if total else tc.warmup_steps
    if total is None:
        return min(1.0, (step + 1) / max(warmup, 1))
    if tc.schedule == "wsd":  # hold, then a linear decay to 0 over the last decay_frac of the steps
        warmup = min(warmup, total - round(tc.decay_frac * total))
        return wsd(step, total, warmup, decay_frac=tc.decay_frac, min_ratio=0.0)
    return warmup_cosine(step, total, warmup, tc.min_lr_ratio)


def make_runtime(parallel=None, resume_from: Path | None = None) -> LocalRuntime:
    """The distributed runtime under torchrun, with explicit `parallel` options (a
    k3.train.distributed.ParallelOptions) or to resume a DCP checkpoint; else one local process."""
    import os

    dcp = False
    if resume_from is not None:
        from k3.parallel.dcp import is_dcp_checkpoint

        dcp = is_dcp_checkpoint(resume_from)
    if parallel is None and "LOCAL_RANK" not in os.environ and not dcp:
        return LocalRuntime()
    from k3.train.distributed import DistributedRuntime

    return DistributedRuntime(parallel)


class _NoLog:
    """metrics.jsonl on ranks other than 0: nothing is written."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, kind: str, **fields) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass


def initial_state(tc) -> dict:
    """The run state a fresh run starts from (a resumed one reads it from its checkpoint)."""
    return {
        "step": 0,
        "total_steps": tc.steps,
        "tokens": 0,
        "bad_streak": 0,
        "skipped": 0,
        "train_seconds": 0.0,
        "threads": tc.threads,
    }


class Trainer:
    """One run. `Trainer(tc).run()` -> summary dict; `resume` is a run or checkpoint directory."""

    def __init__(
        self,
        tc: TrainConfig,
        resume: str | Path | None = None,
        progress: bool = True,
        quiet: bool = False,
        parallel=None,
    ):
        """`tc` is the run's config; with `resume`, build it with `resume_config` (the saved one).
        `parallel`: k3.train.distributed.ParallelOptions (the ep size); see make_runtime."""
        self.started = time.perf_counter()
        self.phases: dict[str, float] = {}  # fixed costs: phase -> seconds (see the module doc)
        self.native_build_seconds = 0.0  # the part of the phases spent compiling C kernels
        self.resume_from = ckpt.resolve_checkpoint(resume) if resume else None
        self.rt = make_runtime(parallel, self.resume_from)
        quiet = quiet or not self.rt.is_main
        self.quiet = quiet
        self._final: tuple[dict, Path] | None = None  # distributed finish: (final eval, checkpoint)
        self.out = (
            Path(tc.out)
            if tc.out
            else (
                self.resume_from.parent.parent
                if self.resume_from
                else default_out_dir(tc.preset, self.rt.broadcast(int(time.time())))  # one name on all ranks
            )
        )
        self.tc = tc.replace(out=str(self.out))
        self.bar = ProgressBar(tc.log_every) if progress and not quiet else None
        self.stop_requested = False
        try:
            self._setup()
        except BaseException:
            self.rt.close(clean=False)
            raise

    # ---- setup ------------------------------------------------------------------------------------
    def _setup(self) -> None:
        tc, rt = self.tc, self.rt
        if tc.threads:
            torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        random.seed(tc.seed)
        np.random.seed(tc.seed)
        self.config = tc.model_config()
        if tc.batch_size % rt.world_size:
            raise ValueError(
                f"batch_size={tc.batch_size} must be divisible by the world size {rt.world_size}"
            )
        if rt.distributed and tc.model_transforms:
            raise ValueError(
                f"model_transforms: {list(tc.model_transforms)} are not supported distributed yet"
            )
        with self.phase("data") as note:
            with rt.main_first():  # rank 0 trains / caches the tokenizer and tokens, the others load them
                self.data = prepare_data(
                    tc.data, self.config.vocab_size, tc.val_percent, skip_bad=tc.skip_bad
                )
            note.append("tokenizer and tokens " + ("cached" if self.data.cached else "built, now cached"))
        self.data_seconds = self.phases["data"]
        self._say("corpus: " + describe_data(self.data.stats, tc.data))
        self.tokenizer = self.data.tokenizer
        self.token_bytes = token_byte_lengths(self.tokenizer)
        self._token_bytes_t = torch.from_numpy(self.token_bytes)
        self.unigram_logp = unigram_log_probs(self.data.train, self.tokenizer.eos_id, self.config.vocab_size)
        if self.data.val.num_docs == 0:
            raise ValueError(
                f"data: the validation split of {tc.data or 'the stdlib'} is empty; add documents"
            )
        self.eval_set = build_eval_set(self.data.val, tc.seq_len, self.tokenizer.eos_id)
        with self.phase("model"):
            self.model = rt.prepare_model(self._build_model(), capacity_factor=tc.capacity_factor)
            self.optimizers = build_optimizers(self.model, **tc.optimizer_options(), muon_class=rt.muon_class)
        self.loader = ShuffledRows(  # rows in random order: a batch spans many files (k3/data/rows.py)
            self.data.train,
            tc.seq_len,
            tc.batch_size // rt.world_size,
            self.tokenizer.eos_id,
            tc.seed,
            rank=rt.rank,
            world_size=rt.world_size,
        )
        self.monitor = MaxLogitMonitor(self.model)
        self.state = initial_state(tc)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = (
            MetricsLog(self.out / "metrics.jsonl") if rt.is_main else _NoLog(self.out / "metrics.jsonl")
        )
        if self.resume_from is not None:
            self._resume()
        if rt.is_main:
            (self.out / "train_config.json").write_text(tc.to_json() + "\n")
        with self.phase("baselines") as note:
            self.baselines = self._baselines()
            note.append(", ".join(self.baselines) or "none: no final evaluation")
        self._say(f"parallel: {rt.describe()}" if rt.distributed else "")

    def _build_model(self) -> torch.nn.Module:
        cfg = self.config
        with torch.device("meta"):
            model = K3ForCausalLM(cfg)
        model.to_empty(device="cpu")
        init_weights(model, cfg.initializer_range, cfg.num_hidden_layers, seed=self.tc.seed)
        for name in self.tc.model_transforms:
            if name not in MODEL_TRANSFORMS:
                raise ValueError(
                    f"model_transforms: unknown {name!r}; registered: {sorted(MODEL_TRANSFORMS)}"
                )
            model = MODEL_TRANSFORMS[name](model, cfg)
        return model.train()

    def _resume(self) -> None:
        if self.rt.distributed and not (self.resume_from / ".metadata").exists():  # DCP's index file
            raise ValueError(
                f"resume: {self.resume_from} is a single-process checkpoint; resume it without --nproc"
            )
        trainer = self.rt.load_checkpoint(self.resume_from, self.model, self.optimizers)
        self.loader.load_state_dict(trainer["data"])
        self.state.update(trainer["counters"])
        if self.tc.threads is not None:
            self.state["threads"] = self.tc.threads
        if self.state["threads"]:
            torch.set_num_threads(self.state["threads"])
        if self.tc.steps is not None and self.tc.steps != self.state["total_steps"]:
            self.state["total_steps"] = self.tc.steps  # an explicit --steps extends/shortens the schedule
        self.log.truncate_after(self.state["step"])
        self._say(f"resumed from {self.resume_from} at step {self.state['step']}")

    def _baselines(self) -> dict[str, float]:
        """Bits per byte of the compressors and of the unigram model on exactly the bytes the final
        evaluation scores (k3.train.baselines; {} without a final evaluation); logged once as a
        `baselines` event for loss.png."""
        es, limit = self.eval_set, self.final_eval_limit()
        if limit == 0:
            return {}
        if limit is None or -(-limit // es.seq_len) >= es.rows:
            data = eval_set_bytes(self.data.val, es.order, self.tokenizer, self.token_bytes)
            labels = es.labels[es.labels != IGNORE_INDEX].numpy()
        else:
            rows = -(-limit // es.seq_len)
            data = eval_rows_bytes(es, rows, self.tokenizer)
            labels = es.labels[:rows][es.labels[:rows] != IGNORE_INDEX].numpy()
        out = compressor_bpb(data)
        out["unigram"] = float(-self.unigram_logp[labels].sum() / (math.log(2) * len(data)))
        if not any(r.get("event") == "baselines" for r in read_metrics(self.log.path)):
            self.log.write("event", step=0, event="baselines", bytes=len(data), bpb=out)
        return out

    # ---- helpers ----------------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str) -> Iterator[list[str]]:
        """Time a fixed cost: its seconds are added to `phases[name]` and printed when it ends, with
        whatever the body appended to the yielded list as details."""
        notes: list[str] = []
        t0, built = time.perf_counter(), native.build_seconds
        yield notes
        dt, built = time.perf_counter() - t0, native.build_seconds - built
        self.phases[name] = self.phases.get(name, 0.0) + dt
        if built >= 0.05:  # kernels compile on first use into the cache (k3.ops.native)
            notes.append(f"{built:.1f} s of it compiling native kernels")
            self.native_build_seconds += built
        self._say(f"{name}: {dt:.1f} s" + (f" ({'; '.join(notes)})" if notes else ""))

    def _say(self, text: str) -> None:
        if self.quiet or not text:
            return
        if self.bar is not None:
            self.bar.message(text)
        else:
            print(text, flush=True)

    def _set_lr(self, step: int) -> float:
        mult = lr_multiplier(self.tc, step, self.state["total_steps"])
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * mult
        return mult

    def _trainer_state(self) -> dict:
        return {
            "counters": dict(self.state),
            "data": self.loader.state_dict(),
            "train_config": self.tc.to_json(),
        }

    def save(self) -> Path:
        if self._final is not None:
            return self._final[1]
        path = self.rt.save_checkpoint(
            self.out,
            self.state["step"],
            self.model,
            self.config,
            self.optimizers,
            self._trainer_state(),
            tokenizer=self.tokenizer,
            keep=self.tc.keep,
        )
        self.log.write("event", step=self.state["step"], event="checkpoint", path=str(path))
        return path

    def run_eval(self, final: bool = False) -> dict | None:
        """Score the fixed evaluation set: its first `eval_tokens` targets during training; for the
        `final` evaluation its first `final_eval_tokens` (None: all of it, every validation byte, the
        compressors' input; 0: no final evaluation, returns None), in inference mode and large batches."""
        if self._final is not None:
            return self._final[0]
        tc = self.tc
        limit = self.final_eval_limit()
        if final and limit == 0:
            return None
        t0 = time.perf_counter()
        with self.phase("final eval" if final else "evals") as note:
            res = evaluate(
                self.model,
                self.eval_set,
                self.token_bytes,
                self.tokenizer.eos_id,
                seq_len=tc.seq_len,
                batch_size=self._final_eval_rows() if final else tc.batch_size,
                max_tokens=limit if final else tc.eval_tokens,
                bf16=tc.bf16,
                unigram_logp=self.unigram_logp,
                runtime=self.rt,
                inference=final,
            )
            res["seconds"] = time.perf_counter() - t0
            note.append(
                f"step {self.state['step']}, {res['tokens']:,} tokens: "
                f"val loss {res['val_loss']:.4f}, val bpb {res['val_bpb']:.4f}"
            )
        self.log.write("eval", step=self.state["step"], final=final, **res)
        if self.rt.is_main and not final:  # the end of the run draws the final plot
            self.plot()
        return res

    def _final_eval_rows(self) -> int:
        """Rows per forward of the final evaluation (k3.train.evaluate.eval_batch_rows)."""
        tc, es, limit = self.tc, self.eval_set, self.final_eval_limit()
        rows = es.rows if not limit else min(es.rows, -(-limit // es.seq_len))
        return eval_batch_rows(tc.seq_len, tc.batch_size, self.rt.world_size, rows)

    def final_eval_limit(self) -> int | None:
        """The final evaluation's targets (None: the whole split). `final_eval_tokens` when set; by default
        the whole split, unless the run is a short `--steps` one whose training costs less than scoring
        the split would (a forward is ~1/3 of a training step per token): then max(eval_tokens, 3 x its
        training tokens), so a `--steps 2` run of a large preset does not spend minutes on its final
        number (the summary says how many tokens it scored)."""
        tc, es = self.tc, self.eval_set
        if tc.final_eval_tokens is not None:
            return tc.final_eval_tokens
        if tc.steps is None or self.state["total_steps"] is None:  # a time-bounded run: the whole split
            return None
        trained = self.state["total_steps"] * tc.batch_size * tc.seq_len * tc.grad_accum
        split = es.rows * es.seq_len
        return None if 3 * trained >= split else max(tc.eval_tokens, 3 * trained)

    def plot(self) -> None:
        """Redraw loss.png from metrics.jsonl (a fixed cost: the "plots" phase)."""
        tc = self.tc
        t0 = time.perf_counter()
        plot_losses(self.log.path, self.out / "loss.png", f"{tc.preset} ({self.out.name})", tc.warmup_steps)
        self.phases["plots"] = self.phases.get("plots", 0.0) + time.perf_counter() - t0

    # ---- loop -------------------------------------------------------------------------------------
    def _fix_total(self, step_times: list[float], deadline: float) -> None:
        """--minutes: after CALIBRATION_STEPS, total = steps that fit before the deadline (evals included)."""
        tc = self.tc
        per_step = 1.05 * float(np.median(step_times[2:] or step_times))  # 5 %: steps slow down a little
        # an evaluation: forward only (~1/3 of a step per token) over eval_tokens
        per_eval = per_step / (3 * tc.grad_accum) * max(1, -(-tc.eval_tokens // (tc.seq_len * tc.batch_size)))
        left = deadline - time.perf_counter()
        if tc.eval_every is None:  # a fixed number of evaluations, whatever the length
            left -= AUTO_EVALS * per_eval
        per_step_all = per_step + (per_eval / tc.eval_every if tc.eval_every else 0.0)
        total = self.state["step"] + max(1, int(left / per_step_all))
        self.state["total_steps"] = self.rt.broadcast(max(total, self.state["step"] + 1, tc.warmup_steps + 1))
        self._say(
            f"time budget {tc.minutes:g} min -> {self.state['total_steps']} steps ({per_step:.2f} s/step)"
        )

    def _retime_total(self, step_times: list[float], deadline: float) -> None:
        """--minutes + wsd: refit the step count to the recent step time, if the lr is still at its peak
        under both the old and the new count (the schedule up to here is then the same either way)."""
        tc, s = self.tc, self.state
        per_step = 1.04 * float(np.median(step_times[CALIBRATION_STEPS:] or step_times))  # robust to a blip
        per_eval = per_step / (3 * tc.grad_accum) * max(1, -(-tc.eval_tokens // (tc.seq_len * tc.batch_size)))
        old = s["total_steps"]
        if tc.eval_every is None:
            evals = sum(e > s["step"] for e in eval_steps(old))
        else:
            evals = (old - s["step"]) // tc.eval_every if tc.eval_every else 0
        left = deadline - time.perf_counter() - evals * per_eval
        new = self.rt.broadcast(max(s["step"] + 1, s["step"] + int(left / per_step)))
        hold = lambda total: total - round(tc.decay_frac * total)  # noqa: E731 -- the decay's first step
        if new != old and s["step"] < min(hold(old), hold(new)) and tc.warmup_steps < hold(new):
            s["total_steps"] = new
            self._say(f"re-timed at step {s['step']}: {per_step:.2f} s/step -> {new} steps")

    def _eval_due(self, step: int) -> bool:
        """An evaluation during training after `step` (never at the last step: the final one follows)."""
        tc, total = self.tc, self.state["total_steps"]
        if step == total:
            return False
        if tc.eval_every is not None:
            return bool(tc.eval_every) and step % tc.eval_every == 0
        return total is not None and step in eval_steps(total)

    def _micro_batches(self) -> list[dict]:
        dev = self.rt.device
        batches = [next(self.loader) for _ in range(self.tc.grad_accum)]
        return batches if dev.type == "cpu" else [{k: v.to(dev) for k, v in b.items()} for b in batches]

    def _train_bpb(self, loss: float, batches: list[dict]) -> float:
        """The step's loss in bits per byte, with this rank's rows' bytes per target token."""
        labels = torch.cat([b["labels"].flatten() for b in batches]).cpu()
        labels = labels[labels != IGNORE_INDEX]
        nbytes = int(self._token_bytes_t[labels].sum())
        return loss * labels.numel() / (math.log(2) * max(nbytes, 1))

    def _log_step(self, res, mult: float, dt: float, rate: float, extra: dict) -> None:
        s = self.state
        rec = dict(
            step=s["step"],
            loss=res.loss,
            lr_mult=mult,
            grad_norm=res.grad_norm,
            tokens=s["tokens"],
            tok_per_s=rate,
            step_seconds=dt,
            skipped=res.skipped,
            **extra,
        )
        if res.moe_load:
            rec["moe_load_max"] = max(v[0] for v in res.moe_load.values())
            rec["moe_load_min"] = min(v[1] for v in res.moe_load.values())
            rec["moe_load"] = {
                k.split(".")[2]: [round(a, 3), round(b, 3)] for k, (a, b) in res.moe_load.items()
            }
        if res.max_logit:
            rec["max_logit"] = {k.split(".")[2]: round(v, 3) for k, v in res.max_logit.items()}
            rec["qk_clipped_heads"] = res.clipped_heads
        self.log.write("train", **rec)

    def _handle_bad(self, res) -> None:
        s = self.state
        s["bad_streak"] += 1
        s["skipped"] += 1
        self.log.write(
            "event", step=s["step"], event="skipped_non_finite", loss=res.loss, grad_norm=res.grad_norm
        )
        self._say(
            f"step {s['step']}: non-finite loss/grad ({res.loss}, {res.grad_norm}); step skipped "
            f"({s['bad_streak']} in a row)"
        )
        if s["bad_streak"] >= self.tc.max_bad_steps:
            raise TrainingStopped(
                f"stopping: {s['bad_streak']} consecutive non-finite steps (max_bad_steps="
                f"{self.tc.max_bad_steps}) at step {s['step']}; weights were never updated with them. "
                "Try a lower --lr, --grad-clip, or fp32 instead of --bf16."
            )

    def _loop(self) -> None:
        tc, s = self.tc, self.state
        start = time.perf_counter()
        budget = tc.minutes * 60 if tc.minutes and tc.steps is None else math.inf
        deadline = start + budget
        step_times: list[float] = []
        rate = 0.0
        qat_from = tc.qat_from_step if "qat-mx" in tc.model_transforms else None
        while not self.stop_requested and (s["total_steps"] is None or s["step"] < s["total_steps"]):
            maybe_enable_qat(self.model, s["step"], qat_from)
            mult = self._set_lr(s["step"])
            t = time.perf_counter()
            batches = self._micro_batches()
            res = train_step(
                self.model,
                batches,
                self.optimizers,
                grad_clip=tc.grad_clip,
                bf16=tc.bf16,
                monitor=self.monitor,
                qk_clip_tau=tc.qk_clip_tau,
                runtime=self.rt,
            )
            extra = self.rt.step_stats(self.model)
            dt = time.perf_counter() - t
            s["step"] += 1
            s["tokens"] += res.tokens
            s["train_seconds"] += dt
            step_times.append(dt)
            rate = res.tokens / dt if rate == 0 else 0.9 * rate + 0.1 * res.tokens / dt
            if res.skipped:
                self._handle_bad(res)
            else:
                s["bad_streak"] = 0
            self._log_step(res, mult, dt, rate, {**extra, "bpb": self._train_bpb(res.loss, batches)})
            if s["total_steps"] is None and len(step_times) >= CALIBRATION_STEPS:
                self._fix_total(step_times, deadline)
            elif (
                len(step_times) in RETIME_STEPS
                and tc.schedule == "wsd"
                and tc.steps is None
                and self.resume_from is None  # a resumed run keeps the total it started with
            ):
                self._retime_total(step_times, deadline)
            self._progress(res.loss, rate, step_times)
            if self._eval_due(s["step"]):
                self.run_eval()
            if tc.save_every and s["step"] % tc.save_every == 0:
                self.save()
            # every rank stops at the same step: Ctrl-C and the clock are local, the decision is not
            stop, late = self.rt.sum([self.stop_requested, time.perf_counter() > deadline + 0.15 * budget])
            self.stop_requested = stop > 0
            if late:
                self._say("time budget exceeded by 15 %; stopping early")
                break
        self.loop_seconds = time.perf_counter() - start

    def _progress(self, loss: float, rate: float, step_times: list[float]) -> None:
        if self.bar is None:
            return
        s = self.state
        recent = step_times[-20:]
        eta = (s["total_steps"] - s["step"]) * sum(recent) / len(recent) if s["total_steps"] else float("nan")
        self.bar.update(s["step"], s["total_steps"], loss, rate, eta)

    # ---- run --------------------------------------------------------------------------------------
    def _on_sigint(self, signum, frame) -> None:
        if self.rt.distributed and time.monotonic() - getattr(self, "_sigint_at", -10.0) < 2.0:
            return  # torchrun forwards the terminal's Ctrl-C: the same interrupt arrives twice
        self._sigint_at = time.monotonic()
        already, self.stop_requested = self.stop_requested, True
        if already or not self.rt.distributed:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts at once
        self._say("interrupt: finishing this step, then saving (Ctrl-C again to abort)")

    def _choose_threads(self) -> float:
        """Measure the matmul peak; with `threads` unset, also with 1 thread and keep the faster count
        (on a CPU shared with other jobs, 2 threads that wait on each other can be 2x slower than 1).
        The choice is stored in the checkpoint, so a resumed run uses the same count (bit-exactness)."""
        dtype = torch.bfloat16 if self.tc.bf16 else torch.float32
        if self.state["threads"] is not None:
            torch.set_num_threads(self.state["threads"])
            return measure_matmul_peak(dtype, seconds=1.5)
        peaks = {}
        for n in sorted({torch.get_num_threads(), 1}, reverse=True):
            torch.set_num_threads(n)
            peaks[n] = measure_matmul_peak(dtype, seconds=0.75)
        best = max(peaks, key=peaks.get)
        torch.set_num_threads(best)
        self.state["threads"] = best
        if len(peaks) > 1:
            rates = ", ".join(f"{n} thread(s) {p / 1e9:.0f}" for n, p in peaks.items())
            self._say(f"matmul peak GFLOP/s: {rates} -> using {best}")
        return peaks[best]

    def run(self, measure_peak: bool = True) -> dict:
        """Train, evaluate, save, export, sample; returns the summary dict (also summary.json)."""
        previous = signal.signal(signal.SIGINT, self._on_sigint) if _main_thread() else None
        try:
            try:
                with self.phase("matmul peak"):
                    self.peak = self._choose_threads() if measure_peak else 0.0
                self._loop()
            finally:
                if previous is not None:
                    signal.signal(signal.SIGINT, previous)
                if self.bar is not None:
                    self.bar.close()
            summary = self.finish(interrupted=self.stop_requested)
        except BaseException:
            self.rt.close(clean=False)  # no barrier: the other ranks may never get there
            raise
        self.rt.close()
        return summary

    def finish(self, interrupted: bool = False) -> dict:
        from k3.train.report import finish_run  # the end-of-run report lives in its own file

        if not self.rt.distributed:
            return finish_run(self, interrupted)
        # the collective part on every rank: final eval, DCP checkpoint; rank 0 then consolidates it to
        # the official layout in the run directory and reports from that unsharded model (the sample)
        ev, path = self.run_eval(final=True), self.save()
        plain = self.rt.consolidate(path, self.out)
        self.rt.barrier()
        self._final = (ev, path)
        if not self.rt.is_main:
            return {"out": str(self.out), "interrupted": interrupted, "checkpoint": str(path), **(ev or {})}
        self.model = plain
        return finish_run(self, interrupted)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
