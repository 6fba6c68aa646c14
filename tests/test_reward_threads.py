"""Sync rewards run in their own bounded pool: a reward that hangs costs its own sample, never
trio's shared thread pool or the other samples' threads; too many hung calls end the run naming
the reward. Real threads, real clock, short timeouts, a `fail_after` guard on each wait."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import trio
import trio.testing

from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.reward_threads import RewardThreads, RewardThreadsExhausted
from rollouts.scoring import score_samples
from rollouts.types import Sample
from tests.rl_helpers import prompts
from training.data.buffer import DataBuffer


def make_batch(n: int, group_id: int = 0) -> list[Sample]:
    return [Sample((1, 2), (3,), (1,), group_id=group_id, index_in_group=i) for i in range(n)]


async def one_batch(engine, tokenizer, reward_fn, **rollout):
    """(manager, its first batch) for `reward_fn` on 64 prompts, 2-token answers."""
    config = RolloutConfig(filter_groups="none", sampling=SamplingConfig(max_new_tokens=2),
                           **rollout)  # fmt: skip
    manager = AsyncRolloutManager(engine, DataBuffer(prompts(tokenizer, 64), seed=0), config,
                                  reward_fn=reward_fn)  # fmt: skip
    with trio.fail_after(60):
        return manager, await manager.generate_batch()


@pytest.fixture
def release():
    """An event hung rewards wait on; set at the end so their threads return."""
    event = threading.Event()
    yield event
    event.set()


async def test_hung_sync_rewards_leave_trios_shared_thread_pool_free(
    local_engine, tiny_tokenizer, release
):
    _, engine = local_engine

    def hangs_on_the_first_sample(sample) -> float:
        if sample.index_in_group == 0:
            release.wait(30)
        return float(sample.index_in_group)

    manager, batch = await one_batch(engine, tiny_tokenizer, hangs_on_the_first_sample,
                                     batch_size=4, n_samples_per_prompt=4, reward_timeout_s=1.0,
                                     reward_failure_value=0.0)  # fmt: skip
    hung = int(batch.metrics["reward_failed"])
    assert hung == 4  # every group had one hung sample, scored with the failure reward
    # the hung threads are counted in the rewards' own pool, not held in trio's shared one
    assert trio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
    assert manager.reward_threads.statistics().hung == hung
    assert batch.metrics["reward_threads_hung"] == hung
    assert set(batch.failures) == {"reward hangs_on_the_first_sample timed out after 1.0 s"}


async def test_more_hung_calls_than_pool_threads_still_score_every_other_sample(release):
    threads = RewardThreads(2)

    def reward(sample) -> float:
        if sample.group_id < 3 and sample.index_in_group == 0:  # groups 0-2: the first hangs
            release.wait(30)
        return 1.0

    with trio.fail_after(30):
        for g in range(3):
            scored = await score_samples(reward, make_batch(2, g), timeout_s=0.5, threads=threads)
            assert [s.status for s in scored] == ["failed", "completed"]
        assert threads.statistics().hung == 3
        scored = await score_samples(reward, make_batch(4, 9), timeout_s=5, threads=threads)
    assert [s.reward for s in scored] == [1.0] * 4
    release.set()
    with trio.fail_after(10):
        while threads.statistics().hung:  # each hung thread returns and is counted off
            await trio.sleep(0.01)


async def test_past_max_hung_threads_scoring_raises_naming_the_reward(release):
    threads = RewardThreads(4, max_hung=2)

    def stuck_verifier(sample) -> float:
        release.wait(30)
        return 1.0

    with trio.fail_after(30):
        for g in range(2):
            await score_samples(stuck_verifier, make_batch(1, g), timeout_s=0.05, threads=threads)
        with pytest.raises(RewardThreadsExhausted, match="reward stuck_verifier: 2 calls"):
            await score_samples(stuck_verifier, make_batch(3), timeout_s=0.05, threads=threads)


async def test_an_async_reward_that_blocks_the_event_loop_is_named_in_a_warning(
    local_engine, tiny_tokenizer, caplog
):
    _, engine = local_engine
    caplog.set_level(logging.WARNING, logger="rollouts.stall")

    async def blocking_judge(sample) -> float:
        time.sleep(1.0)  # blocks trio's thread: nothing else runs meanwhile
        return 1.0

    _, batch = await one_batch(engine, tiny_tokenizer, blocking_judge, batch_size=1,
                               n_samples_per_prompt=2, stall_warning_s=0.2)  # fmt: skip
    assert [s.reward for s in batch.samples] == [1.0, 1.0]
    warnings = [r.getMessage() for r in caplog.records if r.name == "rollouts.stall"]
    assert warnings, "no stall was reported"
    # Under load another pause (a gc run) can be reported first: the judge's must be among them.
    name = ("async reward test_an_async_reward_that_blocks_the_event_loop_is_named_in_a_warning"
            ".<locals>.blocking_judge")  # fmt: skip
    assert any(name in w and "has not yielded" in w for w in warnings), warnings


async def test_a_call_that_waited_for_a_slot_is_refused_once_max_hung_calls_are_running(release):
    # the bound is checked when the call starts, and again once its slot is free: a call that
    # queued while another held the only slot must not run after that one was abandoned
    threads = RewardThreads(1, max_hung=1)
    outcomes: list[str] = []
    first, second = trio.CancelScope(), trio.CancelScope()

    def stuck() -> float:
        release.wait(30)
        return 1.0

    async def call(scope: trio.CancelScope) -> None:
        with scope:
            try:
                await threads.run_sync(stuck, name="stuck")
            except RewardThreadsExhausted:
                outcomes.append("refused")
                return
        outcomes.append("ran")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, first)
            await trio.testing.wait_all_tasks_blocked()  # its thread runs: it holds the slot
            nursery.start_soon(call, second)
            await trio.testing.wait_all_tasks_blocked()  # queued for the slot
            first.cancel()  # abandoned (its timeout): one hung thread, the bound
            await trio.testing.wait_all_tasks_blocked()
            second.cancel()  # if it ran
    assert outcomes == ["ran", "refused"]
    assert threads.statistics().hung == 1
