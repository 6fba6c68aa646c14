"""`generate_rollout_batches`: an AsyncRolloutManager's batches as an async-for stream.

For programs that want rollouts without the RL loop (offline data collection, evaluation,
a training loop of their own): `async with generate_rollout_batches(manager, n) as batches:
async for batch in batches: ...`.

Guarantees: the stream owns the manager's lifecycle (it enters `async with manager:`, so do
not enter it yourself), asks for the next batch only when the consumer asks for it (in "sync"
mode nothing is generated while the consumer works on a batch), and leaving the `async with`
block, by `break`, an exception or a cancellation, stops generation there: the manager's tasks
are cancelled, a batch cut off mid-way has its engine requests aborted, and no task is left
running. It is built on `trio.as_safe_channel`, so the generator runs in a task of the block's
own nursery rather than being suspended across the consumer's code (PEP 789).

Not covered: pushing weights to the engines between batches (the consumer's job, as in
`run_rl_training`).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator

import trio

from rollouts.manager import AsyncRolloutManager
from rollouts.types import RolloutBatch


@trio.as_safe_channel
async def generate_rollout_batches(
    manager: AsyncRolloutManager, n_batches: int | None = None
) -> AsyncGenerator[RolloutBatch, None]:
    """Yield `n_batches` batches from `manager.generate_batch()` (None: until the block exits).

    Args:
        manager: a manager that is not entered yet; the stream enters and leaves it.
        n_batches: how many batches to yield; None for no limit.

    Returns:
        An async context manager whose value is a receive channel of RolloutBatch.

    Raises:
        ValueError: n_batches < 0.
    """
    if n_batches is not None and n_batches < 0:
        raise ValueError(f"generate_rollout_batches: n_batches must be >= 0, got {n_batches}")
    async with manager:
        for _ in itertools.count() if n_batches is None else range(n_batches):
            yield await manager.generate_batch()
