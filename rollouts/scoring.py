"""Scoring the samples of one finished request together: one worker-thread call per batch.

Why: a group's samples come back together (one batched `/generate` call). Handing each to its
own worker thread cost ~0.2 ms of client CPU per sample, most of the rollout manager's own
overhead: a thread hand-off, an event-loop wake-up, a task and a cancel scope per sample.

Contract of `score_samples(reward_fn, samples, timeout_s=...)`: each sample ends up exactly as
`score_sample` would leave it (scored, or failed with the reason in `error`; `RewardError`
under `fail_fast`), in the order given.
- A sync reward runs in ONE worker-thread call for the batch, sample after sample, so the event
  loop never blocks; the thread comes from a `RewardThreads` pool (rollouts/reward_threads.py),
  never from trio's shared one. Each sample still has `timeout_s` of its own, counted from when
  the thread starts: the deadline follows the sample the thread is working on. A sample that runs past it is marked failed ("timed out")
  and the thread is abandoned (it stops once that call returns); the samples before it keep
  their rewards and those after it are scored by a fresh thread.
- A reward that raises or returns an invalid value fails only its own sample.
- An async reward is awaited for all samples concurrently, each under its own timeout.
- A single sample goes through `score_sample` itself.

Not covered: parallelism inside a batch for a sync reward that releases the GIL (e.g. one that
waits on a subprocess): its samples run one after another. Make such a reward async (e.g.
`trio.run_process`, or its own `trio.to_thread.run_sync` per sample) to score them
concurrently. A sample the abandoned thread had already started when it was abandoned may be
scored twice (once by each thread); only the fresh thread's result is kept.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Awaitable, Sequence
from typing import TypeAlias

import trio

from plumbing.errors import DropSample, RewardError
from plumbing.nursery import open_nursery
from rollouts.reward_calls import RewardFn, call_reward, is_async_reward, reward_name, split_reward
from rollouts.reward_threads import RewardThreads, RewardThreadsExhausted
from rollouts.types import Sample

_PENDING = object()

# One reward call's result: split_reward's (total, components), what it raised, or None (timed out)
RewardOutcome: TypeAlias = tuple[float, dict[str, float] | None] | Exception | None


async def score_sample(
    reward_fn: RewardFn,
    sample: Sample,
    *,
    timeout_s: float,
    fail_fast: bool = False,
    threads: RewardThreads | None = None,
    failure_reward: float | None = None,
) -> Sample:
    """`sample` with its reward (and components) set, or marked failed if the reward could not be computed.

    A reward that raises, returns a non-finite or non-numeric value, or runs past
    `timeout_s` marks the sample failed with the reason in `sample.error` (count these in
    metrics); it does not stop the run unless `fail_fast`. On timeout a sync reward's thread
    is abandoned, not killed (see the module docstring).
    Score only samples whose generation succeeded: a failed sample's error would be
    overwritten by the reward's.

    Args:
        reward_fn: the reward (sync or async; scalar or vector with "total").
        sample: the trajectory to score; its status is otherwise left as is.
        timeout_s: wall-clock budget for this reward call.
        fail_fast: raise instead of marking the sample failed.
        threads: the pool for sync rewards' threads (default: one for this call).
        failure_reward: if set, a reward that raised or timed out gives the sample this value
            (error kept in `sample.error`) instead of failing it; `DropSample` still fails it.

    Returns:
        The scored sample, or a failed copy.

    Raises:
        RewardError: only with `fail_fast`; names the sample and the cause.
        RewardThreadsExhausted: too many sync reward threads are hung (whatever `fail_fast`).
    """
    outcome: RewardOutcome = None
    with trio.move_on_after(timeout_s):
        try:
            outcome = split_reward(await call_reward(reward_fn, sample, threads=threads))
        except RewardThreadsExhausted:
            raise
        except Exception as exc:
            outcome = exc
    return settle_reward(reward_fn, sample, outcome, timeout_s=timeout_s, fail_fast=fail_fast,
                         failure_reward=failure_reward)  # fmt: skip


_DROPPED = "dropped the sample (DropSample)"


def reward_failure(before: Sample, after: Sample) -> str | None:
    """The error of a reward that failed on `before` (raised, timed out, gave no number), as
    scoring left it on `after`; None if it gave a reward or dropped the sample on purpose."""
    if before.status == "failed" or after.error is None or after.error == before.error:
        return None
    return None if _DROPPED in after.error else after.error


def settle_reward(reward_fn: RewardFn, sample: Sample, outcome: RewardOutcome, *,
                  timeout_s: float, fail_fast: bool,
                  failure_reward: float | None = None) -> Sample:  # fmt: skip
    """`sample` scored with `outcome`, or a failed copy naming the error (see `score_sample`).

    Raises:
        RewardError: the reward failed and `fail_fast` is set.
    """
    if isinstance(outcome, tuple):
        return sample.with_reward(*outcome)
    name = reward_name(reward_fn)
    if outcome is None:
        error = f"reward {name} timed out after {timeout_s} s"
    else:
        error = f"reward {name} raised {type(outcome).__name__}: {outcome}"
    if isinstance(outcome, DropSample):  # deliberate: regenerated, never scored
        return sample.failed(f"reward {name} {_DROPPED}: {outcome}")
    if fail_fast:
        raise RewardError(
            f"group {sample.group_id} sample {sample.index_in_group}: {error} "
            "(reward fail-fast is on; turn it off to mark such samples failed instead)"
        ) from outcome
    if failure_reward is not None:
        return dataclasses.replace(sample.with_reward(failure_reward), error=error)
    return sample.failed(error)


async def score_samples(
    reward_fn: RewardFn,
    samples: Sequence[Sample],
    *,
    timeout_s: float,
    fail_fast: bool = False,
    threads: RewardThreads | None = None,
    failure_reward: float | None = None,
) -> list[Sample]:
    """`samples` scored by `reward_fn` (or marked failed), in order. See the module docstring.

    Args:
        reward_fn: the reward (sync or async; scalar or vector with "total").
        samples: finished trajectories, e.g. the samples of one batched request.
        timeout_s: wall-clock budget of each sample's reward call.
        fail_fast: raise instead of marking a sample failed.
        threads: the pool for sync rewards' threads (default: one for this call).

    Raises:
        RewardError: only with `fail_fast`; names the first failed sample and the cause.
    """
    if len(samples) <= 1:
        return [await score_sample(reward_fn, s, timeout_s=timeout_s, fail_fast=fail_fast,
                                   threads=threads, failure_reward=failure_reward)
                for s in samples]  # fmt: skip
    if is_async_reward(reward_fn):
        out = list(samples)

        async def one(i: int) -> None:
            out[i] = await score_sample(reward_fn, samples[i], timeout_s=timeout_s,
                                        fail_fast=fail_fast, failure_reward=failure_reward)  # fmt: skip

        async with trio.open_nursery() as nursery:
            for i in range(len(samples)):
                nursery.start_soon(one, i)
        return out
    threads = threads or RewardThreads(1)
    out = []
    while len(out) < len(samples):
        todo = samples[len(out) :]
        results = await _run_in_thread(reward_fn, todo, timeout_s, threads)
        if len(results) < len(todo):
            results.append(None)  # the sample the thread was stuck on: timed out
        for sample, result in zip(todo, results, strict=False):
            if inspect.isawaitable(result):  # a sync callable that returned an awaitable
                result = await await_reward(result, timeout_s)
            out.append(settle_reward(reward_fn, sample, result,  # type: ignore[arg-type]
                                     timeout_s=timeout_s, fail_fast=fail_fast,
                                     failure_reward=failure_reward))  # fmt: skip
    return out


class _ThreadBatch:
    """What the worker thread scoring a batch shares with the event loop.

    The thread writes `results[i]` and `current`; the event loop only reads them. Each write is
    one reference assignment (atomic under the GIL), and `current` is a new tuple per sample, so
    "the thread is still on the same sample" is an identity check.
    """

    def __init__(self, samples: Sequence[Sample]) -> None:
        self.samples = samples
        self.results: list[object] = [_PENDING] * len(samples)
        self.current: tuple[int, float] = (0, time.perf_counter())  # (index, started at)
        self.abandoned = False

    def run(self, reward_fn: RewardFn) -> None:
        """Score every sample in order (in the worker thread); stop early once abandoned."""
        for i, sample in enumerate(self.samples):
            if self.abandoned:
                return
            self.current = (i, time.perf_counter())
            try:
                value = reward_fn(sample)
                self.results[i] = value if inspect.isawaitable(value) else split_reward(value)
            except Exception as exc:
                self.results[i] = exc


async def _run_in_thread(reward_fn: RewardFn, samples: Sequence[Sample], timeout_s: float,
                         threads: RewardThreads) -> list[object]:  # fmt: skip
    """Results for `samples` from one worker-thread call, in order (a `split_reward` tuple, an
    exception or an awaitable each). Shorter than `samples` when the sample right after the
    last result ran past `timeout_s`: the thread is then abandoned."""
    batch = _ThreadBatch(samples)
    # trio's clock is time.perf_counter() plus an offset (or virtual time under a MockClock)
    to_trio_time = trio.current_time() - time.perf_counter()
    finished, started = trio.Event(), trio.Event()

    def start_clock() -> None:  # the pool's slot is ours: the first sample's time starts now
        batch.current = (0, time.perf_counter())
        started.set()

    async def run() -> None:
        await threads.run_sync(batch.run, reward_fn, name=reward_name(reward_fn),
                               on_start=start_clock)  # fmt: skip
        finished.set()

    async with open_nursery() as nursery:  # RewardThreadsExhausted raises as itself
        nursery.start_soon(run)
        await started.wait()  # waits on the pool's other calls, each bounded by its timeout
        while not finished.is_set():
            current = batch.current
            with trio.move_on_at(current[1] + to_trio_time + timeout_s):
                await finished.wait()
            if not finished.is_set() and batch.current is current:  # stuck on one sample
                batch.abandoned = True
                nursery.cancel_scope.cancel()
                i = current[0]
                kept = batch.results[: i + 1]  # a copy: the abandoned thread may write on
                return kept if kept[i] is not _PENDING else kept[:i]
    return batch.results


async def await_reward(awaitable: Awaitable[object], timeout_s: float) -> RewardOutcome:
    """What a sync reward's returned awaitable gives, under `timeout_s` (None: timed out)."""
    with trio.move_on_after(timeout_s):
        try:
            return split_reward(await awaitable)
        except Exception as exc:
            return exc
    return None
