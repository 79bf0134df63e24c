"""The result format of a bench script: `python bench/X.py --json PATH` writes one JSON object

    {"bench": "prefix_cache",                      # the script's name
     "figures": [                                  # the headline numbers, one row each in bench.md
        {"figure": "TTFT at the last turn, cache on vs off",
         "value": 0.031, "unit": "s",              # what we measured
         "peer": "cache off", "peer_value": 0.52,  # what it is compared with, measured in the same run
         "ratio": 16.8,                            # the figure's ratio (here peer / value: a speedup)
         "goal": 10, "goal_op": ">="},             # the ratio's goal; ">=", "<=" or "~" (|ratio-1| <= goal)
        ...],
     "params": {...},                              # the settings the run used (preset, lengths, threads)
     ...}                                          # anything else the bench wants to keep (raw timings)

`ratio` is stated by the bench (it knows which way is better); when it is absent and both `value` and
`peer_value` are there it is value / peer_value. `peer`, `peer_value`, `ratio`, `goal` may be null.
`load_result` also accepts a file without "figures" (every top-level number becomes a figure without a
peer), so a bench that has not adopted the format still shows up in the table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GOAL_OPS = (">=", "<=", "~")


def figure(
    name: str,
    value: float,
    unit: str = "",
    peer: str | None = None,
    peer_value: float | None = None,
    ratio: float | None = None,
    goal: float | None = None,
    goal_op: str = ">=",
    **extra: Any,
) -> dict:
    """One figure row (see the module doc); `ratio` defaults to value / peer_value."""
    if goal_op not in GOAL_OPS:
        raise ValueError(f"goal_op: must be one of {GOAL_OPS}, got {goal_op!r}")
    if ratio is None and peer_value:
        ratio = value / peer_value
    return dict(
        figure=name,
        value=value,
        unit=unit,
        peer=peer,
        peer_value=peer_value,
        ratio=ratio,
        goal=goal,
        goal_op=goal_op,
        **extra,
    )


def write_result(
    path: str | Path, bench: str, figures: list[dict], params: dict | None = None, **extra
) -> None:
    """Write a bench's result JSON (NaN/inf become null: JSON has no such numbers)."""
    doc = {"bench": bench, "figures": figures, "params": params or {}, **extra}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(doc), indent=2) + "\n")


def goal_met(fig: dict) -> bool | None:
    """Whether the figure's ratio meets its goal; None when there is no goal or no ratio."""
    goal, ratio = fig.get("goal"), fig.get("ratio")
    if goal is None or ratio is None:
        return None
    op = fig.get("goal_op", ">=")
    if op == ">=":
        return ratio >= goal
    if op == "<=":
        return ratio <= goal
    return abs(ratio - 1.0) <= goal


def load_result(path: str | Path, bench: str) -> dict:
    """Read a bench's JSON and normalise it to the format above; ValueError if it is not a JSON object."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{bench}: no readable result JSON at {path}: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{bench}: result JSON at {path} is not an object")
    figs = doc.get("figures")
    if isinstance(figs, dict):  # {"name": {...}} -> [{"figure": "name", ...}]
        figs = [
            {"figure": k, **v} if isinstance(v, dict) else {"figure": k, "value": v} for k, v in figs.items()
        ]
    if figs is None:
        rest = {k: v for k, v in doc.items() if k != "params"}
        figs = [{"figure": k, "value": v} for k, v in _numbers(rest)]
    if not isinstance(figs, list) or not all(isinstance(f, dict) for f in figs):
        raise ValueError(f"{bench}: 'figures' in {path} must be a list of objects")
    out = []
    for f in figs:
        f = {"figure": str(f.get("figure", f.get("name", "?"))), **f}
        f.setdefault("unit", "")
        f.setdefault("goal_op", ">=")
        if f.get("ratio") is None and f.get("peer_value") and isinstance(f.get("value"), int | float):
            f["ratio"] = f["value"] / f["peer_value"]
        f["goal_met"] = goal_met(f)
        out.append(f)
    return {**doc, "bench": doc.get("bench", bench), "figures": out}


def _numbers(doc: dict, prefix: str = ""):
    """(dotted key, number) for every numeric leaf of a nested dict."""
    for k, v in doc.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int | float):
            yield prefix + k, v
        elif isinstance(v, dict):
            yield from _numbers(v, f"{prefix}{k}.")


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
