"""Stall bound: a `/generate` that has not answered well within what its length allows is
given up on, so the pool can re-send it to another engine (issue 26 item 3).

Contract:
- `stall_bound_s(sampling_params, floor_s, per_token_s)` is `floor_s + per_token_s ×
  max_new_tokens` (the largest of a batch's); None when either knob is None (no bound) or the
  request names no `max_new_tokens`. The defaults (`engines.stall_floor_s` = 60 s,
  `engines.stall_s_per_token` = 0.2 s) give a 1024-token request 265 s and an 8-token one
  62 s, where the HTTP timeout (`engines.generate_timeout_s`) is 600 s. They are generous on
  purpose: the time includes queueing behind other requests in the engine, and a big model
  at a large batch decodes 15-30 tokens/s per sequence; a false stall costs a re-sent
  request. Tighten them where the engine's speed is known.
- `call_unless_stalled(call, engine, bound_s)` runs `call()`; once it has been outstanding
  `bound_s` it is cancelled (its HTTP request closed, so its answer can never be returned) and
  `EngineStalledError` raised. Time the engine spends paused by this client (a weight sync:
  requests wait behind the pause by design), or by another process its owner was told of
  (`mark_paused_elsewhere`: a rollout worker's client while the trainer pushes), does not count, and a pause never restarts the
  count (issue 49 item D6: each pause used to start the whole bound again, so a hung request
  waited twice its bound or more): the time is counted in `bound_s / 16` ticks, and a tick
  counts unless the engine was paused at either end of it or paused and resumed inside it
  (`kv_namespace` changed). A request hung across pauses is given up on at most two ticks
  per pause after its bound of unpaused time; a weight sync's pause is itself bounded
  (engines/weight_sync.py), so it cannot hold a request forever.

Not covered: the engine's own progress (tokens so far) is not read; the bound is per request,
from its length only, so an engine loaded far beyond its usual queue may be taken for stalled
(the request then runs elsewhere; raise `stall_s_per_token`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import trio

from .types import EngineTimeoutError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TICKS = 16  # the stall watch counts unpaused time in ticks of bound_s / _TICKS


class EngineStalledError(EngineTimeoutError):
    """No answer within the stall bound from `max_new_tokens`; the request may still run there
    (the pool aborts it) and is sent to another engine."""


def stall_bound_s(
    sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
    floor_s: float | None,
    per_token_s: float | None,
) -> float | None:
    """`floor_s + per_token_s * max_new_tokens`, or None (no bound); see the module docstring."""
    if floor_s is None or per_token_s is None or sampling_params is None:
        return None
    params = [sampling_params] if isinstance(sampling_params, Mapping) else list(sampling_params)
    lengths = [p.get("max_new_tokens") for p in params]
    if not lengths or any(n is None for n in lengths):
        return None
    return floor_s + per_token_s * max(int(n) for n in lengths)  # type: ignore[arg-type]


def _pause_state(engine: Any) -> tuple[tuple[Any, int], bool]:
    """(a mark that changes with each pause, paused now): this client's pauses (`kv_namespace`,
    `paused`) and another process's its owner was told of (`pauses_elsewhere`, `paused_elsewhere`:
    a rollout worker's engines while the trainer pushes weights)."""
    mark = (getattr(engine, "kv_namespace", None), getattr(engine, "pauses_elsewhere", 0))
    paused = getattr(engine, "paused", False) or getattr(engine, "paused_elsewhere", False)
    return mark, paused


async def call_unless_stalled(
    call: Callable[[], Awaitable[T]], engine: Any, bound_s: float | None
) -> T:
    """`await call()`, raising `EngineStalledError` once it has run `bound_s` unpaused."""
    if bound_s is None:
        return await call()
    stalled = False
    result: list[T] = []  # empty until `call` returns: an answer that came is never dropped

    async def watch(scope: trio.CancelScope) -> None:
        nonlocal stalled
        counted = 0  # ticks outstanding while the engine was not paused
        mark, was_paused = _pause_state(engine)
        while counted < _TICKS:
            await trio.sleep(bound_s / _TICKS)
            now_mark, paused = _pause_state(engine)
            if not (was_paused or paused or now_mark != mark):
                counted += 1
            mark, was_paused = now_mark, paused
        stalled = True
        scope.cancel()

    error: Exception | None = None  # raised as is after the nursery, not wrapped in a group
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        try:
            result.append(await call())
        except Exception as exc:
            error = exc
        finally:
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    if stalled and not result:
        raise EngineStalledError(
            f"no answer within {bound_s:.1f} s, the stall bound (engines.stall_floor_s + "
            "engines.stall_s_per_token × max_new_tokens)",
            url=getattr(engine, "url", ""),
        )
    return result[0]
