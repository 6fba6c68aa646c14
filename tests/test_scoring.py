"""score_samples: a batch of samples scored together, with each sample's outcome its own.

Sync rewards here block on real threading primitives, so these tests run on the real clock
with short timeouts (an autojump clock would time a worker thread out the moment the event loop
idles) and with a `fail_after` guard so a broken abandonment fails instead of hanging.
"""

from __future__ import annotations

import threading
import time

import pytest
import trio

from rollouts.errors import RewardError
from rollouts.scoring import score_samples
from rollouts.types import Sample


def make_batch(n: int) -> list[Sample]:
    return [
        Sample(prompt_ids=(1, 2), response_ids=(3,), loss_mask=(1,), group_id=7, index_in_group=i)
        for i in range(n)
    ]


async def test_sync_reward_scores_the_whole_batch_in_one_thread_call(monkeypatch):
    threads: set[int] = set()
    thread_calls = 0
    run_sync = trio.to_thread.run_sync

    async def counting_run_sync(*args, **kwargs):
        nonlocal thread_calls
        thread_calls += 1
        return await run_sync(*args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting_run_sync)

    def reward(sample: Sample) -> float:
        threads.add(threading.get_ident())
        return float(sample.index_in_group)

    scored = await score_samples(reward, make_batch(8), timeout_s=5)
    assert [s.reward for s in scored] == [float(i) for i in range(8)]
    assert [s.status for s in scored] == ["completed"] * 8
    assert thread_calls == 1 and len(threads) == 1 and threading.get_ident() not in threads


async def test_stalled_sync_reward_fails_only_its_sample_and_the_others_keep_their_rewards():
    release = threading.Event()
    calls: list[int] = []

    def reward(sample: Sample) -> dict[str, float]:
        calls.append(sample.index_in_group)
        if sample.index_in_group == 2:
            release.wait(timeout=10)  # stalls far past the timeout
        return {"index": float(sample.index_in_group), "total": 1.0}

    try:
        with trio.fail_after(5):  # the test itself must not hang if abandonment broke
            scored = await score_samples(reward, make_batch(5), timeout_s=1.0)
    finally:
        release.set()  # let the abandoned thread finish
    assert [s.status for s in scored] == ["completed", "completed", "failed", "completed",
                                          "completed"]  # fmt: skip
    assert "reward reward timed out after 1.0 s" in scored[2].error
    for i in (0, 1, 3, 4):  # scored before and after the stall, components included
        assert (scored[i].reward, dict(scored[i].reward_components)) == (1.0, {"index": float(i)})
    assert [s.index_in_group for s in scored] == list(range(5))
    assert calls[:3] == [0, 1, 2] and sorted(calls[3:]) == [3, 4]


async def test_event_loop_runs_while_a_sync_reward_blocks():
    started, release = threading.Event(), threading.Event()
    ticks = 0

    def reward(sample: Sample) -> float:
        started.set()
        release.wait(timeout=10)
        return 1.0

    async def tick() -> None:
        nonlocal ticks
        await trio.to_thread.run_sync(started.wait)
        for _ in range(10):
            ticks += 1
            await trio.sleep(0.01)
        release.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            scored = await score_samples(reward, make_batch(3), timeout_s=4)
    assert ticks == 10 and all(s.reward == 1.0 for s in scored)


async def test_each_sample_gets_its_own_timeout_within_a_batch():
    def slow(sample: Sample) -> float:
        time.sleep(0.15)  # 4 samples: 0.6 s for the batch, more than one timeout
        return 1.0

    scored = await score_samples(slow, make_batch(4), timeout_s=0.5)
    assert [s.status for s in scored] == ["completed"] * 4


async def test_raising_reward_fails_only_its_sample():
    def reward(sample: Sample) -> float:
        if sample.index_in_group == 1:
            raise ZeroDivisionError("bad verifier")
        if sample.index_in_group == 3:
            return float("nan")
        return 0.5

    scored = await score_samples(reward, make_batch(5), timeout_s=5)
    assert [s.status for s in scored] == ["completed", "failed", "completed", "failed",
                                          "completed"]  # fmt: skip
    assert "reward raised ZeroDivisionError: bad verifier" in scored[1].error
    assert "finite" in scored[3].error
    assert [s.reward for s in scored if s.status == "completed"] == [0.5, 0.5, 0.5]


async def test_fail_fast_raises_reward_error_naming_the_failed_sample():
    def reward(sample: Sample) -> float:
        if sample.index_in_group == 2:
            raise ValueError("bad verifier")
        return 1.0

    with pytest.raises(RewardError, match="group 7 sample 2: .*bad verifier") as info:
        await score_samples(reward, make_batch(4), timeout_s=5, fail_fast=True)
    assert isinstance(info.value.__cause__, ValueError)


async def test_async_reward_is_awaited_for_all_samples_concurrently(autojump_clock):
    async def judge(sample: Sample) -> float:
        await trio.sleep(10)
        if sample.index_in_group == 1:
            await trio.sleep(3600)  # runs past the timeout
        return 0.25

    start = trio.current_time()
    scored = await score_samples(judge, make_batch(4), timeout_s=30)
    assert trio.current_time() - start == pytest.approx(30)  # not 4 x 10 s + 30 s
    assert [s.status for s in scored] == ["completed", "failed", "completed", "completed"]
    assert "judge timed out after 30 s" in scored[1].error


async def test_sync_callable_returning_an_awaitable_is_awaited():
    async def judge(sample: Sample) -> float:
        await trio.sleep(0)
        return 0.75

    scored = await score_samples(lambda s: judge(s), make_batch(3), timeout_s=5)
    assert [s.reward for s in scored] == [0.75] * 3
