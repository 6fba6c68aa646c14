"""A model as the reward: `judge_reward` asks an engine to grade a sample against a rubric.

Seed 001's "Reward Model Integration" for generative judges (LLM-as-a-judge): the rubric is a
template filled from the sample, the judge model's reply is parsed for a score, and the score
is the reward. The judge is any object with the engine protocol's `generate` (an
`SGLangEngine` or `EnginePool` for a judge server, or the policy's own engine).

Guarantees: one bounded request per sample (`max_new_tokens`, a `timeout_s` deadline, greedy
by default so a score is reproducible); a reply with no score in range, or a judge that
errors or times out, raises `RewardError` naming the reply or the cause, so the rollout
config's reward-failure policy applies as to any reward (`reward_failure_value`, or the run
stops under `reward_fail_fast`).

Not covered: scalar reward-model heads (a sequence-classification model's logit) — those need
a scoring endpoint, not generation; batching several samples into one judge request.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import trio

from plumbing.errors import ConfigError, RewardError
from rollouts.prompts import encode_prompt
from rollouts.types import Sample

ScoreParser = Callable[[str], float | None]
"""The judge's reply text -> its score, or None when it holds none."""

_NUMBER_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")
_SCORE_LINE_RE = re.compile(r"^\W*score\W*:\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.I | re.M)


class _Generates(Protocol):
    async def generate(self, input_ids: Any, sampling_params: Any = None, **kw: Any) -> Any: ...


def parse_score(text: str, low: float = 0.0, high: float = 10.0) -> float | None:
    """The score in a judge's reply: the last `Score: N` line, else the last number in range.

    A `Score:` line wins even when later text holds other numbers ("Score: 7 ... out of 10");
    its number must still lie in [low, high]. Without one, numbers outside the range (counts,
    years, "10" of "out of 10" when the range is 1-5) are skipped.
    """
    for match in reversed(_SCORE_LINE_RE.findall(text)):
        value = float(match)
        if low <= value <= high:
            return value
    for match in reversed(_NUMBER_RE.findall(text.replace(",", ""))):
        value = float(match)
        if low <= value <= high:
            return value
    return None


def judge_reward(
    engine: _Generates,
    tokenizer: Any,
    rubric: str,
    *,
    score_range: tuple[float, float] = (0.0, 10.0),
    parse: ScoreParser | None = None,
    timeout_s: float = 30.0,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    name: str = "judge",
) -> Callable[[Sample], Any]:
    """An async reward `(Sample) -> float` that asks `engine` to grade the sample by `rubric`.

    Args:
        engine: the judge (anything with the engine protocol's `generate`).
        tokenizer: the judge model's tokenizer; the rubric is sent as one user turn through
            its chat template, and the sample's prompt is decoded with it.
        rubric: a `str.format` template; fields `{prompt}` (the sample's prompt, decoded),
            `{response}` (its response text) and any key of the sample's `metadata`
            (e.g. `{answer}`).
        score_range: (low, high) a score must lie in; the default parser looks only there.
        parse: reply text -> score or None; default `parse_score` over `score_range`.
        timeout_s: deadline for the judge's request.
        max_new_tokens: the judge's reply budget.
        temperature: the judge's sampling temperature (0: greedy).
        name: the reward's name in errors and metrics.

    Raises:
        ConfigError: a bad range, timeout or budget (when built).
        RewardError: (when called) no score in the reply, a score out of range, the judge
            timed out, or the rubric names a field the sample lacks.
    """
    low, high = score_range
    if not low < high or timeout_s <= 0 or max_new_tokens < 1:
        raise ConfigError(
            f"judge_reward: need low < high, timeout_s > 0, max_new_tokens >= 1; got "
            f"score_range={score_range}, timeout_s={timeout_s}, max_new_tokens={max_new_tokens}"
        )
    parser = parse or (lambda text: parse_score(text, low, high))
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}

    async def judge(sample: Sample) -> float:
        text = _fill(rubric, sample, tokenizer, name)
        ids = encode_prompt(tokenizer, [{"role": "user", "content": text}])
        with trio.move_on_after(timeout_s) as scope:
            result = await engine.generate(ids, params, return_logprob=False)
        if scope.cancelled_caught:
            raise RewardError(f"{name}: the judge gave no reply within timeout_s={timeout_s} s")
        score = parser(result.text)
        if score is None or not low <= score <= high:
            raise RewardError(
                f"{name}: no score in [{low}, {high}] in the judge's reply "
                f"{result.text[-300:]!r} (parsed: {score})"
            )
        return float(score)

    judge.__name__ = name
    return judge


def _fill(rubric: str, sample: Sample, tokenizer: Any, name: str) -> str:
    fields: Mapping[str, Any] = {
        **sample.metadata,
        "prompt": tokenizer.decode(list(sample.prompt_ids), skip_special_tokens=True),
        "response": sample.response_text,
    }
    try:
        return rubric.format(**fields)
    except (KeyError, IndexError) as exc:
        raise RewardError(
            f"{name}: the rubric names {exc} but the sample has only {sorted(fields)} "
            "(prompt, response and its metadata keys)"
        ) from exc
