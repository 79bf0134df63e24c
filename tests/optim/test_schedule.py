"""LR schedules: boundary values, monotonicity, LambdaLR wrapper, bad arguments."""

import pytest
import torch

from k3.optim.schedule import lr_scheduler, warmup_cosine, wsd


def test_warmup_cosine_boundaries():
    total, warmup = 100, 10
    assert warmup_cosine(0, total, warmup) == pytest.approx(0.1)
    assert warmup_cosine(warmup - 1, total, warmup) == pytest.approx(1.0)
    assert warmup_cosine(warmup, total, warmup) == pytest.approx(1.0)
    assert warmup_cosine(55, total, warmup) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through cosine
    assert warmup_cosine(total, total, warmup) == pytest.approx(0.1)
    assert warmup_cosine(10 * total, total, warmup, min_ratio=0.0) == 0.0
    assert warmup_cosine(0, total, 0) == pytest.approx(1.0)  # no warm-up


def test_warmup_cosine_shape():
    vals = [warmup_cosine(s, 50, 5) for s in range(51)]
    assert all(0.0 <= v <= 1.0 for v in vals)
    assert all(a < b for a, b in zip(vals[:4], vals[1:5], strict=True))
    assert all(a >= b for a, b in zip(vals[5:], vals[6:], strict=False))


def test_wsd_boundaries():
    total, warmup = 100, 10  # decay over steps 80..100
    assert wsd(0, total, warmup) == pytest.approx(0.1)
    assert wsd(9, total, warmup) == pytest.approx(1.0)
    assert wsd(10, total, warmup) == 1.0
    assert wsd(79, total, warmup) == 1.0
    assert wsd(80, total, warmup) == pytest.approx(1.0)
    assert wsd(90, total, warmup) == pytest.approx(0.5)
    assert wsd(90, total, warmup, min_ratio=0.2) == pytest.approx(0.6)
    assert wsd(total, total, warmup) == 0.0
    assert wsd(99, total, warmup, decay_frac=0.0) == 1.0


def test_lambda_lr_wrapper():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = lr_scheduler(opt, "wsd", total=10, warmup=2, decay_frac=0.5)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * wsd(s, 10, 2, 0.5) for s in range(10)])
    assert seen[0] == pytest.approx(1.0) and seen[4] == pytest.approx(2.0) and seen[9] < seen[5]


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (warmup_cosine, dict(step=0, total=0, warmup=0), "total"),
        (warmup_cosine, dict(step=0, total=10, warmup=11), "warmup"),
        (warmup_cosine, dict(step=-1, total=10, warmup=1), "step"),
        (warmup_cosine, dict(step=0, total=10, warmup=1, min_ratio=1.5), "min_ratio"),
        (wsd, dict(step=0, total=10, warmup=9, decay_frac=0.5), "warmup"),
        (wsd, dict(step=0, total=10, warmup=1, decay_frac=2.0), "decay_frac"),
    ],
)
def test_bad_arguments(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(**kwargs)


def test_unknown_schedule_name():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="schedule"):
        lr_scheduler(opt, "linear", total=10, warmup=1)
