"""A rollout batch with no accepted group (every sample's reward failed, or every group was
filtered) is skipped, logged with the samples' own errors and counted; too many in a row end the
run with a message naming the cause. Held-out evaluation counts reward failures apart from wrong
answers. Real loop, in-process engine, tiny model."""

from __future__ import annotations

import logging
import threading

import pytest

from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.errors import RolloutsError
from rollouts.evaluation import evaluate_greedy
from rollouts.prompts import prompt_item
from tests.rl_helpers import index_reward, run_loop

# 2 groups x 2 samples, no over-sampling nor retry: a batch whose samples all fail is 4 reward calls
ROLLOUT = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                        max_launch_factor=1.0, max_failed_group_rate=1.0, sample_retries=0,
                        sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip


def failing_first(n_calls: int):
    """A reward that reads a missing field for its first `n_calls` calls, then scores normally."""
    lock, calls = threading.Lock(), [0]

    def reads_missing_field(sample) -> float:
        with lock:
            calls[0] += 1
            broken = calls[0] <= n_calls
        if broken:
            return sample.metadata["label"]  # KeyError: the prompts carry "answer"
        return index_reward(sample)

    return reads_missing_field


async def test_a_batch_whose_rewards_all_fail_is_skipped_and_counted_with_its_errors_logged(
    local_engine, tiny_model_dir, tmp_path, caplog
):
    _, engine = local_engine
    caplog.set_level(logging.WARNING)
    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2, rollout=ROLLOUT,
                         reward_fn=failing_first(4))  # fmt: skip
    assert [m["step"] for m in run.history] == [1, 2]
    assert run.backend.step == 2
    assert run.history[0]["empty_batches_skipped"] == 1
    assert run.history[1]["empty_batches_skipped"] == 0
    assert run.history[1]["empty_batches_total"] == 1
    text = caplog.text
    # the reward's own error, deduplicated with its count, in the manager's and the loop's lines
    assert "4x reward reads_missing_field raised KeyError: 'label'" in text
    assert "step 1: rollout batch skipped (1 in a row)" in text


async def test_rewards_that_always_fail_end_the_run_naming_the_reward_error(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine

    def returns_a_list(sample):
        return [1.0, 0.0]

    with pytest.raises(RolloutsError) as caught:
        await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2, rollout=ROLLOUT,
                       reward_fn=returns_a_list, max_empty_batches=2)  # fmt: skip
    message = str(caught.value)
    assert "2 rollout batches in a row had no group to train on" in message
    assert "train.max_empty_batches=2" in message
    assert "4x reward returns_a_list raised TypeError" in message
    assert "shape (0,)" not in message


async def test_batches_whose_groups_are_all_filtered_are_skipped_not_trained_on(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    filtered = ROLLOUT.model_copy(update={"filter_groups": "reward_varies"})
    with pytest.raises(RolloutsError, match="2 filtered out for equal rewards"):
        await run_loop(engine, tiny_model_dir, tmp_path, rollout=filtered,
                       reward_fn=lambda sample: 1.0)  # fmt: skip


async def test_evaluation_reports_reward_failures_apart_from_wrong_answers(
    local_engine, tiny_tokenizer, caplog
):
    _, engine = local_engine
    caplog.set_level(logging.WARNING)
    held_out = [
        prompt_item(tiny_tokenizer, [{"role": "user", "content": f"{i}+1"}],
                    {"answer": "999"} if i % 2 else {})  # half without the ground truth
        for i in range(6)
    ]  # fmt: skip

    def correct_if_answer_matches(sample) -> float:
        return float(sample.response_text.strip() == sample.metadata["answer"])

    out = await evaluate_greedy(engine, held_out, correct_if_answer_matches, max_new_tokens=2)
    assert out["reward_failed"] == 3
    assert out["reward_failure_rate"] == 0.5
    assert out["accuracy"] == 0.0  # over the 3 scored answers, all wrong
    assert "3x reward correct_if_answer_matches raised KeyError: 'answer'" in caplog.text
