"""The pause lease: a pause whose holder stopped renewing it ends by itself.

A project extension to SGLang's `/pause_generation`: a body with `"lease_s": S` pauses for at most
S seconds unless renewed; the same request again while paused renews the lease (it does not
pause a second time, so requests held behind the pause are not aborted). When the lease expires
the engine resumes and logs a warning naming the lease: the trainer that paused it (for a
weight sync) died or hung, and every other client's `/generate` would otherwise wait forever.
`/continue_generation`, or a pause without `lease_s` (SGLang's request), clears the lease.

Not covered: SGLang has no lease (it ignores the field), so an SGLang engine paused by a trainer
that died stays paused until someone calls `/continue_generation`; the RL recipe does that at
start for every engine it finds paused (training/recipes/rl_engines.py).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

logger = logging.getLogger(__name__)

MAX_LEASE_S = 3600.0


class PauseLease:
    """The deadline of the current pause, if it has one; `run` resumes the scheduler at it."""

    def __init__(self) -> None:
        self.deadline: float | None = None
        self.lease_s: float | None = None
        self._changed = trio.Event()

    def hold(self, lease_s: float) -> None:
        """Start or renew the lease: the pause ends `lease_s` from now unless renewed."""
        self.lease_s, self.deadline = lease_s, trio.current_time() + lease_s
        self._changed.set()

    def release(self) -> None:
        """No lease: the pause ended, or it is SGLang's (until `/continue_generation`)."""
        self.lease_s = self.deadline = None
        self._changed.set()

    @property
    def held(self) -> bool:
        return self.deadline is not None

    async def run(self, scheduler: Any, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._changed = trio.Event()
            if self.deadline is None:
                await self._changed.wait()
                continue
            with trio.move_on_at(self.deadline) as expiry:
                await self._changed.wait()
            if not expiry.cancelled_caught:
                continue  # renewed or released
            if scheduler.paused:
                logger.warning("pause lease of %.1f s expired without a renewal (the client that "
                               "paused this engine is gone): resuming generation",
                               self.lease_s)  # fmt: skip
                scheduler.resume()
            self.release()
