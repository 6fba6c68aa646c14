"""Which rank of the job died: what rank 0 says when a collective fails because a peer is gone.

Each rank records `<host> <pid>` in the job's key-value store (torchrun's TCP store, hosted by
the launcher, so it outlives the ranks) when it joins. When rank 0's run fails with gloo's
"connection closed/reset by peer", `lost_rank_error` looks up which ranks on this host no longer
run and returns one `RankLostError` naming them, which the CLI prints as one `error:` line
instead of the nested traceback trio and gloo give.

The same when rank 0 was stopped by a signal while a peer was already dead: torchrun SIGTERMs
the ranks left as soon as it reaps a dead one, often before rank 0's collective has failed, and
the user must read "lost rank 1", not "stopped by SIGTERM". This is sound because ranks ≥ 1
ignore SIGINT and SIGTERM (`ignore_stop_signals`): they leave only when rank 0 releases them or
goes away, so a user's Ctrl-C, `kill` or `scancel` never makes a rank ≥ 1 "dead" first.

Covered: ranks on rank 0's host (their pids are checked). Not covered: a rank on another host is
not probed; the error then says that a peer closed the connection, with gloo's message.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from plumbing.errors import Interrupted, RolloutsError, leaf_errors

if TYPE_CHECKING:
    from training.distributed.context import DistContext

log = logging.getLogger("rollouts.distributed")

_KEY = "rollouts/process/{rank}"
# gloo's messages when the other end of a pair went away (tcp/pair.cc)
_PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")
_PF_EXITING = 0x4  # include/linux/sched.h: the process is in do_exit
_SETTLE_S = 2.0  # how long a closed connection waits for its peer's process to be gone


class RankLostError(RolloutsError, RuntimeError):
    """A rank of the job died (killed, out of memory, crashed); names it when it can."""


def record_process(ctx: DistContext) -> None:
    """Record this rank's host and pid in the job's store (at join)."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_KEY.format(rank=ctx.rank), f"{socket.gethostname()} {os.getpid()}")
    except RuntimeError as err:  # no store: the error on a death names no rank
        log.debug("rank %d could not record its process: %s", ctx.rank, err)


def lost_rank_error(ctx: DistContext, err: BaseException) -> RankLostError | None:
    """A `RankLostError` when `err` (or an exception inside it) is gloo's report of a peer that
    went away, or a stop signal that found a peer already dead; None for any other failure."""
    leaves = leaf_errors(err)
    gone = next((e for e in leaves if isinstance(e, RuntimeError)
                 and any(s in str(e) for s in _PEER_GONE)), None)  # fmt: skip
    stopped = any(isinstance(e, Interrupted) for e in leaves)
    if not stopped and (gone is None or any(isinstance(e, RolloutsError) for e in leaves)):
        return None
    dead = _dead_ranks(ctx)
    settle_until = time.monotonic() + _SETTLE_S
    while gone is not None and not dead and time.monotonic() < settle_until:
        time.sleep(0.05)  # the connection closed first; the peer's exit may lag behind it
        dead = _dead_ranks(ctx)
    if stopped and not dead:  # the user's own stop: every rank is still there
        return None
    if dead:
        who = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in dead)
        what = f"lost {who}: its process is gone (killed or crashed)"
    else:
        first_line = str(gone).splitlines()[0] if str(gone) else ""
        what = f"lost another rank: a peer closed its connection ({first_line})"
    return RankLostError(f"{what}; the job stops. Check that rank's log (an out-of-memory kill "
                         "shows in dmesg), then resume with --resume")  # fmt: skip


def ignore_stop_signals() -> None:
    """Ranks ≥ 1: ignore SIGINT and SIGTERM; rank 0 alone decides when the job stops.

    Why: a clean stop (requests aborted, the last checkpoint written) needs every rank's share
    of the collectives, and a rank that died of the signal first would turn the user's stop into
    a lost-rank failure. A rank ≥ 1 still leaves at once when rank 0 exits (its sockets close),
    and torchrun SIGKILLs what is left after its grace period.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Rank0StopSignal:
    """Rank 0's SIGTERM handler outside the run's own signal receiver (trio's, while it runs).

    Why: torchrun SIGTERMs rank 0 as soon as it reaps a dead rank. When rank 0's collective had
    already failed, the run's receiver was closed and the default action killed rank 0 in the
    middle of its report (exit -15, no `error:` line naming the lost rank). While `main()` runs
    a SIGTERM still stops it (`Interrupted`); once `main()` has returned or raised (`finish()`)
    it is noted, not obeyed, so the report and the release of the other ranks complete (both
    are bounded). torchrun SIGKILLs what is left after its grace period (30 s).
    """

    def __init__(self) -> None:
        self._stopping_main = True

    def install(self) -> Rank0StopSignal:
        import signal

        signal.signal(signal.SIGTERM, self._handle)
        return self

    def finish(self) -> None:
        """`main()` is over: from now on a SIGTERM is noted, not raised."""
        self._stopping_main = False

    def _handle(self, signum: int, frame: object) -> None:
        if self._stopping_main:
            raise Interrupted("SIGTERM")


def _dead_ranks(ctx: DistContext) -> list[tuple[int, int]]:
    """(rank, pid) of each rank on this host whose process no longer runs."""
    import torch.distributed as dist

    host, dead = socket.gethostname(), []
    try:
        store = dist.distributed_c10d._get_default_store()
        for rank in range(ctx.world):
            key = _KEY.format(rank=rank)
            if rank == ctx.rank or not store.check([key]):
                continue
            their_host, pid = store.get(key).decode().split()
            if their_host == host and not _alive(int(pid)):
                dead.append((rank, int(pid)))
    except (RuntimeError, ValueError) as lookup:  # the store went too: name no rank
        log.debug("could not look up the ranks' processes: %s", lookup)
    return dead


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child not yet reaped by torchrun is a zombie: gone all the same. Before that it
    # is exiting (PF_EXITING, set before its sockets close): under load rank 0 reads "reset by
    # peer" while the killed rank is still in that state, and must already count it as gone.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING
