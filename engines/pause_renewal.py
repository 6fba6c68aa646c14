"""`renewing_pauses`: keep the leases of this client's pauses alive while a sync holds them.

Contract:
- A pause sent by `SGLangEngine` carries `lease_s = engine.pause_lease_s` (default 60 s); the
  local engine resumes by itself when a lease is not renewed in time (engines/local/
  pause_lease.py), so a trainer killed in the middle of a weight sync leaves it paused for at
  most one lease, not until the next run pushes weights (issue 26 item 5).
- `async with renewing_pauses(engines):` renews, every `lease_s / 3`, the lease of each engine
  this client has paused (`engine.paused`), in a task of the block's own nursery: it stops
  when the block ends, and with the process. A failed renewal is logged, never raised: the
  sync's own steps say whether the engine is gone.
- Engines without `renew_pause` (the gateway control plane, test fakes) or with
  `pause_lease_s = None` are left alone.

Not covered: SGLang ignores `lease_s` (its pause lasts until `/continue_generation`; the RL
recipe resumes engines it finds paused at start) and takes the renewal as one more "in_place"
pause, which aborts nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from plumbing.errors import EngineError
from plumbing.nursery import open_nursery

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def renewing_pauses(engines: Sequence[Any]) -> AsyncIterator[None]:
    """Renew the pause leases of `engines` while the block runs (see the module docstring)."""
    leased = [e for e in engines if hasattr(e, "renew_pause") and getattr(e, "pause_lease_s", None)]
    if not leased:
        yield
        return
    async with open_nursery() as nursery:  # the body's error propagates as itself
        nursery.start_soon(_renew_forever, leased)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()


async def _renew_forever(engines: Sequence[Any]) -> None:
    interval_s = min(e.pause_lease_s for e in engines) / 3
    while True:
        await trio.sleep(interval_s)
        for engine in engines:
            if not engine.paused:
                continue
            with trio.move_on_after(interval_s):
                try:
                    await engine.renew_pause()
                except EngineError as exc:
                    logger.warning("could not renew the pause lease of %s: %s", engine.url, exc)
