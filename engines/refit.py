"""`RefitGroup` and `receive_on_engines`: weights to engines over a process group,
SGLang's distributed refit, instead of through a shared filesystem.

The group: the trainer's rank 0 (rank 0 of this group) and every engine (ranks 1..n, each
joins with `rank_offset`), world size 1 + n, its own TCP store at `master_address:master_port`
(a fresh port and group name each time it is formed), independent of the trainer's torchrun
group. gloo on CPU, NCCL on GPU (`backend`). Formed at the first push, and again whenever the
engines that should be in it change (one died, one came back); a restarted trainer forms a new
one (the engines leave a group of the same name first).

One update (per engine, all at once, the engines already paused): flush the prefix cache
(unless "in_place": see weight_sync.py) → `/begin_weight_update` (SGLang 0.5.23; a server
without the route, 404, updates without the session, as before 0.5.23) → for each bucket
`/update_weights_from_distributed` (names, dtypes, shapes; `flattened_bucket`) while the
trainer broadcasts that bucket's bytes → the last bucket carries `weight_version` →
`/end_weight_update` (the local engine loads the staged buckets there, all at once:
engines/local/refit_session.py) → `/model_info` must report the version. The engines are left paused:
the caller resumes them, or first gives them the weights from disk if the broadcast failed.

Faults, bounded everywhere: the rendezvous is under `timeout_s`, each bucket's broadcast under
`broadcast_timeout_s` (gloo's timeout on the trainer's side of the group), every HTTP call under
`timeout_s` + a margin. A failed broadcast (an engine died: gloo fails at once; it or its link
stalls: after `broadcast_timeout_s`) tears the trainer's side of the group down at once, which
ends every engine's pending receive; a receive call still pending `ABANDON_S` later (a hung
engine or proxy: nothing will end it) is given up on, so a hung update costs about
`broadcast_timeout_s` + `ABANDON_S`, not the HTTP deadline; the group is re-formed without the
missing engine at the next push. Engines out of the group get the weights from
disk (the trainer exports them only then: training/loops/refit_push.py).

Nothing here imports torch at module level (engines/__init__.py's rule); the trainer-side
collectives import it when they run, on the trainer's thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import trio

from plumbing.errors import EngineError

from .launch import find_free_port
from .pause_renewal import renewing_pauses
from .sync_steps import flush as _flush
from .sync_steps import raise_failures as _raise_failures
from .sync_steps import resume_noting as _resume_noting
from .types import EngineUnavailableError

logger = logging.getLogger(__name__)

_HTTP_MARGIN_S = 30.0  # an engine answers this long after its receive ended, at most
ABANDON_S = 10.0  # a receive still pending this long after the trainer's broadcast failed is hung


class RefitGroup:
    """The trainer's end of the weight-update group (see the module docstring)."""

    def __init__(self, *, master_address: str = "127.0.0.1", backend: str = "gloo",
                 timeout_s: float = 120.0, bucket_mb: float = 512.0,
                 broadcast_timeout_s: float | None = None) -> None:  # fmt: skip
        broadcast_timeout_s = min(timeout_s, 30.0) if broadcast_timeout_s is None else (
            broadcast_timeout_s)  # fmt: skip
        if min(timeout_s, bucket_mb, broadcast_timeout_s) <= 0:
            raise ValueError(f"RefitGroup: timeout_s, bucket_mb and broadcast_timeout_s must be "
                             f"> 0, got {timeout_s}, {bucket_mb}, {broadcast_timeout_s}")  # fmt: skip
        self.master_address, self.backend, self.timeout_s = master_address, backend, timeout_s
        self.broadcast_timeout_s = broadcast_timeout_s
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.name: str | None = None
        self.members: tuple[str, ...] = ()  # engine URLs, in rank order (rank i + 1)
        self._pg: Any = None
        self._engines: list[Any] = []  # the member engines (for `close()`)
        self._lock = threading.Lock()  # `send` (trainer thread) vs `close` (trio thread)
        self._formed = 0
        # the buckets of the current push rank 0 has sent, or None once a send failed; engines
        # ask for bucket i + 1 only after bucket i went out (see `wait_sent`)
        self._sent: int | None = 0
        self._changed = trio.Event()
        self._token: Any = None

    @property
    def formed(self) -> bool:
        return self._pg is not None

    async def ensure(self, engines: Sequence[Any]) -> list[Any]:
        """The engines in the group, forming it anew if they are not the ones that answer now.

        An engine the pool knows is down, or that does not answer `/model_info`, is left out.
        A group that cannot be formed (an engine refused or timed out) leaves none: the caller
        pushes through disk this time and the next push tries again.
        """
        alive = [e for e in engines if await _answers(e)]
        if self.formed and tuple(e.url for e in alive) == self.members:
            return alive
        await self.close(engines)
        if not alive:
            return []
        self._formed += 1
        name = f"rollouts-refit-{uuid.uuid4().hex[:8]}-{self._formed}"
        port = find_free_port(self.master_address)
        world = 1 + len(alive)
        failures: list[str] = []

        async def join(rank: int, engine: Any) -> None:
            try:
                await engine.init_weights_update_group(
                    self.master_address, port, rank, world, name, backend=self.backend,
                    timeout_s=self.timeout_s + _HTTP_MARGIN_S)  # fmt: skip
            except EngineError as exc:
                failures.append(f"{engine.url}: {exc}")

        def host() -> Any:
            from plumbing.process_group import init_custom_process_group

            return init_custom_process_group(
                backend=self.backend, master_address=self.master_address, master_port=port,
                world_size=world, rank=0, group_name=name, timeout_s=self.timeout_s,
                collective_timeout_s=self.broadcast_timeout_s)  # fmt: skip

        pg = None
        with trio.move_on_after(self.timeout_s + _HTTP_MARGIN_S):
            async with trio.open_nursery() as nursery:
                for rank, engine in enumerate(alive, start=1):
                    nursery.start_soon(join, rank, engine)
                try:
                    pg = await trio.to_thread.run_sync(host)
                except Exception as exc:  # the store's timeout: some engine never joined
                    failures.append(f"trainer (rank 0): {exc}")
        if pg is None or failures:
            logger.warning("could not form the weight-update group %s (disk this time): %s",
                           name, "; ".join(failures) or "timed out")  # fmt: skip
            if pg is not None:
                await trio.to_thread.run_sync(_destroy, pg)
            return []
        self._pg, self.name, self.members = pg, name, tuple(e.url for e in alive)
        self._engines = list(alive)
        logger.info("weight-update group %s formed: trainer + %d engine(s) at %s:%d (%s)", name,
                    len(alive), self.master_address, port, self.backend)  # fmt: skip
        return alive

    def start_push(self) -> None:
        """A push begins (trio thread): no bucket sent yet."""
        self._sent, self._token = 0, trio.lowlevel.current_trio_token()
        self._bump()

    async def wait_sent(self, n: int) -> bool:
        """Wait until rank 0 has sent `n` buckets of this push (True) or a send failed (False).

        Why: an engine whose next receive the trainer will never serve would wait out its own
        deadline (SGLang's: 30 min) with its scheduler blocked; so an engine is asked for
        bucket i + 1 only once bucket i went out."""
        while self._sent is not None and self._sent < n:
            await self._changed.wait()
        return self._sent is not None

    async def wait_failed(self) -> None:
        """Return once a send of the current push failed (never, if none does)."""
        while self._sent is not None:
            await self._changed.wait()

    def _bump(self, sent: int | None = 0) -> None:
        if sent is None:
            self._sent = None
        elif self._sent is not None:
            self._sent += sent
        self._changed.set()
        self._changed = trio.Event()

    def send(self, tensors: list[Any]) -> None:
        """Broadcast one bucket (trainer thread); on failure the group is torn down at once,
        so every engine's receive ends, and the error is raised."""
        import torch

        from plumbing.process_group import flatten_bucket

        pg = self._pg
        try:
            if pg is None:
                raise EngineError("the weight-update group was torn down during the push")
            torch.distributed.broadcast(flatten_bucket(tensors), src=0, group=pg)
        except Exception:
            self._drop()
            self._report(None)
            raise
        self._report(1)

    def _report(self, sent: int | None) -> None:
        if self._token is not None:
            trio.from_thread.run_sync(self._bump, sent, trio_token=self._token)

    def _drop(self) -> None:
        with self._lock:
            pg, self._pg = self._pg, None
        if pg is not None:
            _destroy(pg)

    async def close(self, engines: Sequence[Any] | None = None) -> None:
        """Tear the group down: the trainer's side, then each member (among `engines` if
        given) leaves it; best effort, bounded: a dead engine has nothing to leave."""
        name, members = self.name, set(self.members)
        engines = self._engines if engines is None else engines
        self.name, self.members, self._engines = None, (), []
        await trio.to_thread.run_sync(self._drop)
        if name is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self.timeout_s):
            async with trio.open_nursery() as nursery:
                for engine in engines:
                    if engine.url in members:
                        nursery.start_soon(_leave, engine, name)


async def receive_on_engines(group: RefitGroup, engines: Sequence[Any], plan: Sequence[Any],
                             weight_version: str, *, pause_mode: str = "abort",
                             flush_retries: int = 5, flush_retry_s: float = 0.2
                             ) -> dict[str, list[str]]:  # fmt: skip
    """The engines' part of one update (module docstring), while the trainer broadcasts `plan`
    (buckets with `names`, `dtypes`, `shapes`, in broadcast order) on `group`.

    Returns:
        {engine url: [what failed]}, empty when every engine reports `weight_version`. The
        engines stay paused.
    """
    failures: dict[str, list[str]] = {}
    http_s = group.timeout_s + _HTTP_MARGIN_S

    scopes: dict[str, trio.CancelScope] = {}

    async def receive(engine: Any) -> None:
        with trio.CancelScope() as scopes[engine.url]:
            await _receive(engine)
        if scopes[engine.url].cancelled_caught:
            failures.setdefault(engine.url, []).append(
                f"its receive was still pending {ABANDON_S:.0f} s after the trainer's broadcast "
                "failed (a hung engine or link); given up on")  # fmt: skip

    async def abandon_hung() -> None:  # see the module docstring
        await group.wait_failed()
        await trio.sleep(ABANDON_S)
        for scope in scopes.values():
            scope.cancel()

    async def _receive(engine: Any) -> None:
        began = session = False
        try:
            if pause_mode != "in_place":
                await _flush(engine, flush_retries, flush_retry_s)
            began = await _begin(engine)
            session = began
            for i, bucket in enumerate(plan):
                if not await group.wait_sent(i):
                    raise EngineError(f"the trainer's broadcast failed before bucket {i}; "
                                      "not asked for it", url=engine.url)  # fmt: skip
                last = i == len(plan) - 1
                await engine.update_weights_from_distributed(
                    bucket.names, bucket.dtypes, bucket.shapes, group.name,
                    weight_version=weight_version if last else None, timeout_s=http_s)  # fmt: skip
            began = False
            if session:
                await engine.end_weight_update()
            info = await engine.model_info()
            if info.weight_version != weight_version:
                failures.setdefault(engine.url, []).append(
                    f"reports weight_version {info.weight_version!r} after the update, "
                    f"expected {weight_version!r}")  # fmt: skip
        except EngineError as exc:
            # the trainer's broadcast then fails (this engine's peer closed) or times out
            failures.setdefault(engine.url, []).append(str(exc))
        finally:
            if began:  # close the session, or the engine's next begin is refused (bounded
                # like a hung receive: the local engine also drops it at its next group)
                with (trio.CancelScope(shield=True), trio.move_on_after(ABANDON_S),
                      contextlib.suppress(EngineError)):  # fmt: skip
                    await engine.end_weight_update()

    async with renewing_pauses(engines), trio.open_nursery() as outer:
        outer.start_soon(abandon_hung)
        async with trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(receive, engine)
        outer.cancel_scope.cancel()
    return failures


async def resume_updated(engines: Sequence[Any], weight_version: str, path: str | None,
                         resume_timeout_s: float = 30.0) -> None:  # fmt: skip
    """Resume engines that took `weight_version` by broadcast; their `expected_weights` is
    (`path`: a disk copy when one was written, else None, `weight_version`).

    Raises:
        WeightSyncError: an engine could not be resumed (the message names it).
    """
    down: dict[str, str] = {}
    failures: dict[str, list[str]] = {}
    async with trio.open_nursery() as nursery:
        for engine in engines:
            engine.expected_weights = (path, weight_version)
            nursery.start_soon(_resume_noting, engine, True, resume_timeout_s, down, failures)
    await _raise_failures(f"resuming the engines after the broadcast of {weight_version!r}",
                          len(engines), down, failures)  # fmt: skip


async def _begin(engine: Any) -> bool:
    """`/begin_weight_update`; False on a 404: SGLang before 0.5.23 has no session routes
    (and updates without one)."""
    try:
        await engine.begin_weight_update()
    except EngineError as exc:
        if exc.status != 404:
            raise
        return False
    return True


async def _answers(engine: Any) -> bool:
    if getattr(engine, "known_down", False):
        return False
    with trio.move_on_after(10.0):
        try:
            await engine.model_info()
            return True
        except EngineError:
            return False
    return False


async def _leave(engine: Any, name: str) -> None:
    try:
        await engine.destroy_weights_update_group(name)
    except EngineUnavailableError:
        pass  # gone: a restarted engine has no group
    except EngineError as exc:
        logger.debug("%s did not leave weight-update group %s: %s", engine.url, name, exc)


def _destroy(pg: Any) -> None:
    from plumbing.process_group import destroy_process_group

    try:
        destroy_process_group(pg)
    except Exception as exc:  # a group whose peers died may fail to tear down; it is dropped
        logger.debug("tearing down a weight-update group: %s", exc)
