"""`CoalescingEngine`: merged requests, and what is re-sent when a merged request fails."""

from __future__ import annotations

from collections import Counter

import pytest
import trio

from rollouts.coalesce import CoalescingEngine
from rollouts.errors import EngineError


class CountingEngine:
    """Stands in for an engine at its `generate_batch` boundary: counts every rid sent and
    fails each call the way `fail` says (a status, or None to answer)."""

    def __init__(self, fail: int | None) -> None:
        self.sent: Counter[str] = Counter()
        self.fail = fail

    async def generate_batch(self, batch_input_ids, sampling_params=None, *, rids):
        self.sent.update(rids)
        await trio.sleep(0)
        if self.fail is not None and (self.fail != 400 or len(rids) > 2):
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


@pytest.mark.parametrize("status", [500, 503, None])
async def test_a_failed_merged_request_sends_no_rid_twice(status):
    engine = CountingEngine(status)
    outcomes = await _three_callers(engine)
    assert sorted(engine.sent) == sorted(f"g{i}-{j}." for i in range(3) for j in range(2))
    assert set(engine.sent.values()) == {1}
    if status is None:
        assert outcomes[1] == ["result g1-0.", "result g1-1."]
    else:
        assert all(isinstance(o, EngineError) and o.status == status for o in outcomes.values())


async def test_a_merged_request_refused_with_400_is_resent_per_caller():
    engine = CountingEngine(400)  # refuses the merged call only: nothing ran, safe to re-send
    outcomes = await _three_callers(engine)
    assert set(engine.sent.values()) == {2}
    assert outcomes[2] == ["result g2-0.", "result g2-1."]
