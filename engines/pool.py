"""`EnginePool`: spread requests over several engines and survive an engine dying.

Contract:
- Each request goes to the healthy engine with the fewest outstanding requests (ties: the one
  picked least recently).
- A request whose engine fails transiently (`EngineUnavailableError`, a 5xx, a timeout, or an
  answer from weights other than `expected_weights`, now or when the request was sent: a push
  may land while it runs) is retried on another engine that has not failed it (the failing
  engine is asked to abort it first). When every engine has failed it, the pool waits for one
  to be healthy again (the prober brings a down one back; a 5xx or a timeout is retried after
  a backoff of 0.5 s doubling to `probe_interval_s`) and retries there, a pool of one as a
  pool of many. All of it is bounded by `unavailable_timeout_s` from
  the request's first failure (and `max_attempts`); past that `NoEngineAvailableError` says how
  long it waited and the last failure. It returns exactly one result or raises, so a sample is
  never lost silently nor duplicated. Any other error is raised at once, and a 4xx too, except
  a 400 saying the adapter the last LoRA sync gave that engine is not loaded (it restarted):
  that counts as stale weights. A `/generate` with no answer within its stall bound
  (`stall_floor_s + stall_s_per_token × max_new_tokens`, engines/stall.py) is a failure of
  kind "stalled": it is cancelled, aborted on its engine and sent to another, long before the
  HTTP timeout; only one answer is ever returned. Each failure is counted per engine and kind
  (`EngineStats.failures`).
- Which engines serve (health probes, mark down, rejoin with the current weights, supervisor
  events): `pool_membership.py`, whose docstring holds that half of the contract.
- The pool does not own the engines: enter them (`async with SGLangEngine(...)`) yourself.

Not covered: prefix-affinity routing (sglang-router's cache_aware policy), weighted engines.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import trio

from plumbing.errors import EngineError, engine_failure_kind

from .lora import lost_adapter
from .pool_membership import EngineStats as EngineStats
from .pool_membership import NoEngineAvailableError as NoEngineAvailableError
from .pool_membership import PoolMembershipMixin, _Slot, older_weights
from .pool_membership import PoolStatistics as PoolStatistics
from .pool_membership import StaleWeightsError as StaleWeightsError
from .stall import call_unless_stalled, stall_bound_s
from .types import (
    EngineTimeoutError,
    EngineUnavailableError,
    GenerateResult,
    InferenceEngine,
    ScoreResult,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _failover(exc: EngineError) -> bool:
    """Worth trying on another engine: no answer, a server error, a timeout, stale weights."""
    return isinstance(exc, EngineUnavailableError | EngineTimeoutError) or (
        exc.status is not None and exc.status >= 500
    )


def _versions(result: Any) -> list[str | None]:
    items = result if isinstance(result, list) else [result]
    return [getattr(r, "weight_version", None) for r in items if not getattr(r, "aborted", False)]


class EnginePool(PoolMembershipMixin):
    def __init__(
        self,
        engines: Sequence[InferenceEngine],
        *,
        probe_interval_s: float = 2.0,
        unavailable_timeout_s: float = 60.0,
        max_attempts: int = 10,
        rejoin_timeout_s: float = 300.0,
        stall_floor_s: float | None = 60.0,
        stall_s_per_token: float | None = 0.2,
        engine_events: trio.MemoryReceiveChannel[tuple[str, str]] | None = None,
        weights_copy: Callable[[str], Awaitable[tuple[str, str]]] | None = None,
        follows_weights: bool = False,
    ) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self._slots = [_Slot(e) for e in engines]
        self.probe_interval_s = probe_interval_s
        self.unavailable_timeout_s = unavailable_timeout_s
        self.max_attempts = max_attempts
        self.rejoin_timeout_s = rejoin_timeout_s
        self.stall_floor_s, self.stall_s_per_token = stall_floor_s, stall_s_per_token
        self._picks = itertools.count(1)
        self._changed = trio.Event()  # set and replaced whenever an engine goes down or up
        self._rid_slot: dict[str, _Slot] = {}
        self._nursery_manager: Any = None
        self._nursery: trio.Nursery | None = None
        self._engine_events = engine_events
        self.weights_copy = weights_copy  # pool_membership.py: rejoin after a broadcast push
        self.follows_weights = follows_weights  # pool_membership.py: another process syncs

    @property
    def engines(self) -> list[InferenceEngine]:
        return [s.engine for s in self._slots]

    @property
    def active_lora(self) -> str | None:
        """The adapter the engines generate with (the newest an engine has); None = base."""
        names = [getattr(s.engine, "active_lora", None) for s in self._slots]
        return next((n for n in names if n is not None), None)

    async def __aenter__(self) -> EnginePool:
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        self._nursery.start_soon(self._probe_loop)
        if self._engine_events is not None:
            self._nursery.start_soon(self._follow_engine_events, self._engine_events)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        self._nursery = None
        try:
            return await self._nursery_manager.__aexit__(*exc_info)
        except BaseExceptionGroup as group:
            # The prober never raises, so a lone error is the body's own: let it through as
            # it was raised instead of wrapped in a group.
            if len(group.exceptions) == 1 and group.exceptions[0] is exc_info[1]:
                return False
            raise

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            tuple(
                EngineStats(
                    s.engine.url,
                    s.healthy,
                    s.in_flight,
                    s.done,
                    s.failed,
                    dict(s.failures),
                    s.rejoined,
                    s.samples_sent,
                    s.samples_received,
                    s.down_reason,
                )
                for s in self._slots
            )
        )

    def _pick(self, exclude: set[_Slot]) -> _Slot | None:
        candidates = [s for s in self._slots if s.healthy and s not in exclude]
        if not candidates:
            return None
        slot = min(candidates, key=lambda s: (s.in_flight, s.last_pick))
        slot.last_pick = next(self._picks)
        return slot

    async def _acquire(
        self, exclude: set[_Slot], deadline: float, why: str, last: EngineError | None
    ) -> _Slot:
        """A healthy engine not in `exclude`, waiting until `deadline` for one."""
        slot = self._pick(exclude)
        if slot is not None:  # the common case, without setting up a deadline
            return slot
        t0 = trio.current_time()
        with trio.move_on_at(deadline):
            while True:
                slot = self._pick(exclude)
                if slot is not None:
                    return slot
                await self._changed.wait()
        down = ", ".join(s.engine.url for s in self._slots if not s.healthy) or "none"
        raise NoEngineAvailableError(
            f"no engine could serve this request: waited {trio.current_time() - t0:.1f} s "
            f"(engines.unavailable_timeout_s={self.unavailable_timeout_s}) for one to answer "
            f"its health probe again; down: {down}; {why}",
            last=last,
        )

    # ----- requests -------------------------------------------------------------------------

    async def _call(
        self,
        fn: Callable[[InferenceEngine], Awaitable[T]],
        rid: str | Sequence[str] | None,
        sampling_params: Any = None,
    ) -> T:
        rids = [rid] if isinstance(rid, str) else list(rid or ())
        failed_on: set[_Slot] = set()
        first_failure: float | None = None
        deadline = trio.current_time() + self.unavailable_timeout_s
        why, last = "no failure of this request yet", None
        backoff = 0.5
        stall_s = stall_bound_s(sampling_params, self.stall_floor_s, self.stall_s_per_token)
        for attempt in range(1, self.max_attempts + 1):
            if first_failure is not None and trio.current_time() >= deadline:
                break
            slot = await self._acquire(failed_on, deadline, why, last)
            weight = max(1, len(rids))  # a batch weighs as many requests as it has items
            slot.in_flight += weight
            slot.samples_sent += weight
            for r in rids:
                self._rid_slot[r] = slot
            sent_to = getattr(slot.engine, "expected_weights", None)  # a push may land meanwhile
            try:
                result = await call_unless_stalled(partial(fn, slot.engine), slot.engine, stall_s)
                self._check_weights(slot, result, sent_to)
            except EngineError as exc:
                if lost_adapter(slot.engine, exc):
                    exc = StaleWeightsError(f"lost its LoRA adapter (restarted?): {exc}",
                                            url=slot.engine.url)  # fmt: skip
                slot.fail(exc)
                if isinstance(exc, EngineUnavailableError):
                    self._mark_down(slot, exc)
                if not _failover(exc):
                    raise exc from None
                if first_failure is None:  # the bound runs from the first failure
                    first_failure = trio.current_time()
                    deadline = first_failure + self.unavailable_timeout_s
                last = exc
                why = f"last failure on {slot.engine.url}: {engine_failure_kind(exc)}: {exc}"
                failed_on.add(slot)
                with trio.move_on_after(1.0):  # the old engine may still run it: best effort
                    for r in rids:
                        with contextlib.suppress(EngineError):
                            await slot.engine.abort(r)
                if all(s in failed_on for s in self._slots):  # nowhere else: wait, then retry
                    failed_on.clear()
                    await trio.sleep_until(min(deadline, trio.current_time() + backoff))
                    backoff = min(2 * backoff, max(self.probe_interval_s, 0.5))
                # an engine marked down had its WARNING (pool_membership._mark_down)
                logger.log(logging.WARNING if slot.healthy else logging.DEBUG,
                           "request %s failed on %s (%s, attempt %d of at most %d): %.300s; "
                           "retrying", _what(rids), slot.engine.url, engine_failure_kind(exc),
                           attempt, self.max_attempts, exc)  # fmt: skip
                continue
            else:
                slot.done += 1
                slot.samples_received += weight
                return result
            finally:
                slot.in_flight -= weight
                for r in rids:
                    if self._rid_slot.get(r) is slot:
                        del self._rid_slot[r]
        waited = trio.current_time() - (first_failure or trio.current_time())
        raise NoEngineAvailableError(
            f"request {_what(rids)} gave up after {attempt} attempts in {waited:.1f} s "
            f"(engines.unavailable_timeout_s={self.unavailable_timeout_s}, max_attempts="
            f"{self.max_attempts}); {why}",
            last=last,
        )

    def _check_weights(self, slot: _Slot, result: Any, sent_to: tuple[str | None, str] | None
                       ) -> None:  # fmt: skip
        """An answer from other weights than the last sync gave (the engine restarted since).
        The weights expected when the request was sent (`sent_to`) are right too: a push that
        lands between the answer and this check does not make it stale."""
        engine = slot.engine
        expected = getattr(engine, "expected_weights", None)
        if expected is None or getattr(engine, "paused", False):
            return
        right = {e[1] for e in (sent_to, expected) if e is not None}
        if self.follows_weights:  # another process syncs: older weights only (a push may land)
            wrong = [v for v in _versions(result) if all(older_weights(v, r) for r in right)]
        else:
            wrong = [v for v in _versions(result) if v is not None and v not in right]
        if wrong:
            raise StaleWeightsError(
                f"answered from weight_version {wrong[0]!r}, the last sync gave it "
                f"{expected[1]!r}: it restarted; it gets the weights before serving again",
                url=engine.url,
            )

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> GenerateResult:
        """`InferenceEngine.generate` on the least-loaded healthy engine (see the contract)."""
        return await self._call(
            lambda e: e.generate(input_ids, sampling_params, **kwargs),
            kwargs.get("rid"),
            sampling_params,
        )

    async def generate_batch(
        self,
        batch_input_ids: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[GenerateResult]:
        """One batched `/generate` call on the least-loaded healthy engine; `rids` (if given)
        are tracked so that `abort(rid)` reaches the engine running each item."""
        return await self._call(
            lambda e: e.generate_batch(batch_input_ids, sampling_params, **kwargs),
            kwargs.get("rids"),
            sampling_params,
        )

    async def score(
        self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0, **kwargs: Any
    ) -> ScoreResult:
        return await self._call(
            lambda e: e.score(input_ids, start, temperature=temperature, **kwargs), None
        )

    async def abort(self, rid: str) -> None:
        """Abort `rid` on the engine running it (on every engine if unknown)."""
        slot = self._rid_slot.get(rid)
        targets = [slot] if slot is not None else [s for s in self._slots if s.healthy]
        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(target.engine.abort, rid)

    async def abort_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for slot in self._slots:
                if slot.healthy:
                    nursery.start_soon(slot.engine.abort_all)

    async def wait_healthy(self, timeout_s: float = 600.0) -> None:
        async with trio.open_nursery() as nursery:
            for slot in self._slots:
                nursery.start_soon(slot.engine.wait_healthy, timeout_s)


def _what(rids: Sequence[str]) -> str:
    if not rids:
        return "(no rid)"
    return rids[0] if len(rids) == 1 else f"{rids[0]} (+{len(rids) - 1} more)"
