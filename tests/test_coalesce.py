"""`CoalescingEngine`: merged requests, and what is re-sent when a merged request fails."""

from __future__ import annotations

from collections import Counter

import trio

from rollouts.coalesce import CoalescingEngine
from rollouts.errors import EngineError


class CountingEngine:
    """Stands in for an engine at its `generate_batch` boundary: counts every rid sent and
    fails each call the way `fail` says (a status, or None to answer)."""

    def __init__(self, fail: int | None) -> None:
        self.sent: Counter[str] = Counter()
        self.fail = fail
        self.fail_only_merged = fail == 400  # a 400 refuses the merged call only
        self.error: EngineError | None = None  # raised for every call when set

    async def generate_batch(self, batch_input_ids, sampling_params=None, *, rids):
        self.sent.update(rids)
        await trio.sleep(0)
        if self.error is not None:
            raise self.error
        if self.fail is not None and (not self.fail_only_merged or len(rids) > 2):
            raise EngineError("boom", url="http://e", status=self.fail)
        return [f"result {r}" for r in rids]


async def _three_callers(engine: CountingEngine) -> dict[int, object]:
    outcomes: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        coalescing = CoalescingEngine(engine, nursery)

        async def caller(i: int) -> None:
            rids = [f"g{i}-0.", f"g{i}-1."]
            try:
                outcomes[i] = await coalescing.generate_batch([[1]] * 2, {"t": 1}, rids=rids)
            except EngineError as exc:
                outcomes[i] = exc

        for i in range(3):
            nursery.start_soon(caller, i)
    return outcomes


class NoEngineAvailableError(EngineError):
    """Named as `engines.pool`'s: the pool waited its bound for an engine."""


async def test_a_merged_request_that_fails_transiently_is_retried_per_group_once():
    # Issue 26 item 1: one reset (or 500) of the coalesced request failed all its groups.
    for status in (500, 503):
        engine = CountingEngine(status)
        engine.fail_only_merged = True
        outcomes = await _three_callers(engine)
        assert outcomes == {i: [f"result g{i}-0.", f"result g{i}-1."] for i in range(3)}
        assert set(engine.sent.values()) == {2}  # merged once, then each part alone once


async def test_a_merged_request_the_pool_gave_up_on_is_not_resent():
    engine = CountingEngine(None)
    engine.error = NoEngineAvailableError("waited 60.0 s", url="http://e")
    outcomes = await _three_callers(engine)
    assert set(engine.sent.values()) == {1}
    assert all(o is engine.error for o in outcomes.values())


async def test_a_merged_request_refused_with_400_is_resent_per_caller():
    engine = CountingEngine(400)  # refuses the merged call only: nothing ran, safe to re-send
    outcomes = await _three_callers(engine)
    assert set(engine.sent.values()) == {2}
    assert outcomes[2] == ["result g2-0.", "result g2-1."]
