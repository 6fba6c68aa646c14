"""Steps every weight sync shares (from disk, LoRA, by broadcast): the bound on one engine's
load, the flush before it, the resume after it, the one error naming every failed engine, and
the wait for an engine to come back when every one is down.

Why a module of its own: weight_sync.py (disk and LoRA) and refit.py (broadcast) both use them,
and these are the fault rules of a sync, read in one place.

Contract:
- `update_bound_s(engine, gb)`: how long one engine may take to load `gb` GB of weights before
  the sync gives up on it: `timeouts.weight_update_floor_s + timeouts.weight_update_s_per_gb ×
  gb` (`engines.weight_update_floor_s`, `engines.weight_update_s_per_gb`; defaults 30 s +
  10 s/GB: 30 s for a small model, 190 s for 16 GB), far below the HTTP limit
  (`weight_update_s`, 1800 s). An engine past it counts as down, not failed (`give_up`): the
  sync logs one WARNING naming it and the bound, and the client stops holding its pause (no
  more lease renewals: a hung engine no longer holds the requests sent to it). It is marked
  `known_down`, as a pool marks a dead engine: later syncs skip it instead of paying the bound
  again, and its `EnginePool` marks it down at its next probe and gives it the weights once it
  loads them in time (without a pool, clear `known_down` to try it again) (issue 49 item D3).
- `wait_until_one_back(...)`: when every engine of a sync is down, wait up to `wait_s`
  (`engines.unavailable_timeout_s`, as a request waits) for one to take the weights instead of
  failing at once: an engine the pool knows is down is left to the pool, whose rejoin gives
  it the weights the sync recorded (`expected_weights`); it counts once the pool has it back
  and it reports the version. Any other engine is tried again every `_RETRY_S` (issue 49 D1).
- `raise_failures` raises one `WeightSyncError` naming every engine that failed, and also when
  every engine was down and the sync `required` one to take the weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from plumbing.errors import EngineError

from .pause_renewal import renewing_pauses
from .types import EngineUnavailableError, WeightSyncError

logger = logging.getLogger("engines.weight_sync")  # the sync's one logger name, as before

KNOWN_DOWN = "known down by the pool (not tried)"


def leave_known_down(engine: Any, down: dict[str, str]) -> None:
    """A sync skips an engine the pool knows is down (the pool gives it the weights when it is
    back). It is no longer held paused by this client, if this client paused it before it went
    down: the pool's probe leaves an engine this client holds paused alone (a sync's own steps
    judge it), so otherwise it would never rejoin, and a sync waiting for an engine to come
    back would wait out its bound (the engine killed during a push, issue 49). A dead server
    holds no pause; a hung one's lease (local engine) or the pool's rejoin ends it. A pause
    the pool's rejoin holds (`engine.rejoining`: it loads the weights) stays held: dropping
    it stopped its lease's renewals, and the engine resumed generation mid-load."""
    down[engine.url] = KNOWN_DOWN
    if getattr(engine, "paused", False) and not getattr(engine, "rejoining", False):
        engine.paused = False


def down_level(reason: str) -> int:
    """DEBUG for an engine the pool knows is down (it said so once, as a WARNING); WARNING for
    one this sync found down itself."""
    return logging.DEBUG if reason.startswith(KNOWN_DOWN) else logging.WARNING


_RETRY_S = 1.0  # how often a sync whose engines are all down tries them again


def weights_gb(path: str | os.PathLike[str]) -> float:
    """The size of the weight files under `path`, in GB (10^9 bytes)."""
    root = Path(path)
    files = [root] if root.is_file() else root.rglob("*")
    return sum(f.stat().st_size for f in files if f.is_file()) / 1e9


def update_bound_s(engine: Any, gb: float) -> float:
    """Seconds `engine` may take to load `gb` GB of weights (module docstring)."""
    timeouts = getattr(engine, "timeouts", None)
    floor_s = getattr(timeouts, "weight_update_floor_s", 30.0)
    per_gb_s = getattr(timeouts, "weight_update_s_per_gb", 10.0)
    return floor_s + per_gb_s * gb


def give_up(engine: Any, down: dict[str, str], route: str, bound_s: float, gb: float) -> None:
    """Count `engine` down after its load went past `bound_s`: noted in `down` with the bound,
    and `known_down`, so later syncs skip it and its `EnginePool` marks it down."""
    timeouts = getattr(engine, "timeouts", None)
    down[engine.url] = (
        f"no answer to {route} within {bound_s:.1f} s (engines.weight_update_floor_s="
        f"{getattr(timeouts, 'weight_update_floor_s', 30.0)} + engines.weight_update_s_per_gb="
        f"{getattr(timeouts, 'weight_update_s_per_gb', 10.0)} × {gb:.2f} GB): it hangs; marked "
        "down, no longer paused by this client, and given these weights before it serves again "
        "(raise the bound if its loads are this slow)"
    )
    with contextlib.suppress(AttributeError):  # as the pool marks it (pool_membership.py)
        engine.known_down = True


async def run_on_every_engine(engines: Sequence[Any], sync_one: Callable[..., Awaitable[None]],
                              weight_version: str, down: dict[str, str], wait_s: float,
                              what: str) -> None:  # fmt: skip
    """`sync_one(engine)` on every engine at once, holding their pause leases; then, if every
    engine was down, wait for one to come back (`wait_until_one_back`, retried unpaused)."""
    async with renewing_pauses(engines):
        async with trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(sync_one, engine)
        await wait_until_one_back(engines, weight_version, down,
                                  partial(sync_one, is_paused=False), wait_s, what)  # fmt: skip


async def wait_until_one_back(engines: Sequence[Any], weight_version: str, down: dict[str, str],
                              retry: Callable[[Any], Awaitable[None]], wait_s: float,
                              what: str) -> None:  # fmt: skip
    """Every engine was down: wait up to `wait_s` for one to take `weight_version`.

    `retry(engine)` runs the sync's whole sequence on one engine, noting in `down` (or the
    sync's failures) how it went. Returns once an engine has the weights, a retry failed
    otherwise than down, or `wait_s` passed: `down` then still names every engine, each reason
    saying how long it waited.
    """
    if wait_s <= 0 or not engines or len(down) < len(engines):
        return
    logger.warning("%s: every engine is down (%s); waiting up to %.0f s "
                   "(engines.unavailable_timeout_s) for one to come back", what,
                   ", ".join(down), wait_s)  # fmt: skip
    deadline = trio.current_time() + wait_s
    while trio.current_time() < deadline:
        await trio.sleep(min(_RETRY_S, max(0.0, deadline - trio.current_time())))
        for engine in engines:
            if getattr(engine, "known_down", False):
                continue  # the pool gives it these weights when it is back
            if await _reports(engine, weight_version):
                down.pop(engine.url, None)  # the pool's rejoin gave it these weights
                return
            down.pop(engine.url, None)
            await retry(engine)
            if engine.url not in down:
                return
    for url, reason in down.items():
        down[url] = (f"{reason}; still down after waiting {wait_s:.0f} s for one engine to come "
                     "back (engines.unavailable_timeout_s)")  # fmt: skip


async def _reports(engine: Any, weight_version: str) -> bool:
    with trio.move_on_after(10.0), contextlib.suppress(EngineError):
        return (await engine.model_info()).weight_version == weight_version
    return False


async def resume_noting(engine: Any, is_paused: bool, timeout_s: float, down: dict[str, str],
                        failures: dict[str, list[str]]) -> None:  # fmt: skip
    """Resume `engine` whatever happened (shielded, bounded), noting how that went. An engine
    the sync gave up on (in `down`) is no longer held paused by this client, resumed or not;
    one whose resume failed otherwise stays paused for its client (it may be), which sends the
    resume again when a pool's probe asks (`retry_resume`, engines/pool_membership.py)."""
    gave_up = engine.url in down
    with trio.CancelScope(shield=True), trio.move_on_after(timeout_s) as scope:
        try:
            await engine.resume()
        except EngineUnavailableError as exc:
            down.setdefault(engine.url, str(exc))
        except EngineError as exc:
            if not gave_up:
                failures.setdefault(engine.url, []).append(
                    f"could not be resumed, it may still be paused: {exc}"
                )
    if scope.cancelled_caught and is_paused and not gave_up:
        failures.setdefault(engine.url, []).append(f"resume timed out after {timeout_s} s")
    if gave_up and getattr(engine, "paused", False):
        engine.paused = False  # its lease (local engine) or the pool's rejoin (SGLang) ends it


async def raise_failures(what: str, n_engines: int, down: dict[str, str],
                         failures: dict[str, list[str]], *, required: bool = True
                         ) -> None:  # fmt: skip
    """Log the engines a sync skipped as down; raise one error naming every failed engine.

    A caller cancelled meanwhile (Ctrl-C, a host app cancelling training) gets its Cancelled
    instead: its teardown may have taken the engines down during the shielded resume, and
    that failure is a consequence, not the cause.

    Raises:
        WeightSyncError: some engine failed, or every engine was down and `required`.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    for url, reason in down.items():
        logger.log(down_level(reason), "%s skipped %s, which is down: %s", what, url, reason)
    if required and len(down) == n_engines and not failures:
        failures = {url: [f"down: {reason}"] for url, reason in down.items()}
    if failures:
        lines = [f"{url}: {'; '.join(reasons)}" for url, reasons in failures.items()]
        raise WeightSyncError(
            f"{what} failed on {len(failures)} of {n_engines} engine(s):\n  " + "\n  ".join(lines)
        )


async def flush(engine: Any, retries: int, retry_s: float) -> None:
    """Flush a paused engine's cache ("abort": idle; "retract": only waiting requests left);
    it answers 400 until aborts settle."""
    for attempt in range(retries + 1):
        try:
            await engine.flush_cache()
            return
        except EngineUnavailableError:
            raise  # gone (it died since the pause): skipped as down, like an unreachable one
        except EngineError as exc:
            if exc.status != 400 or attempt == retries:
                raise EngineError(
                    f"cache flush before the weight update failed after {attempt + 1} "
                    f"attempt(s): {exc}",
                    url=engine.url,
                ) from exc
            logger.warning("%s: cache not flushed yet (%s); retrying", engine.url, exc)
            await trio.sleep(retry_s * 2**attempt)
