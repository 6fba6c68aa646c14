"""A trio nursery that raises a lone error as itself, not wrapped in an ExceptionGroup."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    """`trio.open_nursery()`, except that a single error (the body's or one task's) propagates
    as itself, so callers can catch `WeightSyncError`, `RewardError`, ... directly. Several
    errors at once still raise the ExceptionGroup.
    """
    lone: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        lone = group.exceptions[0]
    if lone is not None:
        raise lone  # outside the handler, so the group is not chained as its context
