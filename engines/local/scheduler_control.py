"""The local engine scheduler's control side: pause and resume, cache flush, weight updates.

Why a module of its own: these calls change what the model loop may do (stop admitting, keep
or drop running rows, swap the weights between two steps) and follow SGLang 0.5.23's rules for
each; `scheduler.py` keeps the loop and the requests. `SchedulerControl` is a mixin of
`Scheduler` and uses the state its `__init__` sets.

Contract (the control half of the scheduler's):
- `pause(mode)`: "abort" aborts everything, "retract" moves running requests back to the queue
  (recomputed on resume, `num_retractions` grows), "in_place" freezes them with their KV cache.
  Each returns once no step is running. New requests wait in front of the scheduler until
  `resume()` (SGLang holds them in its tokenizer manager), out of reach of `/abort_request`
  (by rid or all: SGLang loses those aborts too); a client disconnect still drops them.
- Prefix-cache flush (`flush_cache`, and an update with `flush_cache: true`), SGLang 0.5.23's
  rule (`is_fully_idle(ignore_waiting=self._engine_paused)`): refused while a request is
  running (an "in_place" pause keeps them running) or, unless paused, waiting; so it succeeds
  during an "abort" or a "retract" pause. It runs on the model thread, between steps.
- Weight updates hold a writer lock against every in-flight `/generate` (reader), like SGLang:
  the update waits for in-flight requests (or aborts them with `abort_all_requests`) and new
  requests queue behind it; when paused, the update runs at once. The load runs on the model
  thread, so it never overlaps a step. On failure the old weights, `model_path` and
  `weight_version` stay.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import trio

from .sequence import Sequence

logger = logging.getLogger("engines.local.scheduler")  # the scheduler's one logger name, as before

PauseMode = Literal["abort", "retract", "in_place"]


class ReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers (no writer starvation)."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        while self._writer or self._writers_waiting:
            await self._changed.wait()
        self._readers += 1
        try:
            yield
        finally:
            self._readers -= 1
            self._notify()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        self._writers_waiting += 1
        try:
            while self._writer or self._readers:
                await self._changed.wait()
        finally:
            self._writers_waiting -= 1
            self._notify()
        self._writer = True
        try:
            yield
        finally:
            self._writer = False
            self._notify()


class SchedulerControl:
    """Pause, resume, flush and weight updates of `Scheduler` (uses the state it sets)."""

    runner: Any
    model_path: str
    weight_version: str
    paused: bool
    waiting: deque[Sequence]
    running: list[Sequence]
    _resumed: trio.Event
    _stepping: bool
    _step_done: trio.Event
    _limiter: trio.CapacityLimiter
    _update_lock: ReadWriteLock

    # also used, from scheduler.py: `_wake()`, `abort(...)`, `run_on_model_thread(...)`

    async def wait_idle(self) -> None:
        """Return once no model step is running."""
        while self._stepping:
            await self._step_done.wait()

    async def pause(self, mode: PauseMode = "abort") -> None:
        if not self.paused:
            self.paused, self._resumed = True, trio.Event()
        if mode == "abort":
            self.abort(abort_all=True)
        await self.wait_idle()
        if mode == "retract":
            retracted = [s for s in self.running if not s.finished]
            for seq in retracted:
                seq.num_retractions += 1
            self.running = []
            self.waiting.extendleft(reversed(retracted))

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()
        self._wake()

    @property
    def busy(self) -> bool:
        return any(not s.finished for s in [*self.running, *self.waiting])

    @property
    def can_flush(self) -> bool:
        """SGLang's `is_fully_idle(ignore_waiting=paused)`: waiting requests count only when
        the engine is not paused (retracted ones are recomputed on resume)."""
        if any(not s.finished for s in self.running):
            return False
        return self.paused or not any(not s.finished for s in self.waiting)

    async def flush_cache(self) -> bool:
        """Drop the prefix cache if `can_flush`; False (nothing done) otherwise."""
        if not self.can_flush:
            return False
        await self.wait_idle()
        await self.run_on_model_thread(self.runner.flush_prefix_cache)
        return True

    # ----- weights --------------------------------------------------------------------------

    async def update_weights(
        self,
        path: str,
        weight_version: str | None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        return await self.update_weights_with(
            lambda: self.runner.load_weights(path), weight_version, model_path=path,
            abort_all_requests=abort_all_requests, flush_cache=flush_cache)  # fmt: skip

    async def update_weights_with(self, load: Callable[[], None], weight_version: str | None, *,
                                  model_path: str | None = None, abort_all_requests: bool = False,
                                  flush_cache: bool = True,
                                  done: str = "Succeeded to update model weights."
                                  ) -> tuple[bool, str]:  # fmt: skip
        """`load()` on the model thread under the update rules above (from disk: `model_path`
        is the new one; a broadcast keeps it); `done` is the success message."""
        refused = self.memory.load_refused()
        if refused is not None:
            return False, refused
        if abort_all_requests:
            self.abort(abort_all=True)
        if self.paused:
            return await self._load(load, model_path, weight_version, flush_cache, done)
        async with self._update_lock.write():
            return await self._load(load, model_path, weight_version, flush_cache, done)

    async def _load(self, load: Callable[[], None], path: str | None, weight_version: str | None,
                    flush_cache: bool, done: str) -> tuple[bool, str]:  # fmt: skip
        from .runner import WeightLoadError  # torch-side module, imported lazily

        started = time.perf_counter()
        source = path or "a broadcast"
        try:
            await trio.to_thread.run_sync(load, limiter=self._limiter)
        except WeightLoadError as exc:
            logger.warning("weight update from %s failed: %s", source, exc)
            return False, str(exc)
        self.memory.weights_loaded()
        if path is not None:
            self.model_path = path
        if flush_cache and not await self.flush_cache():
            # SGLang 0.5.23: the new weights are in, but the cache flush that follows is refused
            # while requests are running (a pause "in_place") or queued outside a pause, so the
            # call fails and the weight version is not set.
            message = (
                "Weights were updated, but the cache was not flushed because requests are still "
                "running or queued. Retract or finish them, then call /flush_cache."
            )
            logger.warning("weight update from %s: %s", source, message)
            return False, message
        message = done
        if weight_version is not None:
            self.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
        logger.info("updated weights from %s in %.3f s", source, time.perf_counter() - started)
        return True, message
