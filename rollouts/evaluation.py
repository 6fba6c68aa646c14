"""Held-out evaluation through inference engines: greedy decoding scored by a reward."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import trio

from rollouts.prompts import PromptItem
from rollouts.rewards import RewardFn, score_sample
from rollouts.types import Sample


async def evaluate_greedy(engine: Any, prompts: Sequence[PromptItem], reward_fn: RewardFn, *,
                          max_new_tokens: int = 16, max_concurrency: int = 64,
                          timeout_s: float = 30.0) -> dict[str, float]:  # fmt: skip
    """Greedy (temperature 0) completion of every prompt, scored by `reward_fn`.

    Returns:
        `reward_mean`, and `accuracy` (mean of the reward's "correct" component, or of
        reward > 0 when it has none).
    """
    if not prompts:
        return {}
    limiter = trio.CapacityLimiter(max_concurrency)
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    scored: list[Sample | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        async with limiter:
            r = await engine.generate(prompts[i].prompt_ids, params, rid=f"eval-{i}")
        sample = Sample(prompts[i].prompt_ids, r.output_ids, (1,) * len(r.output_ids),
                        r.output_logprobs or (), r.text, metadata=prompts[i].metadata)  # fmt: skip
        scored[i] = await score_sample(reward_fn, sample, timeout_s=timeout_s)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    done = [s for s in scored if s is not None]
    correct = [s.reward_components.get("correct", float(s.reward > 0)) for s in done]
    return {
        "accuracy": statistics.fmean(correct),
        "reward_mean": statistics.fmean(s.reward for s in done),
    }
