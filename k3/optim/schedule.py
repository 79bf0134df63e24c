"""Learning-rate schedules as pure functions of the step, returning a multiplier in [0, 1].

K3 (docs/spec_training.md#schedule): 1 % linear warm-up, then cosine decay.
WSD (warmup-stable-decay, MiniCPM arXiv 2404.06395) is the usual alternative for open-ended runs.

Conventions shared by both schedules, for steps 0, 1, ..., total - 1:
* warm-up: multiplier (step + 1) / warmup for step < warmup, so step 0 already moves the weights
  and step warmup - 1 reaches 1.0;
* steps >= total return the final value (min_ratio).
``lr_scheduler`` wraps either schedule in a torch LambdaLR (which multiplies each group's initial lr).
"""

import functools
import math
from collections.abc import Callable

import torch


def _check(step: int, total: int, warmup: int, min_ratio: float) -> None:
    if total <= 0:
        raise ValueError(f"total: must be > 0, got {total}")
    if not 0 <= warmup <= total:
        raise ValueError(f"warmup: must be in [0, total={total}], got {warmup}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio: must be in [0, 1], got {min_ratio}")
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up, then cosine from 1.0 at step=warmup down to min_ratio at step=total."""
    _check(step, total, warmup, min_ratio)
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    progress = (step - warmup) / (total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd(step: int, total: int, warmup: int, decay_frac: float = 0.2, min_ratio: float = 0.0) -> float:
    """Linear warm-up, hold 1.0, then decay linearly to min_ratio over the last decay_frac of total steps.

    The decay starts at step total - round(decay_frac * total) (1.0 there) and reaches min_ratio at total.
    """
    _check(step, total, warmup, min_ratio)
    if not 0.0 <= decay_frac <= 1.0:
        raise ValueError(f"decay_frac: must be in [0, 1], got {decay_frac}")
    decay_steps = round(decay_frac * total)
    decay_start = total - decay_steps
    if warmup > decay_start:
        raise ValueError(f"warmup: {warmup} overlaps the decay, which starts at step {decay_start}")
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    if step < decay_start:
        return 1.0
    return 1.0 - (1.0 - min_ratio) * (step - decay_start) / decay_steps


SCHEDULES: dict[str, Callable[..., float]] = {"warmup_cosine": warmup_cosine, "wsd": wsd}


def lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, **kwargs
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose multiplier at step s is SCHEDULES[schedule](s, **kwargs) (total, warmup, ...)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {sorted(SCHEDULES)}, got {schedule!r}")
    fn = functools.partial(SCHEDULES[schedule], **kwargs)
    fn(0)  # validate kwargs now rather than at the first scheduler.step()
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
