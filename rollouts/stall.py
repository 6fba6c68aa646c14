"""Watching the event loop: name the function that blocks it.

Why: an `async def` reward that blocks (`time.sleep`, a sync HTTP call, a CPU-heavy verifier)
holds trio's one thread. Nothing else runs, no timeout can fire (they need the loop), and the
run freezes with no log line.

`watch_event_loop(stall_s)` runs a heartbeat task in the loop and a watcher thread beside it.
When the heartbeat is `stall_s` late, the watcher reads the loop thread's stack and logs one
warning per stall: the async reward that has not yielded when the stack holds one (found as
the callee of the reward-calling frames in rollouts/reward_calls.py and rollouts/scoring.py), else
the innermost function, with file and line. It only reports: the loop is still blocked.

The watcher thread owns no event loop and touches none; it stops within `stall_s / 4` of the
block's exit.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import CodeType, FrameType

import trio

from plumbing.nursery import open_nursery
from rollouts import scoring
from rollouts.reward_calls import call_reward

log = logging.getLogger("rollouts.stall")

# frames running these await a reward: their callee is the reward's own frame
_REWARD_CALLERS: frozenset[CodeType] = frozenset(
    {call_reward.__code__, scoring.await_reward.__code__}
)


@asynccontextmanager
async def watch_event_loop(stall_s: float) -> AsyncIterator[None]:
    """Log the function holding the event loop whenever it stalls for `stall_s` or more."""
    loop_thread = threading.get_ident()
    beat = [time.monotonic()]
    stop = threading.Event()

    def watch() -> None:
        reported = None  # the heartbeat of the stall already reported
        while not stop.wait(stall_s / 4):
            last = beat[0]
            lag = time.monotonic() - last
            if lag < stall_s or reported == last:
                continue
            reported = last
            frame = sys._current_frames().get(loop_thread)
            log.warning("the event loop has not run for %.1f s: %s", lag, describe_block(frame))

    async def heartbeat() -> None:
        while True:
            beat[0] = time.monotonic()
            await trio.sleep(stall_s / 4)

    watcher = threading.Thread(target=watch, name="rollouts-stall-watcher", daemon=True)
    async with open_nursery() as nursery:  # the body's error raises as itself
        nursery.start_soon(heartbeat)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            nursery.cancel_scope.cancel()


def describe_block(frame: FrameType | None) -> str:
    """Who holds the loop, from its thread's innermost frame."""
    if frame is None:
        return "no stack available"
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    where = _where(frames[0])
    for callee, caller in itertools.pairwise(frames):
        if caller.f_code in _REWARD_CALLERS:
            return (
                f"async reward {callee.f_code.co_qualname} ({_where(callee)}) has not yielded, "
                f"blocked at {where}; an `async def` reward must not block: await the slow "
                "part (e.g. `trio.to_thread.run_sync`) or make the reward a plain `def`"
            )
    return f"blocked at {where}"


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_qualname} {frame.f_code.co_filename}:{frame.f_lineno}"
