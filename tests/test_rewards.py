"""Reward builders (pure) and score_sample (timeouts, failures, fail-fast)."""

from __future__ import annotations

import dataclasses
import math
import re
import threading

import pytest
import trio

from rollouts.errors import ConfigError, DataError, RewardError
from rollouts.rewards import (
    TOTAL,
    add_overlong_shaping,
    boxed_answer,
    exact_match_reward,
    gated,
    last_integer,
    length_penalty,
    lexicographic,
    list_reward,
    max_aggregate,
    mean_aggregate,
    min_aggregate,
    normalize_answer,
    overlong_penalty,
    regex_format_reward,
    vector_reward,
    weighted_sum,
)
from rollouts.scoring import score_sample
from rollouts.types import Sample


def make_sample(text: str = "", n_tokens: int = 4, *, mask=None, answer: str = "46") -> Sample:
    return Sample(
        prompt_ids=(1, 2),
        response_ids=tuple(range(n_tokens)),
        loss_mask=tuple(mask) if mask is not None else (1,) * n_tokens,
        response_text=text,
        metadata={"answer": answer},
        group_id=3,
        index_in_group=1,
    )


# ----- builders --------------------------------------------------------------------------------


def test_answer_extractors():
    assert last_integer("12 + 34 = 46.") == "46"
    assert last_integer("total: 1,234") == "1234"
    assert last_integer("no digits") is None
    assert boxed_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert boxed_answer(r"\boxed{1} then \boxed{2}") == "2"
    assert boxed_answer(r"\boxed{unclosed") is None
    assert normalize_answer(" +046. ") == "46"
    assert normalize_answer("x = 3 ") == "x = 3"


def test_exact_match_compares_extracted_answer_to_metadata():
    reward = exact_match_reward()
    assert reward(make_sample("I think 12+34 = 46")) == 1.0
    assert reward(make_sample("= 046")) == 1.0
    assert reward(make_sample("= 45")) == 0.0
    assert reward(make_sample("no idea")) == 0.0


def test_exact_match_with_custom_extractor_and_key():
    reward = exact_match_reward(boxed_answer, key="solution", normalize=str.strip)
    sample = dataclasses.replace(make_sample(r"\boxed{ x+1 }"), metadata={"solution": "x+1"})
    assert reward(sample) == 1.0


def test_exact_match_without_ground_truth_raises_data_error():
    sample = Sample(prompt_ids=(1,), response_ids=(2,), loss_mask=(1,), response_text="4")
    with pytest.raises(DataError, match="no 'answer'"):
        exact_match_reward()(sample)


def test_regex_format_reward():
    reward = regex_format_reward(
        r"^<think>.*</think>\s*<answer>.*</answer>$", reward=1.0, penalty=-0.5, flags=re.DOTALL
    )
    assert reward(make_sample("<think>a\nb</think> <answer>4</answer>")) == 1.0
    assert reward(make_sample("<answer>4</answer>")) == -0.5


def test_length_penalty_counts_only_model_tokens_beyond_budget():
    reward = length_penalty(max_tokens=2, coef=0.1)
    assert reward(make_sample(n_tokens=2)) == 0.0
    assert reward(make_sample(n_tokens=5)) == pytest.approx(-0.3)
    # Two of the five tokens are tool output: only 3 model tokens, 1 over budget.
    assert reward(make_sample(n_tokens=5, mask=[1, 0, 0, 1, 1])) == pytest.approx(-0.1)


def test_overlong_penalty_is_dapo_soft_punishment():
    reward = overlong_penalty(max_response_len=10, cache_len=4)
    values = {n: reward(make_sample(n_tokens=n)) for n in (6, 7, 8, 10, 12)}
    assert values == pytest.approx({6: 0.0, 7: -0.25, 8: -0.5, 10: -1.0, 12: -1.0})
    assert overlong_penalty(10, 4, penalty_factor=2.0)(make_sample(n_tokens=8)) == -1.0
    hard = overlong_penalty(10, 0)
    assert (hard(make_sample(n_tokens=10)), hard(make_sample(n_tokens=11))) == (0.0, -1.0)
    with pytest.raises(ConfigError, match="cache_len"):
        overlong_penalty(10, 11)


def test_vector_reward_returns_components_and_total():
    reward = vector_reward(
        {"correct": exact_match_reward(), "short": length_penalty(2, 0.1)},
        weighted_sum({"correct": 1.0, "short": 2.0}),
    )
    out = reward(make_sample("46", n_tokens=4))
    assert out == pytest.approx({"correct": 1.0, "short": -0.2, TOTAL: 0.6})


def test_vector_reward_rejects_reserved_name_and_empty():
    with pytest.raises(ConfigError, match="reserved"):
        vector_reward({TOTAL: exact_match_reward()}, min_aggregate)
    with pytest.raises(ConfigError):
        vector_reward({}, min_aggregate)


def test_aggregators():
    c = {"format": 1.0, "correct": 0.0, "style": 0.5}
    assert min_aggregate(c) == 0.0
    assert weighted_sum({"correct": 2.0, "style": 2.0})(c) == 1.0
    with pytest.raises(KeyError, match="missing"):
        weighted_sum({"missing": 1.0})(c)
    gate = gated("format", 1.0)
    assert gate(c) == 0.5  # gate passed: sum of the other components
    assert gate({**c, "format": 0.0}) == 0.0
    assert gated("format", 1.0, min_aggregate, otherwise=-1.0)({**c, "format": 0.5}) == -1.0
    lex = lexicographic(["correct", "style"], scale=2.0)
    # Any correct answer outranks every incorrect one, whatever the style score.
    assert lex({"correct": 1.0, "style": 0.0}) > lex({"correct": 0.0, "style": 1.0})
    assert lex({"correct": 1.0, "style": 0.5}) == 2.5


def test_max_and_mean_aggregators():
    components = {"a": 0.2, "b": 0.9, "c": 0.4}
    assert max_aggregate(components) == 0.9
    assert mean_aggregate(components) == pytest.approx(0.5)


async def test_a_list_valued_reward_with_an_aggregator_scores_its_components():
    def multi_objective(sample: Sample) -> list[float]:  # the seeds' vector reward
        return [1.0, 0.5, 0.0, 0.25]

    weighted = list_reward(multi_objective, weighted_sum([0.4, 0.3, 0.2, 0.1]),
                           names=["correct", "helpful", "safe", "concise"])  # fmt: skip
    scored = await score_sample(weighted, make_sample(), timeout_s=5)
    assert scored.status == "completed" and scored.reward == pytest.approx(0.575)
    assert scored.reward_components == {"correct": 1.0, "helpful": 0.5, "safe": 0.0,
                                        "concise": 0.25}  # fmt: skip
    scored = await score_sample(list_reward(multi_objective, mean_aggregate), make_sample(),
                                timeout_s=5)  # fmt: skip
    assert scored.reward == pytest.approx(0.4375) and set(scored.reward_components) == {
        "r0", "r1", "r2", "r3"}  # fmt: skip


async def test_a_vector_reward_from_a_list_of_functions_names_them():
    def correct(sample: Sample) -> float:
        return 1.0

    def short(sample: Sample) -> float:
        return 0.0

    scored = await score_sample(vector_reward([correct, short], max_aggregate), make_sample(),
                                timeout_s=5)  # fmt: skip
    assert scored.reward == 1.0 and scored.reward_components == {"correct": 1.0, "short": 0.0}


async def test_a_reward_returning_a_list_fails_its_sample_saying_how_to_aggregate():
    scored = await score_sample(lambda s: [1.0, 0.0], make_sample(), timeout_s=5)
    assert scored.status == "failed" and "list_reward(fn, mean_aggregate)" in scored.error


def test_add_overlong_shaping_keeps_inner_components():
    scalar = add_overlong_shaping(
        exact_match_reward(), max_response_len=10, cache_len=4, penalty_factor=1.0
    )
    assert scalar(make_sample("46", n_tokens=8)) == pytest.approx(
        {"task": 1.0, "overlong": -0.5, TOTAL: 0.5}
    )
    inner = vector_reward({"correct": exact_match_reward()}, min_aggregate)
    shaped = add_overlong_shaping(inner, max_response_len=10, cache_len=4)
    assert shaped(make_sample("46", n_tokens=12)) == {"correct": 1.0, "overlong": -1.0, TOTAL: 0.0}


# ----- score_sample ----------------------------------------------------------------------------


async def test_score_sample_runs_sync_scalar_reward():
    scored = await score_sample(exact_match_reward(), make_sample("46"), timeout_s=5)
    assert (scored.reward, scored.status, dict(scored.reward_components)) == (1.0, "completed", {})


async def test_score_sample_splits_vector_reward_into_reward_and_components():
    reward = vector_reward(
        {"correct": exact_match_reward(), "overlong": overlong_penalty(10, 4)},
        weighted_sum({"correct": 1.0, "overlong": 1.0}),
    )
    scored = await score_sample(reward, make_sample("46", n_tokens=8), timeout_s=5)
    assert scored.reward == 0.5
    assert dict(scored.reward_components) == {"correct": 1.0, "overlong": -0.5}


async def test_score_sample_awaits_async_reward_and_mixed_vector():
    async def judge(sample: Sample) -> float:
        await trio.sleep(0)
        return 0.25

    assert (await score_sample(judge, make_sample(), timeout_s=5)).reward == 0.25
    mixed = vector_reward({"judge": judge, "correct": exact_match_reward()}, min_aggregate)
    scored = await score_sample(mixed, make_sample("46"), timeout_s=5)
    assert (scored.reward, dict(scored.reward_components)) == (
        0.25,
        {"judge": 0.25, "correct": 1.0},
    )


async def test_raising_reward_marks_sample_failed_with_the_error():
    def broken(sample: Sample) -> float:
        raise ZeroDivisionError("bad verifier")

    scored = await score_sample(broken, make_sample(), timeout_s=5)
    assert scored.status == "failed"
    assert "broken raised ZeroDivisionError: bad verifier" in scored.error


@pytest.mark.parametrize(
    ("value", "message"),
    [(math.nan, "finite"), ("1.0", "expected a float"), ({"correct": 1.0}, "'total'")],
)
async def test_invalid_reward_values_mark_sample_failed(value, message):
    scored = await score_sample(lambda s: value, make_sample(), timeout_s=5)
    assert scored.status == "failed" and message in scored.error


async def test_fail_fast_raises_reward_error_naming_the_sample():
    def broken(sample: Sample) -> float:
        raise ValueError("bad verifier")

    with pytest.raises(RewardError, match="group 3 sample 1: .*bad verifier") as info:
        await score_sample(broken, make_sample(), timeout_s=5, fail_fast=True)
    assert isinstance(info.value.__cause__, ValueError)


async def test_fail_fast_inside_a_nursery_surfaces_as_exception_group():
    async def hangs(sample: Sample) -> float:
        await trio.sleep_forever()
        return 0.0

    with pytest.RaisesGroup(pytest.RaisesExc(RewardError, match="timed out")):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: score_sample(hangs, make_sample(), timeout_s=0.01, fail_fast=True)
            )


async def test_async_reward_timeout_marks_failed(autojump_clock):
    async def slow_judge(sample: Sample) -> float:
        await trio.sleep(3600)
        return 1.0

    start = trio.current_time()
    scored = await score_sample(slow_judge, make_sample(), timeout_s=30)
    assert scored.status == "failed"
    assert "slow_judge timed out after 30 s" in scored.error
    assert trio.current_time() - start == pytest.approx(30)


async def test_hung_sync_reward_times_out_and_its_thread_is_abandoned():
    release = threading.Event()

    def stuck(sample: Sample) -> float:
        release.wait(timeout=10)
        return 1.0

    try:
        with trio.fail_after(5):  # the test itself must not hang if abandonment broke
            scored = await score_sample(stuck, make_sample(), timeout_s=0.05)
        assert scored.status == "failed" and "timed out" in scored.error
    finally:
        release.set()  # let the abandoned thread finish
