"""`CoalescingEngine`: batched `/generate` calls made at the same moment go out as one request.

`collect_groups` runs one task per prompt group, and each group's samples go out as one batched
call. A GRPO step of 16 groups was therefore 16 HTTP requests at once; measured against the
local engine (16 groups x 8 samples, 8 new tokens, 1 thread), merging them into one request took
the client's CPU from 32.6 to 5.4 ms per batch and the batch's wall time from 194 to 132 ms. The
client's CPU matters twice: the trainer's thread shares the GIL with it.

Contract:
- `generate_batch` calls with the same sampling parameters (a single mapping, compared by
  value) and other keywords are merged when they arrive before every task of the program is
  blocked: the first call starts a flush task in the given nursery, which waits for that
  (`trio.testing.wait_all_tasks_blocked`, at most `MAX_WAIT_S`), then sends one request.
  Each caller gets its own results, in its order.
- Merged items keep their rids, so `abort(rid)` still reaches each item.
- A caller cancelled before the request leaves is dropped from it; after, its results are
  discarded (abort its rids to stop them early, as `collect_groups` does).
- When a merged request fails, each caller's part is re-sent on its own, so one failure is never
  every group's: a 400 (one bad group, a prompt too long, say) fails only its own caller, and a
  transient failure (a reset, a 500, a truncated body, a timeout) that outlived the pool's own
  retries of the merged request gets one more try per group. Not re-sent: an
  `EngineUnavailableError` from a pool that already waited its `unavailable_timeout_s` for an
  engine (`NoEngineAvailableError`; every caller gets it). A part re-sent keeps its rids, and
  the pool below aborts a failed request's rids before any retry, so each caller gets exactly
  one answer per rid (a result or the error), never two.
- Over an `EnginePool` of k engines the merged calls go out as at most 2k requests at once
  (one request over a single engine), each caller's call whole, parts of about equal sample counts: the pool spreads
  them over its engines instead of sending a whole wave to one, and each engine has a second
  request to run while this process parses the first one's answer.
- Calls with per-item sampling parameters, and every other method, pass through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from plumbing.errors import EngineError

try:  # trio.testing's own import pulls in pytest (~0.14 s in every process that loads rollouts)
    from trio._core import wait_all_tasks_blocked
except ImportError:  # pragma: no cover - a trio that moved it; the public name still works
    from trio.testing import wait_all_tasks_blocked

MAX_WAIT_S = 0.02  # the longest a call waits for others to join it (all block sooner, as a rule)


@dataclass
class _Call:
    input_ids: list[Sequence[int]]
    kwargs: dict[str, Any]
    done: trio.Event = field(default_factory=trio.Event)
    results: list[Any] | None = None
    error: BaseException | None = None
    cancelled: bool = False


class CoalescingEngine:
    """Wraps an engine (or `EnginePool`) that has `generate_batch`; see the module docstring."""

    def __init__(self, engine: Any, nursery: trio.Nursery) -> None:
        self.engine = engine
        self._nursery = nursery
        self._open: dict[str, tuple[Mapping[str, Any], list[_Call]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate_batch(
        self,
        batch_input_ids: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        key = _key(sampling_params, kwargs)
        if key is None:
            return await self.engine.generate_batch(batch_input_ids, sampling_params, **kwargs)
        call = _Call(list(batch_input_ids), kwargs)
        if key not in self._open:
            self._open[key] = (sampling_params or {}, [])
            self._nursery.start_soon(self._flush, key)
        self._open[key][1].append(call)
        try:
            await call.done.wait()
        except trio.Cancelled:
            call.cancelled = True
            raise
        if call.error is not None:
            raise call.error
        assert call.results is not None
        return call.results

    async def _flush(self, key: str) -> None:
        params, calls = self._open[key]
        try:
            # Until every other task waits (the groups behind this one reach their call one
            # scheduler pass apart, after the slot lock); bounded for busy host apps.
            with trio.move_on_after(MAX_WAIT_S):
                await wait_all_tasks_blocked()
        finally:
            del self._open[key]
        live = [c for c in calls if not c.cancelled]
        try:
            # Two requests per engine: an engine answers a request only once all its items are
            # done, so with one it idled while this process parsed the answer and sent the next
            # (issue 31: 9 % of a step at one H100-speed engine; 0 % with two).
            parts = _spread(live, 2 * len(getattr(self.engine, "engines", ())) or 1)
            if len(parts) == 1:
                await self._send_merged(parts[0], params)
            else:  # sent at once: the pool spreads them over its engines
                async with trio.open_nursery() as nursery:
                    for part in parts:
                        nursery.start_soon(self._send_merged, part, params)
        finally:  # cancelled before the results came: nobody may wait forever
            for c in live:
                if not c.done.is_set():
                    c.error = EngineError("the batched request was cancelled")
                    c.done.set()

    async def _send_merged(self, calls: list[_Call], params: Mapping[str, Any]) -> None:
        if len(calls) <= 1:
            for c in calls:
                await self._send(c, params)
            return
        merged = _Call([ids for c in calls for ids in c.input_ids],
                       {**calls[0].kwargs, "rids": [r for c in calls for r in c.kwargs["rids"]]})  # fmt: skip
        await self._send(merged, params)
        if merged.error is None:
            assert merged.results is not None
            start = 0
            for c in calls:
                c.results = merged.results[start : start + len(c.input_ids)]
                start += len(c.input_ids)
                c.done.set()
            return
        if _pool_gave_up(merged.error):  # it waited its bound for an engine: no use again now
            for c in calls:
                c.error = merged.error
                c.done.set()
            return
        async with trio.open_nursery() as nursery:  # isolate the failure: each part alone
            for c in calls:
                nursery.start_soon(self._send, c, params)

    async def _send(self, call: _Call, params: Mapping[str, Any]) -> None:
        try:
            call.results = await self.engine.generate_batch(call.input_ids, params, **call.kwargs)
        except EngineError as exc:
            call.error = exc
        call.done.set()


def _spread(calls: list[_Call], n_parts: int) -> list[list[_Call]]:
    """`calls` in at most `n_parts` groups of about equal sample counts, each call whole.

    Why: one merged request goes to one engine, so a pool of 64 engines served every group
    launched at once from one of them (issue 31: tokens/s flat from 1 to 16 engines)."""
    n_parts = max(1, min(n_parts, len(calls)))
    parts: list[list[_Call]] = [[] for _ in range(n_parts)]
    sizes = [0] * n_parts
    for call in sorted(calls, key=lambda c: -len(c.input_ids)):  # largest first: balanced
        i = sizes.index(min(sizes))
        parts[i].append(call)
        sizes[i] += len(call.input_ids)
    return [p for p in parts if p] or [[]]


def _pool_gave_up(error: BaseException) -> bool:
    # by name: `rollouts` does not import `engines` (as `plumbing.errors.engine_failure_kind`)
    return any(cls.__name__ == "NoEngineAvailableError" for cls in type(error).__mro__)


def _key(sampling_params: Any, kwargs: Mapping[str, Any]) -> str | None:
    """What calls must share to be merged; None: never merge this call."""
    if sampling_params is not None and not isinstance(sampling_params, Mapping):
        return None  # per-item parameters
    if "rids" not in kwargs or kwargs["rids"] is None:
        return None
    others = {k: v for k, v in kwargs.items() if k != "rids"}
    try:
        return json.dumps([sampling_params or {}, others], sort_keys=True)
    except TypeError:
        return None
