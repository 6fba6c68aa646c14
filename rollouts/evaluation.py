"""Held-out evaluation through inference engines: greedy episodes scored by a reward.

A sample whose reward could not be computed (it raised, timed out, returned a non-number) is a
reward failure, not a wrong answer: it is counted apart (`reward_failed`) and left out of
`accuracy` and `reward_mean`, and the errors are logged, deduplicated with counts. A prompt
whose episode failed (at the engine after the pool's own retries, or in its agent or
environment: a failed sample before any reward) is counted in `failed` and left out too: an evaluation never ends a run. An episode aborted at the engine (a weight sync's
pause, a pool's rejoin, someone's abort_all) is no answer either: it is run again, after a short
backoff, up to `abort_retries` times, then counted in `aborted` and left out. `scored` says how
many answers `accuracy` is over; a WARNING line says when any prompt was left out.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import trio

from plumbing.errors import EngineError, leaf_errors
from rollouts.generate_fn import GenerateContext, GenerateFn, single_turn_generate
from rollouts.groups import summarize_errors
from rollouts.prompts import PromptItem
from rollouts.request_ids import RidPrefixes
from rollouts.reward_threads import RewardThreads
from rollouts.rewards import RewardFn
from rollouts.scoring import score_sample
from rollouts.stall import watch_event_loop
from rollouts.tools.rewards import tool_metrics
from rollouts.types import Sample

log = logging.getLogger("rollouts.evaluation")


async def evaluate_greedy(engine: Any, prompts: Sequence[PromptItem], reward_fn: RewardFn, *,
                          max_new_tokens: int = 16, max_concurrency: int = 64,
                          timeout_s: float = 30.0, generate_fn: GenerateFn = single_turn_generate,
                          tokenizer: Any = None,
                          reward_threads: RewardThreads | None = None,
                          stall_warning_s: float = 5.0,
                          on_scored: Callable[[int, Sample], None] | None = None,
                          abort_retries: int = 3) -> dict[str, float]:  # fmt: skip
    """One greedy (temperature 0) episode per prompt, scored by `reward_fn`.

    Args:
        generate_fn: how an episode runs (default one assistant turn; a multi-turn tool
            rollout evaluates tool use the same way it is trained).
        tokenizer: for generate functions that need it (multi-turn).
        reward_threads: the pool sync rewards run in (default: one for this call).
        stall_warning_s: log the function holding the event loop when it stalls this long.
        on_scored: called with (prompt index, scored sample) as each one is scored (e.g. to
            show a few to a person).
        abort_retries: times an episode aborted at the engine is run again (0.2 s backoff,
            doubling) before it is left out and counted in `aborted`.

    Returns:
        `failed` (prompts whose episode failed, at the engine or before), `aborted` (still aborted after
        `abort_retries`), `abort_retries` (episodes run again after an abort); `reward_mean` and
        `accuracy` (mean of the reward's "correct" component, or of reward > 0 when it has none)
        over the `scored` samples, those the reward scored (absent when it scored none);
        `reward_failed` and `reward_failure_rate` (samples it could not score); and, for
        multi-turn episodes, the tool metrics (`tool_success_rate`, `tool_calls_per_sample`, ...).
    """
    if not prompts:
        return {}
    limiter = trio.CapacityLimiter(max_concurrency)
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    scored: list[Sample | None] = [None] * len(prompts)
    engine_errors: Counter[str] = Counter()
    threads = reward_threads or RewardThreads()
    prefix = RidPrefixes("eval").next()  # never an earlier evaluation's rids (an abort hits all)

    aborted: list[int] = []  # prompts still aborted after their retries
    retried = [0]

    async def one(i: int) -> None:
        samples: list[Sample] = []
        for attempt in range(abort_retries + 1):
            if attempt:  # an abort (a sync's pause, a rejoin) passes: wait a little, run again
                retried[0] += 1
                await trio.sleep(min(0.2 * 2 ** (attempt - 1), 2.0))
            suffix = f"-a{attempt}" if attempt else ""
            ctx = GenerateContext(engine, params, limiter, f"{prefix}-{i}{suffix}", i, tokenizer)
            try:
                samples = await generate_fn(prompts[i], 1, ctx)
            except* EngineError as group:  # except*: a generate function may run a nursery
                engine_errors[str(leaf_errors(group)[0])] += 1
            if not samples or samples[0].status != "aborted":
                break
        if not samples:
            return
        if samples[0].status == "aborted":
            aborted.append(i)
            return
        if samples[0].status == "failed":  # no answer to score (an agent's refused call, say)
            engine_errors[samples[0].error or "failed"] += 1
            return
        scored[i] = await score_sample(reward_fn, samples[0], timeout_s=timeout_s,
                                       threads=threads)  # fmt: skip
        if on_scored is not None:
            on_scored(i, scored[i])

    async with watch_event_loop(stall_warning_s), trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    done = [s for s in scored if s is not None]
    n_failed = sum(engine_errors.values())
    if n_failed:
        log.warning("evaluation: %d of %d episodes failed (left out): %s",
                    n_failed, len(prompts), summarize_errors(engine_errors))  # fmt: skip
    ok = [s for s in done if s.status != "failed"]
    errors = Counter(s.error or "failed" for s in done if s.status == "failed")
    if errors:
        log.warning("evaluation: %d of %d samples could not be scored: %s", len(done) - len(ok),
                    len(done), summarize_errors(errors))  # fmt: skip
    if aborted:
        log.warning("evaluation: %d of %d prompts were still aborted at the engine after %d "
                    "tries each (left out)", len(aborted), len(prompts), abort_retries + 1)  # fmt: skip
    out = {"failed": float(n_failed), "aborted": float(len(aborted)),
           "abort_retries": float(retried[0]), "scored": float(len(ok)),
           "reward_failed": float(len(done) - len(ok)),
           "reward_failure_rate": (len(done) - len(ok)) / max(1, len(done))}  # fmt: skip
    if len(ok) < len(prompts):
        log.warning("evaluation: accuracy over %d of %d prompts (%d episodes failed, %d "
                    "aborted, %d reward failures)", len(ok), len(prompts), n_failed,
                    len(aborted), len(done) - len(ok))  # fmt: skip
    if ok:
        correct = [s.reward_components.get("correct", float(s.reward > 0)) for s in ok]
        out |= {"accuracy": statistics.fmean(correct),
                "reward_mean": statistics.fmean(s.reward for s in ok)}  # fmt: skip
    if generate_fn is not single_turn_generate or any(s.tool_calls for s in done):
        out |= tool_metrics(done)
    return out
