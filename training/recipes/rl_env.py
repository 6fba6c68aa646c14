"""The `env:` section of an RL config → the rollout's GenerateFn, reward and evaluation setup.

`single_turn` is the default one-assistant-turn rollout. `tools` runs multi-turn episodes
(`rollouts.multiturn`) in a `ToolEnv` with the configured tools; the env grades the final
answer, so the reward is `env_reward` unless the config names another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rollouts.envs import env_reward, tool_env_factory
from rollouts.generate_fn import GenerateFn, single_turn_generate
from rollouts.multiturn import MultiTurnConfig, multiturn_generate
from rollouts.rewards import RewardFn
from rollouts.tools import Tool, calculator_tool, parse_hermes_tool_calls, parse_xml_tool_calls
from rollouts.tools import python_tool as make_python_tool
from training.rl_config import EnvSection, RewardConfig

_PARSERS = {"hermes": parse_hermes_tool_calls, "xml": parse_xml_tool_calls}


def build_tools(section: EnvSection) -> list[Tool]:
    makers: dict[str, Callable[[], Tool]] = {"calculator": calculator_tool,
                                             "python": make_python_tool}  # fmt: skip
    return [replace(makers[name](), timeout_s=section.tool_timeout_s) for name in section.tools]


@dataclass(frozen=True)
class EpisodeSetup:
    generate_fn: GenerateFn
    reward_fn: RewardFn


def build_episode_setup(section: EnvSection, reward: RewardConfig, *,
                        resolve: Callable[[str], Any],
                        template_kwargs: Mapping[str, Any] | None = None) -> EpisodeSetup:  # fmt: skip
    """GenerateFn and reward for the configured env (`resolve` imports `module:function`;
    `template_kwargs`: extra chat-template variables of multi-turn episodes)."""
    if section.kind == "single_turn":
        return EpisodeSetup(single_turn_generate, resolve(reward.fn))
    make_env = tool_env_factory(
        build_tools(section), resolve(section.grader), parser=_PARSERS[section.parser],
        system_prompt=section.system_prompt, show_specs=section.show_specs,
    )  # fmt: skip
    config = MultiTurnConfig(max_turns=section.max_turns,
                             max_response_tokens=section.max_response_tokens,
                             template_kwargs=dict(template_kwargs or {}))  # fmt: skip
    explicit = "fn" in reward.model_fields_set
    return EpisodeSetup(multiturn_generate(make_env, config=config),
                        resolve(reward.fn) if explicit else env_reward)  # fmt: skip
