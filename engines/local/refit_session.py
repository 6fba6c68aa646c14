"""The local engine's weight-update session: a broadcast's buckets staged, applied all at once.

A departure from SGLang 0.5.23, which copies each bucket of `/update_weights_from_distributed`
into the model as it arrives (so a trainer killed mid-broadcast leaves it serving a mix of old
and new buckets under the old version label, and its session open, refusing every later
`/begin_weight_update`). Here a broadcast is all or nothing per engine.

Contract:
- `/begin_weight_update` opens a session; each `/update_weights_from_distributed` inside it
  receives its bucket and stages it (`stage`); the weights, and the `weight_version` a bucket
  carries, change only at `/end_weight_update` (`finish`), in one load between two model steps
  under scheduler_control.py's update rules, every tensor checked before any is copied.
- A session whose sender is gone is abandoned (`abandon`): what it staged is dropped and it is
  closed, so the engine keeps its old weights and version and the next push is not refused:
  - a bucket fails (its receive failed: the trainer died, or the group broke or timed out; or
    it was refused: unknown group);
  - a new group is formed (`/init_weights_update_group`: a restarted trainer), or a group the
    session received on is destroyed;
  - no call for `timeout_s` (the group's deadline) while no receive is under way, noticed at
    the next `/begin_weight_update`.
  The `/end_weight_update` that follows an abandoned session answers 400 naming why.
- One receive at a time (`receiving`): two broadcasts on one group must not interleave.

Not covered: the staged copy costs the model's size again in memory while a push is under way
(host memory over gloo, the GPU's over NCCL: refit_api.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

logger = logging.getLogger(__name__)

ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"


class RefitSession:
    """The open session's staged buckets and what its buckets asked for (module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.open = False
        self.staged: dict[str, Any] = {}
        self.groups: set[str] = set()
        self.version: str | None = None
        self.flush = False
        self.abort_all = False
        self.abandoned: str | None = None  # why the last session was dropped, until an end
        self._last_call = 0.0
        self._receiving = trio.Lock()
        self._opened = 0  # sessions begun so far: a receive belongs to the one it began in

    def begin(self) -> str | None:
        """Open a session; the refusal message if one is open and its sender still active."""
        idle_s = trio.current_time() - self._last_call
        if self.open and not self._receiving.locked() and idle_s > self.timeout_s:
            self.abandon(f"no update for {idle_s:.0f} s (the group's deadline is "
                         f"{self.timeout_s:.0f} s): its sender is gone")  # fmt: skip
        if self.open:
            return ALREADY_OPEN
        self._reset()
        self.open, self.abandoned = True, None
        self._opened += 1
        return None

    def _reset(self) -> None:
        self.open, self.staged, self.groups = False, {}, set()
        self.version, self.flush, self.abort_all = None, False, False
        self._last_call = trio.current_time()

    def abandon(self, reason: str) -> None:
        """Drop the open session and what it staged (the weights stay as they were)."""
        if not self.open:
            return
        logger.warning("weight-update session abandoned, %d staged tensor(s) dropped, weights "
                       "and version unchanged: %s", len(self.staged), reason)  # fmt: skip
        self._reset()
        self.abandoned = reason

    def group_formed(self, name: str) -> None:
        self.abandon(f"a new weight-update group {name} was formed: the sender restarted")

    def group_destroyed(self, name: str) -> None:
        if name in self.groups:
            self.abandon(f"the weight-update group {name} it received on was destroyed")

    @asynccontextmanager
    async def receiving(self, group: str) -> AsyncIterator[int]:
        """Around one bucket's receive: one at a time; a failure (raised) abandons the session.
        Yields the ticket `stage` takes: a session abandoned meanwhile gets nothing of it."""
        async with self._receiving:
            ticket = self._opened
            self.groups.add(group)
            try:
                yield ticket
            except BaseException as exc:
                if ticket == self._opened:
                    self.abandon(f"a bucket failed: {exc}")
                raise
            finally:
                self._last_call = trio.current_time()

    def stage(self, ticket: int, tensors: dict[str, Any], version: str | None, flush: bool,
              abort_all: bool) -> None:  # fmt: skip
        if not self.open or ticket != self._opened:
            logger.warning("a bucket of an abandoned weight-update session arrived: dropped")
            return
        self.staged.update(tensors)
        self.version = version if version is not None else self.version
        self.flush, self.abort_all = self.flush or flush, self.abort_all or abort_all

    def finish(self) -> tuple[dict[str, Any], str | None, bool, bool] | str:
        """Close the session: (staged tensors, version, flush, abort_all) to load, or the
        refusal message (none open: the last one was abandoned, or never begun)."""
        if not self.open:
            reason, self.abandoned = self.abandoned, None
            if reason is None:
                return NOT_OPEN
            return (f"the weight update was abandoned before end_weight_update ({reason}); the "
                    "engine keeps its previous weights and weight_version")  # fmt: skip
        out = (self.staged, self.version, self.flush, self.abort_all)
        self._reset()
        return out
