"""The collective watchdog: a rank that waits in a collective too long fails naming the op, the
step and what every rank was doing, instead of gloo's or NCCL's generic timeout.

How: the training group's collectives time out after `backend.collective_timeout_s` (120 s by
default, set on the process group), and so do rank 0's waits on the command channel within an
op (sending the op and the rows, gathering results: gloo's sender waits for the receiver, so a
stopped rank would otherwise hold rank 0 for the command group's long deadline). Each rank writes its status — backend op, step, phase
("agreeing pass counts", "pass 2 of 3", "idle pass 3 of 3", ...) and since when — to the job's
key-value store when an op starts and at each pass, and "waiting for the next op" when it
ends. The store is torchrun's TCP store, outside the collectives, so it answers while they
hang. When a collective times out inside `watch`, the rank reads every rank's status and raises
`CollectiveTimeoutError` with all of them; on rank 0 the CLI prints it as one `error:` line.

Covered: gloo (CPU), whose timeouts raise in the waiting thread. Not covered: NCCL reports a
timeout from its own watchdog thread and aborts the process (same deadline, its own message,
no rank statuses); a rank busy in one long pass makes the others wait, so the deadline must
exceed the longest pass (raise it for very long sequences or slow hardware).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from plumbing.errors import RolloutsError

if TYPE_CHECKING:
    from training.distributed.context import DistContext

log = logging.getLogger("rollouts.distributed")

_KEY = "rollouts/status/{rank}"


class CollectiveTimeoutError(RolloutsError, TimeoutError):
    """A collective waited longer than `backend.collective_timeout_s`; the message says which
    op and step, and what every rank was doing."""


def _store(ctx: DistContext) -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def set_status(ctx: DistContext | None, status: dict[str, Any]) -> None:
    """Record what this rank is doing now (a no-op at world size 1)."""
    if ctx is None:
        return
    try:
        _store(ctx).set(_KEY.format(rank=ctx.rank), json.dumps({**status, "t": time.time()}))
    except RuntimeError as err:  # the store is gone: the job is ending anyway
        log.debug("rank %d could not record its status: %s", ctx.rank, err)


def describe(status: dict[str, Any] | None, now: float) -> str:
    """One rank's status in words: "forward_backward step 3, pass 2 of 3 (for 5 s)"."""
    if status is None:
        return "no status recorded"
    what = status.get("op") or "?"
    if status.get("step") is not None:
        what += f" step {status['step']}"
    if status.get("phase"):
        what += f", {status['phase']}"
    return f"{what} (for {max(0.0, now - status['t']):.0f} s)"


def rank_statuses(ctx: DistContext) -> list[dict[str, Any] | None]:
    """Every rank's last recorded status (None where none is recorded or the store failed)."""
    store, out = _store(ctx), []
    for rank in range(ctx.world):
        key = _KEY.format(rank=rank)
        try:
            out.append(json.loads(store.get(key)) if store.check([key]) else None)
        except RuntimeError:
            out.append(None)
    return out


def is_timeout(err: BaseException) -> bool:
    """A collective's deadline passed (gloo: "Timed out waiting ...ms for recv/send ...")."""
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


class Watch:
    """The status of one op on this rank; `phase` records progress through its passes."""

    def __init__(self, ctx: DistContext | None, op: str, step: int | None):
        self.ctx, self.op, self.step = ctx, op, step

    def phase(self, text: str) -> None:
        set_status(self.ctx, {"op": self.op, "step": self.step, "phase": text})


@contextmanager
def watch(ctx: DistContext | None, op: str, step: int | None) -> Iterator[Watch]:
    """Run one op's local part: its status is recorded, and a collective timeout inside becomes
    a `CollectiveTimeoutError` naming the op, the step and every rank's status."""
    w = Watch(ctx, op, step)
    if ctx is None:
        yield w
        return
    w.phase("starting")
    try:
        yield w
    except RuntimeError as err:
        if not is_timeout(err):
            raise
        now = time.time()
        ranks = "; ".join(f"rank {r}: {describe(s, now)}"
                          for r, s in enumerate(rank_statuses(ctx)))  # fmt: skip
        where = f"{op}" + (f" at step {step}" if step is not None else "")
        raise CollectiveTimeoutError(
            f"rank {ctx.rank} waited more than {ctx.collective_timeout_s:g} s "
            f"(backend.collective_timeout_s) in a collective of {where}. What each rank was "
            f"doing: {ranks}. A rank that stopped answering (stuck, stopped or swapping) or "
            "ranks running different collectives; if one pass legitimately takes longer, "
            "raise backend.collective_timeout_s"
        ) from None
    finally:
        set_status(ctx, {"op": "between ops", "step": None, "phase": f"the last was {op}"})
