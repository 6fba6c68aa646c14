"""`supervise_engine`: a launched engine that is relaunched on the same port when it dies.

Contract:
- `async with supervise_engine(max_relaunches=N, **launch_engine_kwargs) as launched:` yields
  the first `LaunchedEngine` once healthy (see `launch_engine`). If the process exits on its own
  (a crash, `kill -9`), it is launched again on the same port, so clients keep their URL; the
  engine starts on its initial weights, and an `EnginePool` gives it the current ones before it
  serves (`expected_weights`).
- At most `max_relaunches` relaunches (failed launch attempts count), `relaunch_delay_s` apart;
  past that the block is cancelled with `EngineLaunchError` naming the engine and its log.
- Leaving the block stops the current process as `launch_engine` does; a cancellation of the
  code around the block does not, once the engine is up (the caller's shielded cleanup still
  talks to it).
- `relaunches` on the yielded `Supervision` counts them (for metrics and tests).
- `events` (optional, a trio memory channel): ("down", url) is sent as soon as the process is
  seen to exit, before the relaunch, and ("up", url) once the relaunch is healthy, so an
  `EnginePool(engine_events=...)` stops sending it work at once and gives it the weights when
  it is back, without waiting for a probe.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from .launch import EngineLaunchError, LaunchedEngine, find_free_port, launch_engine, log_tail

logger = logging.getLogger(__name__)


@dataclass
class Supervision:
    """The current process of a supervised engine and how often it was relaunched."""

    url: str
    current: LaunchedEngine
    relaunches: int = 0
    pids: list[int] = field(default_factory=list)  # every process it ran, in order
    # shielded once the first launch is up; only supervise_engine's exit cancels it
    keep_running: trio.CancelScope = field(default_factory=trio.CancelScope, repr=False)


@asynccontextmanager
async def supervise_engine(*, max_relaunches: int = 3, relaunch_delay_s: float = 1.0,
                           events: trio.MemorySendChannel[tuple[str, str]] | None = None,
                           **launch_kwargs: Any) -> AsyncIterator[Supervision]:  # fmt: skip
    """See the module docstring; keyword arguments go to `launch_engine`."""
    launch_kwargs["port"] = launch_kwargs.get("port") or find_free_port(
        launch_kwargs.get("host", "127.0.0.1")
    )
    async with trio.open_nursery() as nursery:
        supervision = await nursery.start(_keep_running, max_relaunches, relaunch_delay_s,
                                          launch_kwargs, events)  # fmt: skip
        try:
            yield supervision
        finally:
            supervision.keep_running.cancel()
            nursery.cancel_scope.cancel()


async def _keep_running(max_relaunches: int, delay_s: float, kwargs: dict[str, Any],
                        events: trio.MemorySendChannel[tuple[str, str]] | None, *,
                        task_status: trio.TaskStatus[Supervision]) -> None:  # fmt: skip
    keep_running = trio.CancelScope()
    with keep_running:
        await _relaunch_until_stopped(keep_running, max_relaunches, delay_s, kwargs, events,
                                      task_status)  # fmt: skip


async def _relaunch_until_stopped(keep_running: trio.CancelScope, max_relaunches: int,
                                  delay_s: float, kwargs: dict[str, Any],
                                  events: trio.MemorySendChannel[tuple[str, str]] | None,
                                  task_status: trio.TaskStatus[Supervision]) -> None:  # fmt: skip
    supervision: Supervision | None = None
    while True:
        try:
            async with launch_engine(**kwargs) as launched:
                if supervision is None:
                    supervision = Supervision(url=launched.url, current=launched,
                                              keep_running=keep_running)  # fmt: skip
                    # A Ctrl-C during the first start-up stops it; once up, only the exit of
                    # supervise_engine does, so a cancelled run's cleanup can still use it.
                    keep_running.shield = True
                    task_status.started(supervision)
                else:
                    supervision.current = launched
                    logger.log(_level(events), "engine %s relaunched (pid %d, relaunch %d of at "
                               "most %d)", launched.url, launched.pid, supervision.relaunches,
                               max_relaunches)  # fmt: skip
                    _tell(events, "up", launched.url)
                supervision.pids.append(launched.pid)
                await launched.exited.wait()
                _tell(events, "down", launched.url)
            reason = f"process {launched.pid} exited; log ends with:\n{log_tail(launched.log_path)}"
        except EngineLaunchError as exc:
            if supervision is None:
                raise  # the first launch failed: nothing to keep running
            reason = str(exc)
        supervision.relaunches += 1
        if supervision.relaunches > max_relaunches:
            raise EngineLaunchError(
                f"engine died {supervision.relaunches} times, more than max_relaunches="
                f"{max_relaunches}; last: {reason}",
                url=supervision.url,
            )
        logger.log(_level(events), "engine %s died (%s); relaunching in %.1f s", supervision.url,
                   reason.splitlines()[0], delay_s)  # fmt: skip
        await trio.sleep(delay_s)


def _level(events: trio.MemorySendChannel[tuple[str, str]] | None) -> int:
    """INFO when a pool hears of it (it logs the one WARNING of the engine going down and the
    one of its return); WARNING when nobody else will say it."""
    return logging.WARNING if events is None else logging.INFO


def _tell(events: trio.MemorySendChannel[tuple[str, str]] | None, what: str, url: str) -> None:
    """Tell the listener (an EnginePool) at once; a listener that has gone is no error."""
    if events is None:
        return
    try:
        events.send_nowait((what, url))
    except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
        logger.warning("engine %s is %s, but nobody could be told", url, what)
