"""RewardThreads: the worker threads of sync rewards, apart from trio's shared thread pool.

Why: a thread cannot be killed. A sync reward that runs past its timeout is abandoned, and its
thread runs on. Through `trio.to_thread.run_sync` with no limiter, each such thread kept one of
the 40 tokens of trio's default limiter, which every other thread user shares too (other
rewards, file and DNS work): with 1 sample in 16 hanging, the pool was gone after a few steps,
every later reward timed out waiting for a thread, and the run ended.

Contract:
- At most `max_threads` reward calls run at once; a call waits for a free slot first.
- A call cancelled while its thread runs (its timeout) gives its slot back at once; the thread
  is counted as hung until it returns (`statistics()`), so a hung reward costs its own sample
  and nothing else. trio's shared limiter is never used.
- Hung threads are bounded too: once `max_hung` are still running, the next call raises
  `RewardThreadsExhausted` (a `RewardError`) naming the reward, instead of letting threads pile up without end;
  so does a call that was waiting for a slot meanwhile (checked again once it has one).

Not covered: killing a hung thread (impossible in CPython); it ends when its call returns.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from plumbing.errors import RewardError


class RewardThreadsExhausted(RewardError):
    """Too many sync reward calls are still running past their timeout: the run must end."""


@dataclass(frozen=True)
class RewardThreadStatistics:
    running: int  # calls holding a slot now
    hung: int  # abandoned calls whose thread has not returned yet
    hung_total: int  # calls abandoned since the start


class RewardThreads:
    """See the module docstring."""

    def __init__(self, max_threads: int = 32, *, max_hung: int = 256) -> None:
        if max_threads < 1 or max_hung < 0:
            raise ValueError(f"need max_threads >= 1, max_hung >= 0; got {max_threads}, {max_hung}")
        self.max_hung = max_hung
        self._slots = trio.CapacityLimiter(max_threads)
        self._threads = trio.CapacityLimiter(math.inf)  # bounded by the slots and max_hung
        self._lock = threading.Lock()  # guards the counters: hung threads update them on return
        self._hung = 0
        self._hung_total = 0

    def statistics(self) -> RewardThreadStatistics:
        with self._lock:
            return RewardThreadStatistics(int(self._slots.borrowed_tokens), self._hung,
                                          self._hung_total)  # fmt: skip

    async def run_sync(self, fn: Callable[..., Any], *args: Any, name: str,
                       on_start: Callable[[], None] | None = None) -> Any:  # fmt: skip
        """`fn(*args)` in a worker thread, once a slot is free; cancellable (see the contract).

        Args:
            name: the reward's name, for the error below.
            on_start: called in the event loop once the slot is taken, right before the thread
                starts (timeouts of the call should count from there).

        Raises:
            RewardThreadsExhausted: `max_hung` threads of abandoned calls are still running.
        """
        self._check_hung(name)
        state = {"done": False, "abandoned": False}

        def call() -> Any:
            try:
                return fn(*args)
            finally:
                with self._lock:
                    state["done"] = True
                    if state["abandoned"]:
                        self._hung -= 1

        async with self._slots:
            self._check_hung(name)  # again: calls ahead of it may have hung while it waited
            if on_start is not None:
                on_start()
            try:
                return await trio.to_thread.run_sync(call, abandon_on_cancel=True,
                                                     limiter=self._threads)  # fmt: skip
            except trio.Cancelled:
                with self._lock:
                    if not state["done"]:
                        state["abandoned"] = True
                        self._hung += 1
                        self._hung_total += 1
                raise

    def _check_hung(self, name: str) -> None:
        with self._lock:
            if self._hung >= self.max_hung:
                raise RewardThreadsExhausted(
                    f"reward {name}: {self._hung} calls are still running past their timeout "
                    f"(rollout.reward_max_hung={self.max_hung}); threads cannot be killed, so "
                    "the reward must return: give it its own timeout, or make it async"
                )
