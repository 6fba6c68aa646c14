"""Both ends of the command channel: rank 0 issues operations, ranks ≥ 1 serve them.

One operation = a header broadcast to every rank (`{"op", "id", "args", "rows", "gather"}`),
then, if it has rows, each rank's share sent point to point, then — for operations with a
result — each rank's local result sent back to rank 0. Every rank then runs the operation's
local part, which issues the same collectives in the same order everywhere.

`serve_commands` is the whole life of ranks ≥ 1: build the backends rank 0 builds (the
"create" op carries the builder by import path, so this module imports no backend), run each
operation, and return when rank 0 sends `shutdown` (or raise when it vanished: the gloo wait
ends with an error after `fsdp.command_timeout_s`, or at once when its socket closes).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from training.distributed import wire
from training.distributed.context import DistContext, init_distributed, shutdown_distributed
from training.distributed.liveness import Rank0StopSignal, ignore_stop_signals, lost_rank_error
from training.distributed.watchdog import CollectiveTimeoutError

if TYPE_CHECKING:
    from training.config import BackendConfig

T = TypeVar("T")

log = logging.getLogger("rollouts.distributed")


def issue(ctx: DistContext, op: str, backend_id: int | None, args: dict[str, Any],
          shares: Sequence[Sequence[Any]] | None = None, *, gather: bool = False) -> None:  # fmt: skip
    """Rank 0: announce `op` to every rank and send each rank ≥ 1 its rows (`shares[rank]`)."""
    header = {"op": op, "id": backend_id, "args": args, "rows": shares is not None,
              "gather": gather}  # fmt: skip
    # Every wait of rank 0 here has the collective deadline: a rank that stopped answering
    # must not hold rank 0 for the command group's (ranks ≥ 1 idle there between ops).
    wait_s = ctx.collective_timeout_s
    wire.broadcast_bytes(wire.dumps(header), ctx.commands, wait_s)
    if shares is not None:
        for rank in range(1, ctx.world):
            wire.send_bytes(wire.dumps(list(shares[rank])), rank, ctx.commands, wait_s)


def gather_results(ctx: DistContext, local: Any) -> list[Any]:
    """Rank 0: its own result, then each other rank's, in rank order."""
    wait_s = ctx.collective_timeout_s
    return [local, *(wire.loads(wire.recv_bytes(r, ctx.commands, wait_s))
                     for r in range(1, ctx.world))]  # fmt: skip


def shutdown_workers(ctx: DistContext) -> None:
    """Rank 0: tell every other rank to leave `serve_commands` (after all queued work)."""
    assert ctx.executor is not None
    ctx.executor.submit(issue, ctx, "shutdown", None, {}).result()


def run_rank0(backend: BackendConfig, main: Callable[[], T]) -> T | None:
    """The entry point of a run at any world size: `main()` at world size 1; under torchrun
    `main()` on rank 0 (then the other ranks are released) and `serve_commands` on the others,
    which get None back.

    If `main` raises on rank 0 the others are not waited for: rank 0 exits, its sockets close,
    their next wait fails at once and torchrun ends the job. If it raised because another rank
    died, it raises `RankLostError` naming that rank instead (one `error:` line in the CLI).
    """
    ctx = init_distributed(backend)
    if ctx is None:
        return main()
    if ctx.rank > 0:
        ignore_stop_signals()
        try:
            serve_commands(ctx)
        except CollectiveTimeoutError as err:  # already says the op, the step and every rank
            raise SystemExit(f"rank {ctx.rank}: {err}") from None
        except RuntimeError as err:  # rank 0 is gone (its sockets closed) or went silent
            raise SystemExit(f"rank {ctx.rank}: lost rank 0 ({err}); exiting") from None
        if shutdown_distributed():
            _exit_without_finalizing(0)
        return None
    # Left installed: past main() rank 0 is on its way out, and its report (printed by the
    # caller) must not be cut short by torchrun's SIGTERM (see Rank0StopSignal).
    stop = Rank0StopSignal().install()
    try:
        result = main()
    except BaseException as err:
        stop.finish()
        # first: once released, the other ranks exit, and would look lost too
        lost = lost_rank_error(ctx, err)  # gloo's "closed by peer", or torchrun's SIGTERM
        _release_workers_if_idle(ctx)
        if lost is not None:
            raise lost from None
        raise
    stop.finish()
    shutdown_workers(ctx)
    shutdown_distributed()
    return result


def _exit_without_finalizing(code: int) -> None:
    """A rank ≥ 1 whose gloo threads outlived its process groups: end the process without
    finalizing the interpreter, which such a thread can abort (training/distributed/teardown.py).

    Safe here: every operation of this rank has returned (its checkpoint shards are written and
    closed inside the operation) and nothing else runs in this process; logs and output are
    flushed first. Only atexit handlers are skipped.
    """
    log.info("ending the process without finalizing the interpreter (see teardown.py)")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _release_workers_if_idle(ctx: DistContext, wait_s: float = 10.0) -> None:
    """Rank 0 failed: if its trainer thread is free, tell the others to stop, so that they exit
    cleanly and the job's failure is rank 0's own error. If the thread is stuck in a collective
    the others are stuck too: rank 0's exit closes its sockets, which ends their waits."""
    import concurrent.futures

    assert ctx.executor is not None
    try:
        ctx.executor.submit(issue, ctx, "shutdown", None, {}).result(timeout=wait_s)
    except (concurrent.futures.TimeoutError, RuntimeError):
        log.warning("rank 0 could not release the other ranks; they stop when it exits")


def serve_commands(ctx: DistContext) -> None:
    """Ranks ≥ 1: run rank 0's operations until it says `shutdown`."""
    log.info("rank %d serving rank 0's backend operations", ctx.rank)
    while True:
        header = wire.loads(wire.broadcast_bytes(None, ctx.commands), ctx.backends)
        op, backend_id = header["op"], header["id"]
        if op == "shutdown":
            log.info("rank %d: rank 0 finished", ctx.rank)
            return
        args = header["args"]
        rows = (
            wire.loads(wire.recv_bytes(0, ctx.commands, ctx.collective_timeout_s), ctx.backends)
            if header["rows"]
            else None
        )
        if op == "create":  # args["build"]: the backend class's builder, sent by import path
            args["build"](args["spec"], backend_id)
            continue
        if op == "release":  # rank 0 closed it: free its model and optimizer here now
            ctx.unregister(backend_id)
            gc.collect()  # its FSDP hooks hold cycles; no caller here will drop it later
            continue
        result = ctx.backends[backend_id].run_local(op, rows, args)
        if header["gather"]:
            wire.send_bytes(wire.dumps(result), 0, ctx.commands)
