"""Exponential moving averages of step metrics (`reward_mean_ema`), for a curve one can read.

A step's reward is noisy (a few groups of a few samples); its EMA shows the trend on the console
line and in metrics.jsonl. ema_1 = x_1, then ema_t = decay · ema_(t−1) + (1 − decay) · x_t
(started at the first value, no bias correction). A step without the metric (a skipped batch)
carries the last EMA on.

State: the EMA is the previous step's `<key>_ema` metric, and a checkpoint stores its step's
metrics (trainer_state.json), so a resumed run continues the EMA from the checkpoint it
resumed from: `resumed_metrics` reads them back. Nothing else is kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.backend.checkpoint import STATE_JSON, find_latest_checkpoint


def ema_metrics(previous: Mapping[str, Any], metrics: Mapping[str, Any], keys: Sequence[str],
                decay: float) -> dict[str, float]:  # fmt: skip
    """`{key}_ema` for each of `keys`, from this step's `metrics` and the previous step's.

    Args:
        previous: the previous step's metrics (holding its `{key}_ema`); {} at the first step.
        metrics: this step's metrics.
        keys: which metrics to average.
        decay: weight of the past, in [0, 1).
    """
    out: dict[str, float] = {}
    for key in keys:
        last, value = previous.get(f"{key}_ema"), metrics.get(key)
        if isinstance(value, int | float):
            out[f"{key}_ema"] = (
                float(value) if last is None else decay * float(last) + (1 - decay) * float(value)
            )
        elif last is not None:
            out[f"{key}_ema"] = float(last)
    return out


def resumed_metrics(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The metrics saved with the latest checkpoint under `checkpoint_dir` ({} if none)."""
    latest = find_latest_checkpoint(checkpoint_dir)
    if latest is None:
        return {}
    state = json.loads((Path(latest) / STATE_JSON).read_text(encoding="utf-8"))
    return dict(state.get("metrics") or {})
