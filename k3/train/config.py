"""TrainConfig: everything a training run needs besides the model config, plus named recipes.

A run is `TrainConfig` (this file) + `K3Config` (k3/config.py, the preset with `model_overrides`
applied). Recipes are Python functions returning a TrainConfig (torchtitan style,
CONTRIBUTING.md#configs-and-recipes); the CLI is a thin, flat override of their fields (`k3 train --lr ...`).

Defaults are tuned for the `k3 train` demo: k3-mini on the stdlib for 10 minutes on 2 CPU cores
(the sweep behind them: docs/training.md).
Muon's lr is in AdamW units (the update RMS is matched to 0.2, Moonlight), so `lr` and `adamw_lr` can be
similar; small models like a large lr.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from k3.config import K3Config, load_config

OPTIMIZERS = ("muon", "adamw")
SCHEDULES = ("cosine", "wsd")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `steps` or `minutes` bounds it (`steps` wins when both are set)."""

    # model and data
    preset: str = "k3-mini"  # a preset name or a config.json path
    model_overrides: dict = field(default_factory=dict)  # K3Config fields to replace (ablations)
    data: str | None = None  # None: the Python standard library
    vocab_size: int | None = None  # None: the preset's vocab_size
    val_percent: float = 2.0
    skip_bad: bool = False  # skip and count bad records of `data` (k3.data.corpus) instead of stopping
    # length of the run
    steps: int | None = None
    minutes: float | None = 10.0
    # batch
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1
    # optimisation
    optimizer: str = "muon"
    per_head: bool = True
    lr: float = 0.008  # Muon (AdamW-matched units)
    adamw_lr: float = 0.016  # embeddings, lm_head, norms, scalars (and everything with optimizer="adamw")
    weight_decay: float = 0.1
    momentum: float = 0.95
    betas: tuple[float, float] = (0.9, 0.95)
    schedule: str = "wsd"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine: the final lr over the peak
    decay_frac: float = 0.2  # wsd: the last fraction of the steps, decaying linearly to 0
    grad_clip: float = 1.0
    qk_clip_tau: float | None = 100.0  # None: no QK-Clip
    bf16: bool = False
    # distributed runs only (k3 train --nproc, docs/distributed.md): expert slots per (expert, source
    # rank) = ceil(capacity_factor * tokens * k / E); >= E / k never drops a token
    capacity_factor: float = 1.25
    # bookkeeping
    seed: int = 0
    out: str | None = None  # None: runs/<preset>-<timestamp>
    eval_every: int | None = None  # steps; 0: only at the end; None: 4 evaluations spread over the run
    eval_tokens: int = 16384  # validation tokens per evaluation during training
    final_eval_tokens: int | None = None  # the final evaluation's targets; 0: none; None: the whole split
    # (a short `steps` run: at most max(eval_tokens, 3 x its training tokens), Trainer.final_eval_limit)
    save_every: int = 200  # steps; 0: only at the end
    keep: int = 2  # training checkpoints kept
    log_every: int = 10
    max_bad_steps: int = 5  # consecutive NaN/inf losses before the run stops
    sample_prompt: str | None = None  # None: "def ", "class ", "import " (k3.train.samples.PROMPTS)
    sample_tokens: int = 96  # tokens of each printed continuation; 0: no samples (and no parse check)
    sample_temperature: float = 0.5  # of the printed and the parse-checked continuations (top-k 40)
    parse_samples: int = 4  # continuations per k3.train.samples.PARSE_PROMPTS prompt (0: no parse check)
    threads: int | None = None  # torch intra-op threads; None: torch's default
    # hooks for later issues: names in k3.train.trainer.MODEL_TRANSFORMS applied after init (e.g. "qat-mx")
    model_transforms: tuple[str, ...] = ()
    qat_from_step: int = 0  # with a "qat-*" transform: fake quantization from this optimizer step on

    def __post_init__(self) -> None:
        def check(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"train config '{key}': {msg}")

        for key in (
            "seq_len",
            "batch_size",
            "grad_accum",
            "warmup_steps",
            "keep",
            "log_every",
            "max_bad_steps",
        ):
            v = getattr(self, key)
            check(isinstance(v, int) and v >= (0 if key == "warmup_steps" else 1), key, f"bad value {v!r}")
        for key in (
            "eval_every",
            "save_every",
            "eval_tokens",
            "sample_tokens",
            "parse_samples",
            "final_eval_tokens",
        ):
            v = getattr(self, key)
            check(
                (v is None and key in ("eval_every", "final_eval_tokens")) or (isinstance(v, int) and v >= 0),
                key,
                "must be an int >= 0",
            )
        check(self.steps is None or self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        check(self.minutes is None or self.minutes > 0, "minutes", f"must be > 0, got {self.minutes}")
        check(self.steps is not None or self.minutes is not None, "steps", "set steps or minutes")
        check(
            self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {OPTIMIZERS}, got {self.optimizer!r}"
        )
        check(self.schedule in SCHEDULES, "schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        for key in ("lr", "adamw_lr", "weight_decay", "grad_clip", "sample_temperature"):
            check(getattr(self, key) >= 0, key, "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(0 < self.decay_frac <= 1, "decay_frac", f"must be in (0, 1], got {self.decay_frac}")
        check(self.qk_clip_tau is None or self.qk_clip_tau > 0, "qk_clip_tau", "must be > 0 or None")
        check(0 < self.val_percent < 100, "val_percent", "must be in (0, 100)")
        check(self.threads is None or self.threads >= 1, "threads", "must be >= 1")
        check(self.capacity_factor > 0, "capacity_factor", f"must be > 0, got {self.capacity_factor}")
        check(
            isinstance(self.qat_from_step, int) and self.qat_from_step >= 0, "qat_from_step", "must be >= 0"
        )
        check(
            self.qat_from_step == 0 or any(t.startswith("qat-") for t in self.model_transforms),
            "qat_from_step",
            "needs a qat transform (--qat mx)",
        )

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def model_config(self) -> K3Config:
        """The preset with `vocab_size` and `model_overrides` applied."""
        cfg = load_config(self.preset)
        changes = dict(self.model_overrides)
        if self.vocab_size is not None:
            changes["vocab_size"] = self.vocab_size
        if "vocab_size" in changes:  # reserved block at the top of the vocab (docs/spec_text.md#tokenizer)
            base = changes["vocab_size"] - 256
            changes.update(bos_token_id=base, eos_token_id=base + 2, pad_token_id=base + 255)
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(K3Config)})
        if unknown:
            raise ValueError(f"model_overrides: unknown K3Config keys {unknown}")
        return cfg.replace(**changes) if changes else cfg

    def optimizer_options(self) -> dict[str, Any]:
        """The `k3.train.param_groups.build_optimizers` keyword arguments this config sets (one place for
        the trainer and the training bench)."""
        return dict(
            optimizer=self.optimizer,
            per_head=self.per_head,
            lr=self.lr,
            adamw_lr=self.adamw_lr,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            betas=self.betas,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        d = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"train config: unknown keys {unknown}")
        for key in ("betas", "model_transforms"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


# ---- recipes -------------------------------------------------------------------------------------

K2_MODEL = dict(
    mla_use_nope=False, bias_update="sign", hidden_act="silu", use_attn_res=False, use_latent_moe=False
)


def k3_mini_demo() -> TrainConfig:
    """`k3 train` with no arguments: k3-mini, stdlib, 10 minutes."""
    return TrainConfig()


def k3_recipe(base: TrainConfig) -> TrainConfig:
    """The K3 recipe: every K3 component on (the K3Config defaults) + Per-Head Muon + QK-Clip."""
    return base.replace(optimizer="muon", per_head=True)


def k2_recipe(base: TrainConfig) -> TrainConfig:
    """The K2 recipe: RoPE MLA, sign-update bias, SwiGLU, plain residual, plain MoE, whole-matrix Muon."""
    return base.replace(
        model_overrides={**base.model_overrides, **K2_MODEL}, optimizer="muon", per_head=False
    )


def nano_smoke(**changes: Any) -> TrainConfig:
    """A few seconds of k3-nano: tests and CI."""
    base = TrainConfig(
        preset="k3-nano",
        steps=8,
        minutes=None,
        seq_len=64,
        batch_size=4,
        warmup_steps=2,
        eval_every=0,
        eval_tokens=2048,
        save_every=0,
        log_every=1,
        sample_tokens=8,
    )
    return base.replace(**changes)
