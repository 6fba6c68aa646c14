"""Running a reward: call it (sync in a worker thread, async awaited), check what it returned.

Why a module of its own: this is the half of rewards that touches trio and threads, and that
every scorer needs (`rollouts.scoring`, `rollouts.stall`, `rollouts.thinking`); the builders in
`rollouts.rewards` are pure and only read the sample. The reward types (`RewardFn`,
`RewardValue`, `TOTAL`) live here, the lower of the two layers, and are re-exported there.

What is not covered: a sync reward that hangs cannot be killed. On timeout its thread is
abandoned: the sample is marked failed at once and the thread runs on until it returns,
counted by the `RewardThreads` pool it ran in (rollouts/reward_threads.py), which bounds both
the reward threads running and the hung ones, apart from trio's shared thread pool.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeAlias

from rollouts.reward_threads import RewardThreads
from rollouts.types import Sample

RewardValue: TypeAlias = float | Mapping[str, float]
RewardFn: TypeAlias = Callable[[Sample], RewardValue | Awaitable[RewardValue]]
Aggregator: TypeAlias = Callable[[Mapping[str, float]], float]

TOTAL = "total"
"""Key of the aggregated scalar in a vector reward's mapping."""


def scalar_reward(value: object, name: str = "reward") -> float:
    """`value` as a finite float (bools allowed).

    Raises:
        TypeError: not a real number. ValueError: NaN or infinite.
    """
    if isinstance(value, list | tuple):
        raise TypeError(
            f"{name} returned a {type(value).__name__} of {len(value)} values, expected a float; "
            "for several values wrap the reward: list_reward(fn, mean_aggregate), or return a "
            f"mapping with {TOTAL!r}"
        )
    if not isinstance(value, int | float):
        raise TypeError(f"{name} returned {type(value).__name__}, expected a float")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} returned {out}, expected a finite number")
    return out


def split_reward(value: object) -> tuple[float, dict[str, float] | None]:
    """(total, components or None) from a reward's return value, checking the convention."""
    if isinstance(value, Mapping):
        if TOTAL not in value:
            raise ValueError(
                f"a vector reward must return its aggregate under {TOTAL!r}; got keys "
                f"{sorted(value)} (build it with vector_reward)"
            )
        parts = {k: scalar_reward(v, k) for k, v in value.items() if k != TOTAL}
        return scalar_reward(value[TOTAL], TOTAL), parts
    return scalar_reward(value), None


async def call_reward(
    reward_fn: RewardFn, sample: Sample, *, threads: RewardThreads | None = None
) -> RewardValue:
    """Run `reward_fn` on `sample`: awaited if async, else in an abandonable worker thread.

    Sync rewards run in `threads` (default: a pool of their own for this call), never in
    trio's shared thread pool. A sync callable that returns an awaitable (e.g. a lambda
    wrapping an async function) has that awaitable awaited in the event loop.
    """
    if is_async_reward(reward_fn):
        return await reward_fn(sample)  # type: ignore[misc]
    threads = threads or RewardThreads(1)
    value = await threads.run_sync(reward_fn, sample, name=reward_name(reward_fn))
    if inspect.isawaitable(value):
        value = await value
    return value  # type: ignore[return-value]


def reward_name(fn: object) -> str:
    """The name a reward goes by in errors and logs."""
    return getattr(fn, "__name__", type(fn).__name__)


def is_async_reward(fn: object) -> bool:
    """True for `async def` functions, partials of them and objects with an async __call__."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - checking the method, not callability
    )
