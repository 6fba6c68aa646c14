"""Environments for multi-turn rollouts, in the spirit of tinker-cookbook's `Env`.

An `Env` is one episode's state: `initial_observation()` gives the conversation to start from
(messages, and optionally its token ids and tool specs); `step(turn)` takes what the model
said and answers with a reward, whether the episode is over, the messages to append (tool
results, a user follow-up) and metrics. Envs speak in messages; `rollouts.multiturn` owns the
token ids (token in, token out), the engine and the limits. An `EnvFactory` makes a fresh env
per sample from a `PromptItem`.

Rewards: the episode's reward is the sum of its steps' rewards, and the steps' metrics (e.g.
`correct`) are recorded as the sample's reward components; pass `env_reward` as the rollout's
`reward_fn` to keep them (or combine it with other rewards in `vector_reward`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from rollouts.prompts import PromptItem
from rollouts.tasks.arithmetic import is_correct
from rollouts.tasks.math import answers_match, extract_final_answer
from rollouts.tools.base import Tool, ToolParser, execute_tool_calls, tool_message, tool_specs
from rollouts.tools.base import tools_by_name as _index
from rollouts.tools.parsers import parse_hermes_tool_calls
from rollouts.types import Sample, ToolCallRecord

Message: TypeAlias = Mapping[str, Any]


@dataclass(frozen=True)
class Observation:
    """Where an episode starts. `prompt_ids` (if given) is used as is instead of rendering."""

    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] | None = None  # specs for apply_chat_template(tools=)
    prompt_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelTurn:
    """One assistant turn as sampled: its text (end-of-turn tokens removed) and token ids."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # the engine's: "stop" | "length" | ...
    index: int  # 0 for the first turn

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn."""

    reward: float
    done: bool
    messages: tuple[Message, ...] = ()  # appended before the next model turn
    metrics: Mapping[str, float] = field(default_factory=dict)
    tool_calls: tuple[ToolCallRecord, ...] = ()


class Env(Protocol):
    """One episode. Fresh per sample; may keep state between steps."""

    async def initial_observation(self) -> Observation: ...

    async def step(self, turn: ModelTurn) -> StepResult: ...


EnvFactory: TypeAlias = Callable[[PromptItem], Env]
Grader: TypeAlias = Callable[[str, Mapping[str, Any]], float]
"""(final model text, prompt metadata) -> reward of a final answer (1.0 correct, 0.0 not)."""


def env_reward(sample: Sample) -> dict[str, float]:
    """RewardFn that keeps the reward the env gave during the rollout (and its components)."""
    return {**sample.reward_components, "total": sample.reward}


# ----- graders -----------------------------------------------------------------------------------


def arithmetic_grader(text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the text's last integer equals `metadata["answer"]` (the arithmetic task)."""
    return float(is_correct(text, str(metadata["answer"])))


def _math_verify() -> Callable[[str, str], bool] | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return lambda predicted, truth: bool(verify(parse(truth), parse(predicted)))


def math_grader(text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the final answer (last `\\boxed{}`, else last number) equals the ground truth.

    Uses `math-verify` (symbolic equivalence) when it is installed; otherwise numeric equality
    to 1e-6, else normalised string equality (`rollouts.tasks.math.answers_match`).
    """
    truth = str(metadata["answer"])
    predicted = extract_final_answer(text)
    if predicted is None:
        return 0.0
    verify = _math_verify()
    if verify is not None:
        try:
            if verify(f"${predicted}$", f"${truth}$"):
                return 1.0
        except Exception:  # a math-verify parse failure is "not verified", not a crash
            pass
    return float(answers_match(predicted, truth))


# ----- environments ------------------------------------------------------------------------------


@dataclass
class SingleTurnEnv:
    """One model turn, graded: the single-turn tasks (arithmetic, math) as an env."""

    prompt: PromptItem
    grade: Grader

    async def initial_observation(self) -> Observation:
        return Observation(tuple(self.prompt.messages), prompt_ids=tuple(self.prompt.prompt_ids))

    async def step(self, turn: ModelTurn) -> StepResult:
        reward = float(self.grade(turn.text, self.prompt.metadata))
        return StepResult(reward, done=True, metrics={"correct": reward})


def arithmetic_env(prompt: PromptItem) -> SingleTurnEnv:
    """EnvFactory: the arithmetic task, reward 1 for the right integer."""
    return SingleTurnEnv(prompt, arithmetic_grader)


def math_env(prompt: PromptItem) -> SingleTurnEnv:
    """EnvFactory: a math word problem, reward 1 for the right `\\boxed{}`/final number."""
    return SingleTurnEnv(prompt, math_grader)


@dataclass
class ToolEnv:
    """The model may call tools; each call's result comes back as a tool message.

    A turn with tool calls is answered with one tool message per call (failed calls included,
    so the model sees what went wrong) and the episode goes on. A turn without calls, or a
    truncated one, is the final answer: graded with `grade`, and the episode ends. The prompt
    is rendered from its messages with these tools' specs (its `prompt_ids` are not used, as
    they may have been tokenized without tools).
    """

    prompt: PromptItem
    tools: Sequence[Tool]
    grade: Grader
    parser: ToolParser = parse_hermes_tool_calls
    system_prompt: str | None = None
    max_calls_per_turn: int = 4
    max_output_chars: int = 2000
    show_specs: bool = True  # False: a model that learned its tools in SFT gets no schema turn

    def __post_init__(self) -> None:
        self._tools = _index(self.tools)

    async def initial_observation(self) -> Observation:
        messages = tuple(self.prompt.messages)
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages = ({"role": "system", "content": self.system_prompt}, *messages)
        specs = tuple(tool_specs(self.tools)) if self.show_specs else None
        return Observation(messages, tools=specs)

    async def step(self, turn: ModelTurn) -> StepResult:
        calls = [] if turn.truncated else self.parser(turn.text)
        if not calls:
            reward = float(self.grade(turn.text, self.prompt.metadata))
            return StepResult(reward, done=True, metrics={"correct": reward})
        records = await execute_tool_calls(
            calls, self._tools, max_calls=self.max_calls_per_turn,
            max_output_chars=self.max_output_chars,
        )  # fmt: skip
        return StepResult(
            0.0,
            done=False,
            messages=tuple(tool_message(r) for r in records),
            tool_calls=tuple(records),
        )


def tool_env_factory(
    tools: Sequence[Tool],
    grade: Grader,
    *,
    parser: ToolParser = parse_hermes_tool_calls,
    system_prompt: str | None = None,
    max_calls_per_turn: int = 4,
    max_output_chars: int = 2000,
    show_specs: bool = True,
) -> EnvFactory:
    """An EnvFactory making a `ToolEnv` per sample with these tools and settings."""
    _index(tools)  # duplicate names fail here, at setup, not in the first rollout

    def make(prompt: PromptItem) -> ToolEnv:
        return ToolEnv(prompt, tools, grade, parser, system_prompt, max_calls_per_turn,
                       max_output_chars, show_specs)  # fmt: skip

    return make
