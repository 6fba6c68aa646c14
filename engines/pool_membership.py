"""Which engines of an `EnginePool` serve: per-engine records, health probes, mark down, rejoin.

Why a module of its own: membership is the pool's state machine (up → down → given the current
weights → up), driven by probes and supervisor events in the background; `pool.py` keeps the
dispatch of requests (pick, retry, fail over), which only reads `_Slot.healthy` and waits on
`_changed`. `PoolMembershipMixin` uses the attributes `EnginePool.__init__` sets.

Contract (the membership half of `EnginePool`'s):
- An engine that fails with `EngineUnavailableError` (connection refused or dropped, 503 after
  its own retries) is marked down. A background task (in the nursery of `async with pool:`)
  probes every engine each `probe_interval_s`: a healthy one must still answer `/model_info`
  with the weight version the last sync gave it (`expected_weights`), else it is marked down (it
  died, or restarted on its initial weights); a down one that answers again is first given
  the current weights by a full sync (pause → flush → update → version check → continue), and
  the active LoRA adapter by `sync_lora_to_engines` if the last sync was one, and only then
  marked up; if the last push went by broadcast (`expected_weights` without a path) the pool's
  `weights_copy` (an async callable the trainer side sets: version -> (path, version)) writes a
  disk copy of the trainer's weights, which is recorded and given as above: without one it
  stays down until a push writes a copy for it (engines/refit.py), and with every engine down
  no batch, so no push, would ever come (issue 49 item D1). It stays `known_down` until then:
  a push meanwhile only records its weights, which the rejoin gives it before it is marked up.
  Engines this client has paused (a weight sync in progress) are never marked down by a
  probe; one whose resume did not get through (an error, a timeout: the sync has ended, the
  engine may still be paused) is sent the resume again by each probe until it gets through
  (`retry_resume`), then probed as any other (a down one rejoins). A down engine's
  `known_down` is set: weight syncs skip it without trying (its retries would cost
  0.5 + 1 + 2 s per route); it gets the weights on rejoin. A sync that gave up on an engine's
  load (it hangs: engines/sync_steps.py) sets it too, and the next probe marks that engine
  down.
- `engine_events` (optional, a trio receive channel of (what, url)): an engine supervisor's
  ("down", url) marks that engine down at once, so no request is sent to a dead engine while
  it is relaunched; ("up", url) has it given the current weights and marked up (as a probe
  that finds it answering would), without waiting for the next probe. A "down" while a rejoin
  gives it the weights (to the process that exited) keeps it down: the relaunch's "up" rejoins
  it. A version probe answered before a rejoin (by the initial weights) marks nothing down.
- `follows_weights=True` (a rollout worker's pool, rollouts/workers/worker.py): another process
  (the trainer) pushes the weights; this pool only generates with them. `expect_weights(v)`
  names the version the trainer's last push gave the engines (None: no push yet); an answer
  from older weights fails over as above (`StaleWeightsError`), and a down engine rejoins,
  without a sync, only once its `/model_info` reports that version or a newer one (the
  trainer's pool gave it the weights): an engine back from a relaunch on its initial weights
  gets no request here meanwhile. Versions are compared as integers ("12"; other labels must
  be equal), so a push that lands mid-batch (overlap, async) rejects nothing. Healthy engines
  are not probed for their version (a push moves it between two of the trainer's batches).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import trio

from plumbing.errors import EngineError, engine_failure_kind

from .types import EngineUnavailableError, InferenceEngine
from .weight_sync import sync_lora_to_engines, sync_weights_to_engines

logger = logging.getLogger("engines.pool")  # the pool's one logger name, as before the split


@dataclass(frozen=True)
class EngineStats:
    url: str
    healthy: bool
    in_flight: int
    done: int
    failed: int
    failures: Mapping[str, int] = dataclass_field(default_factory=dict)  # kind -> count
    rejoined: int = 0  # times it came back and was given the current weights
    samples_sent: int = 0  # items of the requests sent to it (a batch counts its items)
    samples_received: int = 0  # items of the answers it returned
    down_reason: str | None = None  # why it is down now (None: it serves)


@dataclass(frozen=True)
class PoolStatistics:
    engines: tuple[EngineStats, ...]

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.engines)

    @property
    def done(self) -> int:
        return sum(e.done for e in self.engines)

    @property
    def failed(self) -> int:
        return sum(e.failed for e in self.engines)


class _Slot:
    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.healthy = True
        self.in_flight = 0
        self.done = 0
        self.failed = 0
        self.failures: Counter[str] = Counter()
        self.rejoined = 0
        self.rejoining = False
        self.exited_in_rejoin = False  # its supervisor saw it exit while a rejoin ran
        self.relaunched_in_rejoin = False  # ...and its relaunch answered: rejoin that next
        self.samples_sent = 0
        self.samples_received = 0
        self.last_pick = 0
        self.down_reason: str | None = None  # why it was marked down, until it rejoins
        self.rejoin_failed = False  # its failed rejoins were logged once (WARNING) this time

    def fail(self, exc: EngineError) -> None:
        self.failed += 1
        self.failures[engine_failure_kind(exc)] += 1


class StaleWeightsError(EngineUnavailableError):
    """The engine answered from other weights than the last sync gave it (it restarted)."""


class NoEngineAvailableError(EngineUnavailableError):
    """The pool waited `unavailable_timeout_s` (or spent `max_attempts`) and no engine served
    the request: sending it again at once would not help. `last_kind`: the last failure's kind."""

    def __init__(self, message: str, *, last: EngineError | None = None) -> None:
        super().__init__(message, url=getattr(last, "url", "") or "")
        self.last_kind = engine_failure_kind(last) if last is not None else None


class PoolMembershipMixin:
    """Health probes, engine events and rejoin for `EnginePool` (uses the state it sets)."""

    _slots: list[_Slot]
    _changed: trio.Event
    _nursery: trio.Nursery | None
    probe_interval_s: float
    rejoin_timeout_s: float
    # version -> (path, version) of a disk copy of the trainer's weights, for an engine that
    # comes back after a broadcast push (module docstring); None: it waits for the next push
    weights_copy: Callable[[str], Awaitable[tuple[str, str]]] | None
    follows_weights: bool  # another process gives the engines their weights (docstring)

    def expect_weights(self, version: str | None) -> None:
        """`follows_weights`: the version of the trainer's last push (module docstring)."""
        for slot in self._slots:
            slot.engine.expected_weights = (  # type: ignore[attr-defined]
                None if version is None else (None, version)
            )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _mark_down(self, slot: _Slot, reason: BaseException) -> None:
        """The one WARNING of an engine going down; what follows while it is down is DEBUG."""
        if slot.healthy:
            serving = sum(s.healthy for s in self._slots) - 1
            logger.warning("engine %s marked down (%d of %d engines serve; it is given the "
                           "current weights when it answers again): %s", slot.engine.url,
                           serving, len(self._slots), reason)  # fmt: skip
            slot.down_reason = f"{type(reason).__name__}: {str(reason)[:200]}"
            slot.healthy = False
            _set_known_down(slot.engine, True)
            self._notify()

    async def _probe_loop(self) -> None:
        while True:
            with trio.move_on_after(self.probe_interval_s):
                async with trio.open_nursery() as nursery:
                    for slot in self._slots:
                        nursery.start_soon(self._probe_one, slot)
            await trio.sleep(self.probe_interval_s)

    async def _probe_one(self, slot: _Slot) -> None:
        engine = slot.engine
        if slot.healthy and getattr(engine, "known_down", False):  # a sync gave up on its load
            self._mark_down(slot, EngineUnavailableError(
                "a weight sync gave up on its load (it hangs)", url=engine.url))  # fmt: skip
            return
        if getattr(engine, "paused", False) and getattr(engine, "resume_wanted", False):
            await _retry_resume(engine)  # a sync's resume failed: the engine may stay paused
        if getattr(engine, "paused", False):
            return  # a weight sync is in progress: its own steps say whether it failed
        if not slot.healthy:
            if await _probe(engine, self.probe_interval_s):
                self._nursery.start_soon(self._rejoin, slot)  # type: ignore[union-attr]
            return
        expected = getattr(engine, "expected_weights", None)
        if expected is None or self.follows_weights:
            return
        rejoined = slot.rejoined
        try:  # a probe still unanswered when its round ends is cancelled, not counted
            version = (await engine.model_info()).weight_version
        except EngineError as exc:
            if not getattr(engine, "paused", False):
                self._mark_down(slot, EngineUnavailableError(f"probe failed: {exc}"))
            return
        if slot.rejoined != rejoined:  # it went down and was given the weights meanwhile: the
            return  # answer may predate that (its initial weights), it says nothing of now
        # a push may have landed while the probe waited: the answer is right if it names the
        # weights expected before or after (the engine answered before or after that load)
        now = getattr(engine, "expected_weights", None)
        if version not in (expected[1], now and now[1]) and not getattr(engine, "paused", False):
            self._mark_down(slot, StaleWeightsError(
                f"serves weight_version {version!r}, the last sync gave it {expected[1]!r}"))  # fmt: skip

    async def _follow_engine_events(self, events: trio.MemoryReceiveChannel[tuple[str, str]]
                                    ) -> None:  # fmt: skip
        """A supervisor saw an engine die ("down") or its relaunch answer ("up")."""
        async for what, url in events:
            for slot in (s for s in self._slots if s.engine.url == url):
                if what == "down":
                    # a rejoin under way gives the weights to the process that exited: it must
                    # not mark the engine up (the relaunch's "up" rejoins it)
                    slot.exited_in_rejoin = slot.exited_in_rejoin or slot.rejoining
                    self._mark_down(slot, EngineUnavailableError("its supervisor saw it exit",
                                                                 url=url))  # fmt: skip
                elif not slot.healthy:
                    slot.relaunched_in_rejoin = slot.rejoining and slot.exited_in_rejoin
                    self._nursery.start_soon(self._rejoin, slot)  # type: ignore[union-attr]

    async def rejoin_down(self, timeout_s: float) -> tuple[str, ...]:
        """Wait up to `timeout_s` for every engine marked down to answer again and be given the
        current weights (its rejoin, as when a probe finds it answering); the URLs still down
        then. A run's end calls it so that the engines it lost for a while (a transient fault,
        a relaunch) serve its final weights too, not only those up at its last push."""
        with trio.move_on_after(timeout_s):
            while down := [s for s in self._slots if not s.healthy]:
                for slot in down:  # one at a time: a rejoin pauses, loads and resumes one
                    if slot.healthy or slot.rejoining:  # another path rejoined it meanwhile
                        continue
                    if await _probe(slot.engine, self.probe_interval_s):
                        await self._rejoin(slot)
                if any(not s.healthy for s in self._slots):
                    await trio.sleep(min(self.probe_interval_s, 0.5))
        return tuple(s.engine.url for s in self._slots if not s.healthy)

    async def _rejoin(self, slot: _Slot) -> None:
        """A down engine answers again: give it the current weights, then let it serve. A
        rejoin that starts after another path's marked it up (its probe answered meanwhile) has
        nothing to do: it would give the weights and count the return twice."""
        if slot.rejoining or slot.healthy:
            return
        if self.follows_weights:
            await self._rejoin_follower(slot)
            return
        slot.rejoining, slot.exited_in_rejoin, slot.relaunched_in_rejoin = True, False, False
        engine = slot.engine
        _set_rejoining(engine, True)  # a push that skips it leaves its pause to this rejoin
        expected = getattr(engine, "expected_weights", None)
        lora = getattr(engine, "expected_lora", None)  # (name, path) of the last LoRA sync
        if expected is not None and expected[0] is None and lora is None \
                and self.weights_copy is None:  # fmt: skip
            # the last push went by broadcast (engines/refit.py): no copy on disk to give it;
            # it stays down, and the next push writes one for it (an engine out of the group)
            slot.rejoining = False
            _set_rejoining(engine, False)
            return
        try:
            with trio.fail_after(self.rejoin_timeout_s):
                # Still `known_down` meanwhile, so a push skips it and only records its weights
                # (`expected_weights`) instead of syncing it at the same time: given again here
                # until no push changed them during the sync (issue 49 item D1).
                while True:
                    if expected is not None and expected[0] is None and lora is None:
                        if self.weights_copy is None:
                            return  # a broadcast since: as above, it waits for a copy on disk
                        # a copy of the trainer's weights, labelled with the version it holds
                        copy = await self.weights_copy(expected[1])
                        if getattr(engine, "expected_weights", None) != expected:
                            expected = getattr(engine, "expected_weights", None)
                            continue  # a push recorded other weights meanwhile: those
                        engine.expected_weights = expected = copy  # type: ignore[attr-defined]
                    if expected is not None and expected[0] is not None:
                        await sync_weights_to_engines([engine], expected[0], expected[1],
                                                      rejoin=True)  # fmt: skip
                    if expected is not None and lora is not None:
                        await sync_lora_to_engines([engine], lora[1], lora[0], expected[1],
                                                   rejoin=True)  # fmt: skip
                    now = (getattr(engine, "expected_weights", None),
                           getattr(engine, "expected_lora", None))  # fmt: skip
                    if now == (expected, lora):
                        break
                    expected, lora = now
            self._mark_up(slot, expected)
        except (EngineError, trio.TooSlowError) as exc:
            level = logging.DEBUG if slot.rejoin_failed else logging.WARNING  # once per outage
            slot.rejoin_failed = True
            logger.log(level, "engine %s answers but could not be given the weights: %s",
                       engine.url, exc)  # fmt: skip
        finally:
            slot.rejoining = False
            _set_rejoining(engine, False)
            self._rejoin_relaunch(slot)

    async def _rejoin_follower(self, slot: _Slot) -> None:
        """`follows_weights`: up once the engine serves the expected version (no sync here)."""
        if slot.healthy:
            return
        slot.rejoining, slot.exited_in_rejoin, slot.relaunched_in_rejoin = True, False, False
        try:
            expected = getattr(slot.engine, "expected_weights", None)
            with trio.move_on_after(max(self.probe_interval_s, 1.0)):
                version = (await slot.engine.model_info()).weight_version
                if expected is None or not older_weights(version, expected[1]):
                    self._mark_up(slot, expected)
                else:  # the trainer's pool has not given it the weights yet: the next probe
                    logger.debug("engine %s answers with weights %r, not the trainer's %r: "
                                 "not used yet", slot.engine.url, version, expected[1])  # fmt: skip
        except EngineError as exc:
            logger.debug("engine %s: its rejoin's /model_info failed: %s", slot.engine.url, exc)
        finally:
            slot.rejoining = False
            self._rejoin_relaunch(slot)

    def _rejoin_relaunch(self, slot: _Slot) -> None:
        """A rejoin ended whose engine exited meanwhile and was relaunched: its "up" found the
        rejoin under way, so the relaunch is rejoined now, not at the next probe."""
        if slot.relaunched_in_rejoin and not slot.healthy and self._nursery is not None:
            slot.relaunched_in_rejoin = False
            self._nursery.start_soon(self._rejoin, slot)

    def _mark_up(self, slot: _Slot, expected: tuple[str | None, str] | None) -> None:
        engine = slot.engine
        if slot.exited_in_rejoin:  # its supervisor saw it exit during the rejoin: still down
            logger.debug("engine %s exited while it was given the weights: it stays down until "
                         "its relaunch answers", engine.url)  # fmt: skip
            return
        _set_known_down(engine, False)  # weight syncs reach it again
        slot.healthy = True  # the one WARNING of its return (the pair of the mark-down's)
        logger.warning("engine %s is back%s (%d of %d engines serve)", engine.url,
                       f" and serves weights {expected[1]}" if expected else "",
                       sum(s.healthy for s in self._slots), len(self._slots))  # fmt: skip
        slot.rejoined += 1
        slot.down_reason, slot.rejoin_failed = None, False
        self._notify()


def older_weights(version: str | None, expected: str) -> bool:
    """`version` is older than `expected`: integers ("12") compare as such; other labels
    ("default") are older unless equal; None (not reported) is not older."""
    if version is None:
        return False
    if version.isdigit() and expected.isdigit():
        return int(version) < int(expected)
    return version != expected


def _set_known_down(engine: InferenceEngine, down: bool) -> None:
    """`engine.known_down`: weight syncs skip it at once instead of paying its retries."""
    with contextlib.suppress(AttributeError):
        engine.known_down = down  # type: ignore[attr-defined]


def _set_rejoining(engine: InferenceEngine, rejoining: bool) -> None:
    """`engine.rejoining`: the pool's rejoin holds its pause, not a push that skips it
    (engines/sync_steps.py `leave_known_down`)."""
    with contextlib.suppress(AttributeError):
        engine.rejoining = rejoining  # type: ignore[attr-defined]


async def _probe(engine: InferenceEngine, timeout_s: float) -> bool:
    is_healthy = getattr(engine, "is_healthy", None)
    with trio.move_on_after(max(timeout_s, 1.0)):
        if is_healthy is not None:
            return bool(await is_healthy())
        try:
            await engine.wait_healthy(timeout_s)
            return True
        except EngineError:
            return False
    return False


async def _retry_resume(engine: InferenceEngine) -> None:
    """Send again a resume of `engine` that did not get through (one try, bounded): logged,
    never raised; the next probe tries again."""
    with trio.move_on_after(10.0):
        try:
            await engine.retry_resume()  # type: ignore[attr-defined]
        except EngineError as exc:
            logger.debug("engine %s: its resume failed again: %s", engine.url, exc)
            return
    if not getattr(engine, "paused", False):
        logger.info("engine %s resumed (its resume after a weight sync had failed)", engine.url)
