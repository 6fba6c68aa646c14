"""Ordered-future plumbing of the training backend, and its LR schedule."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

import trio

from plumbing.errors import RolloutsError
from training.config import OptimConfig

R = TypeVar("R")


class TrainFuture(Generic[R]):
    """The result of one queued backend operation; `await fut.result()` to get it."""

    def __init__(self, cfut: Future[R]):
        self._cfut = cfut
        self._done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: Future[R]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._done.set)

        cfut.add_done_callback(wake)

    def done(self) -> bool:
        return self._cfut.done()

    async def result(self) -> R:
        await self._done.wait()
        return self._cfut.result()


def lr_lambda(optim: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Multiplier of the base LR at a step: linear warmup, then cosine to min_lr_ratio or flat."""

    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        span = max(1, max_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    return factor


class BackendError(RolloutsError, RuntimeError):
    """A backend operation failed, or an earlier one did and the backend refuses to go on."""
