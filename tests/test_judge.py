"""judge_reward against the real local engine over loopback HTTP: the score is parsed from the
judge's actual reply to the filled rubric, and an unparseable reply or a judge that does not
answer in time fails the reward the way any reward fails (RewardError → the failure policy)."""

from __future__ import annotations

import pytest
import trio

from rollouts.errors import ConfigError, RewardError
from rollouts.judge import judge_reward, parse_score
from rollouts.prompts import encode_prompt
from rollouts.scoring import score_sample
from rollouts.types import Sample

RUBRIC = "Question: {prompt}\nAnswer: {response}\nExpected: {answer}\nGrade 0-10. Score:"


def a_sample(tokenizer) -> Sample:
    prompt_ids = tuple(encode_prompt(tokenizer, [{"role": "user", "content": "2+3"}]))
    return Sample(prompt_ids, (5,), (1,), response_text="5", metadata={"answer": "5"})


def test_parse_score_prefers_a_score_line_then_the_last_number_in_range():
    assert parse_score("Reasoning: 3 steps.\nScore: 7\nout of 10 in 2024") == 7.0
    assert parse_score("**Score**: 4.5") == 4.5
    assert parse_score("I count 12 errors, so 6 of 10... no: 8") == 8.0
    assert parse_score("1000 words, grade 3", low=1, high=5) == 3.0
    assert parse_score("Score: 42\nfinal 9") == 9.0  # an out-of-range Score line is skipped
    assert parse_score("no digits at all") is None
    assert parse_score("11 and 2024", low=0, high=10) is None


async def test_the_score_is_the_parse_of_the_engines_reply_to_the_filled_rubric(
    local_engine, tiny_tokenizer
):
    _, engine = local_engine
    sample = a_sample(tiny_tokenizer)
    replies: list[str] = []

    def parse(text: str) -> float:
        replies.append(text)
        return float(len(text) % 10)

    judge = judge_reward(engine, tiny_tokenizer, RUBRIC, parse=parse, max_new_tokens=8)
    with trio.fail_after(30):
        score = await judge(sample)
        # The same request by hand: the rubric filled from the sample, greedy, 8 tokens.
        filled = RUBRIC.format(prompt=tiny_tokenizer.decode(list(sample.prompt_ids),
                                                            skip_special_tokens=True),
                               response="5", answer="5")  # fmt: skip
        ids = encode_prompt(tiny_tokenizer, [{"role": "user", "content": filled}])
        direct = await engine.generate(ids, {"max_new_tokens": 8, "temperature": 0.0})
    assert replies == [direct.text] and direct.completion_tokens <= 8
    assert score == float(len(direct.text) % 10)
    # The default parser on the same real reply: its score, or a RewardError naming the text.
    default = judge_reward(engine, tiny_tokenizer, RUBRIC, max_new_tokens=8)
    expected = parse_score(direct.text, 0, 10)
    if expected is None:
        with pytest.raises(RewardError, match="no score in"):
            await default(sample)
    else:
        assert await default(sample) == expected


async def test_an_unparseable_reply_fails_the_reward_naming_the_text(local_engine, tiny_tokenizer):
    _, engine = local_engine
    sample = a_sample(tiny_tokenizer)
    judge = judge_reward(engine, tiny_tokenizer, RUBRIC, parse=lambda text: None, max_new_tokens=6)
    with trio.fail_after(30):
        with pytest.raises(RewardError, match="no score in") as caught:
            await judge(sample)
        # Under the rollout policy: the sample gets reward_failure_value, the error is kept.
        scored = await score_sample(judge, sample, timeout_s=30, failure_reward=-1.0)
    filled = judge_reward(engine, tiny_tokenizer, RUBRIC, parse=lambda t: 0.0, max_new_tokens=6)
    replies = []
    await judge_reward(engine, tiny_tokenizer, RUBRIC, max_new_tokens=6,
                       parse=lambda t: replies.append(t) or 0.0)(sample)  # fmt: skip
    assert repr(replies[0]) in str(caught.value)  # the judge's actual (greedy) reply
    assert await filled(sample) == 0.0
    assert scored.reward == -1.0 and "no score in" in scored.error


async def test_a_judge_that_does_not_answer_in_time_fails_the_reward(local_engine, tiny_tokenizer):
    _, engine = local_engine
    judge = judge_reward(engine, tiny_tokenizer, RUBRIC, timeout_s=0.3)
    await engine.pause("abort")  # the judge's request waits in front of the scheduler
    try:
        with trio.fail_after(10), pytest.raises(RewardError, match="timeout_s=0.3"):
            await judge(a_sample(tiny_tokenizer))
    finally:
        await engine.resume()


def test_a_rubric_field_the_sample_lacks_and_bad_bounds_are_named(tiny_tokenizer):
    with pytest.raises(ConfigError, match="timeout_s"):
        judge_reward(None, tiny_tokenizer, RUBRIC, timeout_s=0)
    judge = judge_reward(None, tiny_tokenizer, "{reference}: {response}")
    with pytest.raises(RewardError, match="'reference'"):
        trio.run(judge, a_sample(tiny_tokenizer))
