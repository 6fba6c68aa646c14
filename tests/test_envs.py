"""Environments on hand-written model turns: grading, tool execution, malformed calls."""

from __future__ import annotations

import pytest

from rollouts.envs import (
    ModelTurn,
    ToolEnv,
    arithmetic_env,
    env_reward,
    math_env,
    math_grader,
    tool_env_factory,
)
from rollouts.prompts import PromptItem
from rollouts.tools import calculator_tool, parse_xml_tool_calls
from rollouts.types import Sample


def _prompt(question: str, answer: str) -> PromptItem:
    return PromptItem((1, 2, 3), ({"role": "user", "content": question},), {"answer": answer})


def _turn(text: str, finish: str = "stop") -> ModelTurn:
    return ModelTurn(text, (), finish, 0)


async def test_arithmetic_env_is_one_graded_turn_from_the_prompt_ids():
    env = arithmetic_env(_prompt("12+34", "46"))
    obs = await env.initial_observation()
    assert obs.prompt_ids == (1, 2, 3) and obs.messages[0]["content"] == "12+34"
    right, wrong = await env.step(_turn("so 46")), await env.step(_turn("45"))
    assert (right.reward, right.done, dict(right.metrics)) == (1.0, True, {"correct": 1.0})
    assert (wrong.reward, wrong.done) == (0.0, True)


@pytest.mark.parametrize(
    ("text", "answer", "reward"),
    [
        ("The total is \\boxed{72}.", "72", 1.0),
        ("\\boxed{1,200} dollars", "1200", 1.0),
        ("It is 3.50 in the end", "3.5", 1.0),
        ("\\boxed{71}", "72", 0.0),
        ("no number here", "72", 0.0),
    ],
)
async def test_math_env_grades_the_boxed_or_final_number(text, answer, reward):
    env = math_env(_prompt("a word problem", answer))
    assert (await env.step(_turn(text))).reward == reward
    assert math_grader(text, {"answer": answer}) == reward


async def test_tool_env_answers_calls_with_tool_messages_until_a_final_answer():
    env = tool_env_factory([calculator_tool()], math_grader, system_prompt="Use tools.")(
        _prompt("what is 2*3?", "6")
    )
    obs = await env.initial_observation()
    assert obs.prompt_ids is None and obs.tools[0]["function"]["name"] == "calculator"
    assert [m["role"] for m in obs.messages] == ["system", "user"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    step = await env.step(_turn(call))
    assert (step.done, step.reward) == (False, 0.0)
    assert step.messages == ({"role": "tool", "name": "calculator", "content": "6"},)
    assert [(r.name, r.output, r.success) for r in step.tool_calls] == [("calculator", "6", True)]
    final = await env.step(_turn("\\boxed{6}"))
    assert (final.done, final.reward, final.messages) == (True, 1.0, ())


async def test_tool_env_shows_malformed_and_unknown_calls_to_the_model_and_goes_on():
    env = tool_env_factory([calculator_tool()], math_grader)(_prompt("q", "6"))
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    )
    step = await env.step(_turn(text))
    assert not step.done and [r.success for r in step.tool_calls] == [False, False]
    contents = [m["content"] for m in step.messages]
    assert contents[0].startswith("Error: tool call is not valid JSON")
    assert contents[1] == "Error: unknown tool 'search' (available: calculator)"


async def test_tool_env_does_not_run_calls_in_a_truncated_turn():
    env = ToolEnv(_prompt("q", "6"), [calculator_tool()], math_grader, parse_xml_tool_calls)
    text = '<tool_call name="calculator"><expression>2*3</expression></tool_call> so 6'
    cut = await env.step(_turn(text, finish="length"))
    assert cut.done and cut.tool_calls == () and cut.reward == 1.0
    ran = await env.step(_turn(text))
    assert not ran.done and ran.tool_calls[0].output == "6"


def test_env_reward_keeps_the_reward_given_during_the_rollout():
    sample = Sample((1,), (2,), (1,)).with_reward(1.0, {"correct": 1.0})
    assert env_reward(sample) == {"correct": 1.0, "total": 1.0}


def test_duplicate_tool_names_fail_at_setup():
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        tool_env_factory([calculator_tool(), calculator_tool()], math_grader)
