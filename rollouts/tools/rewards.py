"""Tool rewards and per-batch tool metrics: pure functions of samples' `tool_calls`.

Both rewards are ordinary `RewardFn`s (`(sample) -> float`), meant as components of a vector
reward next to task correctness (`vector_reward({"correct": ..., "tool_success": ...}, ...)`),
not as the whole reward: a policy paid only for calling tools learns to call tools.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from rollouts.token_arrays import TokenArray
from rollouts.types import Sample


def tool_usage_reward(sample: Sample) -> float:
    """1.0 when the trajectory made at least one tool call, else 0.0."""
    return float(bool(sample.tool_calls))


def tool_success_reward(sample: Sample) -> float:
    """The share of the trajectory's tool calls that succeeded (0.0 when it made none)."""
    calls = sample.tool_calls
    return sum(c.success for c in calls) / len(calls) if calls else 0.0


def count_model_turns(sample: Sample) -> int:
    """Assistant turns in a trajectory: maximal runs of sampled tokens (loss_mask == 1).

    Tool/environment tokens (mask 0) separate the turns, so this needs no extra field.
    """
    mask = sample.loss_mask
    if type(mask) is TokenArray:  # a rollout worker's sample: counted in numpy, not per token
        n_on = mask.count_nonzero()
        if n_on in (0, len(mask)):  # one turn of model tokens (the common case), or none
            return int(n_on > 0)
        on = mask.array != 0
        return int(on[0]) + int(np.count_nonzero(on[1:] > on[:-1]))
    turns, previous = 0, 0
    for m in sample.loss_mask:
        if m and not previous:
            turns += 1
        previous = m
    return turns


def tool_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Tool-use statistics of a batch.

    Returns (empty dict for no samples):
        tool_calls_per_sample: mean number of calls.
        tool_use_rate: share of samples with at least one call.
        tool_success_rate: share of all calls that succeeded (only when there were calls).
        tool_unique_names: distinct tool names called across the batch (malformed calls with
            no name not counted).
        turns_per_sample: mean number of assistant turns (`count_model_turns`).
        tool_latency_mean_s: mean latency of a call (only when there were calls).
    """
    if not samples:
        return {}
    calls = [c for s in samples for c in s.tool_calls]
    out = {
        "tool_calls_per_sample": len(calls) / len(samples),
        "tool_use_rate": statistics.fmean(tool_usage_reward(s) for s in samples),
        "tool_unique_names": float(len({c.name for c in calls if c.name})),
        "turns_per_sample": statistics.fmean(count_model_turns(s) for s in samples),
    }
    if calls:
        out["tool_success_rate"] = sum(c.success for c in calls) / len(calls)
        out["tool_latency_mean_s"] = statistics.fmean(c.latency_s for c in calls)
    return out
